"""`rlpipe report RUN` on a small synthetic run written with the real writers (archive, registry, store).

The run, with the expected arithmetic next to it:

- 12 episodes over 3 batches, rows per turn (1-3 turns per episode), policy versions 0..2.
  Episodes count once, under the version of their first turn; one episode starts on
  v1 and finishes on v2, so it counts for v1.
- adapters v1, v2 published through ``AdapterRegistry``.
- checkpoints (layout of consumers/checkpoint.py): step 3 (older), step 6 (the newest
  complete one), step 9 without a manifest (incomplete), step 12 whose state.json does
  not match its manifest digest (damaged: skipped with a note).
- evaluations: adapter v2 and a random baseline, plus one unreadable file.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import re
import struct
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from safetensors.numpy import save as save_tensors
from safetensors.numpy import save_file
from typer.testing import CliRunner

from pipeline.analysis.report.metrics import busy_seconds, duty_cycle, episodes_of, wilson_interval
from pipeline.analysis.report.model import FIGURE_FILES, SECTIONS
from pipeline.cli.report_cmd import app, command
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import EventPublisher
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import ObjectStore
from schemas.config import BusConfig
from schemas.evaluation import EvalResult, EvalResultError, eval_from_bytes, eval_key, eval_to_bytes, mean_ci95
from schemas.events import Envelope, ProducerHeartbeat, RunStarted, RunStopped
from schemas.trajectory import NO_ADAPTER_SHA, records_to_table
from tests.fixtures.browser import load_page, require_chromium

runner = CliRunner(env={"COLUMNS": "200"})
RUN = "demo"
T0 = 1_700_000_000.0  # unix seconds: the first learner step starts here
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

# episode id -> (policy version of each turn, episode return, success, batch index)
EPISODES: dict[str, tuple[list[int], float, bool, int]] = {
    "e00": ([0], 10.0, False, 0),
    "e01": ([0, 0], 20.0, False, 0),
    "e02": ([0, 0, 0], 30.0, True, 0),
    "e03": ([0], 40.0, True, 0),
    "e10": ([1, 1], 50.0, True, 1),
    "e11": ([1], 60.0, False, 1),
    "e12": ([1], 70.0, True, 1),
    "e13": ([1, 2], 80.0, True, 2),  # starts on v1, finishes on v2: counts for v1
    "e20": ([2, 2, 2], 90.0, True, 2),
    "e21": ([2], 100.0, True, 2),
    "e22": ([2, 2], 110.0, False, 2),
    "e23": ([2], 120.0, True, 2),
}
# Learner steps as (start offset from T0, duration) in seconds: busy 2+3+1+4+2+3 = 15 s over [0, 23] s.
STEPS = [(0.0, 2.0), (3.0, 3.0), (8.0, 1.0), (9.5, 4.0), (15.0, 2.0), (20.0, 3.0)]
STALENESS = [{"0": 4}, {"0": 3, "1": 1}, {"0": 2, "1": 2}, {"1": 3, "2": 1}, {"0": 5}, {"0": 1, "3": 2}]


def _turn_rows(episode_id: str, spec: tuple[list[int], float, bool, int], batch_id: str) -> list[dict[str, Any]]:
    versions, reward, success, batch = spec
    created = datetime.fromtimestamp(T0, UTC) + timedelta(seconds=10 * batch + int(episode_id[-1]))
    return [
        dict(run_id=RUN, batch_id=batch_id, episode_id=episode_id, group_id=f"g{batch}", env="cartpole",
             env_seed=int(episode_id[1:]), producer_id="p0", policy_version=version, adapter_sha256=NO_ADAPTER_SHA,
             tokens=[1, 2, 3, 4], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.7], turn_rewards=[reward],
             reward=reward, turn=turn, return_to_go=reward, num_turns=len(versions), success=success,
             terminated=success, truncated=not success, created_at=created + timedelta(milliseconds=turn))
        for turn, version in enumerate(versions)
    ]  # fmt: skip


def write_trajectories(store: ObjectStore) -> None:
    archive = TrajectoryArchive(store)
    for batch in range(3):
        rows = [
            row
            for episode_id, spec in EPISODES.items()
            if spec[3] == batch
            for row in _turn_rows(episode_id, spec, f"batch-{batch}")
        ]
        archive.write_batch(RUN, rows, created=datetime.fromtimestamp(T0, UTC))


def publish_adapters(store: ObjectStore, tmp_path: Path) -> None:
    registry = AdapterRegistry(store, RUN)
    for version in (1, 2):
        folder = tmp_path / f"adapter-{version}"
        folder.mkdir()
        (folder / "adapter_config.json").write_text(json.dumps({"r": 2, "peft_type": "LORA"}))
        save_file({"lora_A": np.full((2, 4), version, dtype=np.float32)}, str(folder / "adapter_model.safetensors"))
        registry.publish(folder, base_model="tiny-test", parent_version=version - 1, learner_step=3 * version)


def step_log(count: int) -> list[dict[str, Any]]:
    """The learner's per-step entries (the keys `Learner.step` writes that the report reads)."""
    return [
        {"step": i + 1, "started_at": T0 + start, "finished_at": T0 + start + duration, "rows": 6, "tokens": 24,
         "loss": 0.5 / (i + 1), "ratio_mean": 1.0 + 0.01 * i, "effective_sample_size": 0.95 - 0.05 * i,
         "clip_fraction": 0.0, "staleness_histogram": STALENESS[i], "dropped_stale_rows": 0,
         "version_trained_from": i // 3, "version": (i + 1) // 3, "tokens_per_s": 24 / duration,
         "entropy_mean": 2.0 - 0.3 * i, "identical_group_share": 0.1 * i, "zero_advantage_share": 0.15 * i,
         "reward_spread": 1.0 / (i + 1), "reward_mean": 0.2 * i}
        for i, (start, duration) in enumerate(STEPS[:count])
    ]  # fmt: skip


