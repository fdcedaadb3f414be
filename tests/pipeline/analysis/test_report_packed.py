"""`rlpipe report --run A --run B`: one sampler lane and one trainer lane for a packed process.

Two hand-made runs with known intervals (seconds after T0):

- trainer: A trains [0, 2] and [4, 6]; B trains [2, 3] and [6, 9]  -> window [0, 10] with the heartbeats.
  A: 4 s busy of 10 = 0.4; B: 4 s of 10 = 0.4; the lane 8 s of 10 = 0.8.
- sampler (heartbeats of the one packed producer, one per run): A busy 0.5 over [0, 5] and 0.25 over [5, 10]
  (3.75 s); B busy 0.2 over [0, 10] (2 s). A 0.375, B 0.2, the lane 0.575.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from matplotlib.colors import to_rgb
from PIL import Image
from typer.testing import CliRunner

from pipeline.analysis.report.metrics import lanes_of
from pipeline.analysis.report.model import Lane
from pipeline.analysis.report.packed import (
    PACKED_FIGURE,
    packed_duty_cycle,
    plot_packed_duty_cycle,
    run_color,
    stacked_bars,
)
from pipeline.cli.report_cmd import app
from pipeline.io.store import ObjectStore
from schemas.events import ProducerHeartbeat
from tests.pipeline.analysis.test_report import run_store  # noqa: F401  (the fixture: one full run "demo")

T0 = 1_700_000_000.0
TRAIN = {"a": [(0.0, 2.0), (4.0, 6.0)], "b": [(2.0, 3.0), (6.0, 9.0)]}
BEATS = {"a": [(5.0, 5.0, 0.5), (10.0, 5.0, 0.25)], "b": [(10.0, 10.0, 0.2)]}  # (time, interval, busy share)


def beat(busy: float, interval: float) -> ProducerHeartbeat:
    return ProducerHeartbeat(
        producer_id="packed-0", adapter_version=1, samples_total=10, batches_total=1, tokens_total=100,
        env_steps_total=10, samples_per_s=1.0, tokens_per_s=100.0, env_steps_per_s=1.0, busy_fraction=busy,
        interval_s=interval,
    )  # fmt: skip


def run_lanes(run: str) -> list[Lane]:
    steps = [{"step": i + 1, "started_at": T0 + s, "finished_at": T0 + e} for i, (s, e) in enumerate(TRAIN[run])]
    return lanes_of(steps, [(T0 + t, beat(busy, interval)) for t, interval, busy in BEATS[run]])


@pytest.fixture(scope="module")
def duty() -> dict[str, Any]:
    return packed_duty_cycle({run: (run_lanes(run), (None, None)) for run in ("a", "b")})


def test_the_runs_merge_into_one_trainer_and_one_sampler_lane(duty: dict[str, Any]) -> None:
    assert duty["runs"] == ["a", "b"]
    assert (duty["start"], duty["end"]) == (T0, T0 + 10.0)
    trainer, sampler = duty["lanes"]
    assert (trainer["name"], sampler["name"]) == ("trainer", "sampler")
    assert [(s - T0, e - T0, run) for s, e, _, run in trainer["intervals"]] == [
        (0.0, 2.0, "a"), (2.0, 3.0, "b"), (4.0, 6.0, "a"), (6.0, 9.0, "b")
    ]  # fmt: skip
    assert [(s - T0, e - T0, share, run) for s, e, share, run in sampler["intervals"]] == [
        (0.0, 5.0, 0.5, "a"), (0.0, 10.0, 0.2, "b"), (5.0, 10.0, 0.25, "a")
    ]  # fmt: skip


def test_busy_fractions_per_run_and_per_lane(duty: dict[str, Any]) -> None:
    trainer, sampler = duty["lanes"]
    assert trainer["busy_fraction_by_run"] == pytest.approx({"a": 0.4, "b": 0.4})
    assert trainer["busy_fraction"] == pytest.approx(0.8)
    assert sampler["busy_fraction_by_run"] == pytest.approx({"a": 0.375, "b": 0.2})
    assert sampler["busy_fraction"] == pytest.approx(0.575)


def test_a_run_without_lanes_keeps_its_place_with_no_busy_time() -> None:
    duty = packed_duty_cycle({"a": (run_lanes("a"), (None, None)), "idle": ([], (None, None))})
    assert duty["runs"] == ["a", "idle"]
    assert duty["lanes"][0]["busy_fraction_by_run"]["idle"] == 0.0
    empty = packed_duty_cycle({"x": ([], (None, None))})
    assert empty["start"] is None and all(math.isnan(lane["busy_fraction"]) for lane in empty["lanes"])


def assert_bars(bars: dict[str, list[tuple[float, ...]]], expected: dict[str, list[tuple[float, ...]]]) -> None:
    """The same runs with the same number of bars, each (start, end, bottom, height) equal to float precision."""
    assert {run: len(rows) for run, rows in bars.items()} == {run: len(rows) for run, rows in expected.items()}
    for run, rows in expected.items():
        assert [v for bar in bars[run] for v in bar] == pytest.approx([v for bar in rows for v in bar]), run


def test_shares_under_the_lane_height_stack_as_they_are(duty: dict[str, Any]) -> None:
    """The fixture's sampler: [0, 5] a 0.5 with b 0.2 on top (0.7); [5, 10] a 0.25 with b 0.2 on top (0.45)."""
    bars, scaled = stacked_bars(duty["lanes"][1]["intervals"], duty["runs"])
    assert not scaled
    assert_bars({run: [(s - T0, e - T0, bottom, height) for s, e, bottom, height in rows]
                 for run, rows in bars.items()},
                {"a": [(0.0, 5.0, 0.0, 0.5), (5.0, 10.0, 0.0, 0.25)], "b": [(0.0, 5.0, 0.5, 0.2), (5.0, 10.0, 0.25, 0.2)]})


