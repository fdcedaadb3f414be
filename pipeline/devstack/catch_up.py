"""Whether a run's learner has read every batch announced for the run: what ``rlpipe run`` waits for once every
producer has exited 0, before it stops the learner.

Producers with ``producer.max_groups`` exit when they have written their groups, possibly long before the learner
reaches ``learner.max_steps``; the learner would then wait for batches that never come.  Once the learner has read
(ingested) every batch they announced, a SIGTERM makes it train what is waiting (a last step under
``learner.batch_rows`` included), write its checkpoint and commit: nothing the producers wrote is left untrained.

The learner's read position is the newer of its group's committed offsets and the positions of its latest
``LearnerProgress`` on ``<ns>.control`` (it commits only after a checkpoint, and announces how far it has read
after every step and while it waits).  The run's announcements are its ``TrajectoryBatchCommitted`` events on
``<ns>.trajectories`` from the committed offsets up to the topic's end when this is built: the producers have
exited, so nothing more of the run is written.  Not the group's lag (end - committed offset): the topic is shared
by every run on a stack, so the lag also counts other runs' batches and may never reach 0 for this one.
"""

from __future__ import annotations

from collections.abc import Mapping

from pipeline.io.bus import EventFollower, describe_topic, group_lag, normalize_offsets, resolve_topic
from schemas.config import BusConfig
from schemas.events import LearnerProgress, TrajectoryBatchCommitted


class LearnerCatchUp:
    """Called: whether the learner of ``run_id`` has read every batch announced for it (build it once the run's
    producers have exited).  ``control_from_P`` (the control topic's offset per partition at the launch,
    ``ControlFeed.control_start_P``): the learner's progress announced since then is read, so a last one announced
    before this was built counts too.  Not thread-safe (the followers are not)."""

    def __init__(self, bus: BusConfig, run_id: str, control_from_P: Mapping[int, int]) -> None:
        self.topic = resolve_topic(bus.namespace, "trajectories")
        committed_P = {p.partition: p.committed for p in group_lag(bus, f"rlpipe-learner-{run_id}")
                       if p.topic == self.topic}
        self.read_P: dict[int, int] = dict(committed_P)  # the learner's read position: next offset it reads
        self.announced_P: dict[int, int] = {}  # one past the run's last announcement at or after the committed one
        self.announcements = EventFollower(bus, "trajectories", run_id=run_id, start="earliest", offsets=committed_P)
        try:  # the topic exists now (the follower creates it): where it ends, with the producers gone
            self.end_P = {p.partition: p.end_offset for p in describe_topic(bus, "trajectories").partitions}
            self.progress = EventFollower(bus, "control", run_id=run_id, start="earliest", offsets=control_from_P)
        except BaseException:
            self.announcements.close()
            raise

    def __call__(self) -> bool:
        for item in self.announcements.poll(0.0):
            if isinstance(item.event.payload, TrajectoryBatchCommitted):
                self.announced_P[item.partition] = max(item.offset + 1, self.announced_P.get(item.partition, 0))
        for item in self.progress.poll(0.0):
            payload = item.event.payload
            if isinstance(payload, LearnerProgress):
                stored = {key: offset for key, offset in payload.positions.items() if not key.startswith("replay:")}
                for (topic, partition), offset in normalize_offsets(stored).items():
                    if topic == self.topic:
                        self.read_P[partition] = max(offset, self.read_P.get(partition, 0))
        reached_P = {partition: offset for (_, partition), offset in self.announcements.positions().items()}
        if any(reached_P.get(partition, 0) < end for partition, end in self.end_P.items()):
            return False  # the run's announcements are not all read yet
        return all(self.read_P.get(partition, 0) >= after for partition, after in self.announced_P.items())

    def close(self) -> None:
        self.announcements.close()
        self.progress.close()
