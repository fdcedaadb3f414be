"""TrajectoryArchive: one immutable Parquet batch per write, verified reads, scans with pruning."""

from __future__ import annotations

import re
from datetime import UTC, date, datetime

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.archive import ArchiveError, TrajectoryArchive, batch_committed_payload, parquet_bytes
from pipeline.io.archive_layout import commit_record_key, new_batch_id
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.events import TrajectoryBatchCommitted
from schemas.steps import steps_to_table
from schemas.trajectory import NO_ADAPTER_SHA, SCHEMA_VERSION_KEY, conform_table, records_to_table
from schemas.versions import TRAJECTORY_SCHEMA_VERSION

DAY = datetime(2024, 5, 6, 23, 59, tzinfo=UTC)


def row(**changes: object) -> dict:
    base: dict = dict(
        run_id="r",
        batch_id="b1",
        episode_id="e",
        group_id="g",
        env="cartpole",
        env_seed=3,
        producer_id="p",
        policy_version=2,
        adapter_sha256=NO_ADAPTER_SHA,
        tokens=[5, 6, 7],
        loss_mask=[0, 1, 1],
        logprobs=[0.0, -0.5, -1.25],
        turn_rewards=[1.0],
        reward=1.0,
        num_turns=1,
        success=True,
        terminated=True,
        truncated=False,
        created_at=DAY,
    )
    base.update(changes)
    return base


def two_rows(**changes: object) -> list[dict]:
    # tokens 3 + 2 = 5, generated 2 + 2 = 4, rewards (1.0 - 0.5) / 2 = 0.25, one success in two = 0.5
    return [
        row(**changes),
        row(
            episode_id="e2",
            group_id="g2",
            policy_version=3,
            tokens=[1, 2],
            loss_mask=[1, 1],
            logprobs=[-1.0, -2.0],
            reward=-0.5,
            success=False,
            text="hello",
            **changes,
        ),
    ]


def test_parquet_round_trip_on_every_store(any_store: ObjectStore) -> None:
    archive = TrajectoryArchive(any_store)
    table = records_to_table(two_rows())
    info = archive.write_batch("r", table, created=DAY)
    back = archive.read_batch(info.path, info.sha256)
    assert back.equals(conform_table(table))
    assert back.schema.metadata[SCHEMA_VERSION_KEY] == TRAJECTORY_SCHEMA_VERSION.encode()
    file_meta = pq.read_metadata(pa.BufferReader(any_store.get(info.path))).metadata
    assert file_meta[SCHEMA_VERSION_KEY] == TRAJECTORY_SCHEMA_VERSION.encode()


def test_batch_info_summarises_the_rows(memory_store: ObjectStore) -> None:
    info = TrajectoryArchive(memory_store).write_batch("r", two_rows(), created=DAY)
    assert info.path == "runs/r/trajectories/date=2024-05-06/b1.parquet"
    assert info.batch_id == "b1" and info.num_rows == 2 and info.num_groups == 2
    assert (info.num_tokens, info.num_generated_tokens) == (5, 4)
    assert (info.policy_version_min, info.policy_version_max) == (2, 3)
    assert (info.reward_mean, info.reward_min, info.reward_max) == (0.25, -0.5, 1.0)
    assert info.success_rate == 0.5
    assert info.size_bytes == len(memory_store.get(info.path))


def test_rewriting_a_batch_is_refused(any_store: ObjectStore) -> None:
    archive = TrajectoryArchive(any_store)
    archive.write_batch("r", two_rows(), created=DAY)
    with pytest.raises(FileExistsError):
        archive.write_batch("r", two_rows(), created=DAY)


