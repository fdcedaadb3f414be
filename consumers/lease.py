"""The learner lease: at most one learner of a run commits adapters and checkpoints.

Layout (one immutable object per epoch, written create-only)::

    runs/<run>/learner-lease/epoch-000003.json   {"epoch": 3, "holder": "learner-0-12", "token": ..., "acquired_at": ...}

A learner takes the lease when it starts by creating the next epoch (one above
the highest present); the highest epoch holds the lease.  Every commit point of
the learner (the registry's version manifest and the checkpoint manifest, both
written create-only) first checks that no higher epoch exists; a learner that
finds one stops with a one-line reason naming the holder, before its manifest
is written, so nothing it did since the newer learner started is ever committed.

Why the newest learner wins: a restarted learner (a crash, a rescheduled pod)
cannot tell whether its predecessor is dead or only silent, and must not wait
for it.  It takes over at once with a higher epoch, resumes from the last
checkpoint, and the old one, if it still runs, is fenced out at its next
publish or checkpoint.  A stray second ``rlpipe learner start`` beside a
deployed learner does the same; the one fenced out exits (and a supervisor that
restarts it hands the lease back: still one learner at a time).

The check and the manifest write are two calls, so a learner that loses the
lease in between may commit once more; both learners then wrote a valid manifest
from a complete state, and versions and checkpoints stay dense and readable.  A
checkpoint committed that late may cover steps the newer learner (resumed from an
older checkpoint) trains again on other batches and rewrites in the step log; the
step log's hash chain (``pipeline.io.steplog``) makes a resume skip it then, so its
weights are never paired with the other learner's record of what was trained.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.io.store import ObjectStore
from schemas.names import validate_name

log = logging.getLogger("rlpipe.learner")

_EPOCH_RE = re.compile(r"epoch-(\d{6,})\.json")
MANIFEST_SUFFIX = "/manifest.json"  # the create-only commit point of a version and of a checkpoint


class LeaseLostError(RuntimeError):
    """Another learner of the run holds the lease now: this one must stop without committing."""


def default_holder() -> str:
    """``<host>-<pid>``: names the learner in the lease and in the error the other learner prints."""
    host = "".join(c if c.isalnum() or c in "-_." else "-" for c in socket.gethostname())[:40] or "host"
    return f"{host}-{os.getpid()}"


@dataclass(frozen=True)
class LeaseRecord:
    """One epoch of the lease, as stored."""

    epoch: int
    holder: str
    token: str
    acquired_at: str

    def describe(self) -> str:
        return f"{self.holder} (epoch {self.epoch}, since {self.acquired_at})"


class LearnerLease:
    """Takes and checks the learner lease of one run."""

    def __init__(self, store: ObjectStore, run_id: str, holder: str | None = None, max_attempts: int = 100) -> None:
        self.store, self.run_id = store, validate_name(run_id, "run_id")
        self.holder = holder or default_holder()
        self.prefix = f"runs/{self.run_id}/learner-lease"
        self.max_attempts = max_attempts
        self.epoch: int | None = None
        self.token = uuid.uuid4().hex

    def _key(self, epoch: int) -> str:
        return f"{self.prefix}/epoch-{epoch:06d}.json"

    def epochs(self) -> list[int]:
        """Every epoch taken so far, ascending."""
        names = (key.rsplit("/", 1)[-1] for key in self.store.list(self.prefix))
        return sorted(int(m.group(1)) for m in map(_EPOCH_RE.fullmatch, names) if m)

    def read(self, epoch: int) -> LeaseRecord:
        data: dict[str, Any] = json.loads(self.store.get(self._key(epoch)))
        return LeaseRecord(int(data["epoch"]), str(data["holder"]), str(data["token"]), str(data["acquired_at"]))

    def current(self) -> LeaseRecord | None:
        """The record of the highest epoch (the holder now), or None before any learner started."""
        epochs = self.epochs()
        return self.read(epochs[-1]) if epochs else None

    def acquire(self) -> int:
        """Create the next epoch create-only and hold it; returns the epoch."""
        for _ in range(self.max_attempts):
            epochs = self.epochs()
            previous = self.read(epochs[-1]) if epochs else None
            epoch = (epochs[-1] if epochs else 0) + 1
            record = {"epoch": epoch, "holder": self.holder, "token": self.token,
                      "acquired_at": datetime.now(UTC).isoformat(timespec="seconds")}
            try:
                self.store.put_create(self._key(epoch), json.dumps(record, sort_keys=True).encode())
            except FileExistsError:
                if self.read(epoch).token != self.token:  # another learner took this epoch: try the next
                    continue
            self.epoch = epoch
            taken_from = f", taking over from {previous.describe()}" if previous else ""
            log.info("holding the learner lease of run %s as %s (epoch %d)%s", self.run_id, self.holder, epoch,
                     taken_from)
            return epoch
        raise LeaseLostError(f"could not take the learner lease of run {self.run_id}: {self.max_attempts} learners "
                             "took it first; start one learner per run")

    def check(self) -> None:
        """Raise ``LeaseLostError`` (one line naming the holder) unless this learner still holds the lease."""
        if self.epoch is None:
            raise LeaseLostError(f"this learner of run {self.run_id} has not taken the learner lease; "
                                 "resume() takes it before anything is committed")
        epochs = self.epochs()
        if epochs and epochs[-1] > self.epoch:
            holder = self.read(epochs[-1])
            raise LeaseLostError(
                f"run {self.run_id} has a newer learner: {holder.describe()}; this learner ({self.holder}, "
                f"epoch {self.epoch}) stops without committing; run one learner per run"
            )


class FencedStore:
    """``store`` as the registry and checkpoints see it: creating a ``manifest.json``, replacing an object and
    deleting one check the lease first.

    Manifests are the create-only commit points of adapter versions and
    checkpoints, so a learner fenced out by a newer one never commits either;
    its staged files stay unnamed orphans, which readers never see.  Nor does it
    prune checkpoints.  Everything else is the wrapped store's own.
    """

    def __init__(self, store: ObjectStore, lease: LearnerLease) -> None:
        self._store, self.lease = store, lease

    # Every create-only write method is fenced here: one reached through ``__getattr__``
    # would call the wrapped store's own ``put_create`` and skip the lease.

    def put_create(self, key: str, data: bytes) -> str:
        if key.endswith(MANIFEST_SUFFIX):
            self.lease.check()
        return self._store.put_create(key, data)

    def put_create_once(self, key: str, data: bytes) -> str:
        if key.endswith(MANIFEST_SUFFIX):
            self.lease.check()
        return self._store.put_create_once(key, data)

    def put_create_many(self, files: Mapping[str, bytes]) -> dict[str, str]:
        if any(key.endswith(MANIFEST_SUFFIX) for key in files):
            self.lease.check()
        return self._store.put_create_many(files)

    def put(self, key: str, data: bytes) -> str:
        # The learner's only replacing write is a step object of an attempt that crashed before its
        # checkpoint (``pipeline.io.steplog``): a fenced-out learner must not overwrite the history
        # that the lease holder's checkpoints cover.
        self.lease.check()
        return self._store.put(key, data)

    def delete(self, key: str, recursive: bool = False, missing_ok: bool = False) -> None:
        # A fenced-out learner deletes nothing: its checkpoint committed a moment late may be one the newer
        # learner's steps fork from, and the older checkpoint it would prune as surplus is then the one the
        # next resume falls back to (``CheckpointStore.prune``).
        self.lease.check()
        self._store.delete(key, recursive=recursive, missing_ok=missing_ok)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
