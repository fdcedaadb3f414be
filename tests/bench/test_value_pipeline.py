"""bench/value_pipeline.py in miniature: actors and the value learner share the queue source and the store."""

from __future__ import annotations

import threading
import time

from bench.value_pipeline import QueueSource, pipeline, start, stop_actors
from pipeline.config import resolve_config
from pipeline.io.store import ObjectStore


def test_actors_feed_the_learner_through_the_queue_and_it_publishes(tmp_path) -> None:
    config = resolve_config("dqn-cartpole", overrides=[
        "run_id=bench", "value.actor.steps_per_batch=50", "value.learner.min_replay_size=64",
        "value.learner.updates_per_transition=0.1"], environ={})
    source = QueueSource(backlog=2)
    learner, team = pipeline(config, ObjectStore(f"memory://bench-value-{time.time_ns()}"), source, 2, 0.0, 0,
                             tmp_path)
    stop = threading.Event()
    threads = start(team, stop)
    while learner.state.step < 4:
        refs = source.poll(5.0)
        assert refs, "no batch from the actors within 5 s"
        learner.step(learner.ingest(refs[0]))
    stop_actors(threads, stop, source)
    assert not any(thread.is_alive() for thread in threads)
    assert learner.state.version >= 1 and {a.actor_id for a in team} == {"a0", "a1"}
    assert sum(actor.batches_written for actor in team) >= 4
    assert {p.name for p in tmp_path.iterdir()} <= {"a0", "a1"}  # the actors' caches, in the folder given
