"""Packed sampling: each run's view of the shared engine names the run in every adapter handle; runs join and
leave a serving process."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.adapters import AdapterWatcher
from producers.packed import RunSampler, check_packable, release_run, serve
from producers.samplers.base import AdapterHandle, SampleRequest
from producers.service import RunProducer
from schemas.config import RunConfig


class Recorder:
    """Stands in for the shared engine (``SyncSampler``): records the handles it is given."""

    eos_token_id, max_model_len = 2, 64

    def __init__(self) -> None:
        self.handles: list[tuple[str, AdapterHandle | None]] = []
        self.owners: list[str | None] = []  # each generate call's

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None, owner=None):
        self.handles.append(("generate", adapter))
        self.owners.append(owner)
        return []

    def load_adapter(self, handle):
        self.handles.append(("load", handle))

    def unload_adapter(self, handle):
        self.handles.append(("unload", handle))


def test_equal_versions_of_two_runs_reach_the_engine_as_two_adapters():
    shared = Recorder()
    a, b = RunSampler(shared, "run-a"), RunSampler(shared, "run.b")
    handle = AdapterHandle.for_version(3, "/cache/v3", "0" * 64)
    a.load_adapter(handle)
    b.load_adapter(handle)
    a.generate([SampleRequest([1, 2], 4)], handle, seed=1)
    b.generate([SampleRequest([1, 2], 4)], None)
    b.unload_adapter(handle)
    (_, loaded_a), (_, loaded_b), (_, sampled_a), (_, sampled_b), (_, unloaded_b) = shared.handles
    assert (loaded_a.run, loaded_a.version, loaded_a.name) == ("run-a", 3, "run-a-v3")
    assert (loaded_b.run, loaded_b.name) == ("run.b", "run_db-v3")  # a name peft and vLLM take as an adapter name
    assert sampled_a == loaded_a and sampled_b is None and unloaded_b == loaded_b
    assert (a.eos_token_id, a.max_model_len) == (2, 64)
    assert shared.owners == ["run-a", "run.b"]  # each run's calls are its own in the engine's turns


class Closes:
    """A run's publisher or event reader: only closed here."""

    def close(self) -> None:
        pass


def test_a_run_that_leaves_takes_its_versions_out_of_the_shared_engine(memory_store: ObjectStore, tmp_path,
                                                                        tiny_trained_dir, lora_adapters):
    """The engine serves on for the other runs, so a run let go (stopped, failed, deleted) unloads its versions:
    they are not held for the life of the process, and a run created again under its id loads its own version 1
    (the engine refused it while it still held the old run's other weights under that run and version)."""
    from producers.samplers.hf_engine import TransformersEngine
    from producers.samplers.sync import SyncSampler

    shared = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir)))

    def join(weights: AdapterHandle) -> RunProducer:
        registry = AdapterRegistry(memory_store, "exp")
        registry.publish(weights.path, base_model="tiny", parent_version=0, learner_step=1)
        watcher = AdapterWatcher(registry, RunSampler(shared, "exp"), tmp_path / "cache", max_loaded=2,
                                 registry_poll_s=0.0)
        watcher.refresh()
        return RunProducer(worker=None, watcher=watcher, heartbeat=None, publisher=Closes(),  # type: ignore[arg-type]
                           events=Closes(), backlog=None)

    try:
        first = join(lora_adapters[0])
        held = shared.engine.sampler._handles  # type: ignore[attr-defined]
        assert [h.run for h in held.values()] == ["exp"]
        release_run(first)
        assert held == {}, "the run that left still holds its versions in the shared engine"
        memory_store.delete("runs/exp", recursive=True)  # the run deleted, then created again with other weights
        again = join(lora_adapters[1])
        assert [h.sha256 for h in held.values()] == [again.watcher.current().sha256]  # type: ignore[union-attr]
        sample = shared.generate([SampleRequest([1, 2, 3], 4)], RunSampler(shared, "exp").tagged(
            again.watcher.current()), seed=0)[0]
        assert len(sample.token_ids) == len(sample.logprobs) >= 1
    finally:
        shared.close()


