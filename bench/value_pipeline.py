"""The value pipeline in one process: numeric actors and the value learner over a store, the log in between.

What runs is the pipeline's own code (``producers.value_actor.ValueActor``,
``consumers.value.learner.ValueLearner``, the registry, steps batches in a
``memory://`` store); only the broker is replaced by an in-process queue of
``BatchRef``s, so the numbers are the components' and not Kafka's.  Actors run in
threads (an environment's delay is a sleep, which releases the GIL, as waiting on a
remote simulator would).

Two measurements:

- ``learn``: one actor, the queue bounded to ``--backlog`` batches (the backpressure a
  producer's ``max_backlog_steps`` gives), the learner publishing every step.  Every
  ``--eval-every`` learner steps the newest version plays ``--eval-episodes`` held-out
  seeds greedily (``producers.value_eval.play_greedy``); the run stops at ``--target``
  or ``--max-env-steps``.  Prints env steps and wall-clock to the target per seed.
- ``throughput``: ``--env-delay-s`` per environment step, the learner running, env steps
  per second of 1 actor and of ``--actors`` actors over ``--seconds`` each.

The actors' network caches and the evaluation's pulled versions live in a temporary folder per run,
removed at its end.

Run: nice .venv/bin/python bench/value_pipeline.py learn [--preset dqn-cartpole] [--seeds 3]
     nice .venv/bin/python bench/value_pipeline.py throughput [--actors 4] [--env-delay-s 0.05]
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from bench.cpu import LoadAverage
from bench.options import positive_int
from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from consumers.value.learner import ValueLearner
from pipeline.config import ConfigError, resolve_config
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.value_network import load_network
from producers.envs.registry import make_env
from producers.value_actor import ValueActor, ValueNetworkWatcher
from producers.value_eval import play_greedy
from schemas.config import RunConfig
from schemas.events import TrajectoryBatchCommitted


class QueueSource:
    """The learner's source over an in-process queue (positions count the batches taken)."""

    def __init__(self, backlog: int) -> None:
        self.queue: queue.Queue[BatchRef] = queue.Queue(maxsize=backlog)
        self.taken = 0

    def announce(self, payload: Any) -> None:
        if isinstance(payload, TrajectoryBatchCommitted):  # blocks while the backlog is full
            self.queue.put(BatchRef(payload.batch_id, payload.path, payload.sha256, {}))

    def poll(self, timeout_s: float) -> list[BatchRef]:
        try:
            ref = self.queue.get(timeout=max(timeout_s, 0.01))
        except queue.Empty:
            return []
        self.taken += 1
        return [BatchRef(ref.batch_id, ref.path, ref.sha256, {"queue:0": self.taken})]

    def seek(self, positions: dict[str, int]) -> None: ...
    def commit(self, positions: dict[str, int]) -> None: ...
    def keep_alive(self) -> None: ...
    def exhausted(self) -> bool:
        return False


def pipeline(config: RunConfig, store: ObjectStore, source: QueueSource, actors: int, delay_s: float,
             seed: int, cache: Path) -> tuple[ValueLearner, list[ValueActor]]:
    """The learner and ``actors`` actors of ``config`` over ``store``; the actors cache networks under ``cache``."""
    value = config.value
    assert value is not None
    learner_config = value.learner.model_copy(update={"seed": seed, "max_steps": None})
    learner = ValueLearner(
        run_id=config.run_id, env_name=config.env.name, config=learner_config,
        observation_size=value.observation_size, num_actions=value.num_actions, archive=TrajectoryArchive(store),
        registry=AdapterRegistry(store, config.run_id), checkpoints=CheckpointStore(store, config.run_id),
        source=source,
    )
    team = [
        ValueActor(run_id=config.run_id, actor_id=f"a{i}", env=make_env(config.env.name, config.env.overrides, delay_s),
                   archive=TrajectoryArchive(store),
                   watcher=ValueNetworkWatcher(AdapterRegistry(store, config.run_id), cache / f"a{i}", poll_s=0.2),
                   config=value.actor.model_copy(update={"seed": seed * 100 + i}), announce=source.announce)
        for i in range(actors)
    ]
    return learner, team


def start(team: list[ValueActor], stop: threading.Event) -> list[threading.Thread]:
    threads = [threading.Thread(target=actor.run, kwargs={"should_stop": stop.is_set}, daemon=True) for actor in team]
    for thread in threads:
        thread.start()
    return threads


def stop_actors(threads: list[threading.Thread], stop: threading.Event, source: QueueSource) -> None:
    """Stop the actor threads, emptying the queue while they finish (one may wait on a full backlog)."""
    stop.set()
    while any(thread.is_alive() for thread in threads):
        while not source.queue.empty():
            source.queue.get()
        for thread in threads:
            thread.join(timeout=0.05)


def evaluate(config: RunConfig, store: ObjectStore, version: int, episodes: int, cache: Path) -> float:
    """The mean return of ``version`` played greedily on ``episodes`` held-out seeds (pulled into ``cache``)."""
    registry = AdapterRegistry(store, config.run_id)
    _, network = load_network(registry.pull(version, cache, kind="value-network"))
    env, rng = make_env(config.env.name, config.env.overrides), np.random.default_rng(0)
    offset = config.env.eval_seed_offset
    return float(np.mean([play_greedy(env, network, offset + s, rng)[0] for s in range(episodes)]))


