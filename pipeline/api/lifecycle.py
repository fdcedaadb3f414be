"""When a session of the Tinker-compatible API ends, and what its end frees.

A session ends when its client finishes it (``ServiceClient.close``, or the end of
its ``with`` block) or when it expires: no heartbeat for ``SESSION_EXPIRY_S`` (a
day; the SDK beats every few seconds while its process lives).  The end is one
create-only object, ``sessions/<session>/ended.json`` (its reason and time), so the
first end recorded is the one that stands: a heartbeat that was on its way when
the session finished rewrites ``heartbeat.json`` but cannot bring the session
back, and a second finish keeps the first reason (as the SDK documents).  Whoever
first sees a heartbeat older than the expiry (a gateway taking a call, a trainer's
sweep) records the expiry the same way.  Gateways refuse an ended session's new
calls (410, ``Gateway.check_live``), its heartbeat included; trainers unload its
adapters.

**Snapshots.** ``save_weights_and_get_sampling_client`` publishes an unnamed
registry version for one sampling client, its manifest marked
``ends_with_session``.  The SDK calls such weights ephemeral, and a loop that
makes one per step would otherwise keep every step's adapter for ever.  A
snapshot is kept while its session lives: the trainer notes its training client
in an index (``SNAPSHOTS``) before it publishes one, and its sweep retires
(``AdapterRegistry.retire``: files deleted, number kept) every version of that
client marked with the session, ``END_GRACE_S`` after the session's end, then
removes the index entry.  The grace covers a call accepted just before the end
(gateways look at a live session at most every ``live_check_s``) and a sampler
queue behind it.  Named sampler weights are checkpoints, kept by their own rules
(``pipeline.api.checkpoints``).

**Sampler weights whose name is gone.** A named ``save_weights_for_sampler`` is a
registry version that its checkpoint record names; deleting the record (or the
sweep of its TTL) notes the version in ``UNNAMED_VERSIONS``, and every session that
samples a path is noted under ``VERSION_USERS`` before its sampling record.  A
trainer's sweep (``sweep_unnamed_versions``) retires a noted version
``END_GRACE_S`` after the note once every session sampling it has ended at least
as long ago (a gateway that read the record just before the delete writes its
note within the grace); a version a record still names (a delete cut short) is
kept.  The version's number is kept, and a pull names the reason.

**Calls, results and folds.** Every accepted call leaves its body under
``sessions/<session>/requests/``, its result under ``results/``, and each training
client a fold (``models/<n>.fold.*``, its adapter with the optimizer state).  After
the end they serve only a result fetched late and a trainer replaying calls from
before the end, so they are deleted ``SESSION_FILES_KEPT_S`` (a day) after it.  The
gateway notes every session it creates in an index (``OPEN_SESSIONS``); a trainer's
sweep visits the index (recording the expiries it sees), writes
``files_deleted.json`` (so a late poll is told why its result is gone), deletes the
files and removes the entry, so a sweep cut short is finished by the next.  The
session's own records stay: ``session.json``, its end, its models' and sampling
sessions' records (the listings read them), and its checkpoints, which live under
``runs/``; its notes as a user of named sampler weights go.  Sessions made before
these indexes existed are put in them once per store (``index_existing_sessions``,
a trainer's first sweep).  ``free_session_files`` does the same for one ended session at once
(``rlpipe sessions free``), including a session the index does not hold.

**Places.** A session's end removes it, its training clients and its sampling sessions from its tenant's
count (``free_places``) as the end is recorded (``record_end``: a finish, an operator's end, an
expiry a reader finds), and again when the sweep deletes its files.
"""

from __future__ import annotations

import json
import logging
import math
import time
from typing import Any, NamedTuple

from pipeline.api.checkpoints import UNNAMED_VERSIONS, base_model_of, clients_in_index, model_of_run, named_versions
from pipeline.api.samplers import VERSION_USERS
from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.timefmt import utc_text
from schemas.api import SESSION_TIMEOUT_S, model_id_for, model_run_name, session_path