def test_a_packed_run_s_call_is_not_held_behind_another_run_s_burst_on_the_base_model(tiny_trained_dir, monkeypatch):
    """Two packed runs sample the base model with the same settings, so their calls share one group of the
    transformers engine: run a's 48 one-sample calls wait (three batches of 16), then run b's one call.  Each run's
    sampler names its run as the calls' owner, and owners take turns in a group, so b's call is decoded in the first
    batch, not alone after all of a's."""
    from producers.samplers.hf_engine import TransformersEngine
    from producers.samplers.sync import SyncSampler

    shared = SyncSampler(lambda: TransformersEngine(str(tiny_trained_dir)))
    batches: list[list[int]] = []
    hf = shared.engine.sampler  # type: ignore[attr-defined]
    original = hf.continue_prompts

    def recording(calls, adapter, *args, **kwargs):  # type: ignore[no-untyped-def]
        batches.append([call.prompt[0] for call in calls])  # each call's first prompt token names its run
        return original(calls, adapter, *args, **kwargs)

    monkeypatch.setattr(hf, "continue_prompts", recording)
    a, b = RunSampler(shared, "run-a"), RunSampler(shared, "run-b")
    burst, one = SampleRequest([5, 6, 7], 2), SampleRequest([9, 6, 7], 2)

    async def submitted():  # type: ignore[no-untyped-def]
        # from the engine's loop, so every call is waiting before the engine takes its first batch
        return [*(a.submit(burst, temperature=0.9, seed=i) for i in range(48)), b.submit(one, temperature=0.9, seed=99)]

    try:
        futures = shared.call(submitted())
        outputs = [future.result(timeout=300) for future in futures]
    finally:
        shared.close()
    assert all(len(output.token_ids) == len(output.logprobs) >= 1 for output in outputs)
    assert max(len(batch) for batch in batches) <= 16 and sum(len(batch) for batch in batches) == 49, batches
    assert 9 in batches[0], [batch.count(9) for batch in batches]  # b's call taken in the first batch, not last


def test_runs_whose_ids_differ_only_in_a_dot_or_an_underscore_get_adapter_names_of_their_own():
    """The engines key adapters by (run, version), but a name is all the plain transformers sampler (which keys
    adapters by it) and the logs and errors see: two runs' equal versions must never share one."""
    shared = Recorder()
    handle = AdapterHandle.for_version(3, "/cache/v3", "0" * 64)
    names = {RunSampler(shared, run).tagged(handle).name for run in ("exp.1", "exp_1", "exp__1", "exp._1", "exp_.1")}
    assert len(names) == 5 and not any("." in name for name in names), names


def test_runs_that_cannot_share_an_engine_are_refused_in_one_line():
    first = RunConfig(run_id="a")
    with pytest.raises(ValueError, match="name a run twice"):
        check_packable([first, first])
    other = RunConfig(run_id="b", sampler={"backend": "transformers"})
    with pytest.raises(ValueError, match=r"differ in sampler\.backend"):
        check_packable([first, other])


def test_a_run_whose_lora_rank_the_shared_engine_cannot_load_is_refused_naming_both_settings():
    """The engine takes the first run's sampler settings: a second run training at a higher rank than its
    max_lora_rank would have every adapter refused once sampling started."""
    first = RunConfig(run_id="a")  # sampler.max_lora_rank 8
    wide = RunConfig(run_id="b", learner={"lora_rank": 12}, sampler={"max_lora_rank": 16})
    with pytest.raises(ValueError, match=r"run b .*learner\.lora_rank 12.*run a's\) sampler\.max_lora_rank 8") as refused:
        check_packable([first, wide])
    assert "sampler.max_lora_rank=16" in str(refused.value) and "\n" not in str(refused.value)
    check_packable([wide, first])  # an engine of slot 16 holds both


class LoopingRun:
    """A run's rollout loop that counts its passes until its stop says so."""

    def __init__(self, run_id: str) -> None:
        self.worker = SimpleNamespace(run_id=run_id)
        self.passes = 0
        self.stopped = threading.Event()

    def run(self, stop) -> None:
        while not stop():
            self.passes += 1
            time.sleep(0.01)
        self.stopped.set()


