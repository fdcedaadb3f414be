"""Re-announce stored batches on the event log (seed a run from another run's trajectories)."""

from __future__ import annotations

from consumers.sources import replay_order
from pipeline.io.archive import TrajectoryArchive, batch_committed_payload
from pipeline.io.bus import EventPublisher
from pipeline.runtime import open_store, resolved_bus
from schemas.config import RunConfig
from schemas.events import make_event


def announce_batches(config: RunConfig, source_run: str, date_from: str | None = None,
                     date_to: str | None = None) -> int:
    """Publish ``TrajectoryBatchCommitted`` for each stored batch of ``source_run`` under ``config.run_id``, in the
    order a replay trains them (``replay_order``: the source run's trained order, then commit order), so a run seeded
    with the source run's configuration forms the same steps."""
    store = open_store(config.store)
    archive = TrajectoryArchive(store)
    commits = replay_order(archive, source_run, date_from, date_to)
    with EventPublisher(resolved_bus(config.bus)) as publisher:
        for commit in commits:
            info = archive.describe_batch(commit.key, source_run, commit)  # refuses a changed file: none after it
            publisher.publish("trajectories", make_event(config.run_id, batch_committed_payload(info)))
    return len(commits)
