"""Producer acceptance tests against the real parts: the Tansu broker, fake-gcs-server and vLLM on the CPU.

1. Sokoban against a ``gs://`` store: every row validates, its ``tokens`` decode to the chat transcript
   rebuilt here from the environment (same seed, the decoded answers), ``loss_mask`` marks exactly the
   tokens the sampler returned, and each ``TrajectoryBatchCommitted`` read back from the real topic names
   a file whose sha256 is recomputed here.
2. Adapter v2 published (registry, then ``AdapterPublished``) while the producer runs: within a bound,
   every newly admitted group carries v2 and v2's digest; rows admitted before carry v1.
3. ``rlpipe producer start`` killed with SIGKILL mid-batch: no partial file, no event without a file;
   the next start announces any orphan and writes valid batches with fresh ids.

Tests 1-2 wire in-process what ``run_producer`` wires (watcher over the registry and the adapters topic,
sink over a real ``EventPublisher``), so that the session's single vLLM engine is reused.  Test 3 runs
the real command in a subprocess with the transformers backend (a second vLLM engine would not fit).
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.archive_layout import COMMIT_RECORD_SUFFIX, trajectories_prefix
from pipeline.io.bus import EventPublisher, UnknownTopicError, tail
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import Announcer
from producers.adapters import AdapterWatcher, KafkaAdapterEvents
from producers.envs.registry import make_env
from producers.episode import ChatFormat
from producers.rollout import RolloutWorker
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from producers.sink import StoreThenEventSink
from schemas.config import BusConfig, ProducerConfig, SamplerConfig
from schemas.events import TrajectoryBatchCommitted
from schemas.trajectory import SCHEMA_VERSION_KEY, TrajectoryRecord, table_to_records
from schemas.versions import TRAJECTORY_SCHEMA_VERSION

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
RUN_ID = "e2e"
SOKOBAN = {"max_turns": 2}
# The shared engine was started with max_model_len 1024; the worker must plan with the same context.
SAMPLING = SamplerConfig(max_new_tokens=24, max_model_len=1024, seed=0)
TEMP_PREFIX = ".rlpipe-tmp-"  # pipeline.io.store's temporary files: never listed, never read


# ---- a recording sampler over the session's engine -----------------------------------------------


@dataclasses.dataclass
class Call:
    """One ``generate`` call as the worker made it (the adapter as the watcher handed it over)."""

    requests: list[SampleRequest]
    adapter: AdapterHandle | None
    outputs: list[SampleOutput]


class RecordingSampler(Sampler):
    """Delegates to the shared vLLM engine and records every call.

    Every watcher numbers its adapters from lora id 1, as a fresh process would; several tests share one
    engine here, so each handle is served under an id no other test used (the engine refuses reusing an
    id for other weights, correctly).
    """

    _engine_ids = itertools.count(1000)

    def __init__(self, inner: Sampler) -> None:
        self.inner = inner
        self.eos_token_id, self.max_model_len = inner.eos_token_id, inner.max_model_len
        self.calls: list[Call] = []
        self.engine_handles: dict[AdapterHandle, AdapterHandle] = {}

    def _engine_handle(self, handle: AdapterHandle) -> AdapterHandle:
        if handle not in self.engine_handles:
            lora_id = next(self._engine_ids)
            self.engine_handles[handle] = dataclasses.replace(handle, lora_int_id=lora_id, name=f"e2e-{lora_id}")
        return self.engine_handles[handle]

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):  # type: ignore[no-untyped-def]
        served = self._engine_handle(adapter) if adapter is not None else None
        outputs = self.inner.generate(requests, served, temperature=temperature, top_p=top_p, seed=seed)
        self.calls.append(Call(list(requests), adapter, outputs))
        return outputs

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.inner.load_adapter(self._engine_handle(handle))

    def unload_adapter(self, handle: AdapterHandle) -> None:
        served = self.engine_handles.pop(handle, None)
        if served is not None:
            self.inner.unload_adapter(served)

    def close(self) -> None:
        """Free this test's adapters; the engine itself belongs to the session."""
        for handle in list(self.engine_handles):
            self.unload_adapter(handle)


# ---- the producer, wired in-process as run_producer wires it -------------------------------------


@dataclasses.dataclass
class InProcessProducer:
    worker: RolloutWorker
    watcher: AdapterWatcher
    sampler: RecordingSampler
    sink: StoreThenEventSink
    events: KafkaAdapterEvents
    announce: Announcer