def test_runs_join_and_leave_while_the_others_sample_on():
    """serve() with follow: b joins, then a leaves (its loop stopped, then released) while b goes on; only the
    process's stop ends b."""
    a, b = LoopingRun("a"), LoopingRun("b")
    released: list[str] = []
    calls: list[set[str]] = []
    stop_now = threading.Event()

    def follow(serving: set[str]):
        calls.append(set(serving))
        if len(calls) == 2:
            return [b], []
        if len(calls) == 4:
            return [], ["a"]
        if len(calls) == 8:
            assert not b.stopped.is_set()  # a's leaving did not stop b
            stop_now.set()
        return [], []

    serve([a], stop_now.is_set, follow, lambda run: released.append(run.worker.run_id), poll_s=0.01)
    assert calls[0] == {"a"} and calls[2] == {"a", "b"} and calls[4] == {"b"}
    assert released == ["a"] and a.stopped.is_set() and b.stopped.is_set() and a.passes > 0 and b.passes > 0


def test_without_following_serving_ends_once_every_run_has_left():
    """A packed producer not following new runs returns when its last run has left, with no stop of its own."""
    a, b = LoopingRun("a"), LoopingRun("b")
    calls: list[set[str]] = []

    def follow(serving: set[str]):
        calls.append(set(serving))
        return [], (["a"] if len(calls) == 2 else ["b"] if len(calls) == 4 else [])

    serve([a, b], lambda: len(calls) > 500, follow, poll_s=0.01)  # the stop only ends a serve() that went on
    assert len(calls) == 4, "serve() went on with no run left"
    assert calls[2] == {"b"} and a.stopped.is_set() and b.stopped.is_set()


class FailingRun(LoopingRun):
    """A run whose rollout loop raises after a few passes (its environment's bug, its store failing)."""

    def run(self, stop) -> None:
        for _ in range(3):
            self.passes += 1
            time.sleep(0.01)
        raise OSError("the bucket is unreachable")


def test_a_run_whose_loop_raises_is_released_and_reported_while_the_others_sample_on():
    a, b = LoopingRun("a"), FailingRun("b")
    released: list[str] = []
    failures: list[tuple[str, str]] = []
    stop_now = threading.Event()

    def on_failure(run, error: Exception) -> None:
        failures.append((run.worker.run_id, str(error)))
        threading.Timer(0.1, stop_now.set).start()  # a samples on for a while after b failed

    serve([a, b], stop_now.is_set, None, lambda run: released.append(run.worker.run_id), poll_s=0.01,
          on_failure=on_failure)
    assert failures == [("b", "the bucket is unreachable")] and released == ["b"]
    assert a.stopped.is_set() and a.passes > 10  # stopped by the process's stop, not by b's error
    with pytest.raises(OSError, match="unreachable"):  # without on_failure the first error stops every run
        serve([LoopingRun("c"), FailingRun("d")], lambda: False, None, poll_s=0.01)


class FailsAsItLeaves(LoopingRun):
    """Its loop ends on the leave, and the flush of its finished groups then raises."""

    def run(self, stop) -> None:
        super().run(stop)
        raise OSError("flushing its finished groups failed")


def test_a_run_failing_as_it_leaves_is_released_once_and_the_others_sample_on():
    a, b = FailsAsItLeaves("a"), LoopingRun("b")
    released, failures, calls = [], [], []
    stop_now = threading.Event()

    def follow(serving):
        calls.append(set(serving))
        if len(calls) == 2:
            return [], ["a"]  # a RunStopped for a
        if len(calls) == 20:
            stop_now.set()
        return [], []

    serve([a, b], stop_now.is_set, follow, lambda run: released.append(run.worker.run_id), poll_s=0.01,
          until_stopped=True, on_failure=lambda run, exc: failures.append(run.worker.run_id))
    assert released == ["a"] and failures == []  # it was stopped: it does not come back
    assert len(calls) == 20 and b.stopped.is_set()


def test_an_error_in_follow_stops_every_runs_thread_before_it_is_raised():
    b = LoopingRun("b")
    calls = []

    def follow(serving):
        calls.append(1)
        if len(calls) == 3:
            raise ConnectionError("the control topic's broker is unreachable")
        return [], []

    with pytest.raises(ConnectionError):
        serve([b], lambda: False, follow, poll_s=0.01, until_stopped=True, on_failure=lambda run, exc: None)
    assert b.stopped.is_set()  # not left sampling while the process closes its engine under it