def test_tampered_batch_is_refused(file_store: ObjectStore) -> None:
    archive = TrajectoryArchive(file_store)
    info = archive.write_batch("r", two_rows(), created=DAY)
    data = bytearray(file_store.get(info.path))
    data[len(data) // 2] ^= 0xFF
    file_store.put(info.path, bytes(data))
    with pytest.raises(ChecksumError, match="checksum mismatch"):
        archive.read_batch(info.path, info.sha256)


def test_a_batch_changed_after_its_commit_is_described_by_its_recorded_digest_or_refused(
        file_store: ObjectStore) -> None:
    """The orphan sweep announces a stored batch nobody announced: from its commit record's digest, so a file
    altered since (still valid Parquet) is refused, not announced with a digest that makes the learner trust it."""
    archive = TrajectoryArchive(file_store)
    info = archive.write_batch("r", two_rows(), created=DAY)
    assert archive.describe_batch(info.path, "r") == info
    table = pq.read_table(pa.BufferReader(file_store.get(info.path)))
    rewarded = table.set_column(table.schema.get_field_index("reward"), "reward", pa.array([9.0, 9.0], pa.float32()))
    file_store.put(info.path, parquet_bytes(rewarded))
    with pytest.raises(ChecksumError, match=r"trajectory batch b1 of run r .* does not match the sha256 in its commit"):
        archive.describe_batch(info.path, "r")


class RetriedCreateStore(ObjectStore):
    """A gs:// create whose response was lost: the client retries it and reports ``FileExistsError`` for the
    object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        digest = super().put_create(key, data)
        if key.endswith(".parquet"):
            raise FileExistsError(f"{self.url(key)} already exists")
        return digest


def test_a_retried_create_of_the_writers_own_file_is_not_a_failure(tmp_path) -> None:
    archive = TrajectoryArchive(RetriedCreateStore(tmp_path.as_uri()))
    info = archive.write_batch("r", two_rows(), created=DAY)
    assert archive.read_batch(info.path, info.sha256).num_rows == 2
    steps = steps_to_table([dict(episode_id="ep", step=0, is_first=True, is_last=True, is_terminal=True,
                                 observation=[0.0], action=[0.5], reward=1.0, discount=1.0)])
    digest = archive.write_steps("datasets/d/part-0000.parquet", steps)
    assert archive.read_steps("datasets/d/part-0000.parquet", digest).equals(steps)


def two_batches(store: ObjectStore) -> tuple[TrajectoryArchive, str, str]:
    """Batches b1 and b2 of run r, and their keys."""
    archive = TrajectoryArchive(store)
    first = archive.write_batch("r", two_rows(), created=DAY).path
    second = archive.write_batch("r", two_rows(batch_id="b2"), created=DAY).path
    return archive, first, second


def test_commits_are_refused_for_a_batch_without_its_commit_record(memory_store: ObjectStore) -> None:
    """Without its record a batch's digest cannot be checked, so it is refused, not trained unchecked."""
    archive, _, second = two_batches(memory_store)
    memory_store.delete(commit_record_key(second))
    with pytest.raises(ArchiveError) as refused:
        archive.commits("r")
    line = str(refused.value)
    assert "\n" not in line and "b2" in line and "no commit record" in line and "rlpipe runs delete --run r" in line


def test_a_corrupt_commit_record_is_refused_naming_its_file(memory_store: ObjectStore) -> None:
    archive, first, _ = two_batches(memory_store)
    record = commit_record_key(first)
    memory_store.put(record, memory_store.get(record).replace(b'"sha256":"', b'"sha256":"zz'))
    corrupt = rf"commit record {re.escape(memory_store.url(record))} is corrupt \(sha256: "
    with pytest.raises(ArchiveError, match=corrupt):
        archive.commits("r")
    memory_store.put(record, b"{not json")
    with pytest.raises(ArchiveError, match=r"b1\.commit\.json is corrupt"):
        archive.commits("r")


def test_a_commit_record_naming_another_batch_is_refused(memory_store: ObjectStore) -> None:
    """b2's record replaced by b1's: b2 would never be offered and b1 twice."""
    archive, first, second = two_batches(memory_store)
    memory_store.put(commit_record_key(second), memory_store.get(commit_record_key(first)))
    named = rf"{re.escape(commit_record_key(second))} names batch {re.escape(first)}, not"
    with pytest.raises(ArchiveError, match=named):
        archive.commits("r")


def test_check_digests_refuses_a_rewritten_batch_naming_it_and_the_fix(memory_store: ObjectStore) -> None:
    archive, _, second = two_batches(memory_store)
    commits = archive.commits("r")
    archive.check_digests("r", commits)  # intact
    memory_store.put(second, memory_store.get(second) + b"tampered")
    with pytest.raises(ChecksumError) as refused:
        archive.check_digests("r", commits)
    line = str(refused.value)
    assert "\n" not in line and "batch b2 " in line and "commit record" in line and "rlpipe runs delete --run r" in line


def test_batch_must_match_its_run_and_id(memory_store: ObjectStore) -> None:
    archive = TrajectoryArchive(memory_store)
    with pytest.raises(ArchiveError, match="run_id"):
        archive.write_batch("other-run", two_rows(), created=DAY)
    with pytest.raises(ArchiveError, match="batch_id"):
        archive.write_batch("r", [row(), row(batch_id="b2")], created=DAY)
    with pytest.raises(ArchiveError, match="at least one row"):
        archive.write_batch("r", [], created=DAY)


def test_committed_event_from_batch_info(memory_store: ObjectStore) -> None:
    info = TrajectoryArchive(memory_store).write_batch("r", two_rows(), created=DAY)
    event = batch_committed_payload(info)
    assert isinstance(event, TrajectoryBatchCommitted)
    assert (event.env, event.producer_id, event.path, event.sha256) == ("cartpole", "p", info.path, info.sha256)
    assert (event.num_tokens, event.num_generated_tokens, event.reward_mean) == (5, 4, 0.25)


def test_mixed_env_batch_needs_an_explicit_env(memory_store: ObjectStore) -> None:
    info = TrajectoryArchive(memory_store).write_batch("r", [row(), row(episode_id="x", env="sokoban")], created=DAY)
    with pytest.raises(ArchiveError, match="2 distinct env"):
        batch_committed_payload(info)
    assert batch_committed_payload(info, env="mixed").env == "mixed"


def _fill(archive: TrajectoryArchive) -> None:
    """run a: cartpole v1 on May 1, sokoban v2 on May 2; run b: cartpole v3 on May 3 (two rows per batch)."""
    for run, env, version, day in [("a", "cartpole", 1, 1), ("a", "sokoban", 2, 2), ("b", "cartpole", 3, 3)]:
        batch = new_batch_id(env)
        rows = two_rows(run_id=run, batch_id=batch, env=env)
        for r in rows:
            r["policy_version"] = version
        archive.write_batch(run, rows, created=datetime(2024, 5, day, 12, tzinfo=UTC))


@pytest.fixture(params=["file_store", "gcs_store"])
def filled_archive(request: pytest.FixtureRequest) -> TrajectoryArchive:
    archive = TrajectoryArchive(request.getfixturevalue(request.param))
    _fill(archive)
    return archive


def _versions(frame: pl.LazyFrame) -> list[int]:
    return sorted(frame.collect()["policy_version"].to_list())


def test_scan_filters(filled_archive: TrajectoryArchive) -> None:
    archive = filled_archive
    assert _versions(archive.scan()) == [1, 1, 2, 2, 3, 3]
    assert _versions(archive.scan(run_id="a")) == [1, 1, 2, 2]
    assert _versions(archive.scan(env="cartpole")) == [1, 1, 3, 3]
    assert _versions(archive.scan(date_from="2024-05-02")) == [2, 2, 3, 3]
    assert _versions(archive.scan(date_to=date(2024, 5, 1))) == [1, 1]
    assert _versions(archive.scan(policy_version_min=2, policy_version_max=2)) == [2, 2]
    assert _versions(archive.scan(run_id="a", env="cartpole", date_from="2024-05-01", date_to="2024-05-01")) == [1, 1]
    assert _versions(archive.scan(run_id="nobody")) == []
    frame = archive.scan(run_id="b").collect()
    assert frame["date"].to_list() == [date(2024, 5, 3)] * 2
    assert frame["run_id"].to_list() == ["b", "b"]
    assert len(archive.list_batches("a")) == 2


def test_scan_skips_date_folders_outside_the_range(filled_archive: TrajectoryArchive) -> None:
    # A file that is not Parquet in May 9: only a scan whose range includes that day may open it.
    filled_archive.store.put_create("runs/a/trajectories/date=2024-05-09/broken.parquet", b"not parquet")
    assert _versions(filled_archive.scan(run_id="a", date_to="2024-05-08")) == [1, 1, 2, 2]
    with pytest.raises(Exception):  # noqa: B017 - any Arrow/polars read error proves the file was opened
        filled_archive.scan(run_id="a").collect()


def test_empty_archive_scans_to_an_empty_frame(memory_store: ObjectStore) -> None:
    frame = TrajectoryArchive(memory_store).scan().collect()
    assert frame.height == 0
    assert {"tokens", "policy_version", "date"} <= set(frame.columns)


def test_steps_tables_round_trip(any_store: ObjectStore) -> None:
    archive = TrajectoryArchive(any_store)
    steps = [
        dict(
            episode_id="ep",
            step=i,
            is_first=i == 0,
            is_last=i == 2,
            is_terminal=i == 2,
            observation=[float(i)],
            action=[0.5],
            reward=1.0,
            discount=1.0,
            features={"ahu@temp": 20.0 + i},
        )
        for i in range(3)
    ]
    table = steps_to_table(steps, feature_names=["ahu@temp"])
    digest = archive.write_steps("datasets/bldg/part-0000.parquet", table)
    assert archive.read_steps("datasets/bldg/part-0000.parquet", digest).equals(table)
    frame = archive.scan_steps("datasets/bldg").collect()
    assert frame["ahu@temp"].to_list() == [20.0, 21.0, 22.0]