def write_checkpoint(store: ObjectStore, step: int, log: list[dict[str, Any]], manifest: bool = True,
                     corrupt: bool = False) -> str:  # fmt: skip
    """A checkpoint folder as consumers/checkpoint.py writes it: files, then manifest.json last."""
    key = f"runs/{RUN}/checkpoints/step-{step:06d}-{step:08x}"
    state = {"step": step, "version": step // 3, "positions": {"t:0": 3}, "trained": {"batch-0": 1},
             "step_log": log, "dropped_stale_rows": 5}  # fmt: skip
    files = {
        "adapter.safetensors": save_tensors({"lora_A": np.zeros((2, 2), dtype=np.float32)}),
        "optimizer.safetensors": save_tensors({"exp_avg": np.zeros((2, 2), dtype=np.float32)}),
        "state.json": json.dumps({"state": state, "scalars": {}, "rng": {}}, sort_keys=True).encode(),
    }
    digests = {name: store.put_create(f"{key}/{name}", data) for name, data in files.items()}
    if corrupt:
        digests["state.json"] = "0" * 64
    if manifest:
        body = {"step": step, "version": step // 3, "files": digests, "created_at": "2023-11-14T22:13:20+00:00",
                "schema_version": "1.0"}  # fmt: skip
        store.put_create(f"{key}/manifest.json", json.dumps(body, sort_keys=True).encode())
    return key


def write_evals(store: ObjectStore) -> list[EvalResult]:
    results = [
        EvalResult.from_episodes(RUN, "cartpole", version=2, seed_start=1_000_000, returns=[150.0, 170.0, 160.0, 200.0],
                                 successes=[True, True, False, True], breakdown={"balance": 0.8}),
        EvalResult.from_episodes(RUN, "cartpole", version=0, seed_start=1_000_000, returns=[20.0, 25.0, 15.0],
                                 successes=[False, False, False], policy="random"),
    ]  # fmt: skip
    for result in results:
        store.put_create(eval_key(result), eval_to_bytes(result))
    store.put_create(f"runs/{RUN}/eval/broken.json", b"{not json")
    return results


@pytest.fixture
def run_store(tmp_path: Path) -> ObjectStore:
    """The synthetic run described in the module docstring, in a file:// store."""
    store = ObjectStore(f"file://{tmp_path}/store")
    run_json = {"run_id": RUN, "env": {"name": "cartpole"}, "model": {"base_model": "tiny"},
                "learner": {"max_staleness": 2}}  # fmt: skip
    store.put_create(f"runs/{RUN}/run.json", json.dumps(run_json).encode())
    write_trajectories(store)
    publish_adapters(store, tmp_path)
    write_checkpoint(store, 3, step_log(3))
    write_checkpoint(store, 6, step_log(6))
    write_checkpoint(store, 9, step_log(6) * 2, manifest=False)
    write_checkpoint(store, 12, step_log(6), corrupt=True)
    write_evals(store)
    return store


def run_report(*args: str) -> Any:
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, result.output
    return result


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR chunk."""
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def expected_by_version() -> dict[int, list[tuple[float, bool]]]:
    """Episode (return, success) grouped by the version of the episode's first turn."""
    grouped: dict[int, list[tuple[float, bool]]] = {}
    for versions, reward, success, _ in EPISODES.values():
        grouped.setdefault(versions[0], []).append((reward, success))
    return grouped


# ---------------------------------------------------------------------------------------------------------------------


