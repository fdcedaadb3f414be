"""The sampler role of the Tinker-compatible API: sample calls from the log, end to end with a gateway, a trainer
and a transformers sampler on the real broker (sessions, new versions, retired snapshots, retries, rounds)."""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_sample_response
from transformers import AutoTokenizer

from consumers.api import saves
from consumers.api.worker import TrainerWorker
from consumers.engine import TrainingEngine
from pipeline.analysis.report.server import server_duty_cycle
from pipeline.api import lifecycle
from pipeline.api.activity import ActivityRecorder, read_activity
from pipeline.api.engines import engine_group
from pipeline.api.gateway import Gateway, NotFoundError, ServedModel
from pipeline.api.liveness import ClientPresence
from pipeline.api.samplers import point_inflight
from pipeline.io.bus import EventPublisher, ensure_topics
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.topics import API_TOPIC_KINDS
from producers.api_sampler import SamplerWorker
from producers.samplers.hf_engine import TransformersEngine
from schemas.api import ApiError, ApiRequestAccepted, result_path
from tests.producers.api_sampling import TENANT, sample_request


class Harness:
    """A gateway publishing for real, a trainer and a sampler (transformers) reading the same namespace."""

    def __init__(self, store: ObjectStore, bus, base_model: str, fast_group) -> None:
        self.store, self.bus, self.base_model = store, bus, base_model
        ensure_topics(bus, API_TOPIC_KINDS)
        self.publisher = EventPublisher(bus)
        self.gateway = Gateway(store, lambda event, key: self.publisher.publish("requests", event, key),
                               [ServedModel(base_model, base_model)])
        self.session = self.gateway.create_session(TENANT, [], {})
        self.engine = TransformersEngine(base_model)
        tokenizer = AutoTokenizer.from_pretrained(base_model)
        self.sampler = SamplerWorker(store, bus, base_model, self.engine, tokenizer.decode,
                                     consumer_options=fast_group)
        self.fast_group = fast_group

    def sample(self, sampler_id: str, seq: int, request: types.SampleRequest, tenant: str = TENANT) -> str:
        body = request.model_copy(update={"sampling_session_id": sampler_id, "seq_id": seq}).model_dump_json()
        return self.gateway.submit_sample(tenant, sampler_id, seq, body.encode(), request.num_samples,
                                          request.prompt.length)[0]

    def run(self, request_ids: list[str], timeout_s: float = 60.0) -> list:
        """Step the sampler until every call has its result."""
        async def loop() -> None:
            deadline = time.monotonic() + timeout_s
            while not all(self.gateway.result(TENANT, rid) for rid in request_ids):
                assert time.monotonic() < deadline, "no sample results"
                await self.sampler.step(poll_timeout_s=0.1)

        asyncio.run(loop())
        return [self.gateway.result(TENANT, rid) for rid in request_ids]

    def trainer_with_a_model(self) -> tuple[TrainerWorker, str]:
        """A trainer (a process of its own in a deployment) and a LoRA model created through the gateway."""
        trainer = TrainerWorker(self.store, self.bus, self.base_model, TrainingEngine(self.base_model, device="cpu"),
                                consumer_options=self.fast_group)
        model_id = self.gateway.register_model(TENANT, self.session, 0, self.base_model, 4, {}, None)
        create = types.CreateModelRequest(session_id=self.session, model_seq_id=0, base_model=self.base_model,
                                          lora_config=types.LoraConfig(rank=4, seed=3))
        self.gateway.submit(TENANT, "create_model", model_id, None, create.model_dump_json().encode())
        return trainer, model_id

    def train(self, trainer: TrainerWorker, request_ids: list[str], timeout_s: float = 60.0) -> list:
        """Step the trainer (a process of its own in a deployment) until every call has its result."""
        deadline = time.monotonic() + timeout_s
        while not all(self.gateway.result(TENANT, rid) for rid in request_ids):
            assert time.monotonic() < deadline, "no training results"
            trainer.step(poll_timeout_s=0.1)
        return [self.gateway.result(TENANT, rid) for rid in request_ids]


