"""What the API's engines share: a call's result is stored, then announced, and a failed announcement
stops nothing (the store is the source of truth; a poll finds the result at its next re-check)."""

from __future__ import annotations

import logging

import pytest

from pipeline.api.engines import engine_group, write_result
from pipeline.io.bus import PublishError
from pipeline.io.store import ObjectStore
from schemas.api import ApiRequestAccepted, result_path


class Publisher:
    def __init__(self, fails: bool) -> None:
        self.fails, self.published = fails, []

    def publish(self, topic, event, key=None):
        if self.fails:
            raise PublishError("publishing a ApiResultReady to rlpipe.results failed: OutOfOrderSequenceNumberError")
        self.published.append((topic, event, key))
        return 0, len(self.published) - 1


CALL = ApiRequestAccepted(request_id="sess-1.sample.1", tenant="alice", session_id="sess-1", op="sample",
                          model_id="sess-1.sample", seq_id=1, body_path="sessions/sess-1/requests/1.json",
                          body_sha256="0" * 64)


def test_each_role_of_a_base_model_reads_in_a_group_of_its_own_per_namespace():
    groups = {engine_group(role, namespace, "/models/base/tiny") for role in ("trainer", "sampler")
              for namespace in ("staging", "prod")}
    assert len(groups) == 4
    # the prefixes the deployment's Kafka ACLs grant (infra/k8s/kafka/user.yaml), the namespace readable in tooling
    assert engine_group("trainer", "prod", "/models/base/tiny").startswith("api-trainer-prod-")
    assert engine_group("sampler", "prod", "/models/base/tiny").startswith("api-sampler-prod-")
    assert engine_group("trainer", "prod", "/models/other") != engine_group("trainer", "prod", "/models/base/tiny")
    with pytest.raises(ValueError, match="namespace"):
        engine_group("trainer", "prod/x", "/models/base/tiny")


def test_a_result_is_stored_then_announced_once():
    store, publisher = ObjectStore("memory://engines-announce"), Publisher(fails=False)
    write_result(store, publisher, CALL, b"{}", "json")
    write_result(store, publisher, CALL, b"{}", "json")  # executed again after a restart: already there
    assert store.get(result_path("sess-1", "sess-1.sample.1", "json")) == b"{}"
    assert [(topic, event.payload.request_id) for topic, event, _ in publisher.published] == [
        ("results", "sess-1.sample.1")]


def test_a_failed_announcement_keeps_the_engine_serving(caplog: pytest.LogCaptureFixture):
    store = ObjectStore("memory://engines-unannounced")
    with caplog.at_level(logging.WARNING):
        write_result(store, Publisher(fails=True), CALL, b"{}", "json")  # returns: the next call is served
    assert store.get(result_path("sess-1", "sess-1.sample.1", "json")) == b"{}"
    assert "not announced" in caplog.text and "sess-1.sample.1" in caplog.text