def test_report_writes_html_pngs_and_json_that_match_the_run(run_store: ObjectStore, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_report("--run", RUN, "--root", run_store.root, "--out", str(out), "--no-bus", "--json")
    data = json.loads(result.stdout)
    summary, series = data["summary"], data["series"]

    # Summary: counts from the rows written (26 rows = sum of turns; 4 tokens and 2 generated per row).
    rows = sum(len(spec[0]) for spec in EPISODES.values())
    assert summary["trajectories"] == {"batches": 3, "rows": rows, "episodes": 12, "tokens": 4 * rows,
                                       "generated_tokens": 2 * rows, "producers": ["p0"]}  # fmt: skip
    assert (summary["env"], summary["base_model"]) == ("cartpole", "tiny-test")
    assert (summary["adapter_versions"], summary["latest_version"]) == (2, 2)
    assert summary["learner_steps"] == 6 and summary["checkpoint"].endswith("step-000006-00000006")
    assert summary["dropped_stale_rows"] == 5

    # Reward per version, episode-level, with a Student-t CI (t_{0.975,3} = 3.182 from a t table).
    grouped = expected_by_version()
    assert [p["version"] for p in series["reward_by_version"]] == [0, 1, 2]
    for point in series["reward_by_version"]:
        rewards = np.array([r for r, _ in grouped[point["version"]]])
        assert point["episodes"] == len(rewards)
        assert point["reward_mean"] == pytest.approx(rewards.mean())
        assert point["reward_ci95"] == pytest.approx(3.182 * rewards.std(ddof=1) / math.sqrt(4), rel=1e-3)
        assert point["success_rate"] == pytest.approx(np.mean([s for _, s in grouped[point["version"]]]))
    assert summary["reward_first_version"]["reward_mean"] == pytest.approx(25.0)  # (10+20+30+40)/4
    assert summary["reward_last_version"]["reward_mean"] == pytest.approx(105.0)  # (90+100+110+120)/4

    # Staleness summed over the six steps of the newest complete checkpoint (not step 3's, not the damaged 12).
    expected_staleness: dict[str, int] = {}
    for histogram in STALENESS:
        for key, count in histogram.items():
            expected_staleness[key] = expected_staleness.get(key, 0) + count
    assert series["staleness_histogram"] == {"0": 15, "1": 6, "2": 1, "3": 2} == expected_staleness
    assert [s["ratio_mean"] for s in series["learner_steps"]] == pytest.approx([1.0, 1.01, 1.02, 1.03, 1.04, 1.05])
    assert [s["identical_group_share"] for s in series["learner_steps"]] == pytest.approx([0, .1, .2, .3, .4, .5])
    assert series["collapse_thresholds"]["warn_identical_group_share"] == 0.5  # the learner's default
    assert any("step-000012" in note and "checksum" in note for note in data["notes"]["learner"])

    # Duty cycle: the learner alone (no bus): busy = sum of step durations / (last finish - first start).
    (lane,) = series["duty_cycle"]["lanes"]
    assert lane["name"] == "learner"
    assert lane["busy_fraction"] == pytest.approx(sum(d for _, d in STEPS) / 23.0)  # 15 / 23
    assert summary["busy_fraction"] == {"learner": pytest.approx(15 / 23)}

    # Evaluations: newest per (policy, version); the broken file is noted, not fatal.
    by_policy = {e["policy"]: e for e in series["eval"]}
    assert by_policy["adapter"]["mean_return"] == pytest.approx(170.0)  # (150+170+160+200)/4
    assert by_policy["random"]["success_rate"] == 0.0
    assert any("broken.json" in note for note in data["notes"]["eval"])
    assert "--no-bus" in " ".join(data["notes"]["throughput"])

    # Files: one valid, non-trivial PNG per section with data; the HTML embeds exactly those bytes.
    html_text = (out / "report.html").read_text()
    for title in ["Summary", *SECTIONS.values()]:
        assert title in html_text
    plotted = [s for s in SECTIONS if s not in ("throughput", "value")]  # a LoRA run: no value learner
    for section in plotted:
        png = (out / FIGURE_FILES[section]).read_bytes()
        width, height = png_size(png)
        assert width > 400 and height > 200 and len(png) > 10_000
        assert base64.b64encode(png).decode() in html_text
    assert not (out / FIGURE_FILES["throughput"]).exists()
    assert html_text.count("data:image/png;base64,") == len(plotted)
    assert json.loads((out / "report.json").read_text())["summary"] == summary


def test_report_prints_a_summary_and_busy_fractions(run_store: ObjectStore, tmp_path: Path) -> None:
    result = run_report("--run", RUN, "--root", run_store.root, "--out", str(tmp_path / "r"), "--no-bus")
    assert "learner: busy 65.2% of the run" in result.stdout  # 15 / 23
    assert "tiny-test" in result.stdout and "report written to" in result.stdout
    assert (tmp_path / "r" / "report.html").exists()


def test_unknown_run_is_one_line_and_exit_2(run_store: ObjectStore, tmp_path: Path) -> None:
    result = runner.invoke(app, ["--run", "nope", "--root", run_store.root, "--out", str(tmp_path / "x"), "--no-bus"])
    assert result.exit_code == 2
    assert (
        result.output.strip().count("\n") == 0 and "run 'nope' not found" in result.output and "demo" in result.output
    )
    assert not (tmp_path / "x").exists()


def test_the_step_log_comes_from_step_objects_up_to_the_checkpoint(tmp_path: Path) -> None:
    """The current layout: state.json without the log, one object per step; a step past the checkpoint is left out."""
    store = ObjectStore(f"file://{tmp_path}/store")
    TrajectoryArchive(store).write_batch(RUN, _turn_rows("e00", EPISODES["e00"], "only"))
    key = write_checkpoint(store, 6, [])
    state = json.loads(store.get(f"{key}/state.json"))
    del state["state"]["step_log"], state["state"]["trained"]
    store.put(f"{key}/state.json", json.dumps(state).encode())
    manifest = json.loads(store.get(f"{key}/manifest.json"))
    manifest["files"]["state.json"] = hashlib.sha256(store.get(f"{key}/state.json")).hexdigest()
    store.put(f"{key}/manifest.json", json.dumps(manifest).encode())
    steps = StepLog(store, RUN)
    for entry in step_log(6) + [{**step_log(6)[-1], "step": 7, "ratio_mean": 9.0}]:  # step 7: not checkpointed
        steps.write(entry)
    data = json.loads(run_report(RUN, "--root", store.root, "--out", str(tmp_path / "o"), "--json", "--no-bus").stdout)
    ratios = [s["ratio_mean"] for s in data["series"]["learner_steps"]]
    assert ratios == pytest.approx([1.0, 1.01, 1.02, 1.03, 1.04, 1.05])
    assert data["series"]["staleness_histogram"] == {"0": 15, "1": 6, "2": 1, "3": 2}


def test_missing_pieces_and_an_unreachable_broker_do_not_fail_the_report(tmp_path: Path) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    TrajectoryArchive(store).write_batch(RUN, _turn_rows("e00", EPISODES["e00"], "only"))
    result = run_report("--run", RUN, "--root", store.root, "--out", str(tmp_path / "o"), "--json",
                        "--bootstrap", "127.0.0.1:1", "--bus-timeout", "1")  # fmt: skip
    data = json.loads(result.stdout)
    assert data["summary"]["trajectories"]["episodes"] == 1 and data["summary"]["learner_steps"] is None
    assert "no complete learner checkpoint" in data["notes"]["staleness"][0]
    assert "no evaluation results" in data["notes"]["eval"][0]
    assert "BusUnavailableError" in data["notes"]["throughput"][0]
    html_text = (tmp_path / "o" / "report.html").read_text()
    assert html_text.count("data:image/png;base64,") == 1  # only the reward section has data
    assert "no complete learner checkpoint" in html_text


def test_heartbeats_from_the_broker_become_throughput_and_producer_lanes(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    # p0 beats every 5 s from T0+5 to T0+25 (the first beat has no interval yet); p1 twice; another run once.
    beats = [("p0", 5.0 * k, 5.0 if k > 1 else 0.0, 0.2 * k, 10.0 * k) for k in range(1, 6)]
    beats += [("p1", 12.0, 6.0, 1.0, 3.0), ("p1", 18.0, 6.0, 0.5, 4.0)]
    with EventPublisher(bus_config) as publisher:
        for producer, offset, interval, busy, rate in beats:
            publisher.publish("control", heartbeat(RUN, producer, T0 + offset, interval, busy, rate))
        publisher.publish("control", heartbeat("other-run", "p9", T0 + 1, 1.0, 1.0, 99.0))
    result = run_report("--run", RUN, "--root", run_store.root, "--out", str(tmp_path / "b"), "--json",
                        "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace)  # fmt: skip
    series = json.loads(result.stdout)["series"]

    assert sorted(series["throughput"]) == ["p0", "p1"]  # nothing from other-run
    points = series["throughput"]["p0"]
    assert [p["time"] for p in points] == pytest.approx([T0 + 5.0 * k for k in range(1, 6)])
    assert [p["samples_per_s"] for p in points] == pytest.approx([10.0, 20.0, 30.0, 40.0, 50.0])
    assert [p["tokens_per_s"] for p in series["throughput"]["p1"]] == pytest.approx([300.0, 400.0])

    # Window: earliest start (learner at T0+0) to latest end (p0's beat at T0+25) = 25 s.
    lanes = {lane["name"]: lane for lane in series["duty_cycle"]["lanes"]}
    assert list(lanes) == ["learner", "p0", "p1"]
    p0_busy = 5.0 * (0.4 + 0.6 + 0.8 + 1.0)  # beats 2..5, 5 s each
    p1_busy = 6.0 * 1.0 + 6.0 * 0.5
    assert lanes["p0"]["busy_fraction"] == pytest.approx(p0_busy / 25.0)
    assert lanes["p1"]["busy_fraction"] == pytest.approx(p1_busy / 25.0)
    assert lanes["learner"]["busy_fraction"] == pytest.approx(15.0 / 25.0)
    assert png_size((tmp_path / "b" / FIGURE_FILES["throughput"]).read_bytes())[0] > 400


def test_an_event_sent_twice_counts_once_in_throughput_and_busy_fractions(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    """A publisher that resends an event in doubt (the same ``event_id``) leaves two copies on the topic: the
    second must not double the producer's busy seconds (0.8 busy over 5 s is 4 s, not 8 s) nor its points."""
    beats = [heartbeat(RUN, "p0", T0 + 5.0 * k, 5.0, 0.8, 10.0) for k in range(1, 4)]
    with EventPublisher(bus_config) as publisher:
        for beat in beats:
            publisher.publish("control", beat)
            publisher.publish("control", beat)  # the resend
    result = run_report("--run", RUN, "--root", run_store.root, "--out", str(tmp_path / "d"), "--json",
                        "--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace)  # fmt: skip
    series = json.loads(result.stdout)["series"]
    assert len(series["throughput"]["p0"]) == 3
    # Window: the learner's steps start at T0; p0's last beat ends at T0 + 15.  Busy: 3 beats x 5 s x 0.8 = 12 s.
    lanes = {lane["name"]: lane for lane in series["duty_cycle"]["lanes"]}
    window = series["duty_cycle"]["end"] - series["duty_cycle"]["start"]
    assert lanes["p0"]["busy_s"] == pytest.approx(12.0)
    assert lanes["p0"]["busy_fraction"] == pytest.approx(12.0 / window) and lanes["p0"]["busy_fraction"] <= 1.0


def test_a_run_resumed_after_a_stop_is_not_reported_stopped(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    started = RunStarted(config_path=f"runs/{RUN}/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")
    stops = [RunStopped(reason="stopped by Ctrl-C or a signal", final_step=3), RunStopped(reason="step budget reached")]
    history = [(0.0, started), (10.0, stops[0]), (12.0, started)]  # stopped, then resumed: running again
    with EventPublisher(bus_config) as publisher:
        for offset, payload in history:
            publisher.publish("control", Envelope(type=payload.event_type, run_id=RUN, payload=payload,
                                                  time=datetime.fromtimestamp(T0 + offset, UTC)))
    where = ["--root", run_store.root, "--json", "--bootstrap", bus_config.bootstrap_servers,
             "--namespace", bus_config.namespace]  # fmt: skip
    resumed = json.loads(run_report("--run", RUN, *where, "--out", str(tmp_path / "a")).stdout)
    assert resumed["summary"]["run_stopped"] is None
    assert resumed["series"]["duty_cycle"]["start"] == pytest.approx(T0)  # the run's window starts at its first start

    with EventPublisher(bus_config) as publisher:  # the resumed run ends too
        publisher.publish("control", Envelope(type=stops[1].event_type, run_id=RUN, payload=stops[1],
                                              time=datetime.fromtimestamp(T0 + 30.0, UTC)))
    ended = json.loads(run_report("--run", RUN, *where, "--out", str(tmp_path / "b")).stdout)
    assert ended["summary"]["run_stopped"] == "step budget reached"
    assert ended["series"]["duty_cycle"]["end"] == pytest.approx(T0 + 30.0)


def test_a_stop_the_topic_no_longer_holds_is_reported_from_the_runs_record(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    """Retention trims the control topic, not the run's newest start or stop as the store keeps it
    (runs/<run>/membership.json, what `rlpipe runs list|show` and packed processes follow): the report shows the
    stop from it, with the log and without, unless the topic holds a newer start or stop."""
    from pipeline.membership import membership_key
    from schemas.events import encode_event

    started = RunStarted(config_path=f"runs/{RUN}/run.json", config_sha256="0" * 64, env="cartpole", base_model="tiny")
    stop = RunStopped(reason="stopped by rlpipe runs stop", final_step=6)
    run_store.put(membership_key(RUN), encode_event(Envelope(type=stop.event_type, run_id=RUN, payload=stop,
                                                             time=datetime.fromtimestamp(T0 + 30.0, UTC))))
    with EventPublisher(bus_config) as publisher:  # the run's start is kept, its stop trimmed
        publisher.publish("control", Envelope(type=started.event_type, run_id=RUN, payload=started,
                                              time=datetime.fromtimestamp(T0, UTC)))
    bus = ["--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]
    for where in (bus, ["--no-bus"]):
        report = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", *where,
                                       "--out", str(tmp_path / where[0].strip("-"))).stdout)
        assert report["summary"]["run_stopped"] == "stopped by rlpipe runs stop", where
        assert report["summary"]["run_stopped_at"] == "2023-11-14 22:13:50 UTC"  # T0 + 30 s
        assert report["series"]["duty_cycle"]["end"] == pytest.approx(T0 + 30.0)  # the run's window ends at its stop
    printed = run_report("--run", RUN, "--root", run_store.root, "--no-bus", "--out", str(tmp_path / "p")).stdout
    assert "stopped" in printed and "2023-11-14 22:13:50 UTC (stopped by rlpipe runs stop)" in printed

    with EventPublisher(bus_config) as publisher:  # resumed after the recorded stop, its own record not written
        publisher.publish("control", Envelope(type=started.event_type, run_id=RUN, payload=started,
                                              time=datetime.fromtimestamp(T0 + 40.0, UTC)))
    resumed = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", *bus,
                                    "--out", str(tmp_path / "r")).stdout)
    assert resumed["summary"]["run_stopped"] is None and resumed["summary"]["run_stopped_at"] is None


def test_a_stopped_run_whose_producers_beat_on_is_not_reported_stopped(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    """As in `rlpipe runs show`: heartbeats within LEAVING_WITHIN_S of a stop are the producers letting the run go,
    a later one shows it going again."""
    from pipeline.analysis.runs import LEAVING_WITHIN_S

    stop = RunStopped(reason="stopped by rlpipe runs stop")
    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", Envelope(type=stop.event_type, run_id=RUN, payload=stop,
                                              time=datetime.fromtimestamp(T0 + 10.0, UTC)))
        publisher.publish("control", heartbeat(RUN, "p0", T0 + 10.0 + LEAVING_WITHIN_S + 5.0, 5.0, 0.5, 1.0))
    report = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", "--bootstrap",
                                   bus_config.bootstrap_servers, "--namespace", bus_config.namespace,
                                   "--out", str(tmp_path / "out")).stdout)
    assert report["summary"]["run_stopped"] is None


def test_a_damaged_membership_record_reports_the_run_stopped_as_runs_show_does(
    run_store: ObjectStore, tmp_path: Path
) -> None:
    """Packed processes starting take a run whose membership.json cannot be read as stopped, and so do `rlpipe runs
    list|show`: the report says the same, the stop without a time, and notes the record."""
    from pipeline.analysis.runs import summarize
    from pipeline.membership import membership_key

    run_store.put(membership_key(RUN), b"{not json")
    report = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", "--no-bus",
                                   "--out", str(tmp_path / "out")).stdout)
    shown = summarize(run_store, RUN, None, log_read=False)
    assert shown.status == "stopped" and shown.stop_reason is not None
    assert report["summary"]["run_stopped"] == shown.stop_reason
    assert report["summary"]["run_stopped_at"] is None  # a damaged record holds no time
    assert any("membership.json" in note for notes in report["notes"].values() for note in notes)
    printed = run_report("--run", RUN, "--root", run_store.root, "--no-bus", "--out", str(tmp_path / "p")).stdout
    assert f"at no recorded time ({shown.stop_reason})" in printed


