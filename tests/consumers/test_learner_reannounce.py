"""A learner stopped while the broker refuses a step's announcement, or killed between a version's or checkpoint's
write and its event: the next start announces what was published or checkpointed but never announced, once, with
the event_id of any earlier try (readers dedupe by it).

A scripted source and a publisher that stands in for the broker keep these fast; the real broker's outages are in
test_learner_outage.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from consumers.broker_wait import BrokerAwayOnStop
from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.bus import PublishError
from pipeline.io.registry import AdapterRegistry
from pipeline.io.steplog import StepLog
from pipeline.io.store import sha256_hex
from pipeline.runtime import Announcer
from schemas.checkpoint import MANIFEST_FILE, STATE_FILE
from schemas.events import AdapterPublished, DeadLetter, Envelope, LearnerCheckpointed
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, write_batches
from tests.consumers.test_learner_progress import TOPIC, run_polls, scripted_learner, stored_refs
from tests.fixtures.killing import Killed, KillingFaults

store, setup = test_learner.store, test_learner.setup  # a file store, the tiny model's prompt


class Broker:
    """A publisher whose broker goes away at the ``nth`` event of type ``away_at``: from then on every try is
    refused, and written to the log first when ``writes_refused`` (a send that timed out after the broker wrote
    it).  ``log`` is what the broker holds, in order."""

    def __init__(self, away_at: str, nth: int, writes_refused: bool) -> None:
        self.away_at, self.nth, self.writes_refused = away_at, nth, writes_refused
        self.log: list[Envelope] = []
        self.tried: list[Envelope] = []
        self.seen = self.refused = 0
        self.away = False

    def publish(self, kind: str, event: Envelope) -> tuple[int, int]:
        self.tried.append(event)
        if event.type == self.away_at and not self.away and self.seen >= 0:
            self.seen += 1
            self.away = self.seen == self.nth
        if self.away:
            self.refused += 1
            if self.writes_refused:
                self.log.append(event)
            raise PublishError(f"publishing a {event.type} to ns.{kind} failed: no acknowledgement within 2s")
        self.log.append(event)
        return 0, len(self.log)

    def back(self) -> None:
        self.away, self.seen = False, -1  # never away again

    def deduped(self, kind: type) -> list:
        """The payloads of type ``kind`` as a reader that dedupes by ``event_id`` sees them, in log order."""
        seen: set = set()
        payloads = []
        for event in self.log:
            if isinstance(event.payload, kind) and event.event_id not in seen:
                seen.add(event.event_id)
                payloads.append(event.payload)
        return payloads


def learner_announcing_to(store, setup, broker: Broker, **overrides):  # type: ignore[no-untyped-def]
    learner, _ = scripted_learner(store, setup, stored_refs(store), **{"max_steps": 4, **overrides})
    learner.announce = learner.outputs.announce = Announcer(broker, RUN)  # type: ignore[arg-type]
    return learner


@pytest.mark.parametrize("writes_refused", [False, True], ids=["refused", "written-unacknowledged"])
@pytest.mark.parametrize("away_at", ["AdapterPublished", "LearnerCheckpointed"])
def test_a_restart_announces_the_version_or_checkpoint_a_stop_left_unannounced_once(
        store, setup, away_at: str, writes_refused: bool) -> None:  # type: ignore[no-untyped-def]
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(0))
    broker = Broker(away_at, nth=2, writes_refused=writes_refused)  # away as step 2 announces
    learner = learner_announcing_to(store, setup, broker)
    learner.outputs.stopping = lambda: broker.refused > 0  # the stop comes while the broker refuses
    learner.resume()
    with pytest.raises(BrokerAwayOnStop, match=f"never took {away_at}"):
        learner.run(poll_timeout_s=0)
    assert broker.refused == 1
    refused = broker.tried[-1]
    assert refused.type == away_at
    broker.back()
    again = learner_announcing_to(store, setup, broker)
    assert again.resume()
    again.run(poll_timeout_s=0)
    assert again.state.step == 4 and sorted(again.state.trained.values()) == [1, 2, 3, 4]
    versions = [p.version for p in broker.deduped(AdapterPublished)]
    steps = [p.step for p in broker.deduped(LearnerCheckpointed)]
    # every version in the registry and every checkpoint in the store announced, each once, in order
    assert versions == AdapterRegistry(store, RUN).versions()
    assert steps == sorted(step for step, _ in CheckpointStore(store, RUN).complete())
    assert refused.event_id in {event.event_id for event in broker.log}  # sent again as it was first tried


def assert_each_version_and_checkpoint_announced_once(store, broker: Broker) -> None:  # type: ignore[no-untyped-def]
    """Every version in the registry and every checkpoint in the store is in the broker's log, each under one
    ``event_id`` (a reader that dedupes by it sees each once), versions in order."""
    versions = [p.version for p in broker.deduped(AdapterPublished)]
    paths = [p.path for p in broker.deduped(LearnerCheckpointed)]
    assert versions == AdapterRegistry(store, RUN).versions()
    assert sorted(paths) == sorted(key for _, key in CheckpointStore(store, RUN).complete())


# (point, n): each fault point, where a restart has a checkpoint to resume from and where it has none; checkpoints
# every 2 steps, so versions newer than the checkpoint resumed from were published (v3 after step 2's checkpoint)
KILLS = [("before_version_event", 1), ("before_version_event", 3), ("after_publish", 3), ("before_checkpoint", 1),
         ("before_checkpoint_event", 1), ("after_checkpoint", 1), ("before_checkpoint_event", 2)]


@pytest.mark.parametrize(("point", "at"), KILLS, ids=[f"{p}:{n}" for p, n in KILLS])
def test_a_learner_killed_at_any_point_leaves_every_version_and_checkpoint_announced_once_after_its_restart(
        store, setup, point: str, at: int) -> None:  # type: ignore[no-untyped-def]
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(0))
    broker = Broker("never", nth=0, writes_refused=False)  # the broker takes everything
    killed = learner_announcing_to(store, setup, broker, checkpoint_every=2)
    killed.faults = killed.outputs.faults = KillingFaults(point, at)  # type: ignore[arg-type]
    killed.resume()
    with pytest.raises(Killed):
        killed.run(poll_timeout_s=0)
    again = learner_announcing_to(store, setup, broker, checkpoint_every=2)
    again.resume()
    again.run(poll_timeout_s=0)
    assert again.state.step == 4 and sorted(again.state.trained.values()) == [1, 2, 3, 4]
    assert_each_version_and_checkpoint_announced_once(store, broker)


def rewrite_as_old_layout(store, key: str) -> str:  # type: ignore[no-untyped-def]
    """The checkpoint at ``key`` as a learner before the step log wrote it: its step log and trained ids inline in
    state.json, no step objects (a run upgraded from then); the new folder's key."""
    steps = StepLog(store, RUN)
    meta = json.loads(store.get(f"{key}/{STATE_FILE}"))
    state = meta["state"]
    entries = steps.read(upto=state["step"])
    state.pop("step_log_head", None)
    state["trained"] = {batch_id: entry["step"] for entry in entries for batch_id in entry["batch_ids"]}
    state["step_log"] = entries
    files = {name: store.get(f"{key}/{name}") for name in ("adapter.safetensors", "optimizer.safetensors")}
    files[STATE_FILE] = json.dumps(meta).encode()
    manifest = json.loads(store.get(f"{key}/{MANIFEST_FILE}"))
    old = key.rsplit("-", 1)[0] + "-0ld1ay0u"
    for name, data in files.items():
        store.put_create(f"{old}/{name}", data)
    store.put_create(f"{old}/{MANIFEST_FILE}",
                     json.dumps({**manifest, "files": {n: sha256_hex(d) for n, d in files.items()}}).encode())
    store.delete(key, recursive=True)
    store.delete(steps.prefix, recursive=True)
    return old


