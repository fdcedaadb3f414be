"""`rlpipe report --server`: the duty cycle of a server's engines, one colour per session.

Hand-made activity (seconds after T0), window [0, 4]:

- trainer: s1 [0, 2], s2 [2, 3]: busy 3 s of 4 = 0.75; s1 0.5, s2 0.25.
- sampler: s1 [0, 2], s2 [1, 3], and s1 again [0.5, 1.5] (overlapping its own call: counted once).
  [0, 1] s1 alone, [1, 2] both (half each), [2, 3] s2 alone: busy 3 s of 4 = 0.75;
  shares s1 (1 + 0.5) / 4 = 0.375, s2 (0.5 + 1) / 4 = 0.375; in flight s1 2/4 = 0.5, s2 0.5.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.analysis.report.server import SERVER_FIGURE, SERVER_JSON, server_duty_cycle, write_server_report
from pipeline.api.activity import ActivityRecorder, EngineActivity
from pipeline.cli.report_cmd import app
from pipeline.io.store import ObjectStore

T0 = 1_700_000_000.0
TRAINER, SAMPLER = "trainer-t0", "sampler-s0"


def act(engine: str, session: str, start: float, end: float, tokens: int = 0) -> EngineActivity:
    kind = engine.split("-")[0]
    tenant = "alice" if session == "s1" else "bob"
    return EngineActivity(engine, kind, session, tenant, "sample" if kind == "sampler" else "forward_backward",
                          T0 + start, T0 + end, tokens)


ACTIVITY = [act(TRAINER, "s1", 0, 2, 100), act(TRAINER, "s2", 2, 3, 50), act(SAMPLER, "s1", 0, 2, 7),
            act(SAMPLER, "s2", 1, 3, 5), act(SAMPLER, "s1", 0.5, 1.5, 3)]


@pytest.fixture(scope="module")
def duty() -> dict[str, Any]:
    return server_duty_cycle(ACTIVITY, T0, T0 + 4.0)


def test_one_lane_per_engine_trainers_first(duty: dict[str, Any]) -> None:
    assert duty["runs"] == ["s1", "s2"]
    assert duty["tenants"] == {"s1": "alice", "s2": "bob"}
    assert [(lane["name"], lane["kind"]) for lane in duty["lanes"]] == [(TRAINER, "trainer"), (SAMPLER, "sampler")]
    assert (duty["start"], duty["end"]) == (T0, T0 + 4.0)


def test_trainer_fractions_by_session(duty: dict[str, Any]) -> None:
    trainer = duty["lanes"][0]
    assert trainer["busy_fraction"] == pytest.approx(0.75)
    assert trainer["busy_fraction_by_run"] == pytest.approx({"s1": 0.5, "s2": 0.25})
    assert trainer["tokens_by_run"] == {"s1": 100, "s2": 50}
    assert trainer["calls_by_run"] == {"s1": 1, "s2": 1}


def test_concurrent_sampling_is_shared_between_the_sessions_in_flight(duty: dict[str, Any]) -> None:
    sampler = duty["lanes"][1]
    assert sampler["busy_fraction"] == pytest.approx(0.75)  # the union: never above 1
    assert sampler["busy_fraction_by_run"] == pytest.approx({"s1": 0.375, "s2": 0.375})
    assert sampler["in_flight_fraction_by_run"] == pytest.approx({"s1": 0.5, "s2": 0.5})
    assert sampler["tokens_by_run"] == {"s1": 10, "s2": 5}
    drawn = [(s - T0, e - T0, share, run) for s, e, share, run in sampler["intervals"]]
    assert drawn == [(0.0, 1.0, 1.0, "s1"), (1.0, 2.0, 0.5, "s1"), (1.0, 2.0, 0.5, "s2"), (2.0, 3.0, 1.0, "s2")]


def test_the_window_clips_the_activity() -> None:
    clipped = server_duty_cycle(ACTIVITY, T0 + 1.0, T0 + 3.0)
    trainer, sampler = clipped["lanes"]
    assert trainer["busy_fraction_by_run"] == pytest.approx({"s1": 0.5, "s2": 0.5})
    assert sampler["busy_fraction"] == pytest.approx(1.0)


def test_no_activity_gives_no_lanes() -> None:
    empty = server_duty_cycle([], None, None)
    assert empty["lanes"] == [] and empty["runs"] == [] and empty["start"] is None


def _store_with_activity() -> ObjectStore:
    store = ObjectStore(f"memory://server-report-{uuid.uuid4().hex}")
    for kind in ("trainer", "sampler"):
        recorder = ActivityRecorder(store, kind, f"{kind[0]}0", flush_every_s=3600.0)
        for a in ACTIVITY:
            if a.kind == kind:
                recorder.record(a.session, a.tenant, a.op, a.start, a.end, a.tokens)
        recorder.close()
    return store


def test_the_report_writes_the_figure_and_the_fractions(tmp_path) -> None:
    json_path, body = write_server_report(_store_with_activity(), tmp_path, T0, T0 + 4.0)
    assert (tmp_path / SERVER_FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json_path == tmp_path / SERVER_JSON
    stored = json.loads(json_path.read_text())
    assert stored == json.loads(json.dumps(body))
    assert stored["summary"]["busy_fraction"] == pytest.approx({TRAINER: 0.75, SAMPLER: 0.75})
    assert stored["summary"]["busy_fraction_by_session"][SAMPLER] == pytest.approx({"s1": 0.375, "s2": 0.375})
    assert stored["summary"]["tenants"] == {"s1": "alice", "s2": "bob"}


def test_the_command_reads_the_store_it_is_pointed_at(tmp_path) -> None:
    store = _store_with_activity()
    result = CliRunner().invoke(app, ["--server", "--root", store.root, "--out", str(tmp_path / "out"),
                                      "--since", str(T0), "--until", str(T0 + 4.0)])
    assert result.exit_code == 0, result.output
    assert "trainer-t0: busy 75.0% (s1 50.0%, s2 25.0%)" in result.output
    assert (tmp_path / "out" / SERVER_FIGURE).exists()
    nothing = CliRunner().invoke(app, ["--server", "--root", f"memory://empty-{uuid.uuid4().hex}", "--out",
                                       str(tmp_path / "none")])
    assert nothing.exit_code == 2 and "no engine activity" in nothing.output
    both = CliRunner().invoke(app, ["--server", "--run", "a", "--root", store.root])
    assert both.exit_code == 2 and "--server" in both.output


@pytest.mark.parametrize("since", ["nan", "inf", "-inf", "1e999"])
def test_a_window_bound_that_is_no_moment_is_one_line(tmp_path, since: str) -> None:
    store = _store_with_activity()
    result = CliRunner().invoke(app, ["--server", "--root", store.root, "--out", str(tmp_path / "out"),
                                      "--since", since])
    assert result.exit_code == 2, result.output
    assert f"--since {since!r} is neither unix seconds nor an ISO 8601 time" in result.output
    assert not (tmp_path / "out").exists()


def test_a_window_time_without_a_zone_is_read_as_utc_and_the_window_is_printed_in_utc(tmp_path, monkeypatch) -> None:
    """rlpipe prints times in UTC (``runs list``, ``topics tail``), so a time copied from there means the same
    moment here whatever the machine's zone: T0 is 2023-11-14 22:13:20 UTC, 17:13:20 in New York."""
    import time

    monkeypatch.setenv("TZ", "America/New_York")
    time.tzset()
    store = _store_with_activity()
    try:
        naive = CliRunner().invoke(app, ["--server", "--root", store.root, "--out", str(tmp_path / "naive"),
                                         "--since", "2023-11-14T22:13:20", "--until", "2023-11-14 22:13:24"])
        zoned = CliRunner().invoke(app, ["--server", "--root", store.root, "--out", str(tmp_path / "zoned"),
                                         "--since", "2023-11-14T17:13:20-05:00", "--until", str(T0 + 4.0)])
    finally:  # the machine's zone back for the tests after this one
        monkeypatch.undo()
        time.tzset()
    for result in (naive, zoned):
        assert result.exit_code == 0, result.output
        assert "trainer-t0: busy 75.0% (s1 50.0%, s2 25.0%)" in result.output
        assert "window 2023-11-14 22:13:20 UTC to 2023-11-14 22:13:24 UTC (4 s)" in result.output
    help_text = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "400"}).output
    assert "UTC unless it names its zone" in help_text