def test_the_summary_gives_the_status_runs_show_gives_for_a_running_or_idle_run(
    run_store: ObjectStore, bus_config: BusConfig, tmp_path: Path
) -> None:
    """Not only a stop: a run with a recent heartbeat is running, one without is idle (unknown without the log),
    in the report's summary as in `rlpipe runs show`."""
    import time

    from pipeline.analysis.runs import read_activity, summarize

    bus = ["--bootstrap", bus_config.bootstrap_servers, "--namespace", bus_config.namespace]
    with EventPublisher(bus_config) as publisher:  # another run's event: the topic exists, this run has none
        publisher.publish("control", heartbeat("other", "p0", time.time(), 5.0, 0.5, 1.0))
    idle = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", *bus,
                                 "--out", str(tmp_path / "idle")).stdout)
    assert idle["summary"]["status"] == "idle" == summarize(run_store, RUN, None, log_read=True).status
    blind = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", "--no-bus",
                                  "--out", str(tmp_path / "blind")).stdout)
    assert blind["summary"]["status"] == "unknown" == summarize(run_store, RUN, None, log_read=False).status

    with EventPublisher(bus_config) as publisher:
        publisher.publish("control", heartbeat(RUN, "p0", time.time() - 5.0, 5.0, 0.5, 1.0))
    running = json.loads(run_report("--run", RUN, "--root", run_store.root, "--json", *bus,
                                    "--out", str(tmp_path / "running")).stdout)
    activity = read_activity(bus_config, 5.0, RUN)[RUN]
    assert running["summary"]["status"] == "running" == summarize(run_store, RUN, activity, log_read=True).status
    printed = run_report("--run", RUN, "--root", run_store.root, *bus, "--out", str(tmp_path / "p")).stdout
    assert re.search(r"status\s+│?\s*running", printed), printed