log = logging.getLogger("rlpipe.api.lifecycle")
SESSION_EXPIRY_S = 86400.0  # a session with no heartbeat for a day has ended
END_GRACE_S = 600.0  # what a session made is freed no sooner than this after its end
SNAPSHOTS = "api/snapshots"  # one empty object per training client (its run name) that made a snapshot
SESSION_FILES_KEPT_S = 86400.0  # an ended session's call bodies, results and folds are deleted a day after its end
OPEN_SESSIONS = "api/open-sessions"  # one empty object per session whose files are not deleted yet
INDEXED = "api/indexed.json"  # written once the sessions already in a store were put in the indexes
# <tenant>/<session> and <tenant>/<session>.train.<n>: one empty object per session and training client its tenant
# holds; <tenant>/<session>.sample.<n> likewise per sampling session, in a folder of its own (``pipeline.api.quotas``)
TENANT_PLACES = "api/tenants"
TENANT_SAMPLERS = "api/tenant-samplers"
_DELETED_FOLDERS = ("results", "requests")  # results first: a call replayed meanwhile finds no result either
UNNAMED_REASON = ("its name (sampler_weights) was deleted or expired, and no live session samples from it; "
                  "save_weights_for_sampler(name) keeps weights while the name lives")
RETIRED_REASON = ("the session that made it ended, and unnamed sampler weights "
                  "(save_weights_and_get_sampling_client) live as long as their session; "
                  "save_weights_for_sampler(name) keeps weights")


def heartbeat_key(session_id: str) -> str:
    """The record of a session's last heartbeat (rewritten by every heartbeat)."""
    return f"{session_path(session_id)}/heartbeat.json"


def end_key(session_id: str) -> str:
    """The record of a session's end (create-only)."""
    return f"{session_path(session_id)}/ended.json"


def read_heartbeat(store: ObjectStore, session_id: str) -> dict[str, Any] | None:
    """The session's heartbeat record, or None when it has none."""
    return _read(store, heartbeat_key(session_id))


def heartbeat_time(store: ObjectStore, session_id: str) -> float | None:
    """When the session last beat (unix seconds), or None without a readable record."""
    beat = read_heartbeat(store, session_id)
    return None if beat is None else _seconds(beat.get("time"))


def record_end(store: ObjectStore, session_id: str, reason: str, at: float | None = None) -> tuple[str, float]:
    """Record the session's end, unless one is recorded already; the end that stands (reason, unix time).  The end
    recorded here (a client's finish, an operator's, an expiry a reader finds) frees the session's sampling-session
    places at once; one the store does not free now is freed by the sweep that deletes the session's files."""
    record = {"reason": reason, "time": time.time() if at is None else at}
    try:
        store.put_create(end_key(session_id), json.dumps(record).encode())
    except FileExistsError:
        return _recorded_end(store, session_id) or (reason, float(record["time"]))
    try:
        free_places(store, session_id)
    except OSError as exc:
        log.warning("session %s ended; its places in its tenant's count are freed by the sweep (%s)", session_id, exc)
    return reason, float(record["time"])


def session_end(store: ObjectStore, session_id: str, now: float | None = None,
                expiry_s: float = SESSION_EXPIRY_S, record: bool = True) -> tuple[str, float] | None:
    """Why and when (unix seconds) the session ended, or None while it lives.  An expiry seen here is recorded
    (unless not ``record``: a reader that only looks)."""
    ended = _recorded_end(store, session_id)
    if ended is not None:
        return ended
    return _end_by_heartbeat(store, session_id, read_heartbeat(store, session_id), now, expiry_s, record)


def _end_by_heartbeat(store: ObjectStore, session_id: str, beat: dict[str, Any] | None, now: float | None,
                      expiry_s: float, record: bool) -> tuple[str, float] | None:
    """``session_end`` of a session with no ``ended.json``, from its heartbeat record ``beat`` (None without one)."""
    at = None if beat is None else _seconds(beat.get("time"))
    if beat is not None and beat.get("ended") is True:  # the end as sessions recorded it before ended.json
        return f"finished: {beat.get('reason') or 'success'}", time.time() if at is None else at
    if at is None:  # no heartbeat yet (being written), or one without a time: nothing to expire from
        if beat is not None or store.exists(heartbeat_key(session_id)):
            log.warning("session %s: its heartbeat record has no time; taken as live", session_id)
        return None
    if (time.time() if now is None else now) - at <= expiry_s:
        return None
    end = f"expired: no heartbeat since {utc_text(at)}", at + expiry_s
    return record_end(store, session_id, *end) if record else end


class SessionStatus(NamedTuple):
    """What the readers (``rlpipe sessions``, ``rlpipe runs``) call a session (``session_status``)."""

    state: str  # ended, lapsed or live
    why: str | None  # why it ended; None unless ended
    beat_at: float | None  # when it last beat (unix seconds); None without a readable heartbeat record