@pytest.fixture(scope="module")
def store_root(tmp_path_factory):
    return f"file://{tmp_path_factory.mktemp('api-sampler')}/store"


@pytest.fixture
def harness(store_root, bus_config, tiny_model_dir, fast_group) -> Harness:
    namespace = bus_config.model_copy(update={"namespace": f"t{uuid.uuid4().hex[:12]}"})
    made = Harness(ObjectStore(store_root), namespace, tiny_model_dir, fast_group)
    yield made
    made.sampler.close()
    made.publisher.close()


def test_base_model_samples_with_prompt_logprobs_stop_ids_and_tenant_checks(harness):
    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    seeded = sample_request([], seed=11, num_samples=3, prompt_logprobs=True)
    vocabulary = len(AutoTokenizer.from_pretrained(harness.base_model))
    stop_any = sample_request(list(range(vocabulary)), seed=11, num_samples=1)  # every token id stops at once
    first, again, stopped = (harness.sample(sampler_id, 0, seeded), harness.sample(sampler_id, 1, seeded),
                             harness.sample(sampler_id, 2, stop_any))
    results = harness.run([first, again, stopped])
    assert harness.sampler.consumer.group_id == engine_group("sampler", harness.bus.namespace, harness.base_model)
    assert all(fmt == "pb" for _, fmt in results)
    one, two, three = (deserialize_sample_response(data) for data, _ in results)
    assert [s.tokens for s in one.sequences] == [s.tokens for s in two.sequences]  # a seed fixes the draw
    assert all(len(s.tokens) == 4 and len(s.logprobs) == 4 and s.stop_reason == "length" for s in one.sequences)
    assert one.prompt_logprobs[0] is None and all(math.isfinite(v) for v in one.prompt_logprobs[1:])
    assert len(one.prompt_logprobs) == 3
    last_one = sample_request([], seed=11, num_samples=1, prompt_logprobs=True, prompt_logprobs_last_n=1)
    data, _ = harness.run([harness.sample(sampler_id, 3, last_one)])[0]
    assert deserialize_sample_response(data).prompt_logprobs == [None, None, one.prompt_logprobs[2]]
    assert len(three.sequences[0].tokens) == 1 and three.sequences[0].stop_reason == "stop"
    with pytest.raises(ApiError, match="sampling session"):
        harness.sample(sampler_id, 4, seeded, tenant="t-bob")


def test_unnamed_save_for_sampler_gives_a_sampling_session_on_the_new_version(harness):
    trainer, model_id = harness.trainer_with_a_model()
    try:
        save = types.SaveWeightsForSamplerRequest(model_id=model_id, sampling_session_seq_id=5, seq_id=1)
        saved = harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 1, save.model_dump_json().encode())
        data, _ = harness.train(trainer, [saved])[0]
        sampler_id = json.loads(data)["sampling_session_id"]
        assert sampler_id == f"{harness.session}:sample:5"
        record = harness.gateway.sampler(TENANT, sampler_id)
        assert (record["run"], record["version"]) == (f"{harness.session}.train.0", 1)
        sampled = harness.sample(sampler_id, 0, sample_request(None, seed=2))
        result = deserialize_sample_response(harness.run([sampled])[0][0])
        trainer.step(poll_timeout_s=0.5)
        assert len(result.sequences) == 2 and all(np.isfinite(s.logprobs).all() for s in result.sequences)
        assert list(trainer.models) == [model_id]  # the trainer left the sample call to the sampler
        # executed again (a trainer that died before writing the result): the same session, no new version
        call = ApiRequestAccepted(request_id=saved, tenant=TENANT, session_id=harness.session,
                                  op="save_weights_for_sampler", model_id=model_id, seq_id=1,
                                  base_model=harness.base_model, body_path="unused", body_sha256="0" * 64)
        again = saves.save_for_sampler(harness.store, trainer.engine, harness.base_model, model_id, 2, call, save)
        assert json.loads(again)["sampling_session_id"] == sampler_id
        assert AdapterRegistry(harness.store, f"{harness.session}.train.0").versions() == [1]
    finally:
        trainer.close()


