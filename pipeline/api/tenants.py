"""API keys and tenants: every key is one tenant, and a tenant only ever reaches its own sessions.

Keys are secrets like the bus password: configured in ``RLPIPE_API_KEYS``
(``tenant=key,tenant=key``), held as ``SecretStr`` and printed as ``***``.
With no keys configured (the embedded default of ``rlpipe serve``), any key the
SDK accepts (``tml-...``) is taken, and its tenant is named after a digest of
the key, so two different keys are still two tenants that cannot see each other.

What one tenant may hold at once is bounded (``TenantLimits``, from ``RLPIPE_API_MAX_SESSIONS``,
``RLPIPE_API_MAX_MODELS`` and ``RLPIPE_API_MAX_SAMPLING_SESSIONS``; counted by ``pipeline.api.quotas``), so one key
cannot fill the store and the engines with sessions, training clients and sampling sessions; and so is what one
training request may ask (``RLPIPE_API_MAX_CALL_TOKENS``), since a trainer runs one request at a time for every
tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from schemas.api import ApiError
from schemas.names import InvalidNameError, validate_name

KEYS_ENV = "RLPIPE_API_KEYS"
MAX_SESSIONS_ENV = "RLPIPE_API_MAX_SESSIONS"
MAX_MODELS_ENV = "RLPIPE_API_MAX_MODELS"
MAX_SAMPLING_SESSIONS_ENV = "RLPIPE_API_MAX_SAMPLING_SESSIONS"
MAX_CALL_TOKENS_ENV = "RLPIPE_API_MAX_CALL_TOKENS"
SDK_KEY_PREFIX = "tml-"


class UnauthorizedError(ApiError):
    """No key, or a key no tenant holds (HTTP 401)."""


class TenantLimitError(ApiError):
    """A tenant at its limit of sessions, training clients or sampling sessions (HTTP 403)."""


class TenantLimits(BaseModel):
    """What one tenant may hold at once, and send in one training request.  A session that crashed without
    finishing holds its place until it expires (a day without a heartbeat), hence limits well above what one user's
    loops run at a time."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sessions: int = Field(256, ge=1, le=1_000_000, description=(
        f"sessions of one tenant that have not ended (finished, or expired) ({MAX_SESSIONS_ENV})"))
    max_models: int = Field(1024, ge=1, le=1_000_000, description=(
        f"training clients in those sessions ({MAX_MODELS_ENV})"))
    # a loop making a sampling client per step from a path (create_sampling_client(model_path=...)) makes one per
    # step for as long as its session lives, hence a limit far above the others
    max_sampling_sessions: int = Field(4096, ge=1, le=1_000_000, description=(
        f"sampling sessions made by create_sampling_session in those sessions ({MAX_SAMPLING_SESSIONS_ENV})"))
    # a trainer runs one request at a time, every tenant's: one request's size bounds how long it holds the others
    # (the gateway's client config has the SDK split a larger batch into requests within it: pipeline.api.app)
    max_call_tokens: int = Field(262_144, ge=1, le=1_000_000_000, description=(
        f"tokens of the datums' model_input in one forward_backward or forward request ({MAX_CALL_TOKENS_ENV})"))

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TenantLimits:
        """From ``RLPIPE_API_MAX_SESSIONS``, ``RLPIPE_API_MAX_MODELS``, ``RLPIPE_API_MAX_SAMPLING_SESSIONS`` and
        ``RLPIPE_API_MAX_CALL_TOKENS`` (unset or empty: the defaults)."""
        env = os.environ if environ is None else environ
        values: dict[str, int] = {}
        for field, name in (("max_sessions", MAX_SESSIONS_ENV), ("max_models", MAX_MODELS_ENV),
                            ("max_sampling_sessions", MAX_SAMPLING_SESSIONS_ENV),
                            ("max_call_tokens", MAX_CALL_TOKENS_ENV)):
            raw = env.get(name, "").strip()
            if not raw:
                continue
            try:
                values[field] = int(raw)
                cls.model_validate({field: values[field]})
            except ValueError:  # pydantic's ValidationError is one
                most = next(bound.le for bound in cls.model_fields[field].metadata if hasattr(bound, "le"))
                raise ValueError(f"{name}={raw!r}: set a whole number from 1 to {most}") from None
        return cls(**values)


class Tenants:
    """Maps the ``X-API-Key`` header to a tenant name."""

    def __init__(self, keys: dict[str, SecretStr] | None = None) -> None:
        for tenant in keys or {}:
            validate_name(tenant, "tenant")
        self.keys = dict(keys or {})

    @classmethod
    def from_env(cls, value: str | None = None) -> Tenants:
        """From ``RLPIPE_API_KEYS`` (``tenant=key,...``); empty or unset = any ``tml-`` key."""
        raw = os.environ.get(KEYS_ENV, "") if value is None else value
        keys: dict[str, SecretStr] = {}
        for item in filter(None, (part.strip() for part in raw.split(","))):
            tenant, sep, key = item.partition("=")
            if not sep or not key:
                raise ValueError(f"{KEYS_ENV} entry {tenant!r} has no key; write tenant=key[,tenant=key]")
            try:
                keys[validate_name(tenant.strip(), "tenant")] = SecretStr(key.strip())
            except InvalidNameError as exc:
                raise ValueError(f"{KEYS_ENV}: {exc}") from None
            if not key.strip().startswith(SDK_KEY_PREFIX):  # the SDK refuses such a key before it sends a call
                raise ValueError(f"{KEYS_ENV}: the key of tenant {tenant.strip()!r} does not start with "
                                 f"{SDK_KEY_PREFIX!r}, which the tinker SDK requires of every key; give it one "
                                 f"that does ({tenant.strip()}=tml-...)")
        return cls(keys)

    @property
    def open(self) -> bool:
        """True when any SDK key is accepted (no keys configured)."""
        return not self.keys

    def describe(self) -> str:
        """One line for the start-up banner (keys as ***)."""
        if self.open:
            return (f"accepting ANY API key starting with {SDK_KEY_PREFIX!r} (one tenant per key); "
                    f"set {KEYS_ENV}=tenant=key,... to restrict")
        return "API keys: " + ", ".join(f"{tenant}=***" for tenant in sorted(self.keys))

    def tenant_of(self, key: str | None) -> str:
        """The tenant holding ``key``; ``UnauthorizedError`` otherwise."""
        if not key:
            raise UnauthorizedError("no X-API-Key header; pass api_key= to the tinker client or set TINKER_API_KEY")
        if self.open:
            if not key.startswith(SDK_KEY_PREFIX):
                raise UnauthorizedError(f"API keys start with {SDK_KEY_PREFIX!r}; use e.g. TINKER_API_KEY=tml-mykey")
            return "t-" + hashlib.sha256(key.encode()).hexdigest()[:16]
        for tenant, secret in self.keys.items():
            if hmac.compare_digest(secret.get_secret_value().encode(), key.encode()):
                return tenant
        raise UnauthorizedError("unknown API key; ask the operator for one (RLPIPE_API_KEYS)")