@contextmanager
def in_process_producer(
    store: ObjectStore, bus: BusConfig, engine: Sampler, tokenizer: Any, cache_dir: Path, producer: ProducerConfig,
    registry_poll_s: float = 2.0,
) -> Iterator[InProcessProducer]:
    """Store, publisher, registry, adapter watcher (registry + adapters topic), sink, worker: run_producer's set-up."""
    archive = TrajectoryArchive(store)
    publisher = EventPublisher(bus)
    announce = Announcer(publisher, RUN_ID)
    events = KafkaAdapterEvents.open(bus, RUN_ID)  # as run_producer: before the watcher's first registry read
    sampler = RecordingSampler(engine)
    watcher = AdapterWatcher(AdapterRegistry(store, RUN_ID), sampler, cache_dir, max_loaded=2,
                             events=events, registry_poll_s=registry_poll_s)
    sink = StoreThenEventSink(archive, RUN_ID, "sokoban", producer.producer_id or "p", announce)
    worker = RolloutWorker(
        run_id=RUN_ID, producer_id=producer.producer_id or "p", env_name="sokoban",
        make_env=lambda: make_env("sokoban", SOKOBAN), tokenizer=tokenizer, sampler=sampler, adapters=watcher,
        sink=sink, producer=producer, sampling=SAMPLING,
    )
    try:
        yield InProcessProducer(worker, watcher, sampler, sink, events, announce)
    finally:
        sampler.close()
        events.close()
        publisher.close()


# ---- reading back what the producer wrote ----------------------------------------------------------


def batch_events(bus: BusConfig) -> list[TrajectoryBatchCommitted]:
    """Every ``TrajectoryBatchCommitted`` of the run on the real topic (oldest first)."""
    try:
        records = list(tail(bus, "trajectories", n=10**9, run_id=RUN_ID))
    except UnknownTopicError:
        return []
    assert all(r.event is not None for r in records), [r.error for r in records]
    return [r.event.payload for r in records if isinstance(r.event.payload, TrajectoryBatchCommitted)]


def verified_rows(store: ObjectStore, event: TrajectoryBatchCommitted) -> list[TrajectoryRecord]:
    """The event's file: sha256 recomputed here, schema version in the file, rows validated, counts as announced."""
    data = store.get(event.path)
    assert hashlib.sha256(data).hexdigest() == event.sha256
    table = pq.read_table(pa.BufferReader(data))
    assert table.schema.metadata[SCHEMA_VERSION_KEY].decode() == TRAJECTORY_SCHEMA_VERSION
    rows = table_to_records(table)
    assert len(rows) == event.num_rows
    assert {r.batch_id for r in rows} == {event.batch_id} and {r.run_id for r in rows} == {RUN_ID}
    assert sum(len(r.tokens) for r in rows) == event.num_tokens
    assert sum(sum(r.loss_mask) for r in rows) == event.num_generated_tokens
    assert len({r.group_id for r in rows}) == event.num_groups
    versions = [r.policy_version for r in rows]
    assert (min(versions), max(versions)) == (event.policy_version_min, event.policy_version_max)
    return rows


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of every run of 1s."""
    runs, start = [], None
    for i, bit in enumerate([*mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((start, i))
            start = None
    return runs


def check_generated_tokens(row: TrajectoryRecord, calls: list[Call]) -> list[AdapterHandle | None]:
    """Each run of loss_mask 1 is exactly one sampler output for exactly the tokens before it (its prompt),
    with the sampler's logprobs; everything else is masked 0 with logprob 0.  Returns the adapters used."""
    sent: dict[tuple[int, ...], list[tuple[SampleOutput, AdapterHandle | None]]] = {}
    for call in calls:
        for request, output in zip(call.requests, call.outputs, strict=True):
            sent.setdefault(tuple(request.prompt_token_ids), []).append((output, call.adapter))
    runs = mask_runs(row.loss_mask)
    assert len(runs) == row.num_turns >= 1
    adapters = []
    for start, end in runs:
        candidates = [(o, a) for o, a in sent.get(tuple(row.tokens[:start]), []) if o.token_ids == row.tokens[start:end]]
        assert candidates, f"turn at {start}: no sampler output for this prompt matches the row's generated tokens"
        output, adapter = candidates[0]
        assert row.logprobs[start:end] == pytest.approx(output.logprobs, rel=1e-6, abs=1e-6)  # stored as float32
        adapters.append(adapter)
    assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if not m)
    return adapters