def test_a_call_accepted_before_its_snapshot_was_retired_fails_as_the_users_with_the_reason(harness):
    trainer, model_id = harness.trainer_with_a_model()
    try:
        save = types.SaveWeightsForSamplerRequest(model_id=model_id, sampling_session_seq_id=1, seq_id=1)
        saved = harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 1, save.model_dump_json().encode())
        sampler_id = json.loads(harness.train(trainer, [saved])[0][0])["sampling_session_id"]
        sampled = harness.sample(sampler_id, 0, sample_request(None, seed=2))  # accepted; then the session's end frees it
        registry = AdapterRegistry(harness.store, f"{harness.session}.train.0")
        assert registry.show(1).ends_with_session == harness.session  # a snapshot: retired with its session
        registry.retire(1, "the session that made it ended")
        data, fmt = harness.run([sampled])[0]
        answer = json.loads(data)
        assert fmt == "json" and answer["category"] == "user"
        assert "version 1 was deleted: the session that made it ended" in answer["error"]
    finally:
        trainer.close()


def test_a_call_whose_sessions_files_were_deleted_before_it_ran_is_dropped_and_the_next_runs(harness, caplog):
    """A sampler behind by more than an ended session's files are kept reads a call whose body is gone: it writes
    no result into the deleted folder, and another session's call after it is sampled."""
    gone = harness.session
    sampler_id = harness.gateway.create_sampling_session(TENANT, gone, 0, harness.base_model, None)
    late = harness.sample(sampler_id, 0, sample_request(None, seed=2))
    harness.gateway.finish(TENANT, gone, "success")
    assert lifecycle.free_session_files(harness.store, gone, now=time.time() + 3600) == 1
    harness.session = harness.gateway.create_session(TENANT, [], {})
    other = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    assert harness.run([harness.sample(other, 0, sample_request(None, seed=2))])[0][1] == "pb"
    assert f"sample {late} dropped" in caplog.text
    assert harness.store.list(f"sessions/{gone}/results") == []
    with pytest.raises(NotFoundError, match="deleted"):
        harness.gateway.result(TENANT, late)


def test_inflight_sampling_clients_follow_the_latest_inflight_save_and_snapshots_stay(harness):
    """kind="inflight": every inflight client of a training model samples the weights of its latest inflight save
    (or newer than its own), while a snapshot client keeps the weights it was made on."""
    trainer, model_id = harness.trainer_with_a_model()
    try:
        def save(seq: int, kind: str) -> str:
            body = types.SaveWeightsForSamplerRequest(model_id=model_id, sampling_session_seq_id=seq, seq_id=seq,
                                                      kind=kind)
            saved = harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, seq,
                                           body.model_dump_json().encode())
            return json.loads(harness.train(trainer, [saved])[0][0])["sampling_session_id"]

        def train(seq: int) -> None:
            datum = types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
                                loss_fn_inputs={"target_tokens": [6, 7, 8, 9]})
            fb = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "cross_entropy"), model_id,
                                              seq_id=seq)
            step = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=5e-2), model_id=model_id,
                                          seq_id=seq + 1)
            harness.train(trainer, [
                harness.gateway.submit(TENANT, "forward_backward", model_id, seq,
                                       forward_backward_request_to_proto(fb).SerializeToString(), "pb"),
                harness.gateway.submit(TENANT, "optim_step", model_id, seq + 1, step.model_dump_json().encode())])

        scored = sample_request(None, seed=3, num_samples=1, prompt_logprobs=True)
        seqs: dict[str, int] = {}

        def logprobs(sampler_id: str) -> list[float]:
            seqs[sampler_id] = seqs.get(sampler_id, -1) + 1
            data, fmt = harness.run([harness.sample(sampler_id, seqs[sampler_id], scored)])[0]
            assert fmt == "pb", data
            return deserialize_sample_response(data).prompt_logprobs[1:]

        harness.sampler.inflight_check_s = 0.0  # (the sampler looks at the pointer at every call)
        first, snapshot = save(1, "inflight"), save(2, "snapshot")
        before = logprobs(first)
        assert logprobs(snapshot) == before
        train(3)
        later_snapshot = save(5, "snapshot")
        after = logprobs(later_snapshot)
        assert not np.allclose(after, before, atol=1e-4)  # the training moved the weights
        assert logprobs(first) == before  # a snapshot save moves no inflight client
        second = save(6, "inflight")
        assert logprobs(second) == after
        assert logprobs(first) == after  # the first inflight client follows the latest inflight save
        assert logprobs(snapshot) == before  # a snapshot does not
        # a pointer behind a session's own save (an older save replayed) never takes it back
        run = f"{harness.session}.train.0"
        harness.store.put(f"runs/{run}/inflight.json", json.dumps({"version": 1}).encode())
        assert logprobs(second) == after and logprobs(first) == before
        point_inflight(harness.store, run, 4)  # the pointer only moves forward
        assert json.loads(harness.store.get(f"runs/{run}/inflight.json"))["version"] == 4
        point_inflight(harness.store, run, 2)
        assert json.loads(harness.store.get(f"runs/{run}/inflight.json"))["version"] == 4
        registry = AdapterRegistry(harness.store, f"{harness.session}.train.0")
        assert all(registry.show(v).ends_with_session == harness.session for v in registry.versions())
    finally:
        trainer.close()