def heartbeat(run_id: str, producer: str, time_s: float, interval: float, busy: float, rate: float) -> Envelope:
    payload = ProducerHeartbeat(
        producer_id=producer, adapter_version=1, samples_total=10, batches_total=1,
        tokens_total=100, env_steps_total=10, samples_per_s=rate, tokens_per_s=rate * 100, env_steps_per_s=rate,
        busy_fraction=busy, interval_s=interval,
    )  # fmt: skip
    return Envelope(type=payload.event_type, run_id=run_id, time=datetime.fromtimestamp(time_s, UTC), payload=payload)


# -- pure pieces --------------------------------------------------------------------------------------------------------


def test_episodes_count_once_under_their_first_turns_version() -> None:
    rows = pl.from_arrow(records_to_table(r for eid, spec in EPISODES.items() for r in _turn_rows(eid, spec, "b")))
    episodes = episodes_of(rows)  # type: ignore[arg-type]
    assert episodes.height == 12
    assert dict(zip(episodes["episode_id"], episodes["policy_version"], strict=True))["e13"] == 1


def test_busy_seconds_clip_to_the_window_and_weight_by_share() -> None:
    # [0, 10] at 0.5 inside [5, 20]: 5 s overlap * 0.5 = 2.5; [15, 30] at 1.0: 5 s
    assert busy_seconds([(0.0, 10.0, 0.5), (15.0, 30.0, 1.0)], 5.0, 20.0) == pytest.approx(7.5)
    assert duty_cycle([])["lanes"] == []


