"""``rlpipe sessions list|show|end``: the Tinker-compatible API's sessions, read from the store.

A session's calls and results are objects under ``sessions/<id>/`` (see
``pipeline.api.gateway``), so everything shown here needs only the store:
its models, how many calls were accepted and answered (the difference is
the pending futures), its last heartbeat, and its state: live, lapsed (no
heartbeat for ``SESSION_TIMEOUT_S``: the engines unloaded it until its next
call) or ended (finished, or expired: ``pipeline.api.lifecycle``).  ``end`` records an
operator's end of a session, as its client's close would; ``free`` deletes an ended
session's call bodies, results and folds at once, as the trainers' sweep does a day
after the end.
"""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from typing import Annotated, Any

import typer

from pipeline.api.lifecycle import (
    END_GRACE_S,
    SESSION_FILES_KEPT_S,
    NotFreeableError,
    files_deleted,
    free_session_files,
    record_end,
    session_status,
)
from pipeline.cli.common import (
    JsonOpt,
    console,
    fail,
    fitted_table,
    handle_user_errors,
    left_out_note,
    print_json,
    reachable_store,
)
from pipeline.cli.options import SetOpt, run_config
from pipeline.io.store import ObjectStore
from pipeline.timefmt import utc_text

app = typer.Typer(name="sessions", help="The Tinker-compatible API's sessions.", no_args_is_help=True,
                  add_completion=False)


def session_summary(store: ObjectStore, session_id: str) -> dict[str, Any]:
    """One session: owner, models, accepted calls, answered calls, pending request ids, last heartbeat."""
    prefix = f"sessions/{session_id}"
    record = json.loads(store.get(f"{prefix}/session.json"))
    state, end, beat_at = session_status(store, session_id)
    requests = {key.rsplit("/", 1)[-1].rsplit(".", 1)[0] for key in store.list(f"{prefix}/requests")}
    results = {key.rsplit("/", 1)[-1].rsplit(".", 1)[0] for key in store.list(f"{prefix}/results")}
    models = [json.loads(store.get(key)) for key in store.list(f"{prefix}/models")
              if key.endswith(".json") and not key.endswith(".fold.json")]
    return {
        "session_id": session_id, "tenant": record["tenant"], "created_at": record["created_at"],
        "state": state, "ended": end is not None, "end": end,
        "last_heartbeat_s_ago": round(time.time() - beat_at, 1) if beat_at is not None else None,
        "models": [{"model_id": m["model_id"], "base_model": m["base_model"], "lora_rank": m["lora_rank"]}
                   for m in models],
        "requests": len(requests), "results": len(results), "pending": sorted(requests - results),
        "files_deleted": files_deleted(store, session_id),
    }


def _store(overrides: list[str] | None) -> ObjectStore:
    return reachable_store(run_config(None, None, overrides or []).store)