def session_status(store: ObjectStore, session_id: str, now: float | None = None) -> SessionStatus:
    """``ended`` (with why) once it ended, ``lapsed`` after ``SESSION_TIMEOUT_S`` without a heartbeat (the trainers
    unload it until its next call), else ``live``; with when it last beat, from one read of its heartbeat.  A
    session with no heartbeat yet is live, as the trainers take it: nothing to lapse from.  An expiry seen here is
    not recorded."""
    now = time.time() if now is None else now
    beat = read_heartbeat(store, session_id)
    beat_at = None if beat is None else _seconds(beat.get("time"))
    end = _recorded_end(store, session_id) or _end_by_heartbeat(store, session_id, beat, now, SESSION_EXPIRY_S,
                                                                record=False)
    if end is not None:
        return SessionStatus("ended", end[0], beat_at)
    return SessionStatus("lapsed" if beat_at is not None and now - beat_at > SESSION_TIMEOUT_S else "live", None,
                         beat_at)


def session_state(store: ObjectStore, session_id: str, now: float | None = None) -> tuple[str, str | None]:
    """(state, why it ended) of ``session_status``: (``ended``, why), (``lapsed``, None) or (``live``, None)."""
    status = session_status(store, session_id, now)
    return status.state, status.why


def _recorded_end(store: ObjectStore, session_id: str) -> tuple[str, float] | None:
    """The end recorded in ``ended.json``; one that cannot be read is still an end (its reason unknown, its time
    taken as now, so a grace counted from it starts late rather than early)."""
    try:
        raw = store.get(end_key(session_id))
    except FileNotFoundError:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        record = None
    if not isinstance(record, dict):
        record = {}
    at = _seconds(record.get("time"))
    return str(record.get("reason") or "ended"), time.time() if at is None else at


def _seconds(value: Any) -> float | None:
    """A unix time from a record, or None when it is missing or not a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def mark_snapshots(store: ObjectStore, model_id: str) -> None:
    """Note that the training client makes snapshots (before it publishes one), so sweeps visit it."""
    store.put(f"{SNAPSHOTS}/{model_run_name(model_id)}", b"")


def sweep_snapshots(store: ObjectStore, base_model: str, base_models: dict[str, str | None],
                    now: float | None = None, expiry_s: float = SESSION_EXPIRY_S,
                    grace_s: float = END_GRACE_S) -> int:
    """Retire the snapshots of ``base_model``'s training clients whose session ended at least ``grace_s`` ago
    (the index, not every session in the store); how many versions were retired.  ``base_models`` caches each
    model record's base model.  An index entry is removed after its snapshots are retired, so a sweep cut short
    is finished by the next, and put back when a version was committed meanwhile (another trainer of the base
    model).  A client whose records cannot be read is logged and left for the next sweep; the others go on."""
    now = time.time() if now is None else now
    retired = 0
    for key, model_id in clients_in_index(store, SNAPSHOTS, base_model, base_models):
        try:
            retired += _sweep_client(store, key, model_id, now, expiry_s, grace_s)
        except (OSError, ValueError, LookupError) as exc:
            log.warning("the snapshots of %s were not swept, to be tried at the next sweep: %s", model_id, exc)
    return retired


def _sweep_client(store: ObjectStore, key: str, model_id: str, now: float, expiry_s: float, grace_s: float) -> int:
    run = model_run_name(model_id)
    session = run.split(".")[0]
    end = session_end(store, session, now, expiry_s)
    if end is None or now - end[1] < grace_s:
        return 0
    registry = AdapterRegistry(store, run)
    versions = registry.versions()
    retired = 0
    for version in versions:
        manifest = registry.show(version)
        if manifest.ends_with_session == session and registry.retire(version, RETIRED_REASON):
            retired += 1
    store.delete(key, missing_ok=True)
    if registry.versions() != versions:  # committed meanwhile, by a trainer that indexed it before our delete
        mark_snapshots(store, model_id)
    return retired


def sweep_unnamed_versions(store: ObjectStore, base_model: str, base_models: dict[str, str | None],
                           now: float | None = None, expiry_s: float = SESSION_EXPIRY_S,
                           grace_s: float = END_GRACE_S) -> int:
    """Retire ``base_model``'s registry versions whose sampler_weights name is gone and that no session sampling
    them still needs (the module docstring); how many.  A version whose records cannot be read is logged and left
    for the next sweep; the others go on.  Each session's end and each model's named versions are read once."""
    now = time.time() if now is None else now
    retired = 0
    ends: dict[str, tuple[str, float] | None] = {}
    for folder in store.list(UNNAMED_VERSIONS):
        model_id = model_of_run(folder.rsplit("/", 1)[-1])
        if model_id is None or base_model_of(store, model_id, base_models) != base_model:
            continue
        named: set[int] | None = None
        for key in store.list(folder):
            try:
                run, version = model_run_name(model_id), int(key.rsplit("/", 1)[-1])
                noted = _seconds((_read(store, key) or {}).get("time"))
                if (noted is not None and now - noted < grace_s) or _in_use(store, run, version, ends, now,
                                                                           expiry_s, grace_s):
                    continue
                named = named_versions(store, model_id) if named is None else named
                retired += _retire_unnamed(store, key, run, version, version in named)
            except (OSError, ValueError, LookupError) as exc:
                log.warning("%s was not swept, to be tried at the next sweep: %s", key, exc)
        store.remove_empty_folder(folder)
    return retired


def _in_use(store: ObjectStore, run: str, version: int, ends: dict[str, tuple[str, float] | None], now: float,
            expiry_s: float, grace_s: float) -> bool:
    """Whether a session that samples the version may still sample it (live, or ended within ``grace_s``)."""
    for user in store.list(f"{VERSION_USERS}/{run}/{version}"):
        session = user.rsplit("/", 1)[-1]
        if session not in ends:
            ends[session] = session_end(store, session, now, expiry_s)
        end = ends[session]
        if end is None or now - end[1] < grace_s:
            return True
    return False


def _retire_unnamed(store: ObjectStore, key: str, run: str, version: int, still_named: bool) -> int:
    """Retire the noted version unless a record still names it (a delete cut short: noted again when deleted
    again); then its notes go."""
    retired = False
    if not still_named:
        try:
            retired = AdapterRegistry(store, run).retire(version, UNNAMED_REASON)
        except AdapterNotFoundError:
            retired = False  # never committed, or its manifest is gone: nothing to retire
        users = f"{VERSION_USERS}/{run}/{version}"
        for user in store.list(users):
            store.delete(user, missing_ok=True)
        store.remove_empty_folder(users)
        store.remove_empty_folder(users.rsplit("/", 1)[0])
    store.delete(key, missing_ok=True)
    return int(retired)


def mark_open(store: ObjectStore, session_id: str) -> None:
    """Note a new session (before its record is written), so sweeps visit it after its end."""
    session_path(session_id)  # a valid name
    store.put(f"{OPEN_SESSIONS}/{session_id}", b"")


def files_deleted(store: ObjectStore, session_id: str) -> dict[str, Any] | None:
    """When and why the session's call bodies, results and folds were deleted; None while they are kept."""
    return _read(store, f"{session_path(session_id)}/files_deleted.json")