def test_the_least_recently_sampled_version_is_unloaded_beyond_max_adapters_and_reloaded_on_demand(harness):
    # A researcher's loop saves a version per step: the sampler holds at most max_adapters of them.
    harness.sampler.max_adapters = 2
    trainer, model_id = harness.trainer_with_a_model()
    try:
        samplers = []
        for seq in (1, 2, 3):
            save = types.SaveWeightsForSamplerRequest(model_id=model_id, sampling_session_seq_id=4 + seq, seq_id=seq)
            saved = harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, seq,
                                           save.model_dump_json().encode())
            samplers.append(json.loads(harness.train(trainer, [saved])[0][0])["sampling_session_id"])
        run = f"{harness.session}.train.0"
        seeded = sample_request([], seed=5)

        def sample(sampler_id: str, seq: int) -> list[list[int]]:
            data, fmt = harness.run([harness.sample(sampler_id, seq, seeded)])[0]
            assert fmt == "pb", data
            return [s.tokens for s in deserialize_sample_response(data).sequences]

        first = sample(samplers[0], 0)
        sample(samplers[1], 0)
        assert harness.sampler.adapters_held() == [(run, 1), (run, 2)]
        held_folders = {p.name for p in Path(harness.sampler.cache_dir).iterdir()}
        version_1_folder = str(harness.sampler._adapters[(run, 1)].lora_int_id)
        sample(samplers[2], 0)
        assert harness.sampler.adapters_held() == [(run, 2), (run, 3)]  # version 1 went, least recently sampled
        folders = {p.name for p in Path(harness.sampler.cache_dir).iterdir()}
        assert len(folders) == 2 and version_1_folder in held_folders and version_1_folder not in folders
        assert sample(samplers[0], 1) == first  # pulled and loaded again: the same weights, the same draw
        assert harness.sampler.adapters_held() == [(run, 3), (run, 1)]
        harness.sampler.close()  # the pulled versions of a folder it made itself go with it
        assert not Path(harness.sampler.cache_dir).exists()
        harness.sampler.close()  # and a second close (the fixture's) is harmless
    finally:
        trainer.close()


