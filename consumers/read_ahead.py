"""Reading trajectory batches ahead: the next step's batches are read while this step trains.

A learner ingests the batches it is given in order; reading one (the Parquet file, its
checksum) is the part of ingesting that waits on the store.  ``BatchReader`` starts those
reads on one background thread as soon as the batches are known, and ``read`` hands back the
result (or the error: a corrupt batch is still quarantined by the learner) in the learner's
own order.  A read has no side effects, so a batch read ahead and then not used (a duplicate,
a stop) costs only the read; nothing about what is trained, or when, changes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import pyarrow as pa

from pipeline.io.archive import TrajectoryArchive


class Readable(Protocol):
    """What a batch reference must say to be read: where, and the checksum it must match."""

    path: str
    sha256: str | None


class BatchReader:
    """Reads up to ``ahead`` batches in advance on one thread (``rlpipe-read-ahead``); ``read`` falls back to
    reading in the caller's thread for a batch not read ahead."""

    def __init__(self, archive: TrajectoryArchive, ahead: int = 2) -> None:
        self.archive, self.ahead = archive, ahead
        self.executor: ThreadPoolExecutor | None = None
        self.reads: dict[tuple[str, str | None], Future[pa.Table]] = {}

    def read_ahead(self, refs: Iterable[Readable], skip: Callable[[Any], bool] = lambda ref: False) -> None:
        """Start reading the first ``ahead`` of ``refs`` (those not ``skip``-ped and not already started)."""
        if self.executor is None:
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlpipe-read-ahead")
        for ref in itertools.islice(refs, self.ahead):
            key = (ref.path, ref.sha256)
            if key not in self.reads and not skip(ref):
                self.reads[key] = self.executor.submit(self.archive.read_batch, ref.path, ref.sha256)

    def read(self, ref: Readable) -> pa.Table:
        """The batch, verified against its checksum: the read started ahead if there is one, else read now."""
        future = self.reads.pop((ref.path, ref.sha256), None)
        return future.result() if future is not None else self.archive.read_batch(ref.path, ref.sha256)

    def forget(self, ref: Readable) -> None:
        """Drop the read started ahead for ``ref``, if any (a batch skipped unread): its table is not kept."""
        future = self.reads.pop((ref.path, ref.sha256), None)
        if future is not None:
            future.cancel()

    def close(self) -> None:
        """Drop reads not used and stop the thread (after a read in progress ends)."""
        for future in self.reads.values():
            future.cancel()
        self.reads.clear()
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
