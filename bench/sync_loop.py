"""A sequential sample-then-train loop in one process, built from the pipeline's own parts.

Each iteration samples batches of ``groups_per_batch`` groups with the newest
adapter (the real rollout worker, vLLM or transformers sampler) until the
learner has ``learner.batch_rows`` rows waiting, the same rule the pipeline's
learner steps by, then trains one learner step on them (the real learner, store
and registry, no Kafka), publishes the adapter and loads it.  It is the
synchronous baseline of ``bench/async_vs_sync.py`` and a fast way to tune a
preset's hyper-parameters: it prints the mean episode return of every iteration.
Its store and adapter cache live in a temporary folder, removed at the end.
A slow environment is the run's own setting, as in the pipeline:

    python bench/sync_loop.py --preset demo --steps 20
    python bench/sync_loop.py --preset demo --steps 5 --set env.step_delay_s=0.05
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.options import check_run_config, positive_int


class ListSource:
    """Feeds the learner the batches written in this iteration (a finite, in-process source)."""

    def __init__(self) -> None:
        self.refs: list[Any] = []
        self.position = 0

    def poll(self, timeout_s: float) -> list[Any]:
        refs, self.refs = self.refs, []
        return refs

    def seek(self, positions: dict[str, int]) -> None:
        self.position = positions.get("sync", 0)

    def commit(self, positions: dict[str, int]) -> None:
        pass

    def keep_alive(self) -> None:
        pass

    def exhausted(self) -> bool:
        return not self.refs


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Options; the preset with every ``--set`` is resolved here, so a bad one is refused before anything starts."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=positive_int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="override a config field, e.g. --set env.step_delay_s=0.05 (repeatable)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the summary and per-iteration timings here")
    args = parser.parse_args(argv)
    check_run_config(parser, args.preset, args.overrides)
    return args


def main() -> None:
    args = parse_args()
    summary = run(args.preset, args.steps, args.overrides, args.json_out)
    print(json.dumps({k: v for k, v in summary.items() if k not in TIMELINE_KEYS}, indent=2))


TIMELINE_KEYS = ("learner_intervals", "sampler_intervals")  # long lists: in --json, not on the console


def run(preset: str, steps: int, overrides: list[str], json_out: str | None = None) -> dict[str, Any]:
    """Run ``steps`` sample-then-train iterations; return the summary (times in seconds, intervals in unix time).

    ``wall_s`` runs from the first sample to the end of the last iteration;
    ``setup_s`` is everything before (engine, model, learner).  ``sample_s`` and
    ``train_s`` split the wall time by phase; ``generate_s`` is the part of
    sampling spent inside the engine.  ``sampler_intervals`` (engine generating)
    and ``learner_intervals`` (each step's ``started_at``..``finished_at``, as
    the pipeline's step log has them) feed ``bench/async_vs_sync.py``'s idle
    fractions.  The store and the adapter cache live in a temporary folder, removed at the end.
    """
    with tempfile.TemporaryDirectory(prefix="rlpipe-sync-") as folder:
        return run_in(Path(folder), preset, steps, overrides, json_out)


def run_in(folder: Path, preset: str, steps: int, overrides: list[str], json_out: str | None) -> dict[str, Any]:
    """``run`` with its store and adapter cache in ``folder``."""
    from transformers import AutoTokenizer

    from consumers.checkpoint import CheckpointStore
    from consumers.learner import Learner
    from consumers.policy import LoraPolicy
    from consumers.sources import BatchRef
    from pipeline.config import resolve_config
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.io.registry import AdapterRegistry
    from pipeline.io.steplog import StepLog
    from pipeline.io.store import ObjectStore
    from producers.adapters import AdapterWatcher
    from producers.envs.registry import env_from_spec
    from producers.rollout import RolloutWorker
    from producers.samplers import sampler_for_run
    from producers.sink import StoreThenEventSink
    from producers.tiny_model import resolve_model

    entered = time.monotonic()
    config = resolve_config(preset, overrides=overrides)
    run_id = config.run_id
    store = ObjectStore(folder.as_uri())
    archive = TrajectoryArchive(store)
    model_path = resolve_model(config.model)
    sampler = sampler_for_run(config, model_path)
    try:
        registry = AdapterRegistry(store, run_id)
        watcher = AdapterWatcher(registry, sampler, folder / "cache", max_loaded=config.sampler.max_loras,
                                 registry_poll_s=0.0)
        source = ListSource()
        committed: list[Any] = []
        sink = StoreThenEventSink(archive, run_id, config.env.name, "sync", committed.append)
        learner_cfg = config.learner.model_copy(update={"max_steps": None})
        learner = Learner(run_id=run_id, base_model=model_path, config=learner_cfg,
                          policy=LoraPolicy(model_path, learner_cfg), archive=archive, registry=registry,
                          checkpoints=CheckpointStore(store, run_id), source=source)
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        history: list[dict[str, Any]] = []
        sampler_intervals: list[tuple[float, float]] = []
        batches = 0
        started, started_at = time.monotonic(), time.time()
        for iteration in range(steps):
            t0 = time.monotonic()
            committed.clear()
            generate_s = 0.0
            while not learner.ready():  # whole batches until batch_rows rows wait, as the pipeline's learner steps
                producer_cfg = config.producer.model_copy(update={
                    "max_groups": config.producer.groups_per_batch, "producer_id": "sync",
                    "seed_start": batches * 1000, "max_backlog_steps": None})
                worker = RolloutWorker(run_id=run_id, producer_id="sync", env_name=config.env.name,
                                       make_env=lambda: env_from_spec(config.env), tokenizer=tokenizer, sampler=sampler,
                                       adapters=watcher, sink=sink, producer=producer_cfg, sampling=config.sampler)
                new = len(committed)
                worker.run()
                batches += 1
                generate_s += worker.stats.generate_s
                sampler_intervals += worker.stats.busy_intervals
                source.refs = [BatchRef(i.batch_id, i.path, i.sha256, {"sync": batches}) for i in committed[new:]]
                learner.ingest(source.poll(0))
            t1 = time.monotonic()
            returns = episode_returns(archive, committed)
            metrics = learner.step()
            t2 = time.monotonic()
            watcher.refresh()
            history.append({"iteration": iteration, "mean_return": statistics.fmean(returns), "episodes": len(returns),
                            "batches": len(committed), "rows": metrics.get("rows", 0),
                            "sample_s": t1 - t0, "generate_s": generate_s, "train_s": t2 - t1,
                            "version": learner.state.version,
                            "ess": metrics.get("effective_sample_size"), "loss": metrics.get("loss")})
            print(json.dumps(history[-1]), flush=True)
        total = time.monotonic() - started
    finally:
        sampler.close()
    summary = {
        "preset": preset, "steps": steps, "setup_s": started - entered, "wall_s": total, "started_at": started_at,
        "sample_s": sum(h["sample_s"] for h in history), "train_s": sum(h["train_s"] for h in history),
        "generate_s": sum(h["generate_s"] for h in history), "rows": sum(h["rows"] for h in history),
        "batches": batches,
        "first_returns": [h["mean_return"] for h in history[:3]],
        "last_returns": [h["mean_return"] for h in history[-3:]],
        "learner_intervals": [(e["started_at"], e["finished_at"]) for e in StepLog(store, run_id).read()],
        "sampler_intervals": sampler_intervals,
    }
    if json_out:
        Path(json_out).write_text(json.dumps({"summary": summary, "history": history}, indent=2))
    return summary


def episode_returns(archive: Any, infos: list[Any]) -> list[float]:
    """One return per episode of the batches just written."""
    returns: dict[str, float] = {}
    for info in infos:
        table = archive.read_batch(info.path, info.sha256)
        for episode_id, reward in zip(table.column("episode_id").to_pylist(), table.column("reward").to_pylist(),
                                      strict=True):
            returns[episode_id] = reward
    return list(returns.values())


if __name__ == "__main__":
    main()