def expected_transcript(row: TrajectoryRecord, tokenizer: Any) -> str:
    """The chat transcript rebuilt from the environment: same seed, the row's decoded answers, the template.

    The environment saw each answer decoded without special tokens; the transcript shows the answer's
    tokens as generated (less the closing eos, which the template adds itself).
    """
    eos = tokenizer.eos_token_id
    env = make_env("sokoban", SOKOBAN)
    messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.reset(row.env_seed)}]
    rewards, result = [], None
    for start, end in mask_runs(row.loss_mask):
        generated = row.tokens[start:end]
        content = generated[:-1] if generated[-1] == eos else generated
        messages.append({"role": "assistant", "content": tokenizer.decode(content, skip_special_tokens=False)})
        result = env.step(tokenizer.decode(generated, skip_special_tokens=True))
        rewards.append(result.reward)
        if not (result.terminated or result.truncated):
            messages.append({"role": "user", "content": result.observation})
    assert result is not None and (result.terminated or result.truncated), "the episode must have ended"
    assert row.turn_rewards == pytest.approx(rewards) and row.reward == pytest.approx(sum(rewards))
    assert (row.terminated, row.truncated) == (result.terminated, result.truncated)
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    closing = ChatFormat.from_tokenizer(tokenizer).after_assistant  # "<|im_end|>\n" after the last answer
    assert rendered.endswith(closing)
    ended_on_eos = row.tokens[-1] == eos
    return rendered.removesuffix(closing) + (tokenizer.eos_token if ended_on_eos else "")


