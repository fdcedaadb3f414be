"""The learner keeps a run moving: it announces what it has read, commits on resume, and skips poison batches.

A scripted source stands in for Kafka (its positions look like ``<topic>:<partition>`` offsets), so
these run without a broker; the real broker paths are in tests/integration/test_progress_e2e.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from consumers.service import finish, record_step_metrics
from consumers.sources import BatchRef
from pipeline.health import HealthServer
from pipeline.io.archive import TrajectoryArchive, parquet_bytes
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import sha256_hex
from schemas.events import DeadLetter, LearnerProgress
from schemas.versions import SchemaVersionError
from tests.consumers import test_learner
from tests.consumers.test_learner import RUN, make_learner, write_batches

store, setup = test_learner.store, test_learner.setup  # the same fixtures: a file store, the tiny model's prompt
TOPIC = "t.trajectories"


class ScriptedSource:
    """Hands out the given refs one per poll; records seeks and commits."""

    def __init__(self, refs: list[BatchRef]) -> None:
        self.refs, self.index = refs, 0
        self.seeks: list[dict[str, int]] = []
        self.commits: list[dict[str, int]] = []

    def poll(self, timeout_s: float) -> list[BatchRef]:
        if self.index >= len(self.refs):
            return []
        self.index += 1
        return [self.refs[self.index - 1]]

    def seek(self, positions: dict[str, int]) -> None:
        self.seeks.append(dict(positions))
        self.index = positions.get(f"{TOPIC}:0", 0)

    def commit(self, positions: dict[str, int]) -> None:
        self.commits.append(dict(positions))

    def keep_alive(self) -> None:
        pass

    def exhausted(self) -> bool:
        return False


def stored_refs(store) -> list[BatchRef]:
    """A ref per stored batch of the run, positioned as if announced at offsets 0, 1, 2, ..."""
    archive = TrajectoryArchive(store)
    refs = []
    for offset, key in enumerate(sorted(archive.list_batches(RUN))):
        data = store.get(key)
        refs.append(BatchRef(key.rsplit("/", 1)[-1].removesuffix(".parquet"), key, sha256_hex(data),
                             {f"{TOPIC}:0": offset + 1}))
    return refs


def scripted_learner(store, setup, refs: list[BatchRef], **overrides):
    learner, announced = make_learner(store, setup, **overrides)
    learner.source = ScriptedSource(refs)
    return learner, announced


def run_polls(learner, polls: int) -> None:
    """``polls`` passes of the loop (a stop flag counting calls)."""
    calls = iter(range(polls))
    learner.run(should_stop=lambda: next(calls, None) is None, poll_timeout_s=0)


def test_progress_is_announced_after_each_step_and_while_waiting(store, setup):
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(0))
    refs = stored_refs(store)
    # checkpoint_every 10: no checkpoint (and no commit) in these three steps
    learner, announced = scripted_learner(store, setup, refs, checkpoint_every=10)
    run_polls(learner, 3)
    progress = [p for p in announced if isinstance(p, LearnerProgress)]
    assert [p.positions for p in progress] == [{f"{TOPIC}:0": n} for n in (1, 2, 3)]
    assert [p.step for p in progress] == [1, 2, 3] and learner.source.commits == []
    run_polls(learner, 5)  # waiting for rows: nothing new read, nothing new said within the interval
    assert len([p for p in announced if isinstance(p, LearnerProgress)]) == 3


def test_a_batch_read_but_not_yet_a_step_is_announced_while_waiting(store, setup):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(1), groups=1)  # 8 rows of 16
    learner, announced = scripted_learner(store, setup, stored_refs(store))
    run_polls(learner, 2)
    assert learner.state.step == 0
    assert [p.positions for p in announced if isinstance(p, LearnerProgress)] == [{f"{TOPIC}:0": 1}]


def test_resume_commits_the_checkpoint_positions(store, setup):
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(2))
    refs = stored_refs(store)
    first, _ = scripted_learner(store, setup, refs)
    run_polls(first, 1)  # step 1 checkpointed (a crash before its commit looks the same from here on)
    second, announced = scripted_learner(store, setup, refs)
    assert second.resume()
    assert second.source.seeks == [{f"{TOPIC}:0": 1}]
    assert second.source.commits == [{f"{TOPIC}:0": 1}]
    run_polls(second, 3)
    assert second.state.step == 2
    assert next(p.positions for p in announced if isinstance(p, LearnerProgress)) == {f"{TOPIC}:0": 2}


def test_resume_without_a_checkpoint_seeks_every_partition_from_its_start(store, setup):
    """No checkpoint that loads (all damaged, or none yet): the source is told so, instead of reading on from
    offsets the group committed after checkpoints this learner cannot resume from."""
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(5))
    learner, _ = scripted_learner(store, setup, stored_refs(store))
    assert not learner.resume()
    assert learner.source.seeks == [{}]


def test_a_poison_batch_is_dead_lettered_and_the_next_one_trained(store, setup):
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 3, np.random.default_rng(3))
    good_first, wrong_digest, unreadable = stored_refs(store)
    wrong_digest = BatchRef(wrong_digest.batch_id, wrong_digest.path, "0" * 64, wrong_digest.position)
    garbage = b"PAR1 this is not a parquet file"
    store.put(unreadable.path, garbage)
    unreadable = BatchRef(unreadable.batch_id, unreadable.path, sha256_hex(garbage), unreadable.position)
    write_batches(archive, setup, 1, np.random.default_rng(4))
    last = next(r for r in stored_refs(store) if r.batch_id not in {good_first.batch_id, wrong_digest.batch_id,
                                                                      unreadable.batch_id})
    last = BatchRef(last.batch_id, last.path, last.sha256, {f"{TOPIC}:0": 4})
    learner, announced = scripted_learner(store, setup, [good_first, wrong_digest, unreadable, last])
    steps = []
    calls = iter(range(6))
    learner.run(should_stop=lambda: next(calls, None) is None, on_step=steps.append, poll_timeout_s=0)

    letters = [p for p in announced if isinstance(p, DeadLetter)]
    assert [(d.key, d.origin_topic, d.origin_partition, d.origin_offset) for d in letters] == [
        (wrong_digest.batch_id, TOPIC, 0, 1), (unreadable.batch_id, TOPIC, 0, 2)]
    assert "checksum mismatch" in letters[0].reason and "not a readable Parquet file" in letters[1].reason
    assert all(d.reason.startswith(f"trajectory batch {d.key} quarantined: ") for d in letters)
    # the learner went on: the batch after them was trained, and the step's position is past all three
    assert [m["batch_ids"] for m in steps] == [[good_first.batch_id], [last.batch_id]]
    assert [m["batches_dead_lettered"] for m in steps] == [0, 2]
    assert learner.state.positions == {f"{TOPIC}:0": 4}
    assert learner.source.commits[-1] == {f"{TOPIC}:0": 4}
    assert wrong_digest.batch_id not in learner.state.trained and unreadable.batch_id not in learner.state.trained
    assert AdapterRegistry(store, RUN).versions() == [1, 2]

    health = HealthServer(None)
    for metrics in steps:
        record_step_metrics(health, metrics)
    assert health.metric_value("rlpipe_learner_dead_lettered_batches_total") == 2
    assert b"rlpipe_learner_dead_lettered_batches_total 2.0" in health.render_metrics()


def test_a_claim_check_naming_no_file_or_a_folder_is_dead_lettered_and_the_next_batch_trained(store, setup):
    """The store is immutable, so a batch path that names nothing, a folder, or passes through a file never becomes
    readable: raising would restart the learner at that offset for ever."""
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(6))
    (good,) = stored_refs(store)
    folder = good.path.rsplit("/", 1)[0]  # runs/<run>/trajectories/date=...: a folder on a file store
    missing = BatchRef("gone", f"{folder}/gone.parquet", "0" * 64, {f"{TOPIC}:0": 1})
    a_folder = BatchRef("folder", folder, "0" * 64, {f"{TOPIC}:0": 2})
    through_a_file = BatchRef("through", f"{good.path}/more.parquet", "0" * 64, {f"{TOPIC}:0": 3})
    good = BatchRef(good.batch_id, good.path, good.sha256, {f"{TOPIC}:0": 4})
    learner, announced = scripted_learner(store, setup, [missing, a_folder, through_a_file, good])
    steps = []
    calls = iter(range(5))
    learner.run(should_stop=lambda: next(calls, None) is None, on_step=steps.append, poll_timeout_s=0)

    letters = [p for p in announced if isinstance(p, DeadLetter)]
    assert [(d.key, d.origin_offset) for d in letters] == [("gone", 0), ("folder", 1), ("through", 2)]
    assert all(d.reason.startswith(f"trajectory batch {d.key} quarantined: ") for d in letters)
    assert [m["batch_ids"] for m in steps] == [[good.batch_id]] and steps[0]["batches_dead_lettered"] == 3
    assert learner.source.commits[-1] == {f"{TOPIC}:0": 4}


def test_a_batch_with_a_reward_that_is_not_a_number_is_dead_lettered_not_trained_or_stuck_on(store, setup,
                                                                                          monkeypatch):
    """A producer that wrote NaN (an environment's bug) must neither poison the weights nor stop the learner at that
    batch for ever: it is dead-lettered naming the column, and the batches after it are trained."""
    archive = TrajectoryArchive(store)
    rng = np.random.default_rng(6)
    write_batches(archive, setup, 1, rng)
    (good,) = stored_refs(store)
    rows = archive.read_batch(good.path).to_pylist()
    rows[3]["reward"] = float("nan")
    with monkeypatch.context() as patched:  # an older rlpipe's archive, which did not refuse it
        patched.setattr("pipeline.io.archive.check_trajectory_values", lambda table: None)
        archive.write_batch(RUN, [dict(r, batch_id="bnan") for r in rows], batch_id="bnan")
    write_batches(archive, setup, 1, rng, first=5)
    refs = {r.batch_id: r for r in stored_refs(store)}
    nan, last = refs.pop("bnan"), next(r for b, r in refs.items() if b != good.batch_id)
    scripted = [good, BatchRef(nan.batch_id, nan.path, nan.sha256, {f"{TOPIC}:0": 2}),
                BatchRef(last.batch_id, last.path, last.sha256, {f"{TOPIC}:0": 3})]
    learner, announced = scripted_learner(store, setup, scripted)
    steps = []
    calls = iter(range(5))
    learner.run(should_stop=lambda: next(calls, None) is None, on_step=steps.append, poll_timeout_s=0)
    (letter,) = [p for p in announced if isinstance(p, DeadLetter)]
    assert letter.key == "bnan" and "'reward'" in letter.reason and "not a finite number" in letter.reason
    assert [m["batch_ids"] for m in steps] == [[good.batch_id], [last.batch_id]]
    assert learner.state.positions == {f"{TOPIC}:0": 3} and "bnan" not in learner.state.trained


@pytest.mark.parametrize(("spoil", "reason"), [
    (lambda rows, vocab: rows[2].update(loss_mask=[1, *rows[2]["loss_mask"][1:]]), "loss_mask[0] is 1"),
    (lambda rows, vocab: rows[2].update(tokens=[*rows[2]["tokens"][:-1], vocab]), "outside the model's vocabulary"),
    (lambda rows, vocab: rows[2].update(temperature=0.0), "cannot train on rows sampled with temperature 0"),
    (lambda rows, vocab: [row.update(logprobs=[0.0] * len(row["logprobs"])) for row in rows], "no sampler scored"),
])
def test_a_batch_that_reads_but_cannot_be_trained_is_dead_lettered_not_stuck_on(store, setup, spoil, reason):
    """Rows the store accepts but training refuses (no context for the first token, a token id past the
    vocabulary, greedy rows for an importance-weighted loss) raised inside the step, and every restart met the
    same batch again: they are refused at ingest instead, like an unreadable file.  So are rows no sampler scored
    (demonstrations: every logprob 0), whose importance ratios would be the policy's probabilities themselves."""
    archive = TrajectoryArchive(store)
    rng = np.random.default_rng(7)
    write_batches(archive, setup, 1, rng)
    (good,) = stored_refs(store)
    rows = archive.read_batch(good.path).to_pylist()
    learner, announced = scripted_learner(store, setup, [])
    spoil(rows, learner.policy.input_vocab)
    archive.write_batch(RUN, [dict(r, batch_id="bad") for r in rows], batch_id="bad")
    write_batches(archive, setup, 1, rng, first=5)
    refs = {r.batch_id: r for r in stored_refs(store)}
    bad, last = refs.pop("bad"), next(r for b, r in refs.items() if b != good.batch_id)
    learner.source = ScriptedSource([good, BatchRef(bad.batch_id, bad.path, bad.sha256, {f"{TOPIC}:0": 2}),
                                     BatchRef(last.batch_id, last.path, last.sha256, {f"{TOPIC}:0": 3})])
    steps = []
    calls = iter(range(5))
    learner.run(should_stop=lambda: next(calls, None) is None, on_step=steps.append, poll_timeout_s=0)
    (letter,) = [p for p in announced if isinstance(p, DeadLetter)]
    assert letter.key == "bad" and reason in letter.reason
    assert [m["batch_ids"] for m in steps] == [[good.batch_id], [last.batch_id]]
    assert learner.state.positions == {f"{TOPIC}:0": 3} and "bad" not in learner.state.trained


def test_a_batch_written_by_a_newer_rlpipe_stops_the_learner_instead_of_being_skipped(store, setup):
    """Producers upgraded before the learner: the batch is readable after the learner's upgrade, so it is
    neither dead-lettered nor committed past; the learner stops asking for the upgrade."""
    archive = TrajectoryArchive(store)
    write_batches(archive, setup, 2, np.random.default_rng(8))
    first, newer = stored_refs(store)
    table = archive.read_batch(newer.path)
    data = parquet_bytes(table.replace_schema_metadata({**table.schema.metadata, b"rlpipe.schema_version": b"2.0"}))
    store.put(newer.path, data)
    learner, announced = scripted_learner(
        store, setup, [first, BatchRef(newer.batch_id, newer.path, sha256_hex(data), newer.position)])
    with pytest.raises(SchemaVersionError, match="upgrade rlpipe"):
        run_polls(learner, 4)
    assert not [p for p in announced if isinstance(p, DeadLetter)]
    assert learner.state.positions == {f"{TOPIC}:0": 1} and newer.batch_id not in learner.state.trained


def test_a_storage_error_is_not_a_poison_batch(store, setup, monkeypatch):
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(5))
    learner, announced = scripted_learner(store, setup, stored_refs(store))

    def flaky(*args, **kwargs):
        raise ConnectionError("storage unreachable")

    monkeypatch.setattr(learner.archive, "read_batch", flaky)
    with pytest.raises(ConnectionError):
        run_polls(learner, 1)
    assert not [p for p in announced if isinstance(p, DeadLetter)]


