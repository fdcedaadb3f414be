"""What the API trainer holds for each training client, and how it tells the requests of one split call.

``Model`` is the worker's record of one training client (``consumers.api.worker``):
its next ``seq_id``, the calls waiting for their turn, whether its adapter is in
the engine or parked in its fold, and the calls not yet in a fold.

``SplitCall`` is one ``forward_backward`` that the SDK split into several
requests (more than 1,024 datums, or about 5 MB): consecutive ``seq_id``s sent
at once, the first one last (``parallel_fwdbwd_chunks``, which the gateway's
``client/config`` asks for).  So when the first request runs, the others are
already on the log *before* it, while a call of its own is logged after it:
``split_end`` finds them.  The SDK fails the call if one request fails, so the
trainer then puts the gradients back as before the call (``mark``) and does not
run the requests after it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pipeline.io.bus import ConsumedEvent, TopicPartitionKey
from schemas.api import model_run_name, session_path


@dataclass
class SplitCall:
    """One SDK ``forward_backward`` sent as requests ``first`` to ``last``; ``mark``: the gradients from before it."""

    first: int
    last: int
    mark: dict[str, Any] | None
    datums_before: int = 0  # datums of the call's requests already run (where the next one's datum 0 is)
    failed: str | None = None  # why the call failed: the requests after it do not run

    def covers(self, seq: int | None) -> bool:
        return seq is not None and self.first <= seq <= self.last

    def describe(self, seq: int) -> str:
        return (f"request {seq - self.first + 1} of the {self.last - self.first + 1} the SDK split one "
                f"forward_backward into (its datum 0 is datum {self.datums_before} of the call)")

    def not_run(self, seq: int) -> str:
        """The answer of a request after the one that failed."""
        return (f"forward_backward request {seq} did not run: {self.failed} in the same forward_backward call, "
                "whose gradients were all discarded; send the batch again")


def split_end(pending: dict[int, ConsumedEvent], consumed: ConsumedEvent) -> int | None:
    """The last ``seq_id`` of the split call whose first request is ``consumed`` (None: it is no split call): the
    ``forward_backward``s of the next ``seq_id``s waiting in ``pending`` that were logged before it."""
    call = consumed.event.payload
    if call.op != "forward_backward" or not call.seq_id:
        return None
    last = call.seq_id
    while (later := pending.get(last + 1)) is not None and later.event.payload.op == "forward_backward" \
            and (later.topic, later.partition) == (consumed.topic, consumed.partition) \
            and later.offset < consumed.offset:
        last += 1
    return None if last == call.seq_id else last


@dataclass
class Model:
    """What the worker holds for one training client."""

    model_id: str
    tenant: str | None = None
    next_seq: int = 1
    loaded: bool = False  # in the engine
    parked: bool = False  # folded and out of the engine (idle, or to make room); its next call reloads it
    has_gradients: bool = False
    last_used: float = 0.0  # monotonic time of its last call
    reload_failing_since: float | None = None  # parked, and its reload failed since then (store, memory)
    gap_since: float | None = None  # its calls have waited for a missing seq_id since then (monotonic)
    refused: str | None = None  # why every call fails (its fold is corrupt)
    unfolded: list[tuple[TopicPartitionKey, int]] = field(default_factory=list)  # executed, not yet in a fold
    pending: dict[int, ConsumedEvent] = field(default_factory=dict)  # seq_id -> call waiting for its turn
    creating: list[ConsumedEvent] = field(default_factory=list)  # create_model / load_weights as a new model
    split: SplitCall | None = None  # the forward_backward the SDK split into requests, while they run

    @property
    def run(self) -> str:
        return model_run_name(self.model_id)

    @property
    def fold_key(self) -> str:
        session, _, seq = self.run.split(".")
        return f"{session_path(session)}/models/{seq}.fold"