def test_a_call_handed_over_directly_runs_once_though_the_log_brings_it_too(harness):
    """The direct path answers once the result is stored; the log's copy, in flight or later, samples nothing more."""
    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    body = sample_request([], seed=5, num_samples=1).model_copy(update={"sampling_session_id": sampler_id, "seq_id": 0})
    call = harness.gateway.prepare_sample(TENANT, sampler_id, 0, body.model_dump_json().encode(),
                                           body.prompt.length)  # not on the log
    sampled = []
    engine_sample = harness.engine.sample

    async def counting(*args, **kwargs):
        sampled.append(args[0])
        return await engine_sample(*args, **kwargs)

    harness.engine.sample = counting

    async def scenario() -> None:
        first = harness.sampler.start(call)
        assert harness.sampler.start(call) is first  # the same request id while it runs: the same task
        await harness.sampler.run_direct(call)
        assert harness.gateway.result(TENANT, call.request_id)[1] == "pb"  # stored before the answer
        harness.gateway.publish_call(call)  # the log's copy arrives after the direct path ran it
        deadline = time.monotonic() + 30
        while not await harness.sampler.step(poll_timeout_s=0.2):
            assert time.monotonic() < deadline, "the log's copy never arrived"
        await asyncio.gather(*harness.sampler.running)

    asyncio.run(scenario())
    assert len(sampled) == 1

    other = harness.gateway.prepare_sample(TENANT, sampler_id, 1, body.model_dump_json().encode(),
                                           body.prompt.length)
    forged = other.model_copy(update={"tenant": "t-bob"})  # another tenant naming this (cached) session

    async def refused() -> None:
        await harness.sampler.run_direct(forged)
        with pytest.raises(ValueError, match="sample calls"):
            await harness.sampler.run_direct(forged.model_copy(update={"op": "forward_backward"}))

    asyncio.run(refused())
    data, fmt = harness.gateway.result(TENANT, other.request_id)
    assert fmt == "json" and "no sampling session" in json.loads(data)["error"] and len(sampled) == 1


def test_a_call_that_failed_is_not_sampled_again_when_the_log_brings_it(harness):
    """A client told of a failure never later finds a success under the same request id."""
    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    body = sample_request([], seed=5, num_samples=1).model_copy(update={"sampling_session_id": sampler_id, "seq_id": 0})
    call = harness.gateway.prepare_sample(TENANT, sampler_id, 0, body.model_dump_json().encode(),
                                           body.prompt.length)
    tries = []
    engine_sample = harness.engine.sample

    async def fails_once(*args, **kwargs):
        tries.append(args[0])
        if len(tries) == 1:
            raise RuntimeError("the engine went away for a moment")
        return await engine_sample(*args, **kwargs)

    harness.engine.sample = fails_once

    async def scenario() -> None:
        await harness.sampler.run_direct(call)
        assert harness.gateway.result(TENANT, call.request_id)[1] == "json"  # the client is told it failed
        harness.gateway.publish_call(call)  # the log's copy (or a restarted sampler re-reading the log)
        deadline = time.monotonic() + 30
        while not await harness.sampler.step(poll_timeout_s=0.2):
            assert time.monotonic() < deadline, "the log's copy never arrived"
        await asyncio.gather(*harness.sampler.running)

    asyncio.run(scenario())
    assert len(tries) == 1 and not harness.store.exists(result_path(harness.session, call.request_id, "pb"))
    data, fmt = harness.gateway.result(TENANT, call.request_id)
    assert fmt == "json" and json.loads(data)["category"] == "server"


def test_a_call_of_many_samples_runs_in_rounds_that_let_another_call_in(harness, monkeypatch):
    """One tenant's call of 40 samples holds at most CALL_ROUND_SAMPLES sequences of the engine at a time, so a
    small call that arrives with it starts before the big one's last round; seeded, it draws the same samples.
    Every round is the tenant's (the engine's owner), so the engine takes turns between tenants."""
    from producers import api_sampler

    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    calls: list[tuple[int, int]] = []  # (num_samples, first_stream) of every engine call, in order
    owners: set[str | None] = set()
    sample = harness.engine.sample

    async def recorded(prompt, adapter, params, owner=None):
        calls.append((params.num_samples, params.first_stream))
        owners.add(owner)
        return await sample(prompt, adapter, params, owner=owner)

    monkeypatch.setattr(harness.engine, "sample", recorded)
    big, small = sample_request([], seed=5, num_samples=40, prompt_logprobs=True), sample_request([], seed=6, num_samples=1)
    results = harness.run([harness.sample(sampler_id, 0, big), harness.sample(sampler_id, 1, small)])
    rounds = [(n, first) for n, first in calls if n > 1 or first > 0]
    assert max(n for n, _ in calls) <= api_sampler.CALL_ROUND_SAMPLES < 40
    assert sum(n for n, _ in rounds) == 40 and [first for _, first in rounds] == sorted(first for _, first in rounds)
    assert calls.index((1, 0)) < len(calls) - 1  # the small call did not wait for the whole big one
    assert owners == {TENANT}
    whole = deserialize_sample_response(results[0][0])
    assert len(whole.sequences) == 40 and len(whole.prompt_logprobs) == 3
    again = harness.run([harness.sample(sampler_id, 2, big)])[0]
    assert [s.tokens for s in deserialize_sample_response(again[0]).sequences] == [s.tokens for s in whole.sequences]


