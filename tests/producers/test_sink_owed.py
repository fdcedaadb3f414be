"""A stored batch whose event the broker did not acknowledge is announced again as the same event."""

from __future__ import annotations

from pipeline.runtime import Announcer
from producers.sink import OwedBatchEvents
from schemas.events import TrajectoryBatchCommitted
from tests.fixtures.outages import WrittenButUnacknowledged


def batch(batch_id: str) -> TrajectoryBatchCommitted:
    return TrajectoryBatchCommitted(batch_id=batch_id, path=f"runs/r/trajectories/{batch_id}.parquet",
                                    sha256="0" * 64, num_rows=1, num_tokens=2, num_generated_tokens=1, num_groups=1,
                                    env="toy", producer_id="p", policy_version_min=0, policy_version_max=0,
                                    reward_mean=0.0, reward_min=0.0, reward_max=0.0, success_rate=0.0,
                                    created_at="2026-01-01T00:00:00Z")


def test_an_owed_batch_event_tried_again_is_the_same_event_so_readers_count_it_once() -> None:
    publisher = WrittenButUnacknowledged()
    owed = OwedBatchEvents("r", Announcer(publisher, "r"), retry_interval_s=0.0)  # type: ignore[arg-type]
    assert not owed.owe(batch("b1"))
    assert [event.batch_id for event in owed.unannounced] == ["b1"]
    owed.retry_due()
    first, second = publisher.sent
    assert not owed.unannounced and first.event_id == second.event_id and first == second
