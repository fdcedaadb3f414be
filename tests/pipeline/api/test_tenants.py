"""API keys -> tenants: configured keys (printed as ***) or, by default, any SDK key as its own tenant."""

import pytest

from pipeline.api.tenants import Tenants, UnauthorizedError


def test_open_default_takes_any_sdk_key_and_keeps_keys_apart():
    tenants = Tenants.from_env("")
    assert tenants.open and "ANY" in tenants.describe()
    alice, bob = tenants.tenant_of("tml-alice"), tenants.tenant_of("tml-bob")
    assert alice != bob and alice == tenants.tenant_of("tml-alice") and "alice" not in alice
    for key in (None, "", "sk-alice"):
        with pytest.raises(UnauthorizedError):
            tenants.tenant_of(key)


def test_configured_keys_are_secrets():
    tenants = Tenants.from_env("team-a=tml-aaa, team-b=tml-bbb")
    assert tenants.tenant_of("tml-bbb") == "team-b"
    assert "tml-aaa" not in tenants.describe() and "team-a=***" in tenants.describe()
    assert "tml-aaa" not in repr(tenants.keys)
    with pytest.raises(UnauthorizedError, match="unknown API key"):
        tenants.tenant_of("tml-other")
    for bad in ("team-a", "../x=tml-k"):
        with pytest.raises(ValueError):
            Tenants.from_env(bad)


def test_tenant_limits_come_from_the_environment_with_defaults_and_bad_values_name_the_variable():
    from pipeline.api.tenants import MAX_MODELS_ENV, MAX_SAMPLING_SESSIONS_ENV, MAX_SESSIONS_ENV, TenantLimits

    assert TenantLimits.from_env({}) == TenantLimits()
    assert TenantLimits.from_env({MAX_SESSIONS_ENV: "5", MAX_MODELS_ENV: " 20 "}) == TenantLimits(max_sessions=5,
                                                                                               max_models=20)
    for value in ("0", "-3", "many", "1.5"):
        with pytest.raises(ValueError, match=MAX_SESSIONS_ENV):
            TenantLimits.from_env({MAX_SESSIONS_ENV: value})
    assert TenantLimits.from_env({MAX_SAMPLING_SESSIONS_ENV: "7"}).max_sampling_sessions == 7
    with pytest.raises(ValueError, match=MAX_SAMPLING_SESSIONS_ENV):
        TenantLimits.from_env({MAX_SAMPLING_SESSIONS_ENV: "0"})


def test_a_configured_key_the_sdk_would_refuse_is_refused_at_start_naming_its_tenant():
    """The tinker SDK refuses, before sending anything, every key not starting with ``tml-``: a server configured
    with one would admit a tenant whose client can never reach it."""
    with pytest.raises(ValueError) as refused:
        Tenants.from_env("team-a=tml-aaa,team-b=secret")
    message = str(refused.value)
    assert "team-b" in message and "'tml-'" in message and "secret" not in message and "\n" not in message, message
    assert Tenants.from_env("team-a=tml-aaa").tenant_of("tml-aaa") == "team-a"


def test_serve_checks_the_keys_before_anything_starts(monkeypatch: pytest.MonkeyPatch, capsys):
    """`rlpipe serve` reads RLPIPE_API_KEYS with the gateway's limits, before the stack, the model and the engines."""
    import typer

    from pipeline.cli.serve_cmd import check_gateway_settings

    monkeypatch.setenv("RLPIPE_API_KEYS", "team-a=secret")
    with pytest.raises(typer.Exit):
        check_gateway_settings()
    assert "team-a" in capsys.readouterr().err