def test_a_calls_answer_is_encoded_off_the_event_loop_every_call_shares(harness, monkeypatch):
    """Encoding a call's top-k rows is array work over up to MAX_TOPK_SAMPLE_CELLS entries: on the loop, every other
    call on the sampler would stand still meanwhile."""
    import threading

    from producers import api_sampler

    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    encoded_on: list[int] = []
    encode = api_sampler.encode_sample_response

    def recorded(*args, **kwargs):
        encoded_on.append(threading.get_ident())
        return encode(*args, **kwargs)

    monkeypatch.setattr(api_sampler, "encode_sample_response", recorded)
    request = sample_request([], seed=3, num_samples=2, topk_prompt_logprobs=2, topk_sample_logprobs=3)
    data, _ = harness.run([harness.sample(sampler_id, 0, request)])[0]
    decoded = deserialize_sample_response(data)
    assert all(len(row) == 3 for s in decoded.sequences for row in s.topk_logprobs)
    assert len(encoded_on) == 1 and encoded_on[0] != threading.get_ident()  # asyncio.run's loop runs on this thread


def _recorded_activity(harness) -> ObjectStore:
    """Give the harness's sampler an activity recorder of its own store (closed with the sampler); that store."""
    activity_store = ObjectStore(f"memory://sampler-activity-{uuid.uuid4().hex}")
    harness.sampler.activity = ActivityRecorder(activity_store, "sampler", "test", flush_every_s=3600.0)
    return activity_store


def test_a_call_whose_session_ends_between_rounds_stops_and_fails_as_the_users(harness, monkeypatch):
    """A client gone (its session finished) leaves nobody to read its samples: the sampler looks at the session
    before every round, so a call of 40 samples (rounds of 16, 16 and 8) whose session ends during its first round
    draws no second round and fails as the user's, naming the end; the samples drawn are not returned.  The round
    it drew kept the engine busy: the call is in the sampler's activity, from that round's start to the stop, with
    the tokens the round drew, and the server report gives the session that busy time."""
    sampler_id = harness.gateway.create_sampling_session(TENANT, harness.session, 0, harness.base_model, None)
    harness.sampler.presence.check_s = 0.0  # every round reads the session's records
    activity_store = _recorded_activity(harness)
    rounds: list[int] = []
    drawn_tokens: list[int] = []
    spans: list[tuple[float, float]] = []  # wall-clock span of each engine call
    sample = harness.engine.sample

    async def ends_the_session(prompt, adapter, params, owner=None):
        rounds.append(params.first_stream)
        began = time.time()
        result = await sample(prompt, adapter, params, owner=owner)
        spans.append((began, time.time()))
        drawn_tokens.append(sum(len(s.token_ids) for s in result.sequences))
        harness.gateway.finish(TENANT, harness.session, "success")  # the client closed while the round ran
        return result

    monkeypatch.setattr(harness.engine, "sample", ends_the_session)
    asked = time.time()
    data, fmt = harness.run([harness.sample(sampler_id, 0, sample_request([], seed=5, num_samples=40))])[0]
    answered = time.time()
    answer = json.loads(data)
    assert rounds == [0]  # 3 rounds without the check
    assert fmt == "json" and answer["category"] == "user"
    assert f"session {harness.session} ended (finished: success)" in answer["error"]
    assert "16 of 40 samples" in answer["error"]

    harness.sampler.activity.flush()
    (stopped,) = read_activity(activity_store)
    assert (stopped.session, stopped.tenant, stopped.op, stopped.kind) == (harness.session, TENANT, "sample", "sampler")
    assert stopped.tokens == drawn_tokens[0] > 0  # drawn by the engine, though not returned
    (round_start, round_end), = spans
    assert asked <= stopped.start <= round_start and round_end <= stopped.end <= answered
    (lane,) = server_duty_cycle([stopped])["lanes"]
    assert lane["calls_by_run"] == {harness.session: 1} and lane["tokens_by_run"] == {harness.session: drawn_tokens[0]}
    assert lane["busy_fraction_by_run"] == {harness.session: 1.0}  # the window is the call's own span


