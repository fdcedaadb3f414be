"""The learner's step log in the store: one immutable JSON object per optimizer step.

Layout::

    runs/<run>/steps/step-000123.json    the metrics of step 123 (``Learner.step``), including the
                                         ``batch_ids`` that step trained for the first time

Why objects of their own: a checkpoint that carried the whole log (and every
trained batch id) grew with every step and was rewritten at every checkpoint,
O(steps^2) bytes over a run.  Each step object is written once, so a checkpoint
stays the same size however long the run; the learner rebuilds its set of trained
batch ids from these objects when it loads a checkpoint, and the report reads
its per-step series from them.

Authority.  The learner writes step N's object at the end of step N, before any
checkpoint that covers it.  The objects of steps up to the newest checkpoint's
step are the run's history.  An object above it is provisional: a learner that
crashed before its next checkpoint left it behind, and the learner that resumes
from the checkpoint retrains that step and writes its own entry over it (``write``
replaces an object whose bytes differ; every step up to a durable checkpoint was
therefore written by the attempt that wrote that checkpoint, or by one it resumed
from).  Readers pass ``upto`` (the checkpoint's step) to see only the history.
An object that is not a JSON object of the step its name says is refused
(``StepLogError``) rather than read: the dedup of batch ids would be wrong.

Lineage.  Each entry names the sha256 of the step object before it in its
learner's history (``previous_sha256``; None for step 1 and after an entry that
predates the field), and a checkpoint records the sha256 of its step's object
(``LearnerState.step_log_head``), so the objects a checkpoint covers form a hash
chain ending in it.  A learner fenced out by a newer one may still commit one
checkpoint (its lease check and its manifest write are two calls) after the newer
one resumed from an older checkpoint; the newer one then rewrites the step objects
above that older checkpoint.  ``history`` refuses a checkpoint whose chain no
longer holds (``StepLogForkedError``): resuming from it would pair its weights
with another learner's record of what was trained.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pipeline.io.store import ObjectStore, sha256_hex
from schemas.names import validate_name

log = logging.getLogger("rlpipe.learner")

_STEP_RE = re.compile(r"step-(\d{6,})\.json")
_READ_THREADS = 16  # concurrent GETs: thousands of small objects on gs:// are latency-bound
T = TypeVar("T")
PREVIOUS_KEY = "previous_sha256"  # an entry's link to the step object before it in its learner's history


class StepLogGapError(RuntimeError):
    """Step objects that the history must hold are missing (deleted by hand or never migrated)."""


class StepLogError(ValueError):
    """A step object that is not one: not JSON, not an object, or the entry of another step than its name's."""


class StepLogForkedError(RuntimeError):
    """The step objects a checkpoint covers are not the ones its learner wrote: a learner that took the run over
    rewrote them, so the checkpoint is not part of the run's history any more."""


def encode(entry: dict[str, Any]) -> bytes:
    """A step entry's stored bytes (their sha256 is what the next entry and a checkpoint name)."""
    return json.dumps(entry, sort_keys=True).encode()


def linked(entry: dict[str, Any], previous_sha256: str | None) -> tuple[dict[str, Any], str]:
    """``entry`` naming the step object before it, and the sha256 of its stored bytes (the new head)."""
    entry = {**entry, PREVIOUS_KEY: previous_sha256}
    return entry, sha256_hex(encode(entry))