def test_a_run_stopped_or_started_again_as_its_pause_ends_is_served_as_the_log_says(tmp_path):
    from pipeline.io.store import ObjectStore
    from pipeline.membership import Comebacks, RunMembership
    from producers.packed import following
    from schemas.events import RunStopped
    from tests.pipeline.test_membership import Feed, config, started

    store = ObjectStore(tmp_path.as_uri())
    now = [0.0]
    for last_word in ("stopped", "started"):
        feed = Feed()
        membership = RunMembership("exp-*", config("base", store={"root": store.root}), store, check_packable,
                                   follower=feed)
        comebacks = Comebacks(clock=lambda: now[0])
        follow = following(membership, lambda cfg: cfg.run_id, comebacks)
        cfg = config(f"exp-{last_word}", store={"root": store.root})
        event = started(store, cfg)
        comebacks.failed(cfg, OSError("boom"))
        assert follow(set()) == ([], [])  # waiting
        now[0] += 31.0  # its pause is over, and meanwhile ...
        feed.put(cfg.run_id, RunStopped(reason="the user stopped it") if last_word == "stopped" else event)
        joined, left = follow(set())
        assert (joined, left) == (([], []) if last_word == "stopped" else ([cfg.run_id], [])), last_word


def test_a_producer_whose_named_runs_are_all_stopped_keeps_engine_room_for_each_once(tmp_path, monkeypatch):
    """`rlpipe producer start --run a --run b --follow-runs 'exp-*'` after both were stopped: the engine is set up
    from a's settings and keeps adapter room for a and b (each joins when resumed) and three runs to come, not
    a's room twice."""
    import producers.packed as packed
    from pipeline.io.store import ObjectStore
    from pipeline.membership import membership_key
    from pipeline.runtime import StopFlag
    from schemas.events import RunStopped, encode_event, make_event
    from tests.pipeline.test_membership import Feed, config, started

    store = ObjectStore(tmp_path.as_uri())
    named = [config(run, store={"root": store.root}) for run in ("a", "b")]
    for cfg in named:
        started(store, cfg)
        store.put(membership_key(cfg.run_id), encode_event(make_event(cfg.run_id, RunStopped(reason="stopped"))))
    room: list[list[str]] = []

    class EngineAsked(Exception):
        pass

    def shared_engine(configs, model_path, seed, reserve_runs=0):
        room.append([cfg.run_id for cfg in configs])
        raise EngineAsked  # the runs it was asked to hold are all this test needs

    monkeypatch.setattr(packed, "control_start", lambda configs, template: {})  # no broker: a Feed stands in
    monkeypatch.setattr(packed, "RunMembership", lambda *args, **kwargs: Feed())
    monkeypatch.setattr(packed, "resolve_model", lambda model: "tiny")
    monkeypatch.setattr(packed, "shared_engine", shared_engine)
    with pytest.raises(EngineAsked):
        packed.run_packed_producer(named, StopFlag(), follow_runs="exp-*", template=named[0])
    assert room == [["a", "b"]]


def test_a_run_opened_again_in_one_producer_draws_new_sampling_streams(tmp_path, monkeypatch):
    """A run that comes back after an error, or is stopped and resumed, is opened again under the same producer
    id; like a restarted single-run producer it gets a new sampling incarnation, so it never replays the streams
    (with the same adapter and environment seeds, the very samples) its earlier opening drew."""
    import producers.packed as packed
    from pipeline.runtime import StopFlag
    from tests.pipeline.test_membership import Feed, config

    store = ObjectStore(tmp_path.as_uri())
    cfg = config("a", store={"root": store.root})
    opened: list[tuple[str, int | None]] = []  # (producer id, incarnation) of each opening

    def open_run_producer(config, connection, producer_id, sampler, tokenizer, incarnation, health, labels=None):
        opened.append((producer_id, incarnation))
        worker = SimpleNamespace(run_id=config.run_id, stats=SimpleNamespace(batches=0, samples=0))
        return SimpleNamespace(worker=worker, close=lambda: None, watcher=Closes())

    def following(membership, open_run, comebacks=None):
        return lambda serving: ([open_run(cfg)], [])  # a's comeback (or its resume), opened again

    def serve(runs, stop, follow, release, **kwargs):
        follow({"a"})

    engine = SimpleNamespace(eos_token_id=2, max_model_len=64, close=lambda: None)
    connection = SimpleNamespace(archive=SimpleNamespace(store=store))
    monkeypatch.setattr(packed, "connect_run", lambda cfg, done=None: connection)
    monkeypatch.setattr(packed, "check_run_lora_rank", lambda cfg, store: None)
    monkeypatch.setattr(packed, "control_start", lambda configs, template: {})  # no broker: a Feed stands in
    monkeypatch.setattr(packed, "RunMembership", lambda *args, **kwargs: Feed())
    monkeypatch.setattr(packed, "resolve_model", lambda model: "tiny")
    monkeypatch.setattr(packed, "shared_engine", lambda *args, **kwargs: engine)
    monkeypatch.setattr(packed, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda path: None))
    monkeypatch.setattr(packed, "open_run_producer", open_run_producer)
    monkeypatch.setattr(packed, "following", following)
    monkeypatch.setattr(packed, "serve", serve)
    packed.run_packed_producer([cfg], StopFlag(), follow_runs="a")
    (first_id, first), (again_id, again) = opened
    assert first_id == again_id  # the same producer id, so the same environment seeds from the start
    assert first != again, "the run opened again replays the sampling streams of its first opening"


