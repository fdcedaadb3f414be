"""How the API trainer treats sessions that end: their calls answered without running, their adapters let go.

A call whose session ended before its turn (finished, or expired) does not run: its client is gone (the SDK's
``close`` stops polling), and a large one would hold every other tenant's calls.  It is answered with a user error,
so, like any call that failed, it changed nothing and a replay leaves it as answered; a call that ran before the
end runs again on a replay, so the model's state is rebuilt as it was.  A parked model is not loaded again only to
say so.  Every few seconds the worker parks the adapters idle too long and drops those of sessions that ended or
whose heartbeats lapsed, once nothing would be lost (``SessionEnds.expire_sessions``).

``SessionEnds`` is a part of ``consumers.api.worker.TrainerWorker``, kept apart to keep that module readable; it
uses the worker's store, records of models, engine and answers.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from consumers.api import execute, ops
from pipeline.api import lifecycle
from pipeline.io.store import remote_failures
from schemas.api import ApiRequestAccepted

if TYPE_CHECKING:
    from consumers.api.calls import Model, SplitCall
    from consumers.api.worker import TrainerWorker
    from pipeline.io.bus import TopicPartitionKey

log = logging.getLogger("rlpipe.api.trainer")


class SessionEnds:
    """The session-end part of ``TrainerWorker`` (its only user)."""

    def _answer_ended_parked(self: TrainerWorker, model: Model) -> int:
        """Answer a parked model's next calls whose session ended, never answered before, without loading it (they
        would not run, and the load could push a live tenant's adapter out); stops at a call answered before (a
        replay's, run on the state reloaded).  The number answered."""
        answered = 0
        while model.parked and not model.creating and model.next_seq in model.pending:
            call: ApiRequestAccepted = model.pending[model.next_seq].event.payload
            if (call.refused is not None or execute.answered(self.store, call) is not None
                    or self._session_ended(call) is None):
                break
            self._execute(model, model.pending.pop(model.next_seq))  # answered as ended (``_execute_call``)
            model.next_seq += 1
            answered += 1
        return answered

    def _session_ended(self: TrainerWorker, call: ApiRequestAccepted) -> str | None:
        """Why the call's session ended, or None while it lives (read at most every ``END_CHECK_S``; a store that
        cannot be read leaves the session live, and the call runs)."""
        try:
            return self.liveness.ended(call.session_id)
        except (OSError, *remote_failures()) as exc:  # the second part is looked at only once something failed
            log.warning("session %s: its end could not be read (%s); its %s runs", call.session_id, exc, call.op)
            return None

    def _answer_ended(self: TrainerWorker, model: Model, call: ApiRequestAccepted, split: SplitCall | None, ended: str,
                      entry: tuple[TopicPartitionKey, int]) -> None:
        """Answer, without running it, a call whose session ended before its turn (see the module docstring); a
        split call's earlier requests are undone with it, as for any of its requests that fails.  Once the session's
        files were deleted (a trainer down for a day) it is dropped without an answer, as ``run_call`` would."""
        if lifecycle.files_deleted(self.store, call.session_id) is not None:
            log.warning("%s %s dropped: its session ended and its calls were deleted", call.op, call.request_id)
            model.unfolded.remove(entry)
            return
        message = (f"{call.op} did not run: session {call.session_id} ended ({ended}) before its turn; send it "
                   "again from a live ServiceClient")
        if split is not None:
            self._fail_split(model, split, call.seq_id)
            message += f"; in {split.describe(call.seq_id)}: the whole call was undone, no gradient of it was kept"
        log.info("%s %s not run: session %s ended (%s)", call.op, call.request_id, call.session_id, ended)
        self._write_error(call, message)

    def expire_sessions(self: TrainerWorker) -> None:
        """Park the adapters idle for ``idle_unload_s``, and drop those of sessions that ended or whose heartbeats
        lapsed, once nothing would be lost.

        A fold holds an adapter's weights, optimizer and accumulated gradients (a laptop that slept between a
        step's ``forward_backward`` and its ``optim_step`` comes back to them), so any adapter may leave the
        engine between calls.  Calls waiting for an earlier ``seq_id`` are held only by the worker, so a model
        with such calls keeps its record (parked): while its session lives, and for ``end_grace_s`` after its
        session's end (calls accepted before the end may still be on their way); after that the waiting calls
        are answered with an error and the record goes.  The record of a model in neither place (its creation
        failed, or its fold could not be loaded) goes ``end_grace_s`` after its session's end."""
        self._last_expiry = now = time.monotonic()
        for model in list(self.models.values()):
            if model.creating:
                continue  # its creation runs next round
            session = model.run.split(".")[0]
            end = lifecycle.session_end(self.store, session, record=False)
            if not (model.loaded or model.parked):
                self._expire_unloadable(model, end)
                continue
            if end is None:
                at = lifecycle.heartbeat_time(self.store, session)
                if at is None or time.time() - at <= self.session_timeout_s:
                    if model.loaded and not model.creating and now - model.last_used >= self.idle_unload_s:
                        self._park(model, f"no call for {now - model.last_used:.0f} s")
                    if model.gap_since is not None and now - model.gap_since >= self.gap_give_up_s:
                        # its client lives on (it heartbeats) and gave this seq_id up: the SDK sends a call's
                        # requests in order, retrying each, and stops for good after one fails
                        self._answer_waiting(model, f"seq_id {model.next_seq} of {model.model_id} never arrived "
                                                    f"within {now - model.gap_since:.0f} s while its session "
                                                    "lived (its client gave that call up); create a new training "
                                                    "client")
                    continue
            if end is None and model.gap_since is not None:  # lapsed (a laptop asleep): its wait counts from its
                model.gap_since = now                            # return, when its client sends again
            if model.pending and (end is None or time.time() - end[1] < self.end_grace_s):
                if model.loaded:  # its calls wait for a seq_id that may come late, or never
                    self._park(model, f"session {session} {'ended' if end else 'lapsed'} with calls waiting")
                continue
            if model.pending:
                self._answer_waiting(model, f"session {session} ended before seq_id {model.next_seq} of "
                                            f"{model.model_id} arrived; create a new ServiceClient")
            if model.loaded:
                if model.unfolded:
                    self._fold(model)
                ops.unload(self.engine, model.model_id)
            del self.models[model.model_id]
            log.info("session %s %s: unloaded %s", session, "ended" if end else "lapsed", model.model_id)

    def _expire_unloadable(self: TrainerWorker, model: Model, end: tuple[str, float] | None) -> None:
        """Drop the record of a model in neither the engine nor a fold it can load (its creation failed, or its fold
        is lost) ``end_grace_s`` after its session's end.  Its calls are answered as they come, out of turn, and a
        record made again from its fold would wait for the seq_ids answered so: it stays while its session may
        send one (a lapsed session expires a day after its last heartbeat)."""
        if end is not None and time.time() - end[1] >= self.end_grace_s:
            del self.models[model.model_id]
            log.info("session %s ended: dropped the record of %s", model.run.split(".")[0], model.model_id)

    def _answer_waiting(self: TrainerWorker, model: Model, why: str) -> None:
        """Answer every call waiting for an earlier seq_id with a user error (a call left without a result would
        be polled for ever, and would hold the log's offsets back)."""
        log.warning("%s: answering the calls waiting for seq_id %d: %s", model.model_id, model.next_seq, why)
        for seq in sorted(model.pending):
            call = model.pending.pop(seq).event.payload
            self._write_error(call, call.refused or f"{call.op} did not run: {why}")
        model.gap_since = None