def test_wilson_interval_brackets_the_rate_and_stays_in_0_1() -> None:
    low, high = wilson_interval(0, 4)
    assert low == 0.0 and 0.4 < high < 0.5  # textbook: 0 of 4 -> [0, 0.490]
    low, high = wilson_interval(5, 10)
    assert low == pytest.approx(0.2366, abs=1e-3) and high == pytest.approx(0.7634, abs=1e-3)
    for n in range(1, 200):  # rounding must not put 0% or 100% outside its own interval (the plot's error bars)
        for k in (0, n):
            low, high = wilson_interval(k, n)
            assert low <= k / n <= high, (k, n, low, high)


def test_eval_result_round_trips_and_refuses_inconsistent_summaries() -> None:
    result = EvalResult.from_episodes(RUN, "cartpole", 3, 1_000_000, [1.0, 2.0, 3.0], [True, False, True])
    assert eval_from_bytes(eval_to_bytes(result)) == result
    assert result.ci95 == pytest.approx(4.303 * 1.0 / math.sqrt(3), rel=1e-4)  # s = 1, t_{0.975,2} = 4.303
    assert re.fullmatch(r"runs/demo/eval/adapter-v000003-seed1000000-\d{8}T\d{12}Z\.json", eval_key(result))
    bad = {**result.model_dump(mode="json"), "mean_return": 5.0}
    with pytest.raises(EvalResultError, match="mean_return"):
        eval_from_bytes(json.dumps(bad).encode())
    with pytest.raises(ValueError, match="newer than"):
        eval_from_bytes(json.dumps({**bad, "schema_version": "2.0"}).encode())
    assert mean_ci95([4.0]) == (4.0, 0.0)