def test_a_stop_with_only_a_dead_lettered_batch_pending_checkpoints_past_it(store, setup):
    """The restart reads on after it: the batch is not dead-lettered a second time."""
    write_batches(TrajectoryArchive(store), setup, 2, np.random.default_rng(8))
    good, bad = stored_refs(store)
    bad = BatchRef(bad.batch_id, bad.path, "0" * 64, bad.position)
    first, announced = scripted_learner(store, setup, [good, bad])
    run_polls(first, 3)  # step 1 (checkpointed), then the bad batch read and dead-lettered
    assert first.state.step == 1 and [p.key for p in announced if isinstance(p, DeadLetter)] == [bad.batch_id]
    finish(first, lambda metrics: None)  # what a stop does
    assert first.source.commits[-1] == {f"{TOPIC}:0": 2}
    second, announced_again = scripted_learner(store, setup, [good, bad])
    assert second.resume() and second.state.positions == {f"{TOPIC}:0": 2} and second.state.step == 1
    run_polls(second, 3)
    assert not [p for p in announced_again if isinstance(p, DeadLetter)] and second.state.step == 1


def test_a_packed_runs_step_metrics_are_labelled_with_its_run():
    health = HealthServer(None)
    record_step_metrics(health, {"step": 3, "loss": 0.5, "batches_dead_lettered": 1, "batch_ids": ["x"]},
                        labels={"run": "a"})
    record_step_metrics(health, {"step": 8, "loss": 0.25, "batches_dead_lettered": 0}, labels={"run": "b"})
    assert health.metric_value("rlpipe_learner_step", {"run": "a"}) == 3.0
    assert health.metric_value("rlpipe_learner_loss", {"run": "b"}) == 0.25
    assert health.metric_value("rlpipe_learner_dead_lettered_batches_total", {"run": "a"}) == 1.0
    assert health.metric_value("rlpipe_learner_dead_lettered_batches_total", {"run": "b"}) == 0.0
    assert health.metric_value("rlpipe_learner_step") is None  # no unlabelled series beside the runs'