def file_digest(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tokenizer(tiny_trained_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_trained_dir)


# ---- 1. token-exact rows on gs://, announced on the real topic -------------------------------------


@pytest.mark.vllm
def test_sokoban_batches_on_gcs_are_token_exact_and_announced(
    gcs_store, bus_config, vllm_sampler, tokenizer, lora_adapters, tmp_path
) -> None:
    registry = AdapterRegistry(gcs_store, RUN_ID)
    registry.publish(lora_adapters[0].path, base_model="tiny", parent_version=0, learner_step=0)
    # 3 groups, 2 per batch: the last batch holds the one group left, written as soon as it is done
    producer = ProducerConfig(producer_id="e2e-p1", group_size=2, groups_per_batch=2, concurrent_groups=2,
                              max_groups=3, batch_timeout_s=3600)
    with in_process_producer(gcs_store, bus_config, vllm_sampler, tokenizer, tmp_path / "cache", producer) as p:
        p.worker.run()
        calls = p.sampler.calls

    events = batch_events(bus_config)
    stored = TrajectoryArchive(gcs_store).list_batches(RUN_ID)
    assert len(events) == 2 and sorted(e.path for e in events) == sorted(stored)
    assert sorted(e.num_groups for e in events) == [1, 2]
    assert all(e.producer_id == "e2e-p1" and e.env == "sokoban" for e in events)
    rows = [row for event in events for row in verified_rows(gcs_store, event)]

    # groups: 3 seeds x 2 episodes, one group id per seed, every episode its own id
    assert sorted(r.env_seed for r in rows) == [0, 0, 1, 1, 2, 2]
    assert len({r.episode_id for r in rows}) == 6
    assert all(len({r.env_seed for r in rows if r.group_id == g}) == 1 for g in {r.group_id for r in rows})
    # every row was sampled with v1 as pulled from gs:// and says so with v1's digest
    assert {(r.policy_version, r.adapter_sha256) for r in rows} == {(1, registry.adapter_sha256(1))}
    source_weights = file_digest(Path(lora_adapters[0].path) / "adapter_model.safetensors")
    for row in rows:
        used = check_generated_tokens(row, calls)
        assert all(a is not None and a.version == 1 and a.sha256 == row.adapter_sha256 for a in used)
        assert all(file_digest(Path(a.path) / "adapter_model.safetensors") == source_weights for a in used)
        assert tokenizer.decode(row.tokens, skip_special_tokens=False) == expected_transcript(row, tokenizer)
        assert row.text == tokenizer.decode(row.tokens, skip_special_tokens=False)


# ---- 2. adapter hot-swap while running ---------------------------------------------------------------

SWITCH_BOUND_S = 20.0  # a group admitted this long after AdapterPublished must be on the new version


@pytest.mark.vllm
def test_published_adapter_reaches_new_rows_within_bound(
    gcs_store, bus_config, vllm_sampler, tokenizer, lora_adapters, tmp_path
) -> None:
    registry = AdapterRegistry(gcs_store, RUN_ID)
    registry.publish(lora_adapters[0].path, base_model="tiny", parent_version=0, learner_step=0)
    producer = ProducerConfig(producer_id="e2e-p2", group_size=2, groups_per_batch=1, concurrent_groups=2,
                              batch_timeout_s=300)
    # The registry is polled once (finding v1), then never again: v2 can only arrive through the adapters topic.
    with in_process_producer(gcs_store, bus_config, vllm_sampler, tokenizer, tmp_path / "cache", producer,
                             registry_poll_s=3600) as p:
        started = time.monotonic()
        admissions: list[tuple[float, int]] = []  # (time, next seed) after every pass of the loop
        publish: dict[str, float] = {}

        def on_tick() -> None:
            now = time.monotonic()
            admissions.append((now, p.worker.next_seed))
            if not publish and p.worker.stats.batches >= 2:
                manifest = registry.publish(lora_adapters[1].path, base_model="tiny", parent_version=1, learner_step=1)
                p.announce(registry.published_event(manifest))
                publish.update(at=now, seed=p.worker.next_seed)

        def should_stop() -> bool:
            if not publish:
                return time.monotonic() - started > 90
            v2_batches = [b for b in p.sink.committed if b.policy_version_min == 2]
            return len(v2_batches) >= 2 or time.monotonic() - publish["at"] > 90

        p.worker.run(should_stop=should_stop, on_tick=on_tick)
        calls, load_failures = p.sampler.calls, p.watcher.load_failures

    assert publish, "no batch was written"
    assert load_failures == 0
    sha1, sha2 = registry.adapter_sha256(1), registry.adapter_sha256(2)
    rows = [row for event in batch_events(bus_config) for row in verified_rows(gcs_store, event)]
    assert {(r.policy_version, r.adapter_sha256) for r in rows} <= {(1, sha1), (2, sha2)}
    before = [r for r in rows if r.env_seed < publish["seed"]]
    assert before and all((r.policy_version, r.adapter_sha256) == (1, sha1) for r in before)
    v2_seeds = sorted({r.env_seed for r in rows if r.policy_version == 2})
    assert v2_seeds, "no row carries v2"
    # the switch is for good: every group admitted after the first v2 group is on v2 too
    assert all(r.policy_version == 2 for r in rows if r.env_seed >= v2_seeds[0])
    admitted_at = next(t for t, next_seed in admissions if next_seed > v2_seeds[0])
    assert admitted_at - publish["at"] <= SWITCH_BOUND_S
    # what was sampled with v2 really used v2's weights, pulled through the registry
    weights = {v: file_digest(Path(lora_adapters[v - 1].path) / "adapter_model.safetensors") for v in (1, 2)}
    for row in rows:
        for adapter in check_generated_tokens(row, calls):
            assert adapter is not None and adapter.version == row.policy_version
            assert file_digest(Path(adapter.path) / "adapter_model.safetensors") == weights[adapter.version]


# ---- 3. SIGKILL mid-batch, then a clean restart --------------------------------------------------------


def producer_command(config_path: Path, *extra: str) -> list[str]:
    return [sys.executable, "-c", "from pipeline.cli.main import main; main()", "producer", "start",
            "--config", str(config_path), *extra]


def producer_env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    return env | {"RLPIPE_HOME": str(home), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def stored_files(store_dir: Path) -> tuple[list[Path], list[Path]]:
    """(complete objects, temporary files) on disk under the run's trajectories folder."""
    files = sorted(p for p in (store_dir / trajectories_prefix(RUN_ID)).rglob("*") if p.is_file())
    return [p for p in files if not p.name.startswith(TEMP_PREFIX)], [p for p in files if p.name.startswith(TEMP_PREFIX)]


def wait_for_first_event(proc: subprocess.Popen, bus: BusConfig, log: Path, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while not batch_events(bus):
        if proc.poll() is not None:
            pytest.fail(f"the producer exited early with {proc.returncode}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"no batch event within {timeout_s:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.1)


def test_sigkill_mid_batch_leaves_no_partial_state_and_restart_recovers(
    tiny_model_dir, bus_config, tmp_path
) -> None:
    store_dir = tmp_path / "store"
    store = ObjectStore(store_dir.as_uri())
    archive = TrajectoryArchive(store)
    config = {
        "run_id": RUN_ID,
        "env": {"name": "sokoban", "overrides": SOKOBAN},
        "model": {"base_model": tiny_model_dir},
        "bus": {"bootstrap_servers": bus_config.bootstrap_servers, "namespace": bus_config.namespace,
                "connect_timeout_s": 5.0},
        "store": {"root": store.root},
        "sampler": {"backend": "transformers", "max_new_tokens": 8, "max_model_len": 512},
        # batch_timeout_s 1: the restart announces orphans older than 2 s
        "producer": {"group_size": 2, "groups_per_batch": 2, "concurrent_groups": 2, "batch_timeout_s": 1.0,
                     "heartbeat_interval_s": 1.0, "env_workers": 2},
    }
    config_path = tmp_path / "producer.yaml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    env = producer_env(tmp_path / "home")

    # first run: killed right after its first batch is announced, while it samples the next groups
    first_log = tmp_path / "first.log"
    with open(first_log, "wb") as log:
        proc = subprocess.Popen(producer_command(config_path), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for_first_event(proc, bus_config, first_log)
            os.kill(proc.pid, signal.SIGKILL)
        finally:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    # nothing partial: every object on disk is a complete, valid batch; a temporary file is never listed
    complete, temporary = stored_files(store_dir)
    listed = archive.list_batches(RUN_ID)
    batches = [p for p in complete if p.name.endswith(".parquet")]
    assert sorted(store.key_of(str(p)) for p in batches) == listed and all(k.endswith(".parquet") for k in listed)
    assert all(p.name.endswith(COMMIT_RECORD_SUFFIX) for p in complete if p not in batches)  # written before each
    assert not any(TEMP_PREFIX in key for key in store.list(trajectories_prefix(RUN_ID), recursive=True))
    first_rows = {key: table_to_records(archive.read_batch(key)) for key in listed}
    assert all(len(rows) % 2 == 0 and rows for rows in first_rows.values())  # whole groups of 2 only
    # no event without its file (the sha256 recomputed from the bytes)
    events_before = batch_events(bus_config)
    assert events_before
    for event in events_before:
        assert event.path in listed
        verified_rows(store, event)
    first_producer = {e.producer_id for e in events_before}
    assert len(first_producer) == 1
    # A kill between the store write and the event leaves a file no event names.  SIGKILL rarely lands in
    # that gap, so one such orphan is made here as the killed process would have left it (10 s old).
    orphan_id = f"{first_producer.pop()}-b-orphan-{uuid.uuid4().hex[:8]}"
    first_producer = {e.producer_id for e in events_before}
    template = first_rows[listed[0]]
    orphan = archive.write_batch(RUN_ID, [r.model_copy(update={"batch_id": orphan_id, "episode_id": uuid.uuid4().hex})
                                          for r in template])
    os.utime(store_dir / orphan.path, (time.time() - 10, time.time() - 10))
    listed = archive.list_batches(RUN_ID)
    orphans = set(listed) - {e.path for e in events_before}
    assert orphan.path in orphans

    # second run: a few groups, then a clean exit
    second_log = tmp_path / "second.log"
    with open(second_log, "wb") as log:
        done = subprocess.run(producer_command(config_path, "--max-groups", "2"), cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT, timeout=180)
    assert done.returncode == 0, second_log.read_text()[-3000:]
    _, temporary_after = stored_files(store_dir)
    assert len(temporary_after) <= len(temporary)  # the clean run leaves none of its own

    events_after = batch_events(bus_config)
    listed_after = archive.list_batches(RUN_ID)
    assert set(listed_after) == {e.path for e in events_after}  # every stored batch is announced now
    rows_by_event = {e.batch_id: verified_rows(store, e) for e in events_after}
    announced_orphans = [e for e in events_after[len(events_before):] if e.path in orphans]
    assert {e.path for e in announced_orphans} == orphans
    assert all(e.producer_id in first_producer for e in announced_orphans)
    new_events = [e for e in events_after if e.producer_id not in first_producer]
    assert new_events and {e.path for e in new_events} == set(listed_after) - set(listed)
    new_rows = [row for e in new_events for row in rows_by_event[e.batch_id]]
    old_rows = [row for rows in first_rows.values() for row in rows]
    assert len(new_rows) == 2 * 2  # --max-groups 2, group_size 2, one row per sokoban episode
    assert {r.producer_id for r in new_rows} == {new_events[0].producer_id}
    # fresh identities: a restart never reuses a batch, episode or group id
    for field in ("batch_id", "episode_id", "group_id"):
        assert not {getattr(r, field) for r in new_rows} & {getattr(r, field) for r in old_rows}