def test_shares_past_the_lane_height_are_scaled_to_fit_not_clipped() -> None:
    """One engine busy for both runs: a 1.0 over [0, 10]; b 1.0 over [0, 5], then 0.1.  [0, 5] sums to 2.0, so
    each share is halved (a 0.5, b 0.5 on top); [5, 10] sums to 1.1, so each is divided by 1.1 (a 1/1.1 = 0.909,
    b 0.1/1.1 = 0.091 on top).  Clipped at the lane instead, b would get no height at all over [0, 5]."""
    intervals = [(0.0, 10.0, 1.0, "a"), (0.0, 5.0, 1.0, "b"), (5.0, 10.0, 0.1, "b")]
    bars, scaled = stacked_bars(intervals, ["a", "b"])
    assert scaled
    assert_bars(bars, {"a": [(0.0, 5.0, 0.0, 0.5), (5.0, 10.0, 0.0, 1 / 1.1)],
                       "b": [(0.0, 5.0, 0.5, 0.5), (5.0, 10.0, 1 / 1.1, 0.1 / 1.1)]})
    for run_bars in zip(bars["a"], bars["b"], strict=True):  # each span fills the lane exactly
        assert sum(height for *_, height in run_bars) == pytest.approx(1.0)


def test_a_runs_overlapping_intervals_take_its_highest_share() -> None:
    """Two producers of one run beat over overlapping spans: the run's height there is the higher share, as for
    one run alone, and a span no interval covers draws nothing."""
    bars, scaled = stacked_bars([(0.0, 4.0, 0.3, "a"), (2.0, 6.0, 0.6, "a"), (8.0, 9.0, 0.5, "a")], ["a"])
    assert not scaled
    assert_bars(bars, {"a": [(0.0, 2.0, 0.0, 0.3), (2.0, 6.0, 0.0, 0.6), (8.0, 9.0, 0.0, 0.5)]})


def colours_in(png: bytes, path: Path) -> np.ndarray:
    path.write_bytes(png)
    return np.asarray(Image.open(path).convert("RGB")).reshape(-1, 3).astype(int)


def has_colour(pixels: np.ndarray, colour: str) -> bool:
    target = np.array([round(255 * c) for c in to_rgb(colour)])
    return bool((np.abs(pixels - target).max(axis=1) <= 3).sum() > 200)


def test_the_figure_draws_each_run_in_its_own_colour(duty: dict[str, Any], tmp_path: Path) -> None:
    png = plot_packed_duty_cycle(duty)
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    pixels = colours_in(png, tmp_path / "packed.png")
    assert run_color(0) != run_color(1)
    assert has_colour(pixels, run_color(0)) and has_colour(pixels, run_color(1))
    assert not has_colour(pixels, run_color(2))  # only as many colours as runs


def test_a_run_busy_beside_a_full_lane_is_still_drawn(tmp_path: Path) -> None:
    """Both runs report 100% busy over the whole window (one engine busy for both): each gets half the lane."""
    by_run = {"a": 1.0, "b": 1.0}
    duty = {"runs": ["a", "b"], "start": 0.0, "end": 10.0, "lanes": [
        {"name": "sampler", "busy_fraction": 2.0, "busy_fraction_by_run": by_run,
         "intervals": [[0.0, 10.0, 1.0, "a"], [0.0, 10.0, 1.0, "b"]]}]}
    pixels = colours_in(plot_packed_duty_cycle(duty), tmp_path / "full.png")
    assert has_colour(pixels, run_color(0)) and has_colour(pixels, run_color(1))


def test_report_with_two_runs_writes_the_packed_figure_and_json(run_store: ObjectStore, tmp_path: Path) -> None:  # noqa: F811
    source = Path(run_store.root.removeprefix("file://")) / "runs"
    for run in ("demo-b",):  # a second run: the same learner checkpoints and step log under another name
        for path in (source / "demo").rglob("*"):
            if path.is_file() and path.relative_to(source / "demo").parts[0] in ("checkpoints", "steps"):
                target = source / run / path.relative_to(source / "demo")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(path.read_bytes())
    out = tmp_path / "packed"
    result = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["--run", "demo", "--run", "demo-b", "--root", run_store.root, "--no-bus", "--out", str(out), "--json"]
    )
    assert result.exit_code == 0, result.output
    body = json.loads((out / "packed.json").read_text())
    assert body["runs"] == ["demo", "demo-b"]
    trainer = body["duty_cycle"]["lanes"][0]
    assert trainer["busy_fraction_by_run"] == pytest.approx({"demo": 15 / 23, "demo-b": 15 / 23})
    assert body["summary"]["busy_fraction_by_run"]["trainer"]["demo"] == pytest.approx(15 / 23)
    assert (out / PACKED_FIGURE).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "demo" / "report.html").exists() and (out / "demo-b" / "report.html").exists()
    assert json.loads(result.output)["packed"] == str(out / "packed.json")


def test_a_run_named_twice_is_one_line_and_exit_2(run_store: ObjectStore, tmp_path: Path) -> None:  # noqa: F811
    result = CliRunner().invoke(app, ["--run", "demo", "--run", "demo", "--root", run_store.root, "--no-bus"])
    assert result.exit_code == 2
    assert "named twice" in result.output and len(result.output.strip().splitlines()) == 1
