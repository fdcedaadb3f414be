"""The Tinker-compatible API on the event log: accepted calls and their results.

The gateway turns every accepted mutating call of the ``tinker`` SDK into an
``ApiRequestAccepted`` event on ``<ns>.requests`` (keyed by ``model_id``, or by
the sampling session for sampling calls, so that one model's calls stay in one
partition and in order).  The call's body never rides on the log: it is written
create-only to the store first (``sessions/<session>/requests/<request_id>.<fmt>``)
and the event is its claim check.  An engine executes the calls of one model in
``seq_id`` order (waiting for gaps), idempotent on ``(model_id, seq_id)``, writes
the result create-only to ``sessions/<session>/results/<request_id>.<fmt>`` and
announces it with ``ApiResultReady`` on ``<ns>.results``; the gateway answers
``retrieve_future`` from there.

The bodies and results themselves are the SDK's own types (``tinker.types``,
JSON or the SDK's protobuf for ``forward_backward`` and ``sample``): the SDK is
the contract, and nothing here copies it.

Tinker ids contain ``:`` (``<session>:train:<n>``).  They never become paths or
topic names directly: ``model_run_name`` maps a model id onto a run name that
obeys the name rule.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator

from schemas.events import PAYLOAD_TYPES, Payload, Sha256
from schemas.names import MODEL_ID_RE, InvalidNameError, echoed, validate_name

ApiOp = Literal[
    "create_model",
    "unload_model",
    "forward_backward",
    "optim_step",
    "save_weights",
    "load_weights",
    "save_weights_for_sampler",
    "save_weights_external",
    "create_sampling_session",
    "sample",
]
BodyFormat = Literal["json", "pb"]
ErrorCategory = Literal["user", "server", "unknown"]
SESSION_TIMEOUT_S = 300.0  # heartbeats every 10 s; a session silent this long has ended (engines unload it)
# top-k logprobs a sample call may ask for at each position (``topk_prompt_logprobs``, ``topk_sample_logprobs``):
# bounds one call's answer, and is vLLM's own ``max_logprobs`` default
MAX_TOPK_LOGPROBS = 20
# sampled tokens' top-k rows of one sample call (num_samples x max_tokens x topk_sample_logprobs): 8 bytes each on
# the wire, so 8 MiB at most, where plain logprobs of the same call would be a twentieth of it; the sampler builds and
# encodes them in Python objects first, so the bound keeps one call's rows (and the time to encode them) small
MAX_TOPK_SAMPLE_CELLS = 2**20



class ApiError(ValueError):
    """A call the API refuses or cannot complete; ``str(error)`` is one line naming the fix.

    ``category`` is what the client sees (``{"error": ..., "category": ...}``): ``user`` for a bad
    request (the SDK does not retry it), ``server`` for a fault on rlpipe's side.
    """

    def __init__(self, message: str, category: ErrorCategory = "user") -> None:
        super().__init__(message)
        self.category: ErrorCategory = category


def session_path(session_id: str) -> str:
    """Store folder of one API session (relative to the store root)."""
    return f"sessions/{validate_name(session_id, 'session_id')}"


def request_body_path(session_id: str, request_id: str, fmt: BodyFormat) -> str:
    """Claim-check location of one accepted call's body."""
    return f"{session_path(session_id)}/requests/{validate_name(request_id, 'request_id')}.{fmt}"


def result_path(session_id: str, request_id: str, fmt: BodyFormat) -> str:
    """Create-only location of one call's result."""
    return f"{session_path(session_id)}/results/{validate_name(request_id, 'request_id')}.{fmt}"


def model_id_for(session_id: str, kind: Literal["train", "sample"], seq: int) -> str:
    """The Tinker model id the SDK expects (``<session>:train:<n>``; the client computes it too)."""
    validate_name(session_id, "session_id")
    return f"{session_id}:{kind}:{int(seq)}"


def model_run_name(model_id: str) -> str:
    """Run name (store folder, registry, checkpoints) of a Tinker model id: ``<session>.train.<n>``.

    Session ids are made by the gateway without dots, so the mapping is one to one.
    """
    match = MODEL_ID_RE.fullmatch(model_id or "")
    if match is None:
        raise InvalidNameError(f"model_id {echoed(model_id)} is not of the form <session>:train:<n>")
    return validate_name(f"{match['session']}.{match['kind']}.{match['seq']}", "model run name")


class ApiRequestAccepted(Payload):
    """gateway -> engines, on ``<ns>.requests``: a call is accepted and its body is durable in the store."""

    event_type: ClassVar[str] = "ApiRequestAccepted"
    request_id: str = Field(description="the id the client polls with retrieve_future; unique")
    tenant: str = Field(description="tenant name (from the API key); engines refuse cross-tenant access")
    session_id: str
    op: ApiOp
    model_id: str | None = Field(default=None, description="Tinker model id; None for session-level calls")
    seq_id: int | None = Field(default=None, ge=0, description="per-model order; None or 0 = unordered")
    base_model: str | None = None
    body_path: str = Field(description="object key of the body relative to the store root")
    body_format: BodyFormat = "json"
    body_sha256: Sha256
    refused: str | None = Field(default=None, description=(
        "why the gateway refused this numbered call (the client was answered 400): the trainer answers its "
        "seq_id with this error and goes on to the next, never waiting on a call that will not come"))

    @field_validator("tenant", "session_id", "request_id")
    @classmethod
    def _names(cls, value: str) -> str:
        return validate_name(value, "name")


class ApiResultReady(Payload):
    """engine -> gateway, on ``<ns>.results``: a call's result (or its error) is durable in the store."""

    event_type: ClassVar[str] = "ApiResultReady"
    request_id: str
    session_id: str
    op: ApiOp
    model_id: str | None = None
    seq_id: int | None = None
    ok: bool
    result_path: str | None = Field(default=None, description="object key of the result; None for an error")
    result_format: BodyFormat = "json"
    result_sha256: Sha256 | None = None
    error: str | None = Field(default=None, description="one line naming the fix, shown to the client")
    category: ErrorCategory | None = None


PAYLOAD_TYPES.update({cls.event_type: cls for cls in (ApiRequestAccepted, ApiResultReady)})
