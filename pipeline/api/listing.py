"""The RestClient's listings: a tenant's sessions, training runs and checkpoints, read from the store.

Everything is found under ``sessions/`` (``pipeline.api.gateway`` names the layout):
a tenant's sessions are those whose ``session.json`` names it, newest first; a
session's training runs are its ``models/<n>.json`` records and its samplers its
``samplers/<n>.json``.  Each listing reads every session record of the store, so
it costs one read per session: the store is the only state a gateway keeps.
Pages are ``offset``/``limit`` as the SDK sends them, with the SDK's ``Cursor``.
"""

from __future__ import annotations

from typing import Any

from pipeline.api.gateway import Gateway
from pipeline.api.lifecycle import record_numbers, session_record
from schemas.api import ApiError, model_id_for

SESSIONS = "sessions"


def tenant_sessions(gateway: Gateway, tenant: str) -> list[str]:
    """The ids of this tenant's sessions, newest first."""
    found = []
    for key in gateway.store.list(SESSIONS):
        session_id = key.rsplit("/", 1)[-1]
        record = session_record(gateway.store, session_id)
        if record is not None and record.get("tenant") == tenant:
            found.append((str(record.get("created_at", "")), session_id))
    return [session_id for _, session_id in sorted(found, reverse=True)]


def _numbered(gateway: Gateway, session_id: str, folder: str, kind: str) -> list[str]:
    """The ids of a session's models (``kind`` train) or samplers (``sample``) in the order of their numbers."""
    return [model_id_for(session_id, kind, n) for n in record_numbers(gateway.store, session_id, folder)]


def session_info(gateway: Gateway, tenant: str, session_id: str) -> dict[str, Any]:
    """``GetSessionResponse``: the session's training runs and samplers, and its metadata."""
    record = gateway.session(tenant, session_id)
    return {"training_run_ids": _numbered(gateway, session_id, "models", "train"),
            "sampler_ids": _numbered(gateway, session_id, "samplers", "sample"),
            "user_metadata": {k: str(v) for k, v in (record.get("user_metadata") or {}).items()},
            "display_name": None}


def training_run(gateway: Gateway, tenant: str, model_id: str) -> dict[str, Any]:
    """``TrainingRun``: one training client, with its newest training state and sampler weights."""
    record = gateway.model(tenant, model_id)
    checkpoints = gateway.checkpoints(tenant, model_id)
    last = {kind: next((c for c in reversed(checkpoints) if c["checkpoint_type"] == kind), None)
            for kind in ("training", "sampler")}
    return {"training_run_id": model_id, "base_model": record["base_model"], "model_owner": tenant,
            "is_lora": True, "lora_rank": record["lora_rank"], "last_request_time": record["created_at"],
            "last_checkpoint": last["training"], "last_sampler_checkpoint": last["sampler"],
            "user_metadata": {k: str(v) for k, v in record["user_metadata"].items()}}


def _page(items: list[Any], limit: int, offset: int) -> tuple[list[Any], dict[str, int]]:
    if limit < 1 or offset < 0:
        raise ApiError(f"limit={limit}, offset={offset}: ask for limit >= 1 from offset >= 0")
    return items[offset: offset + limit], {"offset": offset, "limit": limit, "total_count": len(items)}


def _model_ids(gateway: Gateway, tenant: str) -> list[str]:
    """Every training client of the tenant, newest session first, each session's in creation order."""
    return [model_id for session_id in tenant_sessions(gateway, tenant)
            for model_id in _numbered(gateway, session_id, "models", "train")]


def training_runs(gateway: Gateway, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """``TrainingRunsResponse``: a page of the tenant's training runs."""
    page, cursor = _page(_model_ids(gateway, tenant), limit, offset)
    return {"training_runs": [training_run(gateway, tenant, model_id) for model_id in page], "cursor": cursor}


def user_checkpoints(gateway: Gateway, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """``CheckpointsListResponse``: a page of every checkpoint of the tenant's training runs, newest first."""
    found = [checkpoint for model_id in _model_ids(gateway, tenant)
             for checkpoint in gateway.checkpoints(tenant, model_id)]
    page, cursor = _page(sorted(found, key=lambda c: c["time"], reverse=True), limit, offset)
    return {"checkpoints": page, "cursor": cursor}


def sessions(gateway: Gateway, tenant: str, limit: int, offset: int) -> dict[str, Any]:
    """``ListSessionsResponse``: a page of the tenant's session ids, newest first."""
    page, _ = _page(tenant_sessions(gateway, tenant), limit, offset)
    return {"sessions": page}
