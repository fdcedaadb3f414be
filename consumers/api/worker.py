"""The trainer role of the Tinker-compatible API: executes the calls on ``<ns>.requests`` for one base model.

Set up: the object store, a ``TrainingEngine`` for the base model, a group
consumer of ``<ns>.requests`` and a publisher for ``<ns>.results``.  Then a loop
of phases: read (queue each call under its model), execute (each model's calls
in ``seq_id`` order, waiting for gaps, since the SDK sends a batch's chunks
concurrently and the first last), fold (checkpoint clean adapters, then commit
offsets; when idle for ``fold_idle_s``, every ``fold_every`` calls, and a
model alone right after a ``load_weights``), expire
(unload the adapters of sessions that ended or whose heartbeats lapsed), and
every ``SWEEP_S`` the sweeps of ``consumers.api.sweeps`` (expired checkpoints,
what ended sessions and deleted names leave, old engine activity).

A training client's state is a fold over its request log.  The fold of a model
(``sessions/<s>/models/<n>.fold.json`` naming a ``save_state`` blob with the
accumulated gradients too, stored under a name of its own, and the last ``seq_id``
it includes) is written when idle, every ``fold_every`` calls and after each
``load_weights`` (the checkpoint it loaded may be saved again, deleted or expire
later; a replay starting from the model's own fold never reads it), and the group's
offsets are committed only below the oldest call not yet in a fold.  A trainer
that dies is restarted from the folds plus the calls after them, re-executed in
order, so it ends with the same weights.  Results are written create-only:
a re-executed call whose result is already stored keeps the stored one, and a
call that changes nothing (a ``forward``, a save) is not re-executed at all.

Calls are idempotent on ``(model_id, seq_id)``: a resent call is the same
request id, skipped once its ``seq_id`` is behind the model's.

A call whose session ended before its turn does not run, and the adapters of sessions that
ended or lapsed leave the engine: ``consumers.api.endings``.

Every executed call (and every fold) is noted with its session, wall-clock span
and trained tokens in the engine's activity (``pipeline.api.activity``), which
``rlpipe report --server`` draws as the trainer's duty cycle.

What one call does on the engine is ``consumers.api.execute``; the translation
between the SDK's training types and the engine is ``consumers.api.ops``; the
calls that write or read saved weights are ``consumers.api.saves``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from consumers.api import calls, execute, ops, saves
from consumers.api.calls import Model, SplitCall, split_end
from consumers.api.endings import SessionEnds
from consumers.api.sweeps import SWEEP_S, Sweeper
from consumers.engine import NOT_FINITE_STEP, TrainingEngine
from consumers.engine_data import EngineError
from pipeline.api import lifecycle
from pipeline.api.activity import ActivityRecorder
from pipeline.api.engines import engine_arguments, engine_health, engine_reader, engine_setup, write_result
from pipeline.api.liveness import SessionLiveness
from pipeline.io.bus import (
    ConsumedEvent,
    EventPublisher,
    TopicPartitionKey,
    ensure_topics,
    group_timings_from_env,
)
from pipeline.io.store import ObjectStore
from pipeline.topics import API_TOPIC_KINDS
from schemas.api import SESSION_TIMEOUT_S, ApiError, ApiRequestAccepted
from schemas.config import BusConfig

log = logging.getLogger("rlpipe.api.trainer")
_SAMPLING_OPS = ("create_sampling_session", "sample")  # the sampler's calls (its own consumer group reads them)
IDLE_UNLOAD_S = 600.0  # a training client without a call this long is folded and leaves the engine
MAX_WAITING_CALLS = 1024  # a model's calls waiting behind a missing seq_id; later ones are answered at once
GAP_GIVE_UP_S = 600.0  # calls of a live session waiting this long for a seq_id are answered: its client gave it up
RELOAD_RETRY_S = 60.0  # a parked client whose reload fails (store, memory) is retried this long before its calls fail
END_CHECK_S = 1.0  # a session seen live is taken as live this long before its end is read again (as a gateway does)
CACHED_SESSIONS = 4096  # sessions whose end (or life) the trainer keeps in memory (the rest are read again)


# ---- the worker --------------------------------------------------------------------------------------------------


class TrainerWorker(SessionEnds):
    """Executes one base model's API calls from the log; see the module docstring."""

    def __init__(self, store: ObjectStore, bus: BusConfig, base_model: str, engine: TrainingEngine,
                 fold_every: int = 20, fold_idle_s: float = 0.5, session_timeout_s: float = SESSION_TIMEOUT_S,
                 consumer_options: dict[str, Any] | None = None, activity: ActivityRecorder | None = None,
                 idle_unload_s: float = IDLE_UNLOAD_S, max_adapters: int | None = None) -> None:
        self.store, self.bus, self.base_model, self.engine = store, bus, base_model, engine
        self.activity = activity
        self.fold_every, self.fold_idle_s, self.session_timeout_s = fold_every, fold_idle_s, session_timeout_s
        self.idle_unload_s = idle_unload_s  # an adapter without a call this long leaves the engine
        self.max_adapters = max_adapters  # adapters in the engine at once (None: no limit)
        self.reload_retry_s = RELOAD_RETRY_S
        self.gap_give_up_s = GAP_GIVE_UP_S
        self.max_waiting_calls = MAX_WAITING_CALLS
        self.end_grace_s = lifecycle.END_GRACE_S  # an ended session's calls waiting for a seq_id are held this long
        self.liveness = SessionLiveness(store, END_CHECK_S, lifecycle.SESSION_EXPIRY_S, CACHED_SESSIONS)
        ensure_topics(bus, API_TOPIC_KINDS)
        self.consumer = engine_reader(bus, "trainer", base_model, consumer_options)
        self.publisher = EventPublisher(bus)
        self.models: dict[str, Model] = {}
        self._since_fold = 0
        self._last_expiry = self._last_executed = 0.0
        self._committed: dict[TopicPartitionKey, int] = {}
        self._last_sweep = time.monotonic()  # the first sweep comes after a restart's replay
        self.sweeper = Sweeper(store, base_model)

    # ---- the loop -------------------------------------------------------------------------------------------
    def run(self, stop: Callable[[], bool]) -> None:
        log.info("trainer for %s reading %s.requests", self.base_model, self.bus.namespace)
        while not stop():
            self.step(poll_timeout_s=0.2)
        self.fold_all()
        self.close()

    def step(self, poll_timeout_s: float = 0.2) -> int:
        """One round of read, execute, fold, expire; the number of calls executed."""
        for event in self.consumer.poll(timeout_s=poll_timeout_s):
            self.accept(event)
        executed = self.execute_ready()
        if executed:
            self._last_executed = time.monotonic()
        idle = time.monotonic() - self._last_executed > self.fold_idle_s
        if (idle and not executed) or self._since_fold >= self.fold_every:
            self.fold_all()
        if time.monotonic() - self._last_expiry > 5.0:
            self.expire_sessions()
        if time.monotonic() - self._last_sweep > SWEEP_S:
            self.sweep_checkpoints()
        return executed

    def sweep_checkpoints(self) -> int:
        """The sweeps of ``consumers.api.sweeps`` now (between calls, so never beside a save of the same name)."""
        self._last_sweep = time.monotonic()
        return self.sweeper.sweep()

    def close(self) -> None:
        self.consumer.close()
        self.publisher.close()
        if self.activity is not None:
            self.activity.close()

    # ---- read ------------------------------------------------------------------------------------------------
    def accept(self, consumed: ConsumedEvent) -> None:
        """Queue one call under its model, unless it is another base model's or already applied."""
        call = consumed.event.payload
        if not isinstance(call, ApiRequestAccepted) or call.base_model != self.base_model or call.model_id is None:
            return
        if call.op in _SAMPLING_OPS:
            return  # the sampler's (its own consumer group reads them)
        model = self._model(call.model_id)
        model.tenant = call.tenant
        if not call.seq_id:
            if model.loaded or model.parked:
                return  # created before (and folded, or replayed already)
            model.creating.append(consumed)
        elif call.seq_id >= model.next_seq:
            model.pending.setdefault(call.seq_id, consumed)
        elif model.skipped is not None and model.skipped[0] <= call.seq_id <= model.skipped[1]:
            model.late.append(consumed)  # (or one answered before, sent again)

    def _model(self, model_id: str) -> Model:
        """The worker's record of a model; one with a fold starts parked at its ``seq_id`` (loaded at its first call)."""
        model = self.models.get(model_id)
        if model is None:
            model = self.models[model_id] = Model(model_id)
            record = calls.fold_record(self.store, model)
            if record is not None:
                model.parked, model.next_seq = True, int(record["seq_id"]) + 1
                skipped = record.get("skipped")
                model.skipped = (int(skipped[0]), int(skipped[1])) if skipped else None
        return model

    # ---- execute ---------------------------------------------------------------------------------------------
    def execute_ready(self) -> int:
        """Every call whose turn has come, model by model in seq_id order; a gap waits."""
        executed = 0
        for model in list(self.models.values()):
            while model.late:
                self._answer_late(model, model.late.pop(0))
            executed += self._answer_ended_parked(model)
            if model.creating or (model.parked and model.next_seq in model.pending):
                self._make_room(model)
                if model.parked and not self._unpark(model):
                    continue  # its reload failed for now: tried again next round
            while model.creating:
                self._execute(model, model.creating.pop(0))
                self._fold_after_load(model)
                executed += 1
            if not model.loaded and not model.parked and model.pending:  # never created, its creation failed,
                for seq in sorted(model.pending):                         # or its fold is lost: each call says so
                    self._execute(model, model.pending.pop(seq))
                    executed += 1
                    if model.loaded:  # a load_weights brought it in: the calls after it run in seq_id order
                        if seq > model.next_seq:  # past seq_ids not read yet: those still to come are answered
                            first = model.next_seq if model.skipped is None else min(model.skipped[0],
                                                                                     model.next_seq)
                            model.skipped = (first, seq - 1)
                        model.next_seq = seq + 1
                        self._fold_after_load(model)
                        break
            while model.loaded and model.next_seq in model.pending:
                self._execute(model, model.pending.pop(model.next_seq))
                model.next_seq += 1
                self._fold_after_load(model)
                executed += 1
            if (why := calls.abandoned_seq(model)) is not None:  # a split call whose first request never comes
                self._answer_waiting(model, why)
            waiting = bool(model.pending) and model.next_seq not in model.pending
            model.gap_since = (model.gap_since or time.monotonic()) if waiting else None
            if waiting and len(model.pending) > self.max_waiting_calls:
                self._refuse_beyond_limit(model)
        return executed

    def _refuse_beyond_limit(self, model: Model) -> None:
        """Answer the calls furthest ahead beyond ``max_waiting_calls`` waiting behind a gap: each holds memory and
        the log's offsets (every tenant's) until the gap fills, and an SDK client never sends that far ahead."""
        kept = sorted(model.pending)[: self.max_waiting_calls]
        for seq in sorted(model.pending)[self.max_waiting_calls:]:
            call = model.pending.pop(seq).event.payload
            self._write_error(call, f"{call.op} did not run: {len(kept)} calls of {model.model_id} already wait for "
                                    f"seq_id {model.next_seq}; send each call's seq_id after the one before it "
                                    "(the tinker SDK's TrainingClient does)")

    def _answer_late(self, model: Model, consumed: ConsumedEvent) -> None:
        """A call of a ``seq_id`` a load_weights went past (``Model.skipped``) is answered with a user error, unless
        it was answered before (sent again): its turn is gone, and the state it would have run on with it."""
        call: ApiRequestAccepted = consumed.event.payload
        if execute.answered(self.store, call) is not None:
            return
        assert model.skipped is not None
        self._write_error(call, f"{call.op} (seq_id {call.seq_id}) did not run: it reached the trainer after the "
                                f"load_weights (seq_id {model.skipped[1] + 1}) that replaced the state of "
                                f"{model.model_id}, and a training client's calls run in seq_id order; send it again")

    def _execute(self, model: Model, consumed: ConsumedEvent) -> None:
        call: ApiRequestAccepted = consumed.event.payload
        split = self._split_call(model, consumed)
        try:
            self._execute_call(model, consumed, split)
        finally:
            if split is not None and call.seq_id == split.last:
                model.split = None

    def _split_call(self, model: Model, consumed: ConsumedEvent) -> SplitCall | None:
        """The split ``forward_backward`` this call is a request of (``consumers.api.calls``), found when its first
        request runs; the gradients are marked then, to be put back if one of its requests fails."""
        if model.split is not None and model.split.covers(consumed.event.payload.seq_id):
            return model.split
        last = split_end(model.pending, consumed)
        if last is None:
            return None
        mark = self.engine.gradient_mark(ops.adapter_name(model.model_id)) if model.loaded else None
        model.split = SplitCall(consumed.event.payload.seq_id, last, mark)
        return model.split

    def _fail_split(self, model: Model, split: SplitCall, seq: int) -> None:
        """Request ``seq`` of ``split`` failed: the call's gradients are undone, and its later requests will not run."""
        if split.failed is None and split.mark is not None and model.loaded:
            self.engine.restore_gradients(ops.adapter_name(model.model_id), split.mark)
            model.has_gradients = self.engine.has_gradients(ops.adapter_name(model.model_id))
        split.failed = split.failed or f"request {seq - split.first + 1} failed"

    def _execute_call(self, model: Model, consumed: ConsumedEvent, split: SplitCall | None) -> None:
        call: ApiRequestAccepted = consumed.event.payload
        done = execute.answered(self.store, call)
        try:
            stands = done == "error" or (done == "ok" and execute.changes_nothing(self.store, call))
        except execute.FilesDeleted:  # its result is there and its body is gone (a deletion under way): skipped
            log.warning("%s %s dropped: its session ended and its calls were deleted", call.op, call.request_id)
            return
        entry = ((consumed.topic, consumed.partition), consumed.offset)
        model.unfolded.append(entry)
        self._since_fold += 1
        if stands and done == "error" and call.op == "optim_step" and model.loaded:
            self._replay_refused_step(model, call)
        if stands and done == "error" and split is not None:  # (a replay: it failed, and undid its call)
            self._fail_split(model, split, call.seq_id)
        if stands:
            return  # its result stands and it changed nothing (a call that failed changed nothing but this)
        if split is not None and split.failed is not None:  # its call failed for the client: it does not run
            self._write_error(call, split.not_run(call.seq_id))
            return
        if done is None and call.refused is None and (ended := self._session_ended(call)) is not None:
            self._answer_ended(model, call, split, ended, entry)
            return
        started, wall = time.perf_counter(), time.time()
        model.last_used = time.monotonic()
        tokens = 0  # trained tokens of this call (a forward_backward's)
        try:  # done == "ok": a call that succeeded once (a restart's replay, or the call resent)
            data, fmt, tokens = execute.run_call(self.store, self.engine, self.base_model, model, call, done == "ok")
            result: tuple[bytes, str, str | None, str | None] = (data, fmt, None, None)
        except execute.FilesDeleted:  # read after its session's files were deleted (a trainer down for a day): no answer
            log.warning("%s %s dropped: its session ended and its calls were deleted", call.op, call.request_id)
            model.unfolded.remove(entry)  # nothing to rebuild from it
            return
        except (ApiError, EngineError) as exc:
            category = exc.category if isinstance(exc, ApiError) else "user"
            message = str(exc) if split is None else (
                f"{exc}; in {split.describe(call.seq_id)}: the whole call was undone, no gradient of it was kept")
            result = (json.dumps({"error": message, "category": category}).encode(), "json", message, category)
        except Exception as exc:
            log.exception("%s %s failed", call.op, call.request_id)
            message = f"{call.op} failed on the trainer ({type(exc).__name__}: {exc}); retry, or report it"
            result = (json.dumps({"error": message, "category": "server"}).encode(), "json", message, "server")
        if split is not None and result[2] is not None:
            self._fail_split(model, split, call.seq_id)
        if done is None:
            self._write_result(call, *result)
        elif result[2] is not None:  # it succeeded before and cannot again: its model is lost, and says so
            log.error("%s %s ran before and failed on replay: %s", call.op, call.request_id, result[2])
            # (one whose create_model failed again is not loaded: its calls say it does not exist; one a load made
            # is refused, naming why the load failed); the first failure is the cause, the later calls failed on
            # its refusal
            if (model.loaded or call.op == "load_weights") and not model.refused:
                which = f"(seq_id {call.seq_id})" if call.seq_id else "that started it"
                model.replay_failed = True  # (not folded, see _fold; a load that made it is replayed again)
                model.refused = (f"the state of {model.model_id} could not be rebuilt after its trainer restarted: "
                                 f"its {call.op} {which} succeeded before and failed when run again "
                                 f"({result[2]}); {calls.REFUSED_WAY_OUT}")
        seconds = time.perf_counter() - started
        if self.activity is not None:
            self.activity.record(call.session_id, call.tenant, call.op, wall, wall + seconds, tokens)
        log.debug("%s %s: %.3f s", call.op, call.request_id, seconds)

    def _replay_refused_step(self, model: Model, call: ApiRequestAccepted) -> None:
        """A step refused for gradients that were not finite discarded them: a replay discards them there too."""
        if str(saves.stored_answer(self.store, call).get("error", "")).startswith(NOT_FINITE_STEP):
            self.engine.discard_gradients(ops.adapter_name(model.model_id))
            model.has_gradients = False

    # ---- fold ------------------------------------------------------------------------------------------------
    def fold_all(self) -> None:
        """Checkpoint every model with executed calls, then commit offsets below what no fold covers."""
        for model in self.models.values():
            if model.unfolded and model.loaded:
                self._fold(model)
            elif model.unfolded and not model.loaded and not model.creating and not model.replay_failed:
                model.unfolded.clear()  # its calls only failed: nothing to rebuild
        self._since_fold = 0
        self._commit()

    def _fold(self, model: Model) -> None:
        """``calls.write_fold``, noted in the engine's activity.  A model refused for a state it could not rebuild is
        not folded: its calls stay in the log (offsets held), so a trainer restarted later rebuilds it from them; a
        checkpoint loaded into it lifts the refusal, and it is folded again."""
        if model.refused:
            return
        started, wall = time.perf_counter(), time.time()
        if calls.write_fold(self.store, self.engine, model) and self.activity is not None:
            self.activity.record(model.run.split(".")[0], model.tenant, "fold", wall,
                                 wall + time.perf_counter() - started)

    def _fold_after_load(self, model: Model) -> None:
        """Fold a model whose state a load_weights just replaced, the load's seq_id counted, so that its replay starts
        from its own state and never reads the checkpoint it loaded again (saved again, deleted or expired since, the
        client would be lost).  The load is answered before this fold; a trainer killed between the two replays the
        load from the log (offsets are committed only below calls no fold covers), and then only the very save it
        loaded may be loaded again (``saves.load_weights``)."""
        if model.fold_now:
            model.fold_now = False
            if model.loaded:
                self._fold(model)

    # ---- park: fold an adapter and take it out of the engine, its record (and waiting calls) kept ------------
    def _park(self, model: Model, why: str) -> None:
        if model.unfolded:
            self._fold(model)
        ops.unload(self.engine, model.model_id)
        model.loaded, model.parked = False, True
        log.info("unloaded %s (%s); its next call reloads it", model.model_id, why)

    def _unpark(self, model: Model) -> bool:
        """Reload a parked model from its fold; a fold that cannot be loaded refuses its calls (``refused``).

        False while a reload failed on an error that may pass (the store, memory): the model stays parked and is
        tried again next round, for ``reload_retry_s``; then its calls are answered with that error."""
        try:
            calls.load_fold(self.store, self.engine, model)
        except Exception as exc:
            now = time.monotonic()
            model.reload_failing_since = model.reload_failing_since or now
            if now - model.reload_failing_since < self.reload_retry_s:
                log.warning("reloading %s failed (%s: %s); tried again next round", model.model_id,
                            type(exc).__name__, exc)
                return False
            log.error("%s could not be reloaded for %.0f s: %s", model.model_id, now - model.reload_failing_since, exc)
            model.refused = (f"{model.model_id} could not be reloaded for {now - model.reload_failing_since:.0f} s "
                             f"({type(exc).__name__}: {exc}); {calls.REFUSED_WAY_OUT}")
        model.parked, model.reload_failing_since = False, None
        return True

    def _make_room(self, keep: Model) -> None:
        """Park the least recently used adapters until one more fits under ``max_adapters``."""
        if self.max_adapters is None:
            return
        loaded = sorted((m for m in self.models.values() if m.loaded and m is not keep), key=lambda m: m.last_used)
        for model in loaded[:max(0, len(loaded) + 1 - self.max_adapters)]:
            self._park(model, f"room for {keep.model_id}: at most {self.max_adapters} adapters")

    def _commit(self) -> None:
        held: dict[TopicPartitionKey, int] = {}
        for model in self.models.values():
            waiting = [((c.topic, c.partition), c.offset)
                       for c in (*model.pending.values(), *model.creating, *model.late)]
            for tp, offset in (*model.unfolded, *waiting):
                held[tp] = min(offset, held.get(tp, offset))
        positions = self.consumer.positions()
        offsets = {tp: held.get(tp, position) for tp, position in positions.items()}
        if offsets and offsets != self._committed:
            self._committed = self.consumer.commit(offsets)

    # ---- results -----------------------------------------------------------------------------------------------
    def _write_error(self, call: ApiRequestAccepted, message: str) -> None:
        """Answer ``call`` with a user error."""
        self._write_result(call, json.dumps({"error": message, "category": "user"}).encode(), "json", message, "user")

    def _write_result(self, call: ApiRequestAccepted, data: bytes, fmt: str, error: str | None,
                      category: str | None) -> None:
        write_result(self.store, self.publisher, call, data, fmt, error, category)  # type: ignore[arg-type]


