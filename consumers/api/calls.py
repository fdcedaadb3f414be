"""What the API trainer holds for each training client, its fold, and how it tells the requests of one split call.

``Model`` is the worker's record of one training client (``consumers.api.worker``):
its next ``seq_id``, the calls waiting for their turn, whether its adapter is in
the engine or parked in its fold, and the calls not yet in a fold.

A fold (``write_fold``, ``load_fold``) is the client's whole state after its
calls up to a ``seq_id``: adapter, Adam state, RNG and accumulated gradients,
stored under a name of its own, then the record ``<n>.fold.json`` naming it.

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

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from consumers.api import ops
from consumers.engine import TrainingEngine
from pipeline.api import lifecycle
from pipeline.io.bus import ConsumedEvent, TopicPartitionKey
from pipeline.io.store import ObjectStore, sha256_hex
from schemas.api import model_run_name, session_path

log = logging.getLogger("rlpipe.api.trainer")
# how a refused model's answers end: a checkpoint loaded into it replaces its whole state and lifts the refusal
REFUSED_WAY_OUT = ("load one of its checkpoints into it (load_state or load_state_with_optimizer; see "
                   "list_checkpoints) to go on, or start a new training client from one "
                   "(create_training_client_from_state)")


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
    refused: str | None = None  # why every call but a load_weights fails (its state is lost; see REFUSED_WAY_OUT)
    replay_failed: bool = False  # refused for a call that succeeded once and failed on replay: its calls stay in the log
    fold_now: bool = False  # a load_weights replaced its state: folded once its seq_id is counted
    unfolded: list[tuple[TopicPartitionKey, int]] = field(default_factory=list)  # executed, not yet in a fold
    pending: dict[int, ConsumedEvent] = field(default_factory=dict)  # seq_id -> call waiting for its turn
    creating: list[ConsumedEvent] = field(default_factory=list)  # create_model / load_weights as a new model
    # seq_ids (first, last) that a load_weights run while the model was out of the engine went past: one of them
    # arriving later cannot run in its turn, and is answered at once (``late``)
    skipped: tuple[int, int] | None = None
    late: list[ConsumedEvent] = field(default_factory=list)  # calls of ``skipped`` read since the last round
    split: SplitCall | None = None  # the forward_backward the SDK split into requests, while they run
    abandoned: tuple[int, str] | None = None  # a seq_id that never comes, and why (``abandoned_seq``)

    @property
    def run(self) -> str:
        return model_run_name(self.model_id)

    @property
    def fold_key(self) -> str:
        session, _, seq = self.run.split(".")
        return f"{session_path(session)}/models/{seq}.fold"


def abandoned_seq(model: Model) -> str | None:
    """Why the missing ``model.next_seq`` never comes, when a ``forward_backward`` the gateway refused waits behind
    it (then noted in ``model.abandoned``, so requests still on their way are answered as they arrive); else None.

    The SDK sends a split call's first request only after the others were accepted, and any other call only once
    the ones before it were answered: a refused request logged while an earlier ``seq_id`` is missing is a later
    request of a split call whose first request will not be sent."""
    if not model.pending or model.next_seq in model.pending:
        return None  # no call waits for a missing seq_id
    if model.abandoned is not None and model.abandoned[0] == model.next_seq:
        return model.abandoned[1]
    refused = next((consumed.event.payload for _, consumed in sorted(model.pending.items())
                    if consumed.event.payload.op == "forward_backward" and consumed.event.payload.refused), None)
    if refused is None:
        return None
    why = (f"request seq_id {refused.seq_id} of the same forward_backward was refused by the gateway "
           f"({refused.refused}), so the tinker SDK never sends the call's first request (seq_id {model.next_seq}) "
           "and takes no further calls on this training client; nothing of the call was trained: create a new "
           "training client")
    model.abandoned = (model.next_seq, why)
    return why


def write_fold(store: ObjectStore, engine: TrainingEngine, model: Model) -> bool:
    """The model's state under a name of its own, then the record naming it, then older states deleted (a trainer
    killed between two writes leaves the fold before whole); False, writing nothing, once its session's files were
    deleted (nothing would read it)."""
    if lifecycle.files_deleted(store, model.run.split(".")[0]) is not None:
        model.unfolded.clear()
        return False
    state = ops.save_state(engine, model.model_id, True, with_gradients=model.has_gradients)
    digest = sha256_hex(state)
    state_key = f"{model.fold_key}.{digest[:16]}.safetensors"
    try:  # the same state folded again finds its own bytes under its name
        store.put_create_once(state_key, state)
    except FileExistsError:
        # other bytes under this state's name are damaged: every reader refuses them (it checks the digest), and
        # kept, they would fail every later fold of this state
        log.warning("%s held other bytes than the state it names (damaged); replaced", store.url(state_key))
        store.put(state_key, state)
    record: dict[str, Any] = {"model_id": model.model_id, "seq_id": model.next_seq - 1, "state": state_key,
                              "state_sha256": digest}
    if model.skipped is not None:
        record["skipped"] = list(model.skipped)
    store.put(f"{model.fold_key}.json", json.dumps(record).encode())
    for key in store.list(model.fold_key.rsplit("/", 1)[0]):
        if key.startswith(f"{model.fold_key}.") and key.endswith(".safetensors") and key != state_key:
            store.delete(key, missing_ok=True)
    model.unfolded.clear()
    return True


def fold_record(store: ObjectStore, model: Model) -> dict[str, Any] | None:
    """The record of the model's fold (None before its first)."""
    try:
        return json.loads(store.get(f"{model.fold_key}.json"))
    except FileNotFoundError:
        return None


def load_fold(store: ObjectStore, engine: TrainingEngine, model: Model) -> None:
    """Load the model's fold into the engine.  A fold missing or corrupt refuses the model's calls (``refused``:
    every other model goes on); errors that may pass (a store timeout, memory short) are raised."""
    record = fold_record(store, model)
    if record is None:
        return
    try:
        state = store.get(record.get("state", f"{model.fold_key}.safetensors"), record["state_sha256"])
        ops.load_state(engine, model.model_id, state, True)
    except (FileNotFoundError, ValueError, KeyError) as exc:
        log.error("%s cannot be restored: %s", model.model_id, exc)
        model.refused = (f"the saved state of {model.model_id} is missing or corrupt ({type(exc).__name__}); "
                         f"{REFUSED_WAY_OUT}")
        return
    model.loaded, model.next_seq = True, int(record["seq_id"]) + 1
    model.has_gradients = engine.has_gradients(ops.adapter_name(model.model_id))
    model.last_used = time.monotonic()
    log.info("restored %s from its fold at seq_id %d", model.model_id, record["seq_id"])