@app.command("list", epilog="Example: rlpipe sessions list --json")
@handle_user_errors
def list_sessions(overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Every session: tenant, models, calls accepted and pending, last heartbeat."""
    store = _store(overrides)
    ids = [key.rsplit("/", 1)[-1] for key in store.list("sessions")]
    summaries = [session_summary(store, sid) for sid in ids if store.exists(f"sessions/{sid}/session.json")]
    if as_json:
        print_json(summaries)
        return
    if not summaries:
        console.print(f"no sessions in {store.root}; `rlpipe serve` starts the API that opens them")
        return
    rows = [{"session": s["session_id"], "tenant": s["tenant"], "models": str(len(s["models"])),
             "calls": str(s["requests"]), "pending": str(len(s["pending"])), "last heartbeat": _last_beat(s)}
            for s in summaries]
    # the id whole, as it is copied into commands; the counts go first on a narrow terminal, then the tenant
    table, left_out = fitted_table("API sessions", rows, ["models", "calls", "tenant", "pending"], whole=("session",))
    console.print(table)
    if left_out:
        console.print(left_out_note(left_out), markup=False)


def _last_beat(summary: dict[str, Any]) -> str:
    """A live session's heartbeat age (``none yet`` before its first); any other's state (its end, and whether its
    files were freed) with it."""
    ago = summary["last_heartbeat_s_ago"]
    if summary["state"] == "live":
        return "none yet" if ago is None else f"{ago} s ago"
    state = summary["end"] if summary["ended"] else summary["state"]
    if summary["files_deleted"]:
        state += "; its calls' files deleted"
    return f"{state} ({'no heartbeat' if ago is None else f'{ago} s ago'})"


@app.command("show", epilog="Example: rlpipe sessions show sess-0123456789abcdef")
@handle_user_errors
def show_session(session_id: Annotated[str, typer.Argument(help="The session id.")], overrides: SetOpt = None,
                 as_json: JsonOpt = False) -> None:
    """One session in full: its models and its pending futures."""
    from schemas.api import session_path

    store = _store(overrides)
    if not store.exists(f"{session_path(session_id)}/session.json"):
        fail(f"no session {session_id!r} in {store.root}; see `rlpipe sessions list`", 2)
    summary = session_summary(store, session_id)
    if as_json:
        print_json(summary)
        return
    console.print_json(json.dumps(summary))


@app.command("end", epilog="Example: rlpipe sessions end sess-0123456789abcdef --reason 'its loop crashed'")
@handle_user_errors
def end_session(session_id: Annotated[str, typer.Argument(help="The session id.")],
                reason: Annotated[str, typer.Option(help="Why, shown to its client's calls.")] = "no reason given",
                overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """End a session as its client's close would: it takes no new calls, and its snapshots are freed after the
    grace (docs/api.md, "When a session ends"); a session that already ended keeps its first end."""
    from schemas.api import session_path

    store = _store(overrides)
    if not store.exists(f"{session_path(session_id)}/session.json"):
        fail(f"no session {session_id!r} in {store.root}; see `rlpipe sessions list`", 2)
    ours = f"ended by an operator: {reason}"
    why, at = record_end(store, session_id, ours)
    if as_json:
        print_json({"session_id": session_id, "end": why, "time": at, "already_ended": why != ours})
        return
    if why != ours:
        console.print(f"session {session_id} already ended ({why})")
        return
    console.print(f"session {session_id} ended ({why}); its snapshots are freed {END_GRACE_S / 60:.0f} minutes "
                  f"after, its call bodies, results and folds {SESSION_FILES_KEPT_S / 3600:g} h after, at a "
                  f"trainer's sweep (or from {END_GRACE_S / 60:.0f} minutes after the end: "
                  f"rlpipe sessions free {session_id})")


@app.command("free", epilog="Examples: rlpipe sessions free sess-0123456789abcdef; rlpipe sessions free --all-ended")
@handle_user_errors
def free_session(session_id: Annotated[str | None, typer.Argument(help="The session id.")] = None,
                 all_ended: Annotated[bool, typer.Option("--all-ended", help=(
                     "Every session that ended at least 10 minutes ago and still has its files (the whole store "
                     "is read: sessions from before the trainers' index are found too)."))] = False,
                 overrides: SetOpt = None, as_json: JsonOpt = False) -> None:
    """Delete an ended session's call bodies, results and folds now (the trainers' sweep does it a day after the
    end); its records, checkpoints and sampler weights stay.  A live session is refused (end it first), and one
    that ended less than 10 minutes ago (calls accepted before its end may still run)."""
    from schemas.api import session_path

    if session_id is not None and all_ended:
        fail(f"name one session or pass --all-ended, not both (--all-ended frees every ended one; {session_id} "
             "alone frees that one)", 2)
    if session_id is None and not all_ended:
        fail("name one session, or pass --all-ended", 2)
    store = _store(overrides)
    if all_ended:
        _free_all_ended(store, as_json)
        return
    assert session_id is not None
    if not store.exists(f"{session_path(session_id)}/session.json"):
        fail(f"no session {session_id!r} in {store.root}; see `rlpipe sessions list`", 2)
    try:
        deleted = free_session_files(store, session_id)
    except ValueError as exc:
        fail(str(exc), 1)
    if as_json:
        print_json({"session_id": session_id, "deleted": deleted})
        return
    console.print(f"session {session_id}: deleted {deleted} call bodies, results and fold files")


def _free_all_ended(store: ObjectStore, as_json: bool) -> None:
    """Free every ended session still holding its files; say how many ended within the grace were skipped, and
    from when they can be freed (a live session is left alone)."""
    freed: dict[str, int] = {}
    skipped: dict[str, float] = {}  # session -> from when it can be freed (unix seconds)
    for key in store.list("sessions"):
        sid = key.rsplit("/", 1)[-1]
        if not store.exists(f"sessions/{sid}/session.json") or files_deleted(store, sid) is not None:
            continue
        try:
            freed[sid] = free_session_files(store, sid)
        except NotFreeableError as exc:  # live, or ended within the grace: left for later
            if exc.free_from is not None:
                skipped[sid] = exc.free_from
    if as_json:
        print_json({"freed": freed, "deleted": sum(freed.values()),
                    "skipped": {sid: datetime.fromtimestamp(at, UTC).isoformat() for sid, at in skipped.items()}})
        return
    line = f"freed {len(freed)} ended sessions: deleted {sum(freed.values())} call bodies, results and fold files"
    if skipped:
        first, last = min(skipped.values()), max(skipped.values())
        line += (f"; skipped {len(skipped)} that ended less than {END_GRACE_S / 60:g} minutes ago (calls accepted "
                 f"before the end may still run): free {'it' if len(skipped) == 1 else 'them'} from {utc_text(first)}"
                 + (f", the last from {utc_text(last)}" if last > first else ""))
    console.print(line, markup=False)