def test_a_run_whose_environment_this_producer_cannot_build_is_refused_as_it_joins(tmp_path, caplog):
    """A RunStarted for a run whose stored environment is unknown here (or takes no such override) is refused
    for that run alone, in one line naming the fix, rather than taken up to fail at its first episode and come
    back every pause; a sound run announced beside it joins."""
    from pipeline.membership import RunMembership
    from tests.pipeline.test_membership import Feed, config, joined_and_warnings, started

    store = ObjectStore(tmp_path.as_uri())
    feed = Feed()
    membership = RunMembership("exp-*", config("base", store={"root": store.root}), store, check_packable,
                               follower=feed)
    feed.put("exp-1", started(store, config("exp-1", env={"name": "no-such-env"})))
    feed.put("exp-2", started(store, config("exp-2", env={"name": "cartpole", "overrides": {"max_turnz": 3}})))
    feed.put("exp-3", started(store, config("exp-3", env={"name": "cartpole", "overrides": {"max_turns": 3}})))
    joined, warnings = joined_and_warnings(membership, caplog)
    assert joined == ["exp-3"]
    assert "run exp-1 cannot join" in warnings and "'no-such-env' is no environment; choose one of" in warnings
    assert "run exp-2 cannot join" in warnings and "max_turnz" in warnings
    assert all("\n" not in record.getMessage() for record in caplog.records)


