"""What a trainer of the Tinker-compatible API sweeps between calls, every ``SWEEP_S``.

  expired checkpoints            of its base model's training clients (``pipeline.api.checkpoints``;
                                 the trainer writes checkpoints, so a sweep never races a save)
  snapshots of ended sessions    retired ``END_GRACE_S`` after the end (``pipeline.api.lifecycle``)
  sampler weights whose name     retired once no live session samples them
  is gone
  files of ended sessions        call bodies, results and folds, a day after the end
  engine activity                older than ``ACTIVITY_KEPT_S``, at most every ``ACTIVITY_SWEEP_S``
                                 (``pipeline.api.activity``)

Every trainer sweeps every session's files and all activity (deleting twice is
harmless); the rest is per base model.  The last two of the session sweeps rely on
indexes that the gateway and the trainer write; sessions made before those
indexes existed are put into them once per store, in a thread of its own (it
reads the whole store), and those two sweeps wait for it.  A sweep that fails is
logged and tried again at the next: the store's trouble never stops the calls.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable

from pipeline.api import checkpoints, lifecycle
from pipeline.api.activity import ACTIVITY_SWEEP_S, sweep_activity
from pipeline.io.store import ObjectStore

log = logging.getLogger("rlpipe.api.trainer")
SWEEP_S = 600.0  # how often a trainer sweeps


class LookupCache(dict[str, str | None]):
    """Model record key -> its base model, as ``pipeline.api.checkpoints.base_model_of`` caches it, forgetting at
    ``forget_unasked`` the keys nobody asked about since the last call: a client leaves the sweeps' indexes once
    nothing of it is left to sweep, and a server that saw thousands of sessions keeps only those still indexed."""

    def __init__(self) -> None:
        super().__init__()
        self._asked: set[object] = set()

    def __contains__(self, key: object) -> bool:
        self._asked.add(key)
        return super().__contains__(key)

    def forget_unasked(self) -> None:
        for key in [key for key in self if key not in self._asked]:
            del self[key]
        self._asked = set()


class Sweeper:
    """One trainer's sweeps (the module docstring); ``sweep`` runs them all once."""

    def __init__(self, store: ObjectStore, base_model: str) -> None:
        self.store, self.base_model = store, base_model
        self.session_files_kept_s = lifecycle.SESSION_FILES_KEPT_S  # an ended session's files are kept this long
        self._base_models = LookupCache()  # model record key -> its base model, of the clients still indexed
        self._last_activity_sweep = -math.inf
        self._indexed = threading.Event()  # set once the store's existing sessions are in the indexes
        self._indexing: threading.Thread | None = None

    def sweep(self) -> int:
        """Every sweep once; how many things they deleted or retired in all."""
        self._index_existing_sessions()
        indexed = self._indexed.is_set()  # until then a session from before the indexes could lose its weights
        sweeps: tuple[tuple[str, Callable[[], int]], ...] = (
            ("expired checkpoints", lambda: checkpoints.sweep_base_model(self.store, self.base_model,
                                                                        self._base_models)),
            ("snapshots of ended sessions", lambda: lifecycle.sweep_snapshots(self.store, self.base_model,
                                                                             self._base_models)),
            ("sampler weights whose name is gone", lambda: lifecycle.sweep_unnamed_versions(
                self.store, self.base_model, self._base_models) if indexed else 0),
            ("files of ended sessions", lambda: lifecycle.sweep_sessions(
                self.store, kept_s=self.session_files_kept_s) if indexed else 0),
            ("engine activity records past their days", self._sweep_activity))
        swept = 0
        for what, sweep in sweeps:
            try:
                done = sweep()
            except Exception as exc:  # the store's trouble must not stop the calls; the next sweep tries again
                log.warning("the sweep of %s failed, to be tried again in %.0f s: %s", what, SWEEP_S, exc)
                continue
            if done:
                log.info("swept %d %s", done, what)
            swept += done
        self._base_models.forget_unasked()
        return swept

    def wait_indexed(self, timeout_s: float) -> bool:
        """Whether the store's existing sessions are in the sweeps' indexes, waiting up to ``timeout_s``."""
        return self._indexed.wait(timeout_s)

    def _index_existing_sessions(self) -> None:
        """Start putting the sessions made before the indexes into them (once per store) unless done or under way."""
        if self._indexed.is_set() or (self._indexing is not None and self._indexing.is_alive()):
            return

        def index() -> None:
            try:
                count = lifecycle.index_existing_sessions(self.store)
            except Exception as exc:  # tried again at the next sweep
                log.warning("indexing the store's existing sessions failed, to be tried again: %s", exc)
                return
            self._indexed.set()
            if count:
                log.info("indexed %d sessions made before the sweeps' indexes", count)

        self._indexing = threading.Thread(target=index, name="index-sessions", daemon=True)
        self._indexing.start()

    def _sweep_activity(self) -> int:
        """``sweep_activity`` at most every ``ACTIVITY_SWEEP_S`` (it lists every engine's records)."""
        if time.monotonic() - self._last_activity_sweep < ACTIVITY_SWEEP_S:
            return 0
        self._last_activity_sweep = time.monotonic()
        return sweep_activity(self.store)