# ---- entry point -------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """``python -m consumers.api.worker --base-model PATH --store URL --bootstrap HOST:PORT [--namespace NS]``."""
    from pipeline.runtime import StopFlag

    parser = engine_arguments("rlpipe-api-trainer", main.__doc__)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--session-timeout-s", type=float, default=SESSION_TIMEOUT_S)
    parser.add_argument("--max-adapters", type=int, default=None,
                        help="training clients in the engine at once; the least recently used leave (folded)")
    parser.add_argument("--idle-unload-s", type=float, default=IDLE_UNLOAD_S,
                        help="a training client without a call this long is folded and leaves the engine")
    args = parser.parse_args(argv)
    if args.max_adapters is not None and args.max_adapters < 1:
        parser.error(f"--max-adapters {args.max_adapters}: give at least 1, or leave it out for no limit")
    bus = engine_setup(args, log)
    ready = engine_health(args)
    log.info("initialising the training engine for %s", args.base_model)
    engine = TrainingEngine(args.base_model, device=args.device)
    ready.add("engine loaded")
    store = ObjectStore(args.store)
    worker = TrainerWorker(store, bus, args.base_model, engine, session_timeout_s=args.session_timeout_s,
                           consumer_options=group_timings_from_env(),
                           activity=ActivityRecorder(store, "trainer", args.engine_id),
                           idle_unload_s=args.idle_unload_s, max_adapters=args.max_adapters)
    ready.add("reading calls")
    worker.run(StopFlag().install())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
