"""The duty cycle of a Tinker-compatible server's engines, one colour per session.

``rlpipe report --server`` reads the engines' activity from the store
(``pipeline.api.activity``: one record per executed call, with its session) and
draws one lane per engine (trainers on top, samplers below), each session's
busy time in its own colour, with the packed report's drawing
(``pipeline.analysis.report.packed``).

Fractions are of one window (``--since``/``--until``, default the first to the
last recorded moment).  A lane's busy fraction is the union of its calls over the
window, so it never exceeds 1.  The trainer runs one call at a time; the sampler
runs many at once (continuous batching, and a client samples many episodes
concurrently), so each moment of the sampler's busy time is shared equally
between the sessions with a call in flight then: a session's ``busy_fraction_by_run``
is its share (the shares of a lane sum to its busy fraction), and
``in_flight_fraction_by_run`` is the time it had any call running.  In the figure a
shared moment is one bar split into the sessions' shares, stacked in session order.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.analysis.report.model import _finite_json
from pipeline.analysis.report.packed import plot_packed_duty_cycle
from pipeline.api.activity import ENGINE_KINDS, EngineActivity, read_activity
from pipeline.io.store import ObjectStore

SERVER_FIGURE = "server_duty_cycle.png"
SERVER_JSON = "server.json"


def server_duty_cycle(activity: Sequence[EngineActivity], start: float | None = None,
                      end: float | None = None) -> dict[str, Any]:
    """One lane per engine over ``[start, end]`` (default: the activity's span), intervals as (start, end, share,
    session), with per-session busy shares, in-flight fractions, tokens and calls; see the module docstring."""
    clipped = [(max(a.start, start if start is not None else a.start), min(a.end, end if end is not None else a.end), a)
               for a in activity]
    clipped = [(s, e, a) for s, e, a in clipped if e > s]
    if not clipped:
        return {"runs": [], "tenants": {}, "start": start, "end": end, "lanes": []}
    start = min(s for s, _, _ in clipped) if start is None else start
    end = max(e for _, e, _ in clipped) if end is None else end
    span = end - start
    sessions = list(dict.fromkeys(a.session for _, _, a in sorted(clipped, key=lambda c: c[0])))
    tenants = {a.session: a.tenant for _, _, a in clipped if a.tenant is not None}
    names = sorted({a.engine for _, _, a in clipped}, key=lambda n: (_kind_order(n, clipped), n))
    lanes = [_lane(name, [(s, e, a) for s, e, a in clipped if a.engine == name], sessions, span) for name in names]
    return {"runs": sessions, "tenants": tenants, "start": start, "end": end, "lanes": lanes}


def _kind_order(name: str, clipped: list[tuple[float, float, EngineActivity]]) -> int:
    kind = next(a.kind for _, _, a in clipped if a.engine == name)
    return ENGINE_KINDS.index(kind) if kind in ENGINE_KINDS else len(ENGINE_KINDS)  # type: ignore[arg-type]


def _lane(name: str, calls: list[tuple[float, float, EngineActivity]], sessions: list[str],
          span: float) -> dict[str, Any]:
    intervals = shared_intervals([(s, e, a.session) for s, e, a in calls], sessions)
    share_s: Counter[str] = Counter()
    flight_s: Counter[str] = Counter()
    for s, e, share, session in intervals:
        share_s[session] += share * (e - s)
        flight_s[session] += e - s
    served = [session for session in sessions if session in flight_s]
    fraction = (lambda seconds: seconds / span) if span > 0 else (lambda seconds: math.nan)
    return {
        "name": name, "kind": calls[0][2].kind,
        "busy_fraction": fraction(math.fsum(share_s.values())),
        "busy_fraction_by_run": {session: fraction(share_s[session]) for session in served},
        "in_flight_fraction_by_run": {session: fraction(flight_s[session]) for session in served},
        "tokens_by_run": {session: sum(a.tokens for _, _, a in calls if a.session == session) for session in served},
        "calls_by_run": {session: sum(1 for _, _, a in calls if a.session == session) for session in served},
        "intervals": [list(interval) for interval in intervals],
    }  # fmt: skip


def shared_intervals(calls: Sequence[tuple[float, float, str]],
                     order: Sequence[str]) -> list[tuple[float, float, float, str]]:
    """Busy time of one lane as (start, end, share, session): between consecutive call boundaries, every session
    with a call in flight gets ``1 / (sessions in flight)``; runs of moments with the same sessions are merged."""
    events = sorted([(s, 1, session) for s, _, session in calls] + [(e, -1, session) for _, e, session in calls])
    in_flight: Counter[str] = Counter()
    pieces: list[tuple[float, float, tuple[str, ...]]] = []
    previous = None
    for time, step, session in events:
        if previous is not None and time > previous and +in_flight:
            active = tuple(s for s in order if in_flight[s] > 0)
            if pieces and pieces[-1][1] == previous and pieces[-1][2] == active:
                pieces[-1] = (pieces[-1][0], time, active)
            else:
                pieces.append((previous, time, active))
        in_flight[session] += step
        previous = time
    return [(s, e, 1.0 / len(active), session) for s, e, active in pieces for session in active]


def server_summary(duty: dict[str, Any]) -> dict[str, Any]:
    """Busy fractions per lane, and per lane and session, for the JSON and the printed summary."""
    lanes = duty["lanes"]
    return {
        "sessions": duty["runs"], "tenants": duty["tenants"],
        "busy_fraction": {lane["name"]: lane["busy_fraction"] for lane in lanes},
        "busy_fraction_by_session": {lane["name"]: lane["busy_fraction_by_run"] for lane in lanes},
        "in_flight_fraction_by_session": {lane["name"]: lane["in_flight_fraction_by_run"] for lane in lanes},
        "tokens_by_session": {lane["name"]: lane["tokens_by_run"] for lane in lanes},
        "start": duty["start"], "end": duty["end"],
        "seconds": duty["end"] - duty["start"] if duty["start"] is not None and duty["end"] is not None else None,
    }  # fmt: skip


def plot_server_duty_cycle(duty: dict[str, Any]) -> bytes:
    """PNG: one lane per engine, each session's share of the busy time in its own colour."""
    labels = {run: f"{run} ({duty['tenants'][run]})" if run in duty["tenants"] else run for run in duty["runs"]}
    return plot_packed_duty_cycle(
        duty, title=f"server duty cycle of {len(duty['runs'])} sessions (a shared moment split between the "
                    "sessions in flight)", legend_title="session (tenant)", labels=labels)


def write_server_report(store: ObjectStore, out_dir: str | Path, since: float | None = None,
                        until: float | None = None) -> tuple[Path, dict[str, Any]]:
    """Write ``server_duty_cycle.png`` and ``server.json`` into ``out_dir`` from the activity in ``store``;
    return the JSON path and its body (no lanes when nothing was recorded in the window)."""
    duty = server_duty_cycle(read_activity(store, since, until), since, until)
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    if duty["lanes"]:
        (folder / SERVER_FIGURE).write_bytes(plot_server_duty_cycle(duty))
    body = _finite_json({"store": store.root, "summary": server_summary(duty), "duty_cycle": duty})
    path = folder / SERVER_JSON
    path.write_text(json.dumps(body, indent=2) + "\n")
    return path, body