def sweep_sessions(store: ObjectStore, now: float | None = None, expiry_s: float = SESSION_EXPIRY_S,
                   kept_s: float = SESSION_FILES_KEPT_S) -> int:
    """Delete the call bodies, results and folds of the indexed sessions that ended at least ``kept_s`` ago;
    how many sessions were freed.  A session whose files cannot be deleted is logged and left for the next
    sweep; the others go on."""
    now = time.time() if now is None else now
    freed = 0
    for key in store.list(OPEN_SESSIONS):
        session = key.rsplit("/", 1)[-1]
        try:
            end = session_end(store, session, now, expiry_s)
            if end is None or now - end[1] < kept_s:
                continue
            _delete_files(store, session, end, kept_s)
            store.delete(key, missing_ok=True)
            freed += 1
        except (OSError, ValueError) as exc:
            log.warning("the files of session %s were not deleted, to be tried at the next sweep: %s", session, exc)
    return freed


class NotFreeableError(ValueError):
    """A session whose files cannot be freed yet: it lives (``free_from`` None), or it ended within the grace
    (``free_from``: from when it can be freed, unix seconds)."""

    def __init__(self, message: str, free_from: float | None = None) -> None:
        super().__init__(message)
        self.free_from = free_from


def free_session_files(store: ObjectStore, session_id: str, now: float | None = None,
                       grace_s: float = END_GRACE_S) -> int:
    """Delete one ended session's call bodies, results and folds now; how many objects were deleted.
    ``NotFreeableError`` while it lives, and within ``grace_s`` of its end (calls accepted before it may still
    run)."""
    now = time.time() if now is None else now
    end = session_end(store, session_id, now)
    if end is None:
        raise NotFreeableError(f"session {session_id} has not ended; end it first (rlpipe sessions end {session_id})")
    if now - end[1] < grace_s:
        free_from = end[1] + grace_s
        raise NotFreeableError(f"session {session_id} ended less than {grace_s / 60:g} minutes ago; free it from "
                               f"{utc_text(free_from)} (calls accepted before its end may still run)", free_from)
    deleted = _delete_files(store, session_id, end, None)
    store.delete(f"{OPEN_SESSIONS}/{session_id}", missing_ok=True)
    return deleted


