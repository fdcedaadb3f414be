"""When a session of the Tinker-compatible API ends, and what its end frees.

A session ends when its client finishes it (``ServiceClient.close``, or the end of
its ``with`` block: ``sessions/<session>/heartbeat.json`` then says ``ended``) or
when it expires: no heartbeat for ``SESSION_EXPIRY_S`` (a day; the SDK beats every
few seconds while its process lives).  Both are read from the same record by the
same rule (``session_end``), so every gateway and trainer agrees without a writer.
Gateways refuse an ended session's new calls (410, ``Gateway.check_live``), its
heartbeat included; trainers unload its adapters.

**Snapshots.** ``save_weights_and_get_sampling_client`` publishes an unnamed
registry version for one sampling client.  The SDK calls such weights ephemeral,
and a loop that makes one per step would otherwise keep every step's adapter for
ever.  A snapshot is kept while its session lives: the trainer notes its training
client in an index (``SNAPSHOTS``) before it publishes one, and its sweep retires
(``AdapterRegistry.retire``: files deleted, number kept) the snapshots of clients
whose session ended at least ``END_GRACE_S`` ago, then removes the index entry.
The grace covers a call accepted just before the end (gateways look at the record
at most every ``live_check_s``).  Named sampler weights are checkpoints, kept by
their own rules (``pipeline.api.checkpoints``).
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from pipeline.api.checkpoints import clients_in_index
from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.api import model_run_name, session_path

SESSION_EXPIRY_S = 86400.0  # a session with no heartbeat for a day has ended
END_GRACE_S = 60.0  # what a session made is freed no sooner than this after its end
SNAPSHOTS = "api/snapshots"  # one empty object per training client (its run name) that made a snapshot
RETIRED_REASON = ("the session that made it ended, and unnamed sampler weights "
                  "(save_weights_and_get_sampling_client) live as long as their session; "
                  "save_weights_for_sampler(name) keeps weights")


def heartbeat_key(session_id: str) -> str:
    """The record of a session's last heartbeat, or of its end."""
    return f"{session_path(session_id)}/heartbeat.json"


def read_heartbeat(store: ObjectStore, session_id: str) -> dict[str, Any] | None:
    """The session's heartbeat record, or None when it has none."""
    try:
        record = json.loads(store.get(heartbeat_key(session_id)))
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def session_end(record: dict[str, Any], now: float | None = None,
                expiry_s: float = SESSION_EXPIRY_S) -> tuple[str, float] | None:
    """Why and when (unix seconds) the session of this heartbeat record ended, or None while it lives."""
    at = float(record.get("time", 0.0))
    if record.get("ended"):
        return f"finished: {record.get('reason') or 'success'}", at
    if (time.time() if now is None else now) - at > expiry_s:
        since = datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M UTC")
        return f"expired: no heartbeat since {since}", at + expiry_s
    return None


def mark_snapshots(store: ObjectStore, model_id: str) -> None:
    """Note that the training client makes snapshots (before it publishes one), so sweeps visit it."""
    store.put(f"{SNAPSHOTS}/{model_run_name(model_id)}", b"")


def sweep_snapshots(store: ObjectStore, base_model: str, base_models: dict[str, str | None],
                    now: float | None = None, expiry_s: float = SESSION_EXPIRY_S,
                    grace_s: float = END_GRACE_S) -> int:
    """Retire the snapshots of ``base_model``'s training clients whose session ended at least ``grace_s`` ago
    (the index, not every session in the store); how many versions were retired.  ``base_models`` caches each
    model record's base model.  An index entry is removed after its snapshots are retired, so a sweep cut short
    is finished by the next."""
    now = time.time() if now is None else now
    retired = 0
    for key, model_id in clients_in_index(store, SNAPSHOTS, base_model, base_models):
        session, run = model_run_name(model_id).split(".")[0], model_run_name(model_id)
        record = read_heartbeat(store, session)
        end = None if record is None else session_end(record, now, expiry_s)
        if end is None or now - end[1] < grace_s:
            continue
        registry = AdapterRegistry(store, run)
        for sampler_key in store.list(f"{session_path(session)}/samplers"):
            try:
                sampler = json.loads(store.get(sampler_key))
            except (FileNotFoundError, ValueError):
                continue
            if sampler.get("run") == run and sampler.get("model_path") is None and sampler.get("version"):
                version = int(sampler["version"])
                if registry.retired_reason(version) is None:
                    with contextlib.suppress(AdapterNotFoundError):  # (a record whose version is not committed)
                        registry.retire(version, RETIRED_REASON)
                        retired += 1
        store.delete(key, missing_ok=True)
    return retired