def test_a_run_whose_newest_checkpoint_is_of_the_old_layout_resumes_and_announces_it(store, setup) -> None:
    """A user upgrading rlpipe: the checkpoint resumed from has its step log inline and no step objects exist; the
    start announces it with its step's metrics (from the inline log) and trains on."""
    write_batches(TrajectoryArchive(store), setup, 4, np.random.default_rng(0))
    broker = Broker("never", nth=0, writes_refused=False)
    first = learner_announcing_to(store, setup, broker, max_steps=2, checkpoint_every=2)
    first.resume()
    first.run(poll_timeout_s=0)
    [(step, key)] = CheckpointStore(store, RUN).complete()
    sent = next(p for p in broker.deduped(LearnerCheckpointed) if p.path == key)
    old = rewrite_as_old_layout(store, key)
    assert CheckpointStore(store, RUN).latest().state.legacy_layout
    broker.log.clear()
    again = learner_announcing_to(store, setup, broker, checkpoint_every=2)
    assert again.resume()
    [announced] = broker.deduped(LearnerCheckpointed)
    assert (announced.path, announced.step, announced.metrics) == (old, step, sent.metrics) and sent.metrics
    again.run(poll_timeout_s=0)
    assert again.state.step == 4 and sorted(again.state.trained.values()) == [1, 2, 3, 4]


def test_a_batch_dead_lettered_again_after_a_restart_is_one_letter_to_readers(store, setup) -> None:  # type: ignore[no-untyped-def]
    """A learner killed after a batch's dead letter but before a checkpoint passed the batch reads it again on its
    next start and dead-letters it again: the broker holds two letters, under one ``event_id``, so a reader that
    dedupes by it counts the batch once."""
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(0))
    good, bad = stored_refs(store)
    refs = [good, BatchRef(bad.batch_id, bad.path, "0" * 64, bad.position)]  # a wrong digest: never readable
    broker = Broker("never", nth=0, writes_refused=False)
    killed, _ = scripted_learner(store, setup, refs)
    killed.announce = killed.outputs.announce = Announcer(broker, RUN)  # type: ignore[arg-type]
    killed.resume()
    run_polls(killed, 3)  # step 1 checkpointed, then the bad batch dead-lettered; killed before any later step
    assert killed.state.step == 1 and killed.source.commits[-1] == {f"{TOPIC}:0": 1}
    again, _ = scripted_learner(store, setup, refs)
    again.announce = again.outputs.announce = Announcer(broker, RUN)  # type: ignore[arg-type]
    assert again.resume() and again.source.seeks == [{f"{TOPIC}:0": 1}]
    run_polls(again, 3)
    sent = [event for event in broker.log if isinstance(event.payload, DeadLetter)]
    assert [event.payload.key for event in sent] == [bad.batch_id, bad.batch_id]  # read and dead-lettered twice
    assert sent[0].event_id == sent[1].event_id
    assert [letter.key for letter in broker.deduped(DeadLetter)] == [bad.batch_id]