def _delete_files(store: ObjectStore, session_id: str, end: tuple[str, float], kept_s: float | None) -> int:
    """The note first (a late poll reads why), then the files; how many objects were deleted."""
    prefix = session_path(session_id)
    if files_deleted(store, session_id) is None:
        note = {"time": time.time(), "end": end[0], "ended_at": end[1],
                "reason": f"kept {kept_s / 3600:g} h after the end" if kept_s is not None else "freed by an operator"}
        store.put(f"{prefix}/files_deleted.json", json.dumps(note).encode())
    keys = [key for folder in _DELETED_FOLDERS for key in store.list(f"{prefix}/{folder}", recursive=True)]
    keys += [key for key in store.list(f"{prefix}/models") if ".fold." in key.rsplit("/", 1)[-1]]
    for key in keys:
        store.delete(key, missing_ok=True)
    for run, version in _sampled_paths(store, session_id):  # it samples nothing any more
        store.delete(f"{VERSION_USERS}/{run}/{version}/{session_id}", missing_ok=True)
    free_places(store, session_id)  # (again: where the store failed as the end was recorded)
    return len(keys)


def free_places(store: ObjectStore, session_id: str) -> None:
    """Remove an ended session, its training clients and its sampling sessions from its tenant's count
    (``TENANT_PLACES``, ``TENANT_SAMPLERS``), so the folders a creation lists hold the live sessions' entries (and,
    rarely, one of a creation that raced the end, removed when the count reaches its limit)."""
    tenant = (session_record(store, session_id) or {}).get("tenant")
    if not isinstance(tenant, str):
        return
    for number in record_numbers(store, session_id, "samplers"):
        name = model_run_name(model_id_for(session_id, "sample", number))
        store.delete(f"{TENANT_SAMPLERS}/{tenant}/{name}", missing_ok=True)
    for number in record_numbers(store, session_id, "models"):
        name = model_run_name(model_id_for(session_id, "train", number))
        store.delete(f"{TENANT_PLACES}/{tenant}/{name}", missing_ok=True)
    store.delete(f"{TENANT_PLACES}/{tenant}/{session_id}", missing_ok=True)


def _sampled_paths(store: ObjectStore, session_id: str) -> set[tuple[str, int]]:
    """(run, version) of every named sampler weights path the session made a sampling client on."""
    found = set()
    for key in store.list(f"{session_path(session_id)}/samplers"):
        record = _read(store, key) or {}
        run, version = record.get("run"), record.get("version")
        if record.get("model_path") and isinstance(run, str) and isinstance(version, int):
            found.add((run, version))
    return found


def index_existing_sessions(store: ObjectStore) -> int:
    """Note every session already in the store in ``OPEN_SESSIONS`` (unless its files were deleted), and each of
    its sampling clients on a path in ``VERSION_USERS``, once per store (``INDEXED``): sessions made before these
    indexes existed are then swept, and the weights they sample kept, like new ones.  How many sessions."""
    if _read(store, INDEXED) is not None:
        return 0
    count = 0
    for folder in store.list("sessions"):
        session = folder.rsplit("/", 1)[-1]
        if not store.exists(f"{folder}/session.json") or files_deleted(store, session) is not None:
            continue
        for run, version in _sampled_paths(store, session):
            store.put(f"{VERSION_USERS}/{run}/{version}/{session}", b"")
        store.put(f"{OPEN_SESSIONS}/{session}", b"")
        count += 1
    store.put(INDEXED, json.dumps({"version": 1, "time": time.time(), "sessions": count}).encode())
    return count


def session_record(store: ObjectStore, session_id: str) -> dict[str, Any] | None:
    """The session's ``session.json`` (owner tenant, tags, creation time); None when missing or unreadable (a
    folder without a readable record is no session of anyone's)."""
    return _read(store, f"{session_path(session_id)}/session.json")


def record_numbers(store: ObjectStore, session_id: str, folder: str) -> list[int]:
    """The numbers of a session's model (``folder`` models) or sampler (``samplers``) records, in order; a model's
    fold files are not records."""
    numbers = []
    for key in store.list(f"{session_path(session_id)}/{folder}"):
        name = key.rsplit("/", 1)[-1]
        if name.endswith(".json") and name.removesuffix(".json").isdigit():
            numbers.append(int(name.removesuffix(".json")))
    return sorted(numbers)


def _read(store: ObjectStore, key: str) -> dict[str, Any] | None:
    try:
        record = json.loads(store.get(key))
    except (FileNotFoundError, ValueError):
        return None
    return record if isinstance(record, dict) else None