def learn(args: argparse.Namespace) -> None:
    rows = []
    with LoadAverage() as load:
        for seed in range(args.seeds):
            with tempfile.TemporaryDirectory(prefix="rlpipe-bench-value-") as tmp:
                rows.append((seed, *learn_seed(args, seed, Path(tmp))))
    print(f"\n| seed | env steps to {args.target:g} | wall-clock s | updates | last eval |")
    print("| --- | --- | --- | --- | --- |")
    for seed, reached, last in rows:
        if reached:
            print(f"| {seed} | {reached[0]:,} | {reached[1]:.0f} | {reached[2]:,} | {last[1]:.1f} |")
        else:
            print(f"| {seed} | not within {args.max_env_steps:,} | | | {last[1] if last else float('nan'):.1f} |")
    done = [r for _, r, _ in rows if r]
    if len(done) > 1:
        steps = [r[0] for r in done]
        print(f"\nenv steps to target: median {statistics.median(steps):,.0f}, range {min(steps):,}-{max(steps):,}")
    print(f"\n{load}")


def learn_seed(args: argparse.Namespace, seed: int, folder: Path) -> tuple[tuple | None, tuple | None]:
    """One seed's run to the target: (env steps, seconds, updates) when it got there, and the last evaluation."""
    config = resolve_config(args.preset, overrides=[f"run_id=bench-{seed}"], environ={})
    store = ObjectStore(f"memory://bench-value-learn-{seed}-{time.time_ns()}")
    source = QueueSource(args.backlog)
    learner, team = pipeline(config, store, source, 1, 0.0, seed, folder / "actors")
    stop, started = threading.Event(), time.perf_counter()
    threads = start(team, stop)
    curve: list[tuple[int, float]] = []
    reached = None
    while team[0].env_steps < args.max_env_steps and reached is None:
        refs = source.poll(1.0)
        if not refs:
            continue
        learner.step(learner.ingest(refs[0]))
        if learner.state.step % args.eval_every == 0 and learner.state.version:
            score = evaluate(config, store, learner.state.version, args.eval_episodes, folder / "eval")
            curve.append((team[0].env_steps, score))
            print(f"seed {seed} step {learner.state.step} env steps {team[0].env_steps} "
                  f"v{learner.state.version} eval {score:.1f}", flush=True)
            if score >= args.target:
                reached = (team[0].env_steps, time.perf_counter() - started, learner.agent.training_steps)
    stop_actors(threads, stop, source)
    return reached, curve[-1] if curve else None


def throughput(args: argparse.Namespace) -> None:
    print("| actors | env delay | env steps/s | learner steps |")
    print("| --- | --- | --- | --- |")
    rates = {}
    with LoadAverage() as load:
        for actors in (1, args.actors):
            with tempfile.TemporaryDirectory(prefix="rlpipe-bench-value-") as tmp:
                rates[actors], learner_steps = actors_rate(args, actors, Path(tmp))
            print(f"| {actors} | {args.env_delay_s * 1000:.0f} ms | {rates[actors]:.1f} | {learner_steps} |", flush=True)
    print(f"\nspeed-up of {args.actors} actors over 1: {rates[args.actors] / rates[1]:.2f}x; {load}")


def actors_rate(args: argparse.Namespace, actors: int, folder: Path) -> tuple[float, int]:
    """Env steps per second of ``actors`` actors over ``args.seconds`` with the learner running, and its steps."""
    config = resolve_config(args.preset, overrides=[f"run_id=tp-{actors}"], environ={})
    store = ObjectStore(f"memory://bench-value-tp-{actors}-{time.time_ns()}")
    source = QueueSource(backlog=1_000_000)
    learner, team = pipeline(config, store, source, actors, args.env_delay_s, 0, folder)
    stop = threading.Event()
    threads = start(team, stop)
    started = time.perf_counter()
    learner_thread = threading.Thread(target=learner.run, kwargs={"should_stop": stop.is_set}, daemon=True)
    learner_thread.start()
    time.sleep(args.seconds)
    steps = sum(actor.env_steps for actor in team)
    elapsed = time.perf_counter() - started
    stop.set()
    for thread in [*threads, learner_thread]:
        thread.join(timeout=30)
    return steps / elapsed, learner.state.step


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=["learn", "throughput"])
    parser.add_argument("--preset", default="dqn-cartpole", help="a value run's preset (with a value section)")
    parser.add_argument("--seeds", type=positive_int, default=3)
    parser.add_argument("--backlog", type=positive_int, default=1)
    parser.add_argument("--eval-every", type=positive_int, default=5)
    parser.add_argument("--eval-episodes", type=positive_int, default=5)
    parser.add_argument("--target", type=float, default=150.0)
    parser.add_argument("--max-env-steps", type=positive_int, default=30_000)
    parser.add_argument("--actors", type=positive_int, default=4)
    parser.add_argument("--env-delay-s", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.env_delay_s < 0:
        parser.error("--seconds must be above 0 and --env-delay-s at least 0")
    try:
        config = resolve_config(args.preset, overrides=["run_id=bench"], environ={})
    except ConfigError as exc:
        parser.error(str(exc))
    if config.value is None:
        parser.error(f"--preset {args.preset} is not a value run (no value section); e.g. --preset dqn-cartpole")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    learn(args) if args.mode == "learn" else throughput(args)


if __name__ == "__main__":
    main()
