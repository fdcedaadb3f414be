"""Counting what each tenant holds, against its ``TenantLimits``: sessions that have not ended, their
training clients and the sampling sessions ``create_sampling_session`` made in them.

The count is in the store, so every gateway sees the same: one empty object per session and per training
client under ``api/tenants/<tenant>/`` (named ``<session>`` and ``<session>.train.<n>``), written when a gateway
creates it (a session once its record and first heartbeat are written: one that has none never ends, so its entry
would never be removed); sampling sessions likewise under ``api/tenant-samplers/<tenant>/``
(``<session>.sample.<n>``).  A creation lists its folder, notes its entry, then lists it again (``confirm_*``):
one that finds more entries than the limit was admitted at the same moment as a creation on another gateway, and
takes its entry back and is refused.  Of two such creations the later lister sees the other's entry (the store's
listings follow its writes: local disk, gs://), so gateways together never pass a limit; at the limit both may be
refused.  A session's end removes its entry, its training clients' and its sampling sessions'
(``lifecycle.free_places``, as the end is recorded), so the folders hold about the live sessions' entries; entries
of sessions that ended are also removed when a count reaches a limit (each listed session's end is then read), so
a tenant under its limits costs two listings per creation, and its folders hold little more than its limits.  One gateway runs one tenant's
creations one at a time (``creating``: its routes run in worker threads), so it never refuses both of two.

A store written by a gateway that kept no count (one older than the limits) holds sessions no entry names: the
first creation that finds no ``COUNTED`` mark notes every session record's live session (one with a heartbeat)
and its training clients, then writes the mark, so they hold their places.  That costs a few reads per session
in the store (its record, heartbeat and end, and a listing of its training clients), once per store, inside that
creation; a session an older gateway creates after it is not counted, nor are sampling sessions made before their
count was kept (they are freed as their sessions end).
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from collections.abc import Callable

from pipeline.api.lifecycle import TENANT_PLACES, TENANT_SAMPLERS, heartbeat_time, record_numbers, session_record
from pipeline.api.tenants import (
    MAX_MODELS_ENV,
    MAX_SAMPLING_SESSIONS_ENV,
    MAX_SESSIONS_ENV,
    TenantLimitError,
    TenantLimits,
)
from pipeline.io.store import ObjectStore
from schemas.api import model_id_for, model_run_name

TENANTS = TENANT_PLACES
# <tenant>/<session>.sample.<n>: sampling sessions, in a folder of their own, so that counting a tenant's sessions and
# training clients never lists them (a loop can make thousands)
SAMPLERS = TENANT_SAMPLERS
COUNTED = "api/tenants-counted.json"  # written once the sessions of the store from before the count were noted
CREATION_LOCKS = 64  # a tenant's creations take one of these locks (by its name): two tenants rarely share one


class TenantQuota:
    """Admits a tenant's new session, training client or sampling session while it is under its limits;
    ``has_ended(session)`` says whether a session ended (read when a limit is reached)."""

    def __init__(self, store: ObjectStore, limits: TenantLimits, has_ended: Callable[[str], bool]) -> None:
        self.store, self.limits, self.has_ended = store, limits, has_ended
        self._counted = False  # the store's ``COUNTED`` mark was seen
        self._creation_locks = [threading.Lock() for _ in range(CREATION_LOCKS)]  # bounded, however many tenants

    def creating(self, tenant: str) -> threading.Lock:
        """Held from a creation's ``admit_*`` to its ``confirm_*``, so that two creations of one tenant never both
        count its places before either is noted."""
        return self._creation_locks[zlib.crc32(tenant.encode()) % CREATION_LOCKS]

    def admit_session(self, tenant: str) -> None:
        """``TenantLimitError`` when ``tenant`` holds ``max_sessions`` sessions that have not ended."""
        self._admit(tenant, "sessions")

    def admit_model(self, tenant: str) -> None:
        """``TenantLimitError`` when ``tenant`` holds ``max_models`` training clients in sessions not ended."""
        self._admit(tenant, "models")

    def admit_sampler(self, tenant: str) -> None:
        """``TenantLimitError`` when ``tenant`` holds ``max_sampling_sessions`` sampling sessions in sessions not
        ended."""
        self._admit(tenant, "samplers")

    def _admit(self, tenant: str, kind: str) -> None:
        limit = self._limit(kind)[0]
        held = self._held(tenant, kind, limit)
        if held >= limit:
            raise self._refusal(kind, held)

    def note_session(self, tenant: str, session_id: str) -> None:
        self.store.put(f"{TENANTS}/{tenant}/{session_id}", b"")

    def note_model(self, tenant: str, model_id: str) -> None:
        self.store.put(f"{TENANTS}/{tenant}/{model_run_name(model_id)}", b"")

    def note_sampler(self, tenant: str, sampling_session_id: str) -> None:
        self.store.put(f"{SAMPLERS}/{tenant}/{model_run_name(sampling_session_id)}", b"")

    def confirm_session(self, tenant: str, session_id: str) -> None:
        """After ``note_session`` of an admitted session: ``_confirm``."""
        self._confirm(tenant, "sessions", session_id)

    def confirm_model(self, tenant: str, model_id: str) -> None:
        self._confirm(tenant, "models", model_run_name(model_id))

    def confirm_sampler(self, tenant: str, sampling_session_id: str) -> None:
        self._confirm(tenant, "samplers", model_run_name(sampling_session_id))

    def _confirm(self, tenant: str, kind: str, name: str) -> None:
        """``TenantLimitError``, with the entry ``name`` just noted removed, when the tenant now holds more than its
        limit: creations admitted at the same moment by other gateways (module docstring)."""
        limit = self._limit(kind)[0]
        held = self._held(tenant, kind, limit + 1)
        if held > limit:
            self.store.delete(f"{_folder(kind)}/{tenant}/{name}", missing_ok=True)
            raise self._refusal(kind, held - 1)

    def _limit(self, kind: str) -> tuple[int, str, tuple[str, str]]:
        """The limit of ``kind`` (sessions, models or samplers), its setting, and what it counts (one, several)."""
        return {
            "sessions": (self.limits.max_sessions, MAX_SESSIONS_ENV, ("session", "sessions")),
            "models": (self.limits.max_models, MAX_MODELS_ENV, ("training client", "training clients")),
            "samplers": (self.limits.max_sampling_sessions, MAX_SAMPLING_SESSIONS_ENV,
                         ("sampling session", "sampling sessions")),
        }[kind]

    def _refusal(self, kind: str, held: int) -> TenantLimitError:
        limit, setting, (one, several) = self._limit(kind)
        counted = f"{held} {one if held == 1 else several}"
        if kind == "sessions":
            counted += " that has not ended" if held == 1 else " that have not ended"
        else:
            counted += " in sessions that have not ended"
        end = " (or end them with `rlpipe sessions end <id>`)" if kind == "sessions" else ""
        return TenantLimitError(
            f"this API key holds {counted}, its limit ({setting}={limit}); close the "
            f"ServiceClients it no longer uses{end}, or ask the operator to raise {setting}")

    def _held(self, tenant: str, kind: str, drop_at: int) -> int:
        """The tenant's sessions, training clients or sampling sessions noted; from ``drop_at`` of them, those of
        sessions that ended are removed first."""
        self._count_older_sessions()
        folder = f"{_folder(kind)}/{tenant}"
        names = [key.rsplit("/", 1)[-1] for key in self.store.list(folder)]
        if _count(names, kind) >= drop_at:
            names = self._drop_ended(folder, names)
        return _count(names, kind)

    def _count_older_sessions(self) -> None:
        """Note every live session of the store and its training clients, once per store (module docstring)."""
        if self._counted or self.store.exists(COUNTED):
            self._counted = True
            return
        for key in self.store.list("sessions"):
            session_id = key.rsplit("/", 1)[-1]
            tenant = (session_record(self.store, session_id) or {}).get("tenant")
            if not isinstance(tenant, str):
                continue  # no session of anyone's
            if heartbeat_time(self.store, session_id) is None or self.has_ended(session_id):
                continue  # a creation cut short never ends (nor is it counted), or an end frees its places
            self.note_session(tenant, session_id)
            for number in record_numbers(self.store, session_id, "models"):
                self.note_model(tenant, model_id_for(session_id, "train", number))
        self.store.put(COUNTED, json.dumps({"time": time.time()}).encode())
        self._counted = True

    def _drop_ended(self, folder: str, names: list[str]) -> list[str]:
        ended = {session for session in {name.split(".")[0] for name in names} if self.has_ended(session)}
        for name in names:
            if name.split(".")[0] in ended:
                self.store.delete(f"{folder}/{name}", missing_ok=True)
        return [name for name in names if name.split(".")[0] not in ended]


def _folder(kind: str) -> str:
    return SAMPLERS if kind == "samplers" else TENANTS


def _count(names: list[str], kind: str) -> int:
    """Entries of sessions (``<session>``), or else of training clients or sampling sessions (``<session>.<kind>.<n>``,
    each kind in its own folder)."""
    return sum(("." in name) == (kind != "sessions") for name in names)
