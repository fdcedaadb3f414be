"""A sequential sample-then-train loop in one process, built from the pipeline's own parts.

Each iteration samples ``groups`` groups with the newest adapter (the real
rollout worker, vLLM or transformers sampler), trains one learner step on them
(the real learner, store and registry, no Kafka), publishes the adapter and
loads it.  It is the synchronous baseline of ``bench/async_vs_sync.py`` and a
fast way to tune a preset's hyper-parameters: it prints the mean episode return
of every iteration.

    python bench/sync_loop.py --preset demo --steps 20
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="demo")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--env-delay-s", type=float, default=0.0, help="extra seconds per environment step")
    parser.add_argument("--json", dest="json_out", default=None, help="write per-iteration timings here")
    args = parser.parse_args()
    print(json.dumps(run(args.preset, args.steps, args.overrides, args.env_delay_s, args.json_out), indent=2))


def run(preset: str, steps: int, overrides: list[str], env_delay_s: float = 0.0,
        json_out: str | None = None) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from consumers.checkpoint import CheckpointStore
    from consumers.learner import BatchRef, Learner
    from consumers.policy import LoraPolicy
    from pipeline.archive import TrajectoryArchive
    from pipeline.config import resolve_config
    from pipeline.registry import AdapterRegistry
    from pipeline.store import ObjectStore
    from producers.adapters import AdapterWatcher
    from producers.envs.registry import make_env
    from producers.rollout import RolloutWorker
    from producers.samplers import make_sampler
    from producers.sink import StoreThenEventSink
    from producers.tiny_model import resolve_model

    config = resolve_config(preset, overrides=overrides)
    run_id = config.run_id
    folder = Path(tempfile.mkdtemp(prefix="rlpipe-sync-"))
    store = ObjectStore(folder.as_uri())
    archive = TrajectoryArchive(store)
    model_path = resolve_model(config.model)
    sampler = make_sampler(config.sampler.backend, model_path, config.sampler)
    registry = AdapterRegistry(store, run_id)
    watcher = AdapterWatcher(registry, sampler, folder / "cache", max_loaded=config.sampler.max_loras,
                             registry_poll_s=0.0)
    source = ListSource()
    committed: list[Any] = []
    sink = StoreThenEventSink(archive, run_id, config.env.name, "sync", committed.append)

    def make_slow_env():
        env = make_env(config.env.name, config.env.overrides)
        if env_delay_s:
            step = env.step

            def slow_step(answer: str):
                time.sleep(env_delay_s)
                return step(answer)

            env.step = slow_step  # type: ignore[method-assign]
        return env

    learner_cfg = config.learner.model_copy(update={"max_steps": None})
    learner = Learner(run_id=run_id, base_model=model_path, config=learner_cfg,
                      policy=LoraPolicy(model_path, learner_cfg), archive=archive, registry=registry,
                      checkpoints=CheckpointStore(store, run_id), source=source)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    history: list[dict[str, Any]] = []
    started = time.monotonic()
    for iteration in range(steps):
        producer_cfg = config.producer.model_copy(update={
            "max_groups": config.producer.groups_per_batch, "producer_id": "sync",
            "seed_start": iteration * 1000, "max_backlog_steps": None})
        worker = RolloutWorker(run_id=run_id, producer_id="sync", env_name=config.env.name, make_env=make_slow_env,
                               tokenizer=tokenizer, sampler=sampler, adapters=watcher, sink=sink,
                               producer=producer_cfg, sampling=config.sampler)
        t0 = time.monotonic()
        committed.clear()
        worker.run()
        t1 = time.monotonic()
        source.refs = [BatchRef(i.batch_id, i.path, i.sha256, {"sync": iteration + 1})
                       for i in committed]
        returns = episode_returns(archive, committed)
        learner.ingest(source.poll(0))
        metrics = learner.step()
        t2 = time.monotonic()
        watcher.refresh()
        history.append({"iteration": iteration, "mean_return": statistics.fmean(returns), "episodes": len(returns),
                        "sample_s": t1 - t0, "train_s": t2 - t1, "version": learner.state.version,
                        "ess": metrics.get("effective_sample_size"), "loss": metrics.get("loss")})
        print(json.dumps(history[-1]), flush=True)
    total = time.monotonic() - started
    sampler.close()
    summary = {
        "preset": preset, "steps": steps, "wall_s": total,
        "sample_s": sum(h["sample_s"] for h in history), "train_s": sum(h["train_s"] for h in history),
        "first_returns": [h["mean_return"] for h in history[:3]],
        "last_returns": [h["mean_return"] for h in history[-3:]],
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