def test_command_is_the_single_report_command() -> None:
    assert command.name == "report"
    assert [p.name for p in command.params][:2] == ["run", "root"]


# ---------------------------------------------------------------------------------------------------------------------
# The page itself: rendered from the packaged templates, checked in a real headless browser

FIGURE_CHECK = """Array.from(document.images, img => ({
    alt: img.alt, complete: img.complete, naturalWidth: img.naturalWidth, naturalHeight: img.naturalHeight,
    shownWidth: img.getBoundingClientRect().width, visible: img.checkVisibility(),
}))"""


def test_report_page_loads_in_chromium_without_errors_and_shows_every_figure(
    run_store: ObjectStore, tmp_path: Path
) -> None:
    require_chromium()
    out = tmp_path / "page"
    run_report(RUN, "--root", run_store.root, "--out", str(out), "--no-bus")
    page = load_page((out / "report.html").as_uri(), FIGURE_CHECK)
    assert page.errors == []
    plotted = [title for section, title in SECTIONS.items() if (out / FIGURE_FILES[section]).exists()]
    assert [image["alt"] for image in page.value] == plotted and len(plotted) == 6
    for image, title in zip(page.value, plotted, strict=True):
        section = next(s for s, t in SECTIONS.items() if t == title)
        width, height = png_size((out / FIGURE_FILES[section]).read_bytes())
        assert image["complete"] and (image["naturalWidth"], image["naturalHeight"]) == (width, height), image
        assert image["visible"] and image["shownWidth"] > 0, image


def test_the_browser_check_sees_console_errors_and_broken_figures(tmp_path: Path) -> None:
    require_chromium()
    page_file = tmp_path / "broken.html"
    page_file.write_text('<!DOCTYPE html><html><head><link rel="icon" href="data:,"></head><body>'
                         '<img alt="broken" src="data:image/png;base64,bm90IGEgcG5n">'
                         '<script>console.error("something broke")</script></body></html>')  # fmt: skip
    page = load_page(page_file.as_uri(), FIGURE_CHECK)
    assert any("something broke" in error for error in page.errors), page.errors
    assert page.value[0]["alt"] == "broken" and page.value[0]["naturalWidth"] == 0


def test_report_html_comes_from_the_packaged_templates_with_autoescaping(run_store: ObjectStore) -> None:
    from pipeline.analysis.report.gather import gather_report
    from pipeline.analysis.report.html import render_html, report_templates

    templates = report_templates()
    assert "report.html.jinja" in templates.list_templates() and templates.autoescape is True
    report = gather_report(run_store, RUN)
    report.note("summary", '<script>alert("x")</script> & more')
    page = render_html(report, {"reward": PNG_SIGNATURE})
    assert page.startswith("<!DOCTYPE html>") and "<script>" not in page
    assert "&lt;script&gt;alert(&#34;x&#34;)&lt;/script&gt; &amp; more" in page
    assert f'src="data:image/png;base64,{base64.b64encode(PNG_SIGNATURE).decode()}"' in page


@pytest.mark.parametrize("damage", [b"[1, 2]", b"{not json"])
def test_an_unreadable_run_json_is_a_note_not_a_failed_report(tmp_path: Path, damage: bytes) -> None:
    store = ObjectStore(f"file://{tmp_path}/store")
    store.put_create(f"runs/{RUN}/run.json", damage)
    TrajectoryArchive(store).write_batch(RUN, _turn_rows("e00", EPISODES["e00"], "only"))
    result = run_report("--run", RUN, "--root", store.root, "--out", str(tmp_path / "o"), "--json", "--no-bus")
    data = json.loads(result.stdout)
    assert data["summary"]["trajectories"]["episodes"] == 1
    assert any(note.startswith(f"runs/{RUN}/run.json unreadable:") for note in data["notes"]["summary"])