def test_a_stop_trains_a_last_batch_too_small_for_a_step_and_commits_past_it(store, setup):
    """`rlpipe run` stops the learner once its producers are done and it has read their batches: what waits under
    learner.batch_rows is trained by the stop (a step of its own), not left behind."""
    write_batches(TrajectoryArchive(store), setup, 3, np.random.default_rng(11))  # 16 rows each
    refs = stored_refs(store)
    learner, announced = scripted_learner(store, setup, refs, batch_rows=32)
    run_polls(learner, 5)  # step 1 on the first two batches; the third read and waiting (16 of 32 rows)
    assert learner.state.step == 1 and learner.work_waiting()
    assert [p.positions for p in announced if isinstance(p, LearnerProgress)][-1] == {f"{TOPIC}:0": 3}
    steps = []
    finish(learner, steps.append)  # what a stop does
    assert [(m["step"], m["rows"]) for m in steps] == [(2, 16)]
    assert set(learner.state.trained) == {ref.batch_id for ref in refs}
    assert learner.source.commits[-1] == {f"{TOPIC}:0": 3}


def test_a_batch_the_store_cannot_serve_stops_the_learner_and_is_not_dead_lettered(store, setup, monkeypatch):
    """The store away (gcsfs gives up with aiohttp's connection error, an OSError): the batch is not bad, so it is
    not skipped; the learner stops before its position moves, and a restart reads the batch again."""
    write_batches(TrajectoryArchive(store), setup, 1, np.random.default_rng(6))
    learner, announced = scripted_learner(store, setup, stored_refs(store))

    def store_away(path, sha256=None):
        raise ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 4443)")

    monkeypatch.setattr(learner.reader.archive, "read_batch", store_away)
    with pytest.raises(ConnectionRefusedError):
        run_polls(learner, 2)
    assert not [p for p in announced if isinstance(p, DeadLetter)] and learner.dead_lettered == 0
    assert learner.state.step == 0 and learner.state.positions == {} and learner.source.commits == []