def test_queued_calls_of_an_ended_or_lapsed_session_are_not_sampled(harness, monkeypatch):
    """Calls nobody answered yet (a restarted sampler reads them from the log) fail as the user's without a round
    when their session ended, when its heartbeat record is, by the wall clocks, older than the timeout plus
    CLOCK_ALLOWANCE_S on this sampler's first sight (it lapsed before the restart), or when this sampler has watched
    the record stay unchanged past SESSION_TIMEOUT_S on its own clock; a live session's call behind them is
    sampled."""
    from pipeline.api.liveness import CLOCK_ALLOWANCE_S
    from schemas.api import SESSION_TIMEOUT_S

    sessions = [harness.gateway.create_session(TENANT, [], {}) for _ in range(4)]
    ended, stale, watched_lapse, _ = sessions
    samplers = [harness.gateway.create_sampling_session(TENANT, s, 0, harness.base_model, None) for s in sessions]
    calls = [harness.sample(sampler_id, 0, sample_request([], seed=5, num_samples=20)) for sampler_id in samplers]
    harness.gateway.finish(TENANT, ended, "success")
    stale_s = SESSION_TIMEOUT_S + CLOCK_ALLOWANCE_S + 3600  # its client went an hour before the sampler (re)started
    harness.store.put(lifecycle.heartbeat_key(stale), json.dumps({"time": time.time() - stale_s}).encode())
    watched = [0.0]
    harness.sampler.presence = ClientPresence(harness.store, 0.0, 16, clock=lambda: watched[0])
    assert harness.sampler.presence.gone(watched_lapse) is None  # first seen: a fresh record, counted from now
    watched[0] += SESSION_TIMEOUT_S + 12
    sampled: list[int] = []
    sample = harness.engine.sample

    async def recorded(prompt, adapter, params, owner=None):
        sampled.append(params.num_samples)
        return await sample(prompt, adapter, params, owner=owner)

    monkeypatch.setattr(harness.engine, "sample", recorded)
    activity_store = _recorded_activity(harness)
    (ended_data, ended_fmt), (stale_data, stale_fmt), (lapsed_data, lapsed_fmt), (_, live_fmt) = harness.run(calls)
    assert (ended_fmt, stale_fmt, lapsed_fmt, live_fmt) == ("json", "json", "json", "pb")
    assert sampled == [16, 4]  # the live call's two rounds only
    ended_error, stale_error, lapsed_error = json.loads(ended_data), json.loads(stale_data), json.loads(lapsed_data)
    assert ended_error["category"] == stale_error["category"] == lapsed_error["category"] == "user"
    assert f"session {ended} ended (finished: success)" in ended_error["error"]
    assert "sample again from a live ServiceClient" in ended_error["error"]
    silent_s = int(re.search(rf"session {stale} sent no heartbeat for (\d+) s", stale_error["error"]).group(1))
    assert stale_s <= silent_s < stale_s + 60  # the record's age when first seen, give or take the run's seconds
    assert f"session {watched_lapse} sent no heartbeat for {SESSION_TIMEOUT_S + 12:.0f} s" in lapsed_error["error"]
    for error in (stale_error, lapsed_error):
        assert "0 of 20 samples" in error["error"] and "retry the call" in error["error"]
    harness.sampler.activity.flush()  # the engine ran only the live session's call: only it kept it busy
    assert [(a.session, a.op) for a in read_activity(activity_store)] == [(sessions[3], "sample")]