def test_an_unreadable_adapter_manifest_is_a_note_not_a_failed_report(run_store: ObjectStore, tmp_path: Path) -> None:
    run_store.put_create(f"runs/{RUN}/adapters/v000003/manifest.json", b"{not json")  # damaged, or a newer rlpipe's
    result = run_report("--run", RUN, "--root", run_store.root, "--out", str(tmp_path / "o"), "--json", "--no-bus")
    summary = json.loads(result.stdout)["summary"]
    assert summary["adapter_versions"] == 2 and summary["latest_version"] == 2  # v1 and v2 still read
    assert summary["base_model"] == "tiny-test" and summary["trajectories"]["episodes"] == len(EPISODES)
    notes = json.loads(result.stdout)["notes"]["summary"]
    assert any(note.startswith("skipped adapter v3:") and "v000003/manifest.json" in note for note in notes)


def test_summary_and_eval_table_intervals_read_without_exponents_and_one_episode_has_none() -> None:
    from pipeline.analysis.report.html import section_table, summary_lines
    from pipeline.analysis.report.model import RunReport

    def version(episodes: int, mean: float, ci95: float) -> dict[str, Any]:
        return {"version": 0, "episodes": episodes, "reward_mean": mean, "reward_ci95": ci95, "success_rate": 0.5}

    def evaluation(episodes: int, mean: float, ci95: float) -> dict[str, Any]:
        return {"policy": "adapter", "env": "cartpole", "version": 3, "episodes": episodes, "seed_start": 0,
                "mean_return": mean, "ci95": ci95, "success_rate": 0.5, "success_low": 0.2, "success_high": 0.8,
                "breakdown": {}}

    summary = {"env": "cartpole", "reward_first_version": version(1, 10.0, 0.0), "reward_last_version": version(5, 150.0, 123.4),
               "eval": [evaluation(1, -31.631, 0.0), evaluation(40, 12345.6, 1234.5), evaluation(8, 0.01234, 0.00123)]}
    lines = dict(summary_lines(summary))
    assert lines["mean reward, first version"].startswith("v0: 10.0 ± n/a (1 episodes")  # not "± 0": no interval
    assert lines["mean reward, last version"].startswith("v0: 150 ± 123 (5 episodes")  # not 1.2e+02
    assert lines["evaluations"].split("; ")[0].startswith("adapter v3: -31.6 ± n/a")
    assert "12346 ± 1234" in lines["evaluations"] and "0.0123 ± 0.00123" in lines["evaluations"]
    report = RunReport("r", "file:///s", "now", summary, {"eval": summary["eval"]})
    table = section_table("eval", report)
    assert table is not None
    assert [(row[5], row[6]) for row in table["rows"]] == [("-31.6", "± n/a"), ("12346", "± 1234"),
                                                          ("0.0123", "± 0.00123")]


@pytest.mark.parametrize("kind", ["run", "packed", "server"])
def test_an_out_path_that_is_a_file_is_one_line_naming_it(run_store: ObjectStore, tmp_path: Path, kind: str) -> None:
    taken = tmp_path / "notes.txt"
    taken.write_text("kept")
    which = {"run": ["--run", RUN], "packed": ["--run", RUN, "--run", RUN + "-b"], "server": ["--server"]}[kind]
    result = runner.invoke(app, [*which, "--root", run_store.root, "--out", str(taken), "--no-bus"])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1, result.output
    assert f"--out {taken} is a file, not a folder" in result.output
    assert taken.read_text() == "kept"


@pytest.mark.parametrize(("loss", "expected"), [
    ("awr", "by design"),
    ("importance_sampling", "no learner step trained on rows yet (no importance ratios)"),
])
def test_a_run_trained_with_an_offline_objective_says_it_has_no_importance_ratios_by_design(
    loss: str, expected: str
) -> None:
    """``rlpipe replay --train`` with ``learner.loss awr`` trains rows without behaviour logprobs: the missing ratios
    are the objective's design, not a learner that has not trained yet."""
    from pipeline.analysis.report.gather import add_missing_notes
    from pipeline.analysis.report.model import ControlEvents, RunReport
    from schemas.checkpoint import LearnerState

    report = RunReport("r", "file:///s", "now", {"kind": "lora"}, {"staleness_histogram": {"0": 8}})
    trained = [{"step": 1, "ratio_mean": math.nan, "loss": 0.5}]
    add_missing_notes(report, "r", pl.DataFrame({"batch_id": ["b"]}), [], LearnerState(step=1, version=1), trained,
                      ControlEvents(), True, {"learner": {"loss": loss}})
    (note,) = report.notes["importance"]
    assert expected in note, note
    if loss == "awr":
        assert "offline" in note and "learner.loss awr" in note and "yet" not in note, note