def test_a_run_on_another_tiny_build_than_the_engines_is_refused_as_it_joins(tmp_path, caplog):
    """Runs naming model.base_model 'tiny' differ in which tiny model when their model.tiny_dir folders hold two
    builds: the engine samples on the first run's, so a run on another build is refused for that run alone, in one
    line naming both and the fix (a producer per base model).  The same build in another folder, as a run created
    on another machine records it, joins."""
    from pipeline.membership import RunMembership
    from producers.tiny_model import MARKER_FILE
    from tests.pipeline.test_membership import Feed, config, joined_and_warnings, started

    engine_dir = tmp_path / "models" / "engine-tiny"
    engine_dir.mkdir(parents=True)
    (engine_dir / MARKER_FILE).write_text('{"spec_hash": "0123456789abcdef"}')
    elsewhere = "/home/someone/.rlpipe/models/tiny-0123456789abcdef"  # the same build, on the machine that made it
    other = "/home/someone/.rlpipe/models/tiny-fedcba9876543210"  # a build of other parameters
    store = ObjectStore(tmp_path.as_uri())
    engine = config("base", model={"tiny_dir": str(engine_dir)}, store={"root": store.root})
    with pytest.raises(ValueError, match="fedcba9876543210") as refused:
        check_packable([engine, config("b", model={"tiny_dir": other})])
    assert "producer per base model" in str(refused.value) and "\n" not in str(refused.value)
    check_packable([engine, config("c", model={"tiny_dir": elsewhere})])

    feed = Feed()
    membership = RunMembership("exp-*", engine, store, check_packable, follower=feed)
    feed.put("exp-1", started(store, config("exp-1", model={"tiny_dir": other})))
    feed.put("exp-2", started(store, config("exp-2", model={"tiny_dir": elsewhere})))
    joined, warnings = joined_and_warnings(membership, caplog)
    assert joined == ["exp-2"]
    assert "run exp-1 cannot join" in warnings and "fedcba9876543210" in warnings and "0123456789abcdef" in warnings
    assert all("\n" not in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("skew_s", [-3600.0, 3600.0], ids=["clock-behind", "clock-ahead"])
def test_a_packed_process_reads_the_starts_and_stops_sent_after_its_start_whatever_its_clock(
        tmp_path, bus_config, monkeypatch, skew_s: float) -> None:
    """The process's clock an hour off the one that stamped the control topic's events: a stop and a resume from
    before its start (a's, whose record says it is served) are not acted on again, while b's stop and c's
    resume, sent after its start while it connects its runs (the records of b and c were read by then), are."""
    import producers.packed as packed
    from pipeline.io.bus import EventPublisher
    from pipeline.membership import announce_membership
    from pipeline.runtime import StopFlag
    from schemas.events import RunStopped
    from tests.pipeline.test_membership import config, started

    store = ObjectStore(tmp_path.as_uri())
    named = [config(run, bus=bus_config.model_dump(), store={"root": store.root}) for run in ("a", "b", "c")]
    start_of = {cfg.run_id: started(store, cfg) for cfg in named}
    with EventPublisher(bus_config) as publisher:  # an earlier session: a stopped and resumed, c stopped
        announce_membership(store, publisher, "a", RunStopped(reason="an earlier session's stop"))
        announce_membership(store, publisher, "a", start_of["a"])
        announce_membership(store, publisher, "c", RunStopped(reason="stopped until resumed"))
    announced: list[str] = []

    def connect_run(cfg, done=None):  # while the process connects its runs, b is stopped and c resumed
        if not announced:
            with EventPublisher(bus_config) as publisher:
                announce_membership(store, publisher, "b", RunStopped(reason="stopped while the process set up"))
                announce_membership(store, publisher, "c", start_of["c"])
            announced.append(cfg.run_id)
        return SimpleNamespace(archive=SimpleNamespace(store=store))

    def open_run_producer(config, connection, producer_id, sampler, tokenizer, incarnation, health, labels=None):
        worker = SimpleNamespace(run_id=config.run_id, stats=SimpleNamespace(batches=0, samples=0))
        return SimpleNamespace(worker=worker, close=lambda: None, watcher=Closes())

    seen: list[tuple[str, str]] = []  # (joined or left, run) as the process's membership says them

    def serve(runs, stop, follow, release, **kwargs):
        assert sorted(run.worker.run_id for run in runs) == ["a", "b"]  # c stopped at the start
        deadline, settled_at = time.monotonic() + 10.0, None
        while time.monotonic() < deadline and (settled_at is None or time.monotonic() < settled_at):
            joined, left = follow({"a", "b"})
            seen.extend([("joined", run.worker.run_id) for run in joined] + [("left", run) for run in left])
            if settled_at is None and {("left", "b"), ("joined", "c")} <= set(seen):
                settled_at = time.monotonic() + 1.0  # a stale event of a would come with these or before them
            time.sleep(0.1)

    skewed = SimpleNamespace(time=lambda: time.time() + skew_s, monotonic=time.monotonic, sleep=time.sleep)
    monkeypatch.setattr(packed, "time", skewed)
    monkeypatch.setattr(packed, "connect_run", connect_run)
    monkeypatch.setattr(packed, "check_run_lora_rank", lambda cfg, store: None)
    monkeypatch.setattr(packed, "resolve_model", lambda model: "tiny")
    monkeypatch.setattr(packed, "shared_engine", lambda *args, **kwargs: SimpleNamespace(
        eos_token_id=2, max_model_len=64, close=lambda: None))
    monkeypatch.setattr(packed, "AutoTokenizer", SimpleNamespace(from_pretrained=lambda path: None))
    monkeypatch.setattr(packed, "open_run_producer", open_run_producer)
    monkeypatch.setattr(packed, "serve", serve)
    packed.run_packed_producer(named, StopFlag())
    assert sorted(seen) == [("joined", "c"), ("left", "b")], seen
