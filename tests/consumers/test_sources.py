"""The learner's Kafka source against the real broker: a commit asked for before the group assigned partitions."""

from __future__ import annotations

import time
from typing import Any

from consumers.sources import KafkaSource, learner_group_id
from pipeline.bus import EventPublisher, group_lag
from pipeline.topics import topic_name
from schemas.config import BusConfig
from tests.producers.test_service import announce_batch


def test_a_commit_before_the_group_assigned_partitions_is_made_after_it(bus_config: BusConfig,
                                                                           fast_group: dict[str, Any]) -> None:
    """A resumed learner commits its checkpoint's positions before it has joined its group."""
    topic = topic_name(bus_config.namespace, "trajectories")
    with EventPublisher(bus_config) as publisher:
        offsets = [announce_batch(publisher, "a", index) for index in range(3)]
    source = KafkaSource(bus_config, "a", **fast_group)
    try:
        source.seek({f"{topic}:0": offsets[1] + 1})
        source.commit({f"{topic}:0": offsets[1] + 1})  # not a member yet: kafka-python would refuse it
        refs, deadline = [], time.monotonic() + 30.0
        while not refs and time.monotonic() < deadline:
            refs = source.poll(0.5)
        assert [ref.batch_id for ref in refs] == ["a-b2"]
        committed = {p.partition: p.committed for p in group_lag(bus_config, learner_group_id("a"))}
        assert committed == {0: offsets[1] + 1}
    finally:
        source.close()