class StepLog:
    """Writes and reads the per-step objects of one run."""

    def __init__(self, store: ObjectStore, run_id: str) -> None:
        self.store, self.run_id = store, validate_name(run_id, "run_id")
        self.prefix = f"runs/{self.run_id}/steps"

    def key(self, step: int) -> str:
        """``runs/<run>/steps/step-000123.json``."""
        return f"{self.prefix}/step-{step:06d}.json"

    def write(self, entry: dict[str, Any]) -> None:
        """Store ``entry`` (its ``step`` names it): created, or replacing a provisional entry of a crashed attempt."""
        step = int(entry["step"])
        data = encode(entry)
        try:
            self.store.put_create_once(self.key(step), data)
        except FileExistsError:
            log.info("step %d: replacing the entry of an attempt that stopped before checkpointing it", step)
            self.store.put(self.key(step), data)

    def steps(self) -> list[int]:
        """Step numbers with an object, ascending (provisional ones included)."""
        names = (key.rsplit("/", 1)[-1] for key in self.store.list(self.prefix))
        return sorted(int(m.group(1)) for m in map(_STEP_RE.fullmatch, names) if m)

    def read(self, upto: int | None = None, since: int = 1) -> list[dict[str, Any]]:
        """Entries of steps ``since``..``upto`` in order (``upto=None``: every stored step, provisional too).

        With ``upto`` every step of the range must be there (``StepLogGapError`` otherwise): the
        learner's dedup of batch ids relies on the complete history.
        """
        return [entry for _, entry in self._read(upto, since)]

    def history(self, upto: int, head: str | None) -> list[dict[str, Any]]:
        """Entries of steps 1..``upto`` (as ``read``), refused with ``StepLogForkedError`` unless they are the
        chain that a checkpoint at ``upto`` recorded: step ``upto``'s object has the sha256 ``head``, and each
        entry's ``previous_sha256`` is that of the object before it (back to an entry naming none).  ``head``
        None (a checkpoint that recorded none) checks nothing."""
        blobs_entries = self._read(upto, since=1)
        expected = head
        for blob, entry in reversed(blobs_entries):
            if expected is None:
                break
            if sha256_hex(blob) != expected:
                raise StepLogForkedError(
                    f"run {self.run_id}: step object {self.store.url(self.key(int(entry['step'])))} is not the one "
                    f"the checkpoint at step {upto} follows; a learner that took the run over rewrote it"
                )
            expected = entry.get(PREVIOUS_KEY)
        return [entry for _, entry in blobs_entries]

    def _read(self, upto: int | None, since: int) -> list[tuple[bytes, dict[str, Any]]]:
        """(bytes, entry) of steps ``since``..``upto`` in order, gap-checked as ``read`` says."""
        steps = [s for s in self.steps() if s >= since and (upto is None or s <= upto)]
        if upto is not None and len(steps) != upto - since + 1:
            missing = sorted(set(range(since, upto + 1)) - set(steps))
            raise StepLogGapError(
                f"run {self.run_id}: {len(missing)} step objects missing under {self.store.url(self.prefix)} "
                f"(first: step {missing[0]}); restore them from a backup, or the learner could train those "
                "steps' batches twice"
            )
        with ThreadPoolExecutor(max_workers=_READ_THREADS) as pool:
            blobs = list(pool.map(self._get, steps))
        return [(blob, self._entry(step, blob)) for step, blob in zip(steps, blobs, strict=True)]

    def _entry(self, step: int, blob: bytes) -> dict[str, Any]:
        """The entry in ``blob``, refused (``StepLogError``, naming the object) unless it is step ``step``'s."""
        try:
            entry = json.loads(blob)
            problem = None
        except ValueError as exc:
            entry, problem = None, f"not JSON: {exc}"
        if problem is None and not isinstance(entry, dict):
            problem = "not a JSON object"
        elif problem is None and entry.get("step") != step:
            problem = f"it holds the entry of step {entry.get('step')!r}"
        if problem is not None:
            raise StepLogError(f"step object {self.store.url(self.key(step))} is damaged ({problem}); restore it "
                               "from a backup, or the learner could train that step's batches twice")
        return entry  # type: ignore[no-any-return]

    def _get(self, step: int) -> bytes:
        try:
            return self.store.get(self.key(step))
        except FileNotFoundError as exc:  # listed a moment ago: gone is a gap, not a damaged checkpoint
            raise StepLogGapError(f"run {self.run_id}: step {step} vanished while being read ({exc})") from None


def trained_batches(entries: list[dict[str, Any]]) -> dict[str, int]:
    """``batch_id -> step`` from step entries: the learner's dedup set."""
    trained: dict[str, int] = {}
    for entry in entries:
        for batch_id in entry.get("batch_ids", []):
            trained.setdefault(batch_id, int(entry["step"]))
    return trained


def in_trained_order(items: Iterable[T], batch_id_of: Callable[[T], str], entries: list[dict[str, Any]]) -> list[T]:
    """``items`` in the order the step ``entries`` trained them (step by step, each step's ``batch_ids`` as
    listed), then the items no entry names, in their given order.

    A replay that reproduces a run follows this: a learner trains batches in the
    order their announcements reach it, which neither their names nor their
    commit times record, and its steps form from them in that order.
    """
    rank: dict[str, int] = {}
    for entry in entries:
        for batch_id in entry.get("batch_ids", []):
            rank.setdefault(batch_id, len(rank))
    untrained = len(rank)
    return sorted(items, key=lambda item: rank.get(batch_id_of(item), untrained))  # stable: the rest keep their order