def test_an_engine_connects_with_the_bus_settings_of_its_environment_and_serves_flags(monkeypatch) -> None:
    """The trainer and sampler processes took only --bootstrap and --namespace: against a broker that wants TLS and
    SASL (a cluster's) they connected in plain text.  They read every other RLPIPE_BUS__ setting, which `rlpipe
    serve` passes on from its environment and its --set flags."""
    import logging

    from pipeline.api.engines import engine_arguments, engine_setup
    from pipeline.cli.serve_cmd import bus_environment
    from pipeline.config import resolve_config

    served = resolve_config(overrides=["bus.security_protocol=SASL_SSL", "bus.sasl_mechanism=SCRAM-SHA-512",
                                       "bus.sasl_username=rlpipe", "bus.sasl_password=s3cret",
                                       "bus.ssl_cafile=/etc/kafka-ca/ca.crt", "bus.connect_timeout_s=30"]).bus
    environment = bus_environment(served)
    assert "RLPIPE_BUS__BOOTSTRAP_SERVERS" not in environment  # given as --bootstrap
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    args = engine_arguments("test", None).parse_args(
        ["--base-model", "/m", "--store", "memory://s", "--bootstrap", "k:9093", "--namespace", "ns"])
    bus = engine_setup(args, logging.getLogger("test"))
    assert (bus.bootstrap_servers, bus.namespace) == ("k:9093", "ns")
    assert (bus.security_protocol, bus.sasl_mechanism, bus.sasl_username, bus.ssl_cafile, bus.connect_timeout_s) == (
        "SASL_SSL", "SCRAM-SHA-512", "rlpipe", "/etc/kafka-ca/ca.crt", 30.0)
    assert bus.sasl_password is not None and bus.sasl_password.get_secret_value() == "s3cret"
    assert bus_environment(resolve_config(environ={}).bus) == {}  # the defaults: nothing to pass on


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("module", ["consumers.api.worker", "producers.api_sampler"])
def test_an_engine_process_answers_its_health_probes_while_loading_and_is_ready_once_reading_calls(
    module, tmp_path, bus_config, tiny_model_dir
) -> None:
    """Kubernetes probes the trainer and the sampler on --health-port: /healthz as soon as the process runs,
    /readyz 503 naming what is missing until the engine is loaded and reading calls, then 200."""
    import os
    import subprocess
    import sys
    import time
    import urllib.error
    import urllib.request
    from pathlib import Path

    from pipeline.devstack.process import free_port

    port = free_port()
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen([sys.executable, "-m", module, "--base-model", tiny_model_dir, "--store",
                                f"file://{tmp_path}/store", "--bootstrap", bus_config.bootstrap_servers,
                                "--namespace", bus_config.namespace, "--health-port", str(port)],
                               env=env, cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    try:
        statuses = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                statuses.append(get("/readyz"))
            except OSError:  # not listening yet
                time.sleep(0.1)
                continue
            if statuses[-1][0] == 200:
                break
            assert get("/healthz")[0] == 200
            time.sleep(0.1)
        assert process.poll() is None, process.stderr.read().decode()[-2000:] if process.stderr else ""
        assert statuses and statuses[-1][0] == 200, statuses[-3:]
        assert get("/healthz")[0] == 200
        # The engine may load before the first probe (the tiny model loads at once): each 503 names the steps
        # still missing, in their order, and the missing ones only shrink.
        from pipeline.api.engines import ENGINE_SETUP_STEPS

        bodies = ["not ready: " + "\n".join(ENGINE_SETUP_STEPS[k:]) + "\n" for k in range(len(ENGINE_SETUP_STEPS))]
        assert all(body in bodies for code, body in statuses if code == 503), statuses
        missing = [bodies.index(body) for code, body in statuses if code == 503]
        assert missing == sorted(missing), statuses
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_an_engine_reads_a_bus_setting_given_in_lower_case_once(monkeypatch) -> None:
    """`rlpipe serve` passes its bus settings on as RLPIPE_BUS__ names; one the serving process read from a
    lower-case name (as the process environment is read) must not reach the engine in both spellings, where two
    values (``30`` and ``30.0``) would be refused as one name set twice."""
    from pipeline.cli.serve_cmd import engine_environment
    from pipeline.config import env_layer, resolve_config

    monkeypatch.setenv("rlpipe_bus__connect_timeout_s", "30")
    bus = resolve_config().bus
    environment = engine_environment(bus)
    assert float(env_layer(environment)["bus"]["connect_timeout_s"]) == 30.0
    assert [name for name in environment if name.upper() == "RLPIPE_BUS__CONNECT_TIMEOUT_S"] == [
        "RLPIPE_BUS__CONNECT_TIMEOUT_S"]


def test_an_engine_whose_former_groups_offsets_cannot_be_adopted_starts_and_says_why(
        bus_config, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # The adoption is a one-off migration: an ACL narrowed to api-trainer-<ns>- (or a broker refusing admin
    # offset commits) must not keep the engine from reading its calls.
    import pipeline.api.engines as engines
    from pipeline.io.bus import BusError

    def refused(*args, **kwargs):
        raise BusError("admin request failed: GroupAuthorizationFailedError: [Error 30] GroupAuthorizationFailedError")

    monkeypatch.setattr(engines, "adopt_group_offsets", refused)
    with caplog.at_level(logging.WARNING, logger="pipeline.api.engines"):
        reader = engines.engine_reader(bus_config, "trainer", "/models/base/tiny")
    reader.close()
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING and r.name == "pipeline.api.engines"]
    assert engines._unnamespaced_group("trainer", "/models/base/tiny") in warning.getMessage()
    assert "GroupAuthorizationFailedError" in warning.getMessage()
