"""The trainer role against the real broker: calls from the log in seq_id order, results, folds and a restart."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from consumers.api import saves
from consumers.api.worker import TrainerWorker, ops
from consumers.engine import AdamParams, TrainingEngine
from pipeline.api import checkpoints, lifecycle
from pipeline.api.engines import engine_group, request_reader
from pipeline.api.gateway import Gateway, NotFoundError, ServedModel, SessionEndedError
from pipeline.api.wire import parse_tinker_path
from pipeline.io.bus import EventPublisher, ensure_topics
from pipeline.io.registry import MANIFEST_NAME, AdapterNotFoundError, AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.topics import API_TOPIC_KINDS
from schemas.api import model_run_name, result_path

TENANT = "t-alice"


def _datum(seed: int, n: int = 6) -> types.Datum:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, 200, n + 1).tolist()
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n})


def _fb(model_id: str, seq: int, datums: list[types.Datum], loss: str = "cross_entropy") -> bytes:
    request = types.ForwardBackwardRequest(types.ForwardBackwardInput(datums, loss), model_id, seq_id=seq)
    return forward_backward_request_to_proto(request).SerializeToString()


def _optim(model_id: str, seq: int) -> bytes:
    return types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=1e-2), model_id=model_id,
                                  seq_id=seq).model_dump_json().encode()


class Harness:
    """A gateway (in-process, publishing for real) and trainers reading the same namespace."""

    def __init__(self, store: ObjectStore, bus, base_model: str, fast_group) -> None:
        self.store, self.bus, self.base_model, self.fast_group = store, bus, base_model, fast_group
        ensure_topics(bus, API_TOPIC_KINDS)
        self.publisher = EventPublisher(bus)
        self.gateway = Gateway(store, lambda event, key: self.publisher.publish("requests", event, key),
                               [ServedModel(base_model, base_model)])
        self.session = self.gateway.create_session(TENANT, [], {})

    def trainer(self) -> TrainerWorker:
        return TrainerWorker(self.store, self.bus, self.base_model, TrainingEngine(self.base_model, device="cpu"),
                             consumer_options=self.fast_group)

    def create(self, seq: int = 0) -> str:
        model_id = self.gateway.register_model(TENANT, self.session, seq, self.base_model, 4, {}, None)
        body = types.CreateModelRequest(session_id=self.session, model_seq_id=seq, base_model=self.base_model,
                                        lora_config=types.LoraConfig(rank=4, seed=3)).model_dump_json().encode()
        self.gateway.submit(TENANT, "create_model", model_id, None, body)
        return model_id

    def result(self, request_id: str, tenant: str = TENANT) -> tuple[bytes, str] | None:
        return self.gateway.result(tenant, request_id)


def run_until(trainer: TrainerWorker, harness: Harness, request_ids: list[str], timeout_s: float = 60.0,
              tenant: str = TENANT) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(harness.result(rid, tenant) for rid in request_ids):
        assert time.monotonic() < deadline, f"no results for {[r for r in request_ids if not harness.result(r, tenant)]}"
        trainer.step(poll_timeout_s=0.2)


def reference_weights(base_model: str, chunks: list[list[types.Datum]]) -> dict[str, torch.Tensor]:
    """The same calls straight on an engine: create, forward_backward per chunk, one optim_step."""
    engine = TrainingEngine(base_model, device="cpu")
    request = types.CreateModelRequest(session_id="ref", model_seq_id=0, base_model=base_model,
                                       lora_config=types.LoraConfig(rank=4, seed=3))
    ops.create_model(engine, "ref:train:0", request)
    for chunk in chunks:
        ops.forward_backward(engine, "ref:train:0",
                             types.ForwardBackwardRequest(types.ForwardBackwardInput(chunk, "cross_entropy"),
                                                          "ref:train:0"), False)
    engine.optim_step("ref.train.0", AdamParams(learning_rate=1e-2))
    return engine.weights("ref.train.0")


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6


class Killed(BaseException):
    """The trainer process dying (SIGKILL) at a chosen write."""


def dies_at_put(monkeypatch, store: ObjectStore, suffix: str) -> None:
    """``store.put`` of a key ending in ``suffix`` kills the trainer (raises ``Killed``) instead of writing."""
    put = store.put

    def put_or_die(key: str, data: bytes) -> str:
        if key.endswith(suffix):
            raise Killed(key)
        return put(key, data)

    monkeypatch.setattr(store, "put", put_or_die)


def abandon(trainer: TrainerWorker) -> None:
    """The trainer is gone: its connections close, and nothing is folded or committed."""
    trainer.consumer.close()
    trainer.publisher.close()


@pytest.fixture
def harness(tmp_path, bus_config, tiny_model_dir, fast_group) -> Harness:
    store = ObjectStore(f"file://{tmp_path}/store")
    return Harness(store, bus_config.model_copy(update={"namespace": f"t{uuid.uuid4().hex[:12]}"}),
                   tiny_model_dir, fast_group)


def test_out_of_order_chunks_run_in_seq_order_and_match_a_direct_run(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    chunks = [[_datum(1), _datum(2)], [_datum(3)]]
    # the SDK sends a batch's chunks concurrently, the first one last
    second = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, chunks[1]), "pb")
    trainer.step(poll_timeout_s=3.0)
    assert harness.result(second) is None  # waits for seq_id 1
    first = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, chunks[0]), "pb")
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))
    again = harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))
    assert again == step
    run_until(trainer, harness, [first, second, step])
    output = deserialize_forward_backward_output(harness.result(first)[0])
    assert len(output.loss_fn_outputs) == 2 and output.loss_fn_outputs[0]["logprobs"].shape == [6]
    assert output.metrics["loss:sum"] > 0
    assert json.loads(harness.result(step)[0])["metrics"]["step:max"] == 1.0
    assert_same(trainer.engine.weights(f"{harness.session}.train.0"), reference_weights(harness.base_model, chunks))
    assert trainer.consumer.group_id == engine_group("trainer", harness.bus.namespace, harness.base_model)
    trainer.close()


def _bad_datum() -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                       loss_fn_inputs={"target_tokens": [6, 7, 10_000_000], "weights": [1.0] * 3})


@pytest.mark.parametrize("bad", [1, 2])
def test_a_forward_backward_the_sdk_split_into_requests_fails_as_a_whole_and_adds_no_gradient(harness, bad):
    """The SDK splits a large forward_backward into requests (consecutive seq_ids, sent at once, the first last) and
    fails the call if one fails: then none of them may leave gradients (an optim_step would apply part of the
    batch).  Gradients of an earlier, separate call stay; the error names the request and where its datums start."""
    trainer = harness.trainer()
    model_id = harness.create()
    earlier = [_datum(90)]
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                                        _fb(model_id, 1, earlier), "pb")])
    chunks = [[_datum(91), _datum(92)], [_datum(93)], [_datum(94)]]
    chunks[bad] = [_datum(95), _bad_datum()]
    requests = {seq: harness.gateway.submit(TENANT, "forward_backward", model_id, seq,
                                            _fb(model_id, seq, chunks[seq - 2]), "pb") for seq in (3, 4, 2)}
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 5, _optim(model_id, 5))
    run_until(trainer, harness, [*requests.values(), step])
    failed = json.loads(harness.result(requests[2 + bad])[0])
    assert failed["category"] == "user" and "target_tokens" in failed["error"]
    assert f"request {bad + 1} of the 3 the SDK split one forward_backward into" in failed["error"]
    assert f"its datum 0 is datum {sum(map(len, chunks[:bad]))} of the call" in failed["error"]
    for seq in range(3 + bad, 5):  # the requests after it do not run
        assert "did not run" in json.loads(harness.result(requests[seq])[0])["error"]
    assert "metrics" in json.loads(harness.result(step)[0])  # the step takes the earlier call's gradients alone
    assert_same(trainer.engine.weights(model_run_name(model_id)), reference_weights(harness.base_model, [earlier]))
    abandon(trainer)  # a trainer restarted from before the call replays it the same way
    harness.store.delete(f"sessions/{harness.session}/models/0.fold.json", missing_ok=True)
    restarted = harness.trainer()
    undone: list[str] = []
    fail_split = restarted._fail_split
    restarted._fail_split = lambda model, split, seq: (fail_split(model, split, seq), undone.append(split.failed))
    step_until(restarted, lambda: restarted.models and restarted.models[model_id].next_seq == 6, "the replay")
    assert undone[0] == f"request {bad + 1} failed"  # its stored failure undid the call again
    assert_same(restarted.engine.weights(model_run_name(model_id)), reference_weights(harness.base_model, [earlier]))
    restarted.close()


def test_bad_calls_are_user_errors_and_the_model_carries_on(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    unknown = harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                     _fb(model_id, 1, [_datum(1)], loss="stable_reinforce"), "pb")
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 10**6]})
    vocab = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, [bad]), "pb")
    fine = harness.gateway.submit(TENANT, "forward_backward", model_id, 3, _fb(model_id, 3, [_datum(1)]), "pb")
    # the gateway refuses rank 0 itself: a create logged with it anyway (an older gateway) fails on the trainer
    broken = harness.gateway.register_model(TENANT, harness.session, 1, harness.base_model, 4, {}, None)
    body = types.CreateModelRequest(session_id=harness.session, model_seq_id=1, base_model=harness.base_model,
                                    lora_config=types.LoraConfig(rank=0)).model_dump_json().encode()
    harness.gateway.submit(TENANT, "create_model", broken, None, body)
    orphan = harness.gateway.submit(TENANT, "forward_backward", broken, 1, _fb(broken, 1, [_datum(1)]), "pb")
    run_until(trainer, harness, [unknown, vocab, fine, orphan])
    for rid, words in ((unknown, "stable_reinforce"), (vocab, "vocabulary"), (f"{harness.session}.train.1.create", "rank"),
                       (orphan, "does not exist")):
        answer = json.loads(harness.result(rid)[0])
        assert answer["category"] == "user" and words in answer["error"]
    assert harness.result(fine)[1] == "pb"
    trainer.close()


def test_a_restarted_trainer_replays_from_its_fold_to_the_same_weights(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()  # as when idle: folds the new model and commits past its create
    assert harness.store.exists(f"sessions/{harness.session}/models/0.fold.json")
    chunks = [[_datum(5), _datum(6)]]
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, chunks[0]), "pb")
    run_until(trainer, harness, [fb])
    abandon(trainer)  # dies between forward_backward and optim_step: gradients lost, nothing committed
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    restarted = harness.trainer()
    run_until(restarted, harness, [step])
    assert_same(restarted.engine.weights(f"{harness.session}.train.0"), reference_weights(harness.base_model, chunks))
    restarted.close()


def fail_next_forward_backward(monkeypatch) -> None:
    """The next forward_backward the engine runs fails as a device would; the ones after it run."""
    forward_backward, failures = ops.forward_backward, iter([RuntimeError("CUDA out of memory")])

    def fails_once(*args, **kwargs):
        failure = next(failures, None)
        if failure is not None:
            raise failure
        return forward_backward(*args, **kwargs)

    monkeypatch.setattr(ops, "forward_backward", fails_once)


def test_a_call_that_ran_before_and_fails_when_replayed_fails_its_models_later_calls(harness, monkeypatch):
    """A restarted trainer that cannot re-run a call which succeeded before (memory short for a moment) has lost the
    model's state: its later calls are answered with that, not run on the gradients that are missing."""
    trainer = harness.trainer()
    model_id = harness.create()
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(5)]), "pb")
    run_until(trainer, harness, [fb])
    abandon(trainer)  # dies before its fold: a restart replays the create and the forward_backward
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    fail_next_forward_backward(monkeypatch)
    restarted = harness.trainer()
    run_until(restarted, harness, [step])
    answer = json.loads(harness.result(step)[0])
    assert answer["category"] == "server"
    assert "forward_backward" in answer["error"] and "checkpoints" in answer["error"]
    assert "\n" not in answer["error"]
    restarted.close()


def test_a_model_refused_after_a_failed_replay_goes_on_from_a_checkpoint_loaded_into_it(harness, monkeypatch):
    """The refusal names the way out, and a load_state into the refused training client replaces its whole state:
    the refusal is lifted, its calls run again and it is folded from then on."""
    trainer = harness.trainer()
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 2, "w")  # seq_ids 1 to 3
    saved = trainer.engine.weights(model_run_name(model_id))
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 4, _fb(model_id, 4, [_datum(3)]), "pb")
    run_until(trainer, harness, [fb])
    abandon(trainer)  # nothing folded: a restart replays seq_ids 1 to 4
    fail_next_forward_backward(monkeypatch)
    restarted = harness.trainer()
    refused = harness.gateway.submit(TENANT, "optim_step", model_id, 5, _optim(model_id, 5))
    run_until(restarted, harness, [refused])
    assert "load_state" in json.loads(harness.result(refused)[0])["error"]
    body = types.LoadWeightsRequest(model_id=model_id, seq_id=6, path=f"tinker://{model_id}/weights/w", optimizer=True)
    load = harness.gateway.submit(TENANT, "load_weights", model_id, 6, body.model_dump_json().encode())
    run_until(restarted, harness, [load])
    assert "error" not in json.loads(harness.result(load)[0])
    assert_same(restarted.engine.weights(model_run_name(model_id)), saved)
    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 7, _fb(model_id, 7, [_datum(3)]), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 8, _optim(model_id, 8))]
    run_until(restarted, harness, calls)
    assert "metrics" in json.loads(harness.result(calls[1])[0])
    restarted.fold_all()
    assert json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))["seq_id"] == 8
    restarted.close()


def test_calls_that_failed_replay_after_a_restart_without_stopping_the_trainer(harness):
    """A call answered with an error (refused by the gateway, or failing on the trainer) is read again by a
    restarted trainer: its stored error stands and the calls after it run."""
    trainer = harness.trainer()
    model_id = harness.create()
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"png", format="png",
                                                                              expected_tokens=2)]),
                        loss_fn_inputs={"target_tokens": [1, 2]})
    unsupported = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [image]), "pb")
    nan = b'{"adam_params": {"learning_rate": NaN}, "model_id": "%s", "seq_id": 2}' % model_id.encode()
    harness.gateway.refuse(TENANT, "optim_step", nan, "json", "learning_rate: Input should be a valid number")
    refused = f"{harness.session}.train.0.2"
    run_until(trainer, harness, [unsupported, refused])
    abandon(trainer)  # nothing folded or committed: a restart reads both again
    fine = harness.gateway.submit(TENANT, "forward_backward", model_id, 3, _fb(model_id, 3, [_datum(1)]), "pb")
    restarted = harness.trainer()
    run_until(restarted, harness, [fine])
    assert harness.result(fine)[1] == "pb"
    for rid, words in ((unsupported, "image"), (refused, "valid number")):
        answer = json.loads(harness.result(rid)[0])
        assert answer["category"] == "user" and words in answer["error"]
    restarted.close()


def test_a_forward_backward_refused_for_its_size_is_answered_from_its_header_and_the_next_call_runs(harness):
    """A forward_backward the gateway refused for its size (413) is logged with only its first fields as its body
    (``pipeline.api.wire.forward_backward_prefix``): the trainer answers it with the gateway's error, reading no
    datums, and runs the training client's next call at once."""
    from pipeline.api.wire import forward_backward_prefix

    trainer = harness.trainer()
    model_id = harness.create()
    header = forward_backward_prefix(_fb(model_id, 1, [_datum(5)] * 50)[:1024])
    harness.gateway.refuse(TENANT, "forward_backward", header, "pb", "request body over 4096 bytes; send smaller")
    refused = f"{harness.session}.train.0.1"
    fine = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, [_datum(6)]), "pb")
    run_until(trainer, harness, [refused, fine], timeout_s=30.0)
    answer = json.loads(harness.result(refused)[0])
    assert answer["category"] == "user" and "4096 bytes" in answer["error"]
    assert harness.result(fine)[1] == "pb"
    trainer.close()


def test_a_trainer_killed_between_a_folds_two_writes_restarts_from_the_fold_before(harness, monkeypatch):
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()  # the fold at seq_id 0
    chunks = [[_datum(7), _datum(8)]]
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, chunks[0]), "pb")
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    run_until(trainer, harness, [fb, step])
    dies_at_put(monkeypatch, trainer.store, ".fold.json")
    with pytest.raises(Killed):
        trainer.fold_all()  # the new state written, its record not
    monkeypatch.undo()
    abandon(trainer)
    late = harness.gateway.submit(TENANT, "forward_backward", model_id, 3, _fb(model_id, 3, [_datum(9)]), "pb")
    restarted = harness.trainer()
    run_until(restarted, harness, [late])  # the fold at seq_id 0 and the calls after it
    assert_same(restarted.engine.weights(f"{harness.session}.train.0"), reference_weights(harness.base_model, chunks))
    last = harness.gateway.submit(TENANT, "optim_step", model_id, 4, _optim(model_id, 4))
    run_until(restarted, harness, [last])
    restarted.fold_all()
    states = [key for key in harness.store.list(f"sessions/{harness.session}/models") if key.endswith(".safetensors")]
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    assert record["seq_id"] == 4 and states == [record["state"]]  # none left behind by the folds before
    restarted.close()


def test_a_corrupt_fold_fails_its_own_models_calls_and_no_other_and_an_older_fold_loads(harness):
    trainer = harness.trainer()
    broken, fine = harness.create(0), harness.create(1)
    run_until(trainer, harness, [f"{harness.session}.train.0.create", f"{harness.session}.train.1.create"])
    trainer.fold_all()
    trainer.close()
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    harness.store.put(record["state"], b"not the state")
    folder = f"sessions/{harness.session}/models"  # the other model's fold as an older trainer wrote it
    old = json.loads(harness.store.get(f"{folder}/1.fold.json"))
    harness.store.put(f"{folder}/1.fold.safetensors", harness.store.get(old.pop("state")))
    harness.store.put(f"{folder}/1.fold.json", json.dumps(old).encode())
    restarted = harness.trainer()
    calls = [harness.gateway.submit(TENANT, "optim_step", model_id, 1, _optim(model_id, 1)) for model_id in (broken, fine)]
    run_until(restarted, harness, calls)
    answer = json.loads(harness.result(calls[0])[0])
    assert answer["category"] == "server" and "missing or corrupt (ChecksumError)" in answer["error"]
    assert "load_state" in answer["error"]
    assert "metrics" in json.loads(harness.result(calls[1])[0])
    run_until(restarted, harness, [harness.gateway.submit(TENANT, "save_weights", fine, 2, _save(fine, 2, "f"))])
    body = types.LoadWeightsRequest(model_id=broken, seq_id=2, path=f"tinker://{fine}/weights/f", optimizer=False)
    load = harness.gateway.submit(TENANT, "load_weights", broken, 2, body.model_dump_json().encode())
    run_until(restarted, harness, [load])
    step = harness.gateway.submit(TENANT, "optim_step", broken, 3, _optim(broken, 3))
    run_until(restarted, harness, [step])  # the checkpoint loaded into it brought it back
    assert "metrics" in json.loads(harness.result(step)[0])
    assert_same(restarted.engine.weights(model_run_name(broken)), restarted.engine.weights(model_run_name(fine)))
    restarted.close()


def test_a_damaged_object_under_a_folds_state_name_is_replaced_when_that_state_is_folded_again(harness, caplog):
    """A fold's state is stored under a name made of its sha256.  When the object under that name holds other
    bytes (damaged on disk) and the model folds the same state again (its calls since only failed), the fold
    replaces the damaged object rather than failing at every round, and the model reloads from it."""
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    harness.store.put(record["state"], b"damaged")
    failed = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_bad_datum()]), "pb")
    run_until(trainer, harness, [failed])  # a user error: the state is the one folded
    assert json.loads(harness.result(failed)[0])["category"] == "user"
    for _ in range(2):
        trainer.fold_all()
    assert any(record["state"] in r.getMessage() and "damaged" in r.getMessage()
               for r in caplog.records if r.levelname == "WARNING")
    again = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    assert (again["state"], again["seq_id"]) == (record["state"], 1)
    harness.store.get(record["state"], record["state_sha256"])  # the state again, not the damaged bytes
    trainer.idle_unload_s = 0.0
    trainer.expire_sessions()  # parked: its next call reloads the fold
    trainer.idle_unload_s = 600.0
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    run_until(trainer, harness, [step])
    assert "metrics" in json.loads(harness.result(step)[0])
    trainer.close()


def test_models_whose_fold_is_lost_or_whose_creation_failed_go_after_their_sessions_end(harness):
    """A training client neither in the engine nor folded (its fold cannot be loaded, or its creation failed) has a
    record on the trainer too.  It answers a lapsed session's late call as before, and goes ``end_grace_s`` after
    its session's end, as a parked model's does."""
    trainer = harness.trainer()
    lost = harness.create(0)
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    trainer.close()
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    harness.store.put(record["state"], b"not the state")
    failed = harness.gateway.register_model(TENANT, harness.session, 1, harness.base_model, 4, {}, None)
    body = types.CreateModelRequest(session_id=harness.session, model_seq_id=1, base_model=harness.base_model,
                                    lora_config=types.LoraConfig(rank=0)).model_dump_json().encode()
    harness.gateway.submit(TENANT, "create_model", failed, None, body)  # refused on the trainer (rank 0)
    restarted = harness.trainer()
    first = harness.gateway.submit(TENANT, "optim_step", lost, 1, _optim(lost, 1))
    run_until(restarted, harness, [first, f"{harness.session}.train.1.create"])
    assert "missing or corrupt" in json.loads(harness.result(first)[0])["error"]
    assert "rank" in json.loads(harness.result(f"{harness.session}.train.1.create")[0])["error"]
    restarted.session_timeout_s = 0.0  # every heartbeat has lapsed
    restarted.expire_sessions()
    late = harness.gateway.submit(TENANT, "optim_step", lost, 2, _optim(lost, 2))  # the client comes back
    run_until(restarted, harness, [late], timeout_s=10.0)
    assert "missing or corrupt" in json.loads(harness.result(late)[0])["error"]
    harness.gateway.finish(TENANT, harness.session, "success")
    restarted.expire_sessions()
    assert lost in restarted.models and failed in restarted.models  # a call accepted before the end may come
    restarted.end_grace_s = 0.0
    restarted.expire_sessions()
    assert lost not in restarted.models and failed not in restarted.models
    restarted.close()


def test_a_call_arriving_after_a_load_with_a_later_seq_id_brought_back_a_lost_fold_is_answered(harness):
    """While a training client's fold cannot be loaded, each of its calls is answered with an error as it comes,
    and a load_weights brings it back, its calls running in seq_id order from there.  A call with a seq_id below
    that load's reaching the trainer after it can no longer run in its turn: it is answered with a user error at
    once (and again by a restarted trainer), rather than never."""
    trainer = harness.trainer()
    broken, fine = harness.create(0), harness.create(1)
    run_until(trainer, harness, [f"{harness.session}.train.0.create", f"{harness.session}.train.1.create"])
    train_and_save(harness, trainer, fine, 2, "f")  # seq_ids 1 to 3
    trainer.fold_all()
    trainer.close()
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/0.fold.json"))
    harness.store.put(record["state"], b"not the state")
    restarted = harness.trainer()
    first = harness.gateway.submit(TENANT, "optim_step", broken, 1, _optim(broken, 1))
    run_until(restarted, harness, [first])
    assert "missing or corrupt" in json.loads(harness.result(first)[0])["error"]
    body = types.LoadWeightsRequest(model_id=broken, seq_id=4, path=f"tinker://{fine}/weights/f", optimizer=False)
    load = harness.gateway.submit(TENANT, "load_weights", broken, 4, body.model_dump_json().encode())
    run_until(restarted, harness, [load])  # seq_ids 2 and 3 not there yet
    assert "error" not in json.loads(harness.result(load)[0])
    late = harness.gateway.submit(TENANT, "optim_step", broken, 2, _optim(broken, 2))
    run_until(restarted, harness, [late], timeout_s=10.0)
    answer = json.loads(harness.result(late)[0])
    assert answer["category"] == "user" and "load_weights (seq_id 4)" in answer["error"]
    step = harness.gateway.submit(TENANT, "optim_step", broken, 5, _optim(broken, 5))
    run_until(restarted, harness, [step])  # the calls after the load run in their turn
    assert "metrics" in json.loads(harness.result(step)[0])
    restarted.fold_all()
    restarted.close()
    again = harness.trainer()  # a restart keeps the seq_ids the load went past
    later = harness.gateway.submit(TENANT, "forward_backward", broken, 3, _fb(broken, 3, [_datum(4)]), "pb")
    resent = harness.gateway.submit(TENANT, "optim_step", broken, 1, _optim(broken, 1))
    assert harness.result(later) is None
    run_until(again, harness, [later], timeout_s=10.0)
    assert "load_weights (seq_id 4)" in json.loads(harness.result(later)[0])["error"]
    assert "missing or corrupt" in json.loads(harness.result(resent)[0])["error"]  # its first answer stands
    again.close()


def _save(model_id: str, seq: int, name: str, overwrite: bool = False) -> bytes:
    return types.SaveWeightsRequest(model_id=model_id, path=name, seq_id=seq,
                                    overwrite=overwrite).model_dump_json().encode()


def test_a_save_replayed_after_a_kill_completes_and_a_taken_name_is_a_user_error(harness, monkeypatch):
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    dies_at_put(monkeypatch, trainer.store, "/weights/w1.json")
    save = harness.gateway.submit(TENANT, "save_weights", model_id, 1, _save(model_id, 1, "w1"))
    with pytest.raises(Killed):
        run_until(trainer, harness, [save])
    monkeypatch.undo()
    abandon(trainer)
    weights = next(k for k in harness.store.list("", recursive=True) if k.endswith("/weights/w1.safetensors"))
    harness.store.put(weights, b"the killed attempt's bytes")  # a replay need not write the same bytes (GPUs)
    restarted = harness.trainer()
    run_until(restarted, harness, [save])
    assert "weights/w1" in json.loads(harness.result(save)[0])["path"]
    assert harness.store.get(weights) != b"the killed attempt's bytes"
    again = harness.gateway.submit(TENANT, "save_weights", model_id, 2, _save(model_id, 2, "w1"))
    run_until(restarted, harness, [again])
    answer = json.loads(harness.result(again)[0])
    assert answer["category"] == "user" and "already exist" in answer["error"] and "overwrite=True" in answer["error"]
    replaced = harness.gateway.submit(TENANT, "save_weights", model_id, 3, _save(model_id, 3, "w1", overwrite=True))
    run_until(restarted, harness, [replaced])
    assert "weights/w1" in json.loads(harness.result(replaced)[0])["path"]  # save_state(name, overwrite=True)
    record = json.loads(harness.store.get(weights.removesuffix(".safetensors") + ".json"))
    assert record["request_id"] == replaced  # the name is this save's now
    restarted.close()


def test_finished_session_unloads_its_adapters(harness):
    trainer = harness.trainer()
    trainer.liveness.live_check_s = 0.0  # (an end is seen up to END_CHECK_S late)
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    assert trainer.engine.adapters() == [f"{harness.session}.train.0"]
    accepted = harness.gateway.submit(TENANT, "optim_step", model_id, 1, _optim(model_id, 1))  # not yet run
    harness.gateway.finish(TENANT, harness.session, "success")
    trainer.expire_sessions()
    assert trainer.engine.adapters() == []
    with pytest.raises(SessionEndedError):  # it takes no more calls
        harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    run_until(trainer, harness, [accepted])  # and one accepted before its end is answered without running
    answer = json.loads(harness.result(accepted)[0])
    assert answer["category"] == "user" and "did not run" in answer["error"] and "ended" in answer["error"]
    trainer.close()


def test_other_base_models_calls_are_left_to_their_trainer_and_lapsed_sessions_end(harness):
    harness.gateway.models["/models/other"] = ServedModel("/models/other", "/models/other")
    trainer = harness.trainer()
    harness.store.put(f"sessions/{harness.session}/models/5.json", json.dumps({"base_model": "/models/other"}).encode())
    other = f"{harness.session}:train:5"
    harness.gateway.submit(TENANT, "create_model", other, None, b"{}")
    mine = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.step()
    assert harness.result(f"{harness.session}.train.5.create") is None  # another trainer's call
    assert other not in trainer.models and mine in trainer.models
    trainer.session_timeout_s = 0.0  # every heartbeat has lapsed
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [] and harness.store.exists(
        f"sessions/{harness.session}/models/0.fold.json")
    late = harness.gateway.submit(TENANT, "optim_step", mine, 1, _optim(mine, 1))  # the client comes back
    run_until(trainer, harness, [late])  # reloaded from its fold: a late call still completes
    assert "metrics" in json.loads(harness.result(late)[0])
    trainer.close()


def test_a_lapse_between_forward_backward_and_optim_step_keeps_the_gradients(harness):
    """A laptop that sleeps between a step's forward_backward and its optim_step: its heartbeats lapse while the
    adapter holds gradients.  The adapter is folded with them and unloaded, and the late optim_step completes
    with the weights of an uninterrupted run, on this trainer and on one restarted from the fold."""
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    chunk = [_datum(11), _datum(12)]
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, chunk), "pb")
    run_until(trainer, harness, [fb])
    trainer.session_timeout_s = 0.0  # every heartbeat has lapsed
    trainer.expire_sessions()
    assert trainer.engine.adapters() == []  # folded with its gradients, unloaded
    abandon(trainer)  # and even a trainer restarted meanwhile reloads them from the fold
    late = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    restarted = harness.trainer()
    run_until(restarted, harness, [late], timeout_s=20.0)
    assert_same(restarted.engine.weights(model_run_name(model_id)), reference_weights(harness.base_model, [chunk]))
    restarted.close()


def test_a_session_finished_with_calls_in_flight_answers_them_without_running_then_unloads(harness):
    """close() right after a step's futures were sent: the end comes while the adapter holds gradients, its
    optim_step waiting for a forward_backward chunk that the trainer has not read yet.  Neither runs (nobody reads
    their results): both are answered with a user error, and the adapter keeps the gradients it had.  Meanwhile the
    adapter waits folded, out of the engine; the model's record goes once no call waits, or ``end_grace_s`` after
    the end, when the calls still waiting are answered."""
    trainer = harness.trainer()
    trainer.liveness.live_check_s = 0.0  # (an end is seen up to END_CHECK_S late)
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    first, second = [_datum(21)], [_datum(22)]
    fb1 = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, first), "pb")
    run_until(trainer, harness, [fb1])
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))
    trainer.step()  # read: it waits for seq_id 2
    fb2 = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, second), "pb")
    harness.gateway.finish(TENANT, harness.session, "success")
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [] and model_id in trainer.models  # parked: a call waits
    run_until(trainer, harness, [fb2, step], timeout_s=20.0)
    for request_id in (fb2, step):
        answer = json.loads(harness.result(request_id)[0])
        assert answer["category"] == "user" and f"session {harness.session} ended" in answer["error"]
    assert trainer.models[model_id].has_gradients  # the first forward_backward's, as the fold held them
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [] and model_id not in trainer.models  # none waits: gone
    # a call waiting for a seq_id that will never come: held for end_grace_s after the end, then answered
    harness.session = harness.gateway.create_session(TENANT, [], {})
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                                        _fb(model_id, 1, first), "pb")])
    stranded = harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))  # seq_id 2 never comes
    trainer.step()
    harness.gateway.finish(TENANT, harness.session, "success")
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [] and model_id in trainer.models  # parked: its call waits
    trainer.end_grace_s = 0.0
    trainer.expire_sessions()
    assert model_id not in trainer.models
    answer = json.loads(harness.result(stranded)[0])  # answered, not left running for ever
    assert answer["category"] == "user" and "seq_id 2" in answer["error"] and "did not run" in answer["error"]
    # the trainer's sweep deletes both ended sessions' call bodies, results and folds (here at once)
    trainer.sweeper.session_files_kept_s = 0.0
    assert harness.store.list(f"sessions/{harness.session}/requests") != []
    old_activity = "engines/trainer-gone-1/activity/1600000000000-1600000001000-0a1b2c3d.jsonl"  # 2020
    harness.store.put(old_activity, b"")
    trainer.sweep_checkpoints()  # the first sweep indexes the store's sessions (once, in a thread) first
    assert trainer.sweeper.wait_indexed(30.0)
    trainer.sweep_checkpoints()
    assert not harness.store.exists(old_activity)  # and engine activity past its days
    for folder in ("requests", "results"):
        assert harness.store.list(f"sessions/{harness.session}/{folder}") == []
    assert not harness.store.exists(f"sessions/{harness.session}/models/0.fold.json")
    assert harness.store.exists(f"sessions/{harness.session}/models/0.json")
    trainer.close()


def test_a_call_whose_sessions_files_were_deleted_before_it_ran_is_dropped_and_the_others_run(harness):
    """A trainer that was down for longer than an ended session's files are kept reads its calls with their bodies
    gone: it writes no result into the deleted folder and goes on with the next session's calls."""
    gone = harness.create()
    late = harness.gateway.submit(TENANT, "forward_backward", gone, 1, _fb(gone, 1, [_datum(1)]), "pb")
    gone_session = harness.session
    harness.gateway.finish(TENANT, gone_session, "success")
    assert lifecycle.free_session_files(harness.store, gone_session, now=time.time() + 3600) == 2
    harness.session = harness.gateway.create_session(TENANT, [], {})
    trainer = harness.trainer()
    harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    assert harness.store.list(f"sessions/{gone_session}/results") == []
    with pytest.raises(NotFoundError, match="deleted"):
        harness.result(late)
    trainer.close()


def test_a_replayed_call_whose_body_was_deleted_but_not_yet_its_result_is_skipped(harness):
    """A trainer restarted while an ended session's files are being deleted replays a forward_backward whose
    result is still there and whose body is gone: it is skipped, and the trainer goes on."""
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    fb = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(3)]), "pb")
    run_until(trainer, harness, [fb])
    abandon(trainer)  # nothing committed past the forward_backward
    gone = harness.session
    lifecycle.record_end(harness.store, gone, "finished: success", at=time.time() - 2 * 86400)
    harness.store.put(f"sessions/{gone}/files_deleted.json", json.dumps({"time": time.time()}).encode())
    for key in harness.store.list(f"sessions/{gone}/requests"):  # a sweep half done: bodies gone, results not
        harness.store.delete(key)
    harness.session = harness.gateway.create_session(TENANT, [], {})
    restarted = harness.trainer()
    harness.create()
    run_until(restarted, harness, [f"{harness.session}.train.0.create"])  # it did not stop at the old call
    restarted.close()


def test_an_optim_step_refused_for_gradients_that_are_not_finite_discards_them_again_on_replay(harness):
    """The refusal discards the gradients (a change), so a restarted trainer replaying from an older fold must
    discard them at the same point, not skip the call as one that changed nothing."""
    import math

    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    run = model_run_name(model_id)

    def poison_gradients() -> None:  # what a loss that overflowed in its backward leaves (here by hand, once)
        next(iter(trainer.engine._get(run).params.values())).grad.view(-1)[0] = math.nan

    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(1)]), "pb")]
    run_until(trainer, harness, calls)
    poison_gradients()
    calls.append(harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2)))
    run_until(trainer, harness, calls)
    assert "not finite" in json.loads(harness.result(calls[-1])[0])["error"]
    assert not trainer.models[model_id].has_gradients  # discarded: the model may be folded again
    calls += [harness.gateway.submit(TENANT, "forward_backward", model_id, 3, _fb(model_id, 3, [_datum(2)]), "pb"),
              harness.gateway.submit(TENANT, "optim_step", model_id, 4, _optim(model_id, 4))]
    run_until(trainer, harness, calls)
    weights = trainer.engine.weights(run)
    abandon(trainer)  # nothing folded or committed after the create
    restarted = harness.trainer()
    probe = harness.gateway.submit(TENANT, "forward_backward", model_id, 5, _fb(model_id, 5, [_datum(3)]), "pb")
    run_until(restarted, harness, [probe])
    assert_same(restarted.engine.weights(run), weights)
    restarted.close()


def three_clients_interleaved(harness: Harness, trainer: TrainerWorker, first_seed: int) -> dict[str, list]:
    """Three training clients, each two forward_backwards and an optim_step, their calls interleaved on the log and
    run to the end; each client's chunks."""
    models = [harness.create(seq) for seq in range(3)]
    chunks = {model_id: [[_datum(first_seed + i)], [_datum(first_seed + 10 + i), _datum(first_seed + 20 + i)]]
              for i, model_id in enumerate(models)}
    for seq in (1, 2):
        for model_id in models:
            harness.gateway.submit(TENANT, "forward_backward", model_id, seq,
                                   _fb(model_id, seq, chunks[model_id][seq - 1]), "pb")
    steps = [harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3)) for model_id in models]
    run_until(trainer, harness, steps)
    return chunks


def test_three_clients_training_at_once_end_as_each_trained_alone(harness):
    trainer = harness.trainer()
    chunks = three_clients_interleaved(harness, trainer, 20)
    models = list(chunks)
    for seq, model_id in enumerate(models):
        assert_same(trainer.engine.weights(f"{harness.session}.train.{seq}"),
                    reference_weights(harness.base_model, chunks[model_id]))
    trainer.close()


def test_an_adapter_idle_past_its_limit_is_unloaded_and_its_next_call_reloads_it(harness):
    """A live session's training client that makes no call for ``idle_unload_s`` (a long sampling phase, a
    notebook left open) leaves the engine's memory, gradients and all; its next call reloads it from its fold
    and the run ends as if it had never left."""
    trainer = harness.trainer()
    model_id = harness.create()
    first, second = [_datum(51)], [_datum(52), _datum(53)]
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                                        _fb(model_id, 1, first), "pb")])
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [model_run_name(model_id)]  # used a moment ago: kept
    trainer.idle_unload_s = 0.0
    trainer.expire_sessions()
    assert trainer.engine.adapters() == [] and model_id in trainer.models  # parked, its session alive
    trainer.idle_unload_s = 600.0
    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, second), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))]
    run_until(trainer, harness, calls)
    assert_same(trainer.engine.weights(model_run_name(model_id)),
                reference_weights(harness.base_model, [first, second]))
    trainer.close()


def test_with_room_for_one_adapter_three_clients_take_turns_and_end_as_each_trained_alone(harness, monkeypatch):
    """``max_adapters``: the least recently used adapters are folded and unloaded to make room, even one whose
    client has calls waiting; every client's weights end as if it had the engine to itself."""
    trainer = harness.trainer()
    trainer.max_adapters = 1
    held: list[int] = []
    forward_backward = trainer.engine.forward_backward

    def counting(*args, **kwargs):
        held.append(len(trainer.engine.adapters()))
        return forward_backward(*args, **kwargs)

    monkeypatch.setattr(trainer.engine, "forward_backward", counting)
    chunks = three_clients_interleaved(harness, trainer, 60)
    models = list(chunks)
    assert len(held) == 6 and max(held) == 1
    for seq, model_id in enumerate(models):
        name = f"{harness.session}.train.{seq}"
        if name not in trainer.engine.adapters():
            ops.load_state(trainer.engine, model_id, _fold_state(harness, seq), True)
        assert_same(trainer.engine.weights(name), reference_weights(harness.base_model, chunks[model_id]))
    trainer.close()


def _fold_state(harness: Harness, seq: int) -> bytes:
    record = json.loads(harness.store.get(f"sessions/{harness.session}/models/{seq}.fold.json"))
    return harness.store.get(record["state"])


def test_external_weights_are_the_adapters_peft_folder_with_its_ttl_and_a_taken_name_is_refused(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(1)]), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))]

    def export(seq: int) -> str:
        body = types.SaveWeightsExternalRequest(model_id=model_id, path="final", seq_id=seq, ttl_seconds=7200)
        return harness.gateway.submit(TENANT, "save_weights_external", model_id, seq, body.model_dump_json().encode())

    save = export(3)
    started = time.time()
    run_until(trainer, harness, [*calls, save])
    answer = json.loads(harness.result(save)[0])
    path = parse_tinker_path(answer["path"])
    assert answer["path"] == f"tinker://{model_id}/external_weights/final"
    files = {file: harness.store.get(checkpoints.external_file_key(path, file))
             for file in ("adapter_config.json", "adapter_model.safetensors")}
    assert answer["size_bytes"] == sum(map(len, files.values()))
    trained = load_safetensors(files["adapter_model.safetensors"])
    assert_same(trained, reference_weights(harness.base_model, [[_datum(1)]]))  # the adapter as trained
    assert json.loads(files["adapter_config.json"])["r"] == 4
    record = checkpoints.read_record(harness.store, path)
    assert started + 7200 <= record["expires_at"] <= time.time() + 7200 and record["request_id"] == save
    again = export(4)
    run_until(trainer, harness, [again])
    refused = json.loads(harness.result(again)[0])
    assert refused["category"] == "user" and "already exists" in refused["error"]
    trainer.close()


BOB = "t-bob"


def load_as(harness: Harness, session: str, seq: int, path: str, tenant: str = BOB,
            optimizer: bool = False) -> tuple[str, str]:
    """A new training client ``seq`` of ``session`` (Bob's unless ``tenant``) started from ``path`` (load_weights);
    (request id, model)."""
    model_id = harness.gateway.register_model(tenant, session, seq, harness.base_model, 4, {}, None)
    body = types.LoadWeightsRequest(path=path, session_id=session, model_seq_id=seq, optimizer=optimizer)
    return harness.gateway.submit(tenant, "load_weights", model_id, None, body.model_dump_json().encode()), model_id


def step_until(trainer: TrainerWorker, done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Step ``trainer`` until ``done()`` (e.g. a restart's replay reached a model), failing with ``what``."""
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, what
        trainer.step(poll_timeout_s=0.2)


def no_idle_folds(trainer: TrainerWorker) -> TrainerWorker:
    """``trainer`` folding only when a call makes it (a load), never for being idle or after many calls."""
    trainer.fold_idle_s, trainer.fold_every = float("inf"), 1_000_000
    return trainer


def train_and_save(harness: Harness, trainer: TrainerWorker, model_id: str, seed: int, name: str) -> None:
    """Alice's first three calls: a forward_backward on ``_datum(seed)``, an optim_step, save_state(``name``)."""
    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(seed)]), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2)),
             harness.gateway.submit(TENANT, "save_weights", model_id, 3, _save(model_id, 3, name))]
    run_until(trainer, harness, calls)


def test_a_published_state_is_anyones_to_load_and_a_load_that_ran_replays_after_it_is_unpublished(
        harness, monkeypatch):
    """Bob loads Alice's state only once she publishes it; after she takes that back, Bob cannot load it again,
    but his load that ran is replayed by a trainer killed before the load's fold (its log is a fold: the same
    weights again)."""
    trainer = harness.trainer()
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 2, "shared")
    path, bob = f"tinker://{model_id}/weights/shared", BOB
    bob_session = harness.gateway.create_session(bob, [], {})

    def load(seq: int) -> tuple[str, str]:
        return load_as(harness, bob_session, seq, path)

    def error(request_id: str) -> str:
        return json.loads(harness.result(request_id, bob)[0]).get("error", "")

    private, _ = load(0)
    run_until(trainer, harness, [private], tenant=bob)
    assert "no session" in error(private)
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/shared", True)
    public, bob_model = load(1)
    dies_at_put(monkeypatch, harness.store, f"{bob_session}/models/1.fold.json")
    with pytest.raises(Killed):
        run_until(trainer, harness, [public], tenant=bob)
    monkeypatch.undo()
    alice_weights = trainer.engine.weights(model_run_name(model_id))
    assert error(public) == ""
    assert_same(trainer.engine.weights(model_run_name(bob_model)), alice_weights)
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/shared", False)
    abandon(trainer)  # killed at the load's fold: a restarted trainer replays the whole log
    restarted = harness.trainer()
    again, _ = load(2)
    run_until(restarted, harness, [again], tenant=bob)
    assert "no session" in error(again)
    step_until(restarted, lambda: model_run_name(bob_model) in restarted.engine.adapters(),
               "the load that ran was not replayed")
    assert_same(restarted.engine.weights(model_run_name(bob_model)), alice_weights)
    restarted.close()


def test_ttls_apply_to_every_named_save_an_expired_state_is_not_loaded_and_the_trainer_sweeps_it(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    sampler = types.SaveWeightsForSamplerRequest(model_id=model_id, path="s1", seq_id=2, ttl_seconds=7200)
    calls = [harness.gateway.submit(TENANT, "save_weights", model_id, 1, types.SaveWeightsRequest(
                 model_id=model_id, path="w1", seq_id=1, ttl_seconds=3600).model_dump_json().encode()),
             harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 2,
                                    sampler.model_dump_json().encode())]
    started = time.time()
    run_until(trainer, harness, calls)
    listed = {c["checkpoint_id"]: c["expires_at"] for c in harness.gateway.checkpoints(TENANT, model_id)}
    assert started + 3600 <= listed["weights/w1"] <= time.time() + 3600
    assert started + 7200 <= listed["sampler_weights/s1"] <= time.time() + 7200
    # another base model's client with an expired checkpoint: not this trainer's to sweep
    harness.store.put(f"sessions/{harness.session}/models/5.json", json.dumps({"base_model": "/models/other"}).encode())
    other = f"{harness.session}:train:5"
    other_state = parse_tinker_path(f"tinker://{other}/weights/w")
    checkpoints.write_record(harness.store, other_state, 1, time.time() - 1)
    state = parse_tinker_path(f"tinker://{model_id}/weights/w1")
    key = checkpoints.record_key(state)
    harness.store.put(key, json.dumps({**json.loads(harness.store.get(key)), "expires_at": time.time() - 1}).encode())
    load = harness.gateway.submit(TENANT, "load_weights", model_id, 3, types.LoadWeightsRequest(
        model_id=model_id, path=str(state), seq_id=3, optimizer=True).model_dump_json().encode())
    run_until(trainer, harness, [load])
    assert "expired" in json.loads(harness.result(load)[0])["error"]
    assert trainer.sweep_checkpoints() == 1
    assert not harness.store.exists(checkpoints.weights_key(state)) and not harness.store.exists(key)
    assert harness.store.exists(checkpoints.record_key(other_state))
    assert trainer.sweep_checkpoints() == 0
    trainer.close()


def test_named_sampler_weights_are_listed_with_the_size_of_their_adapter_files(harness, tmp_path):
    """``list_checkpoints`` gives a ``sampler_weights`` checkpoint the bytes of the adapter files of its registry
    version (what a sampler downloads), as it gives ``weights`` the bytes of their state."""
    trainer = harness.trainer()
    model_id = harness.create()
    body = types.SaveWeightsForSamplerRequest(model_id=model_id, path="s1", seq_id=1)
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 1,
                                                        body.model_dump_json().encode())])
    listed = {c["checkpoint_id"]: c for c in harness.gateway.checkpoints(TENANT, model_id)}
    record = checkpoints.read_record(harness.store, parse_tinker_path(f"tinker://{model_id}/sampler_weights/s1"))
    folder = AdapterRegistry(harness.store, model_run_name(model_id)).pull(record["version"], tmp_path / "pulled")
    adapter_files = [f for f in folder.rglob("*") if f.is_file() and f.name != MANIFEST_NAME]
    assert {f.name for f in adapter_files} >= {"adapter_config.json", "adapter_model.safetensors"}
    assert listed["sampler_weights/s1"]["size_bytes"] == sum(f.stat().st_size for f in adapter_files) > 0
    trainer.close()


def test_a_replayed_load_never_loads_weights_saved_since_under_its_name(harness, monkeypatch):
    """Bob's client started from Alice's published `latest`; she takes it back and saves `latest` again, privately.
    A replay of Bob's load (a trainer killed before the load's fold) must not hand him her new weights: his client
    is lost instead (its calls say why, and what to do), and Alice's own client is untouched."""
    trainer = no_idle_folds(harness.trainer())
    monkeypatch.setattr(trainer, "_fold_after_load", lambda model: None)  # killed before it, once Alice saved
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 3, "latest")
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/latest", True)
    bob = BOB
    load, bob_model = load_as(harness, harness.gateway.create_session(bob, [], {}), 0,
                              f"tinker://{model_id}/weights/latest")
    run_until(trainer, harness, [load], tenant=bob)
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/latest", False)
    again = [harness.gateway.submit(TENANT, "forward_backward", model_id, 4, _fb(model_id, 4, [_datum(4)]), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 5, _optim(model_id, 5)),
             harness.gateway.submit(TENANT, "save_weights", model_id, 6, _save(model_id, 6, "latest", overwrite=True))]
    run_until(trainer, harness, again)
    alice_weights = trainer.engine.weights(model_run_name(model_id))
    abandon(trainer)  # nothing folded or committed: a restarted trainer replays the whole log
    restarted = harness.trainer()
    probe = harness.gateway.submit(bob, "forward_backward", bob_model, 1, _fb(bob_model, 1, [_datum(5)]), "pb")
    run_until(restarted, harness, [probe], tenant=bob)
    error = json.loads(harness.result(probe, bob)[0])["error"]
    assert "was saved again, deleted or expired since" in error and "start a new training client" in error, error
    assert model_run_name(bob_model) not in restarted.engine.adapters()
    step_until(restarted, lambda: model_run_name(model_id) in restarted.engine.adapters()
               and restarted.models[model_id].next_seq >= 7, "Alice's calls were not replayed")
    assert_same(restarted.engine.weights(model_run_name(model_id)), alice_weights)
    restarted.close()


def test_a_replayed_load_whose_answer_names_no_source_is_checked_as_a_new_one(harness, monkeypatch):
    """An answer stored before loads named their source: its replay gets the access check of a first load."""
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "save_weights", model_id, 1, _save(model_id, 1, "w"))])
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/w", True)
    bob, bob_session = BOB, harness.gateway.create_session(BOB, [], {})
    load, bob_model = load_as(harness, bob_session, 0, f"tinker://{model_id}/weights/w")
    dies_at_put(monkeypatch, harness.store, f"{bob_session}/models/0.fold.json")  # killed before the load's fold
    with pytest.raises(Killed):
        run_until(trainer, harness, [load], tenant=bob)
    monkeypatch.undo()
    key = result_path(bob_session, load, "json")
    answer = json.loads(harness.store.get(key))
    assert answer.pop("source")["request_id"] == f"{harness.session}.train.0.1"
    harness.store.put(key, json.dumps(answer).encode())  # as an older trainer wrote it
    harness.gateway.publish_checkpoint(TENANT, model_id, "weights/w", False)
    abandon(trainer)
    restarted = harness.trainer()
    probe = harness.gateway.submit(bob, "forward_backward", bob_model, 1, _fb(bob_model, 1, [_datum(5)]), "pb")
    run_until(restarted, harness, [probe], tenant=bob)
    assert "no session" in json.loads(harness.result(probe, bob)[0])["error"]  # Alice's, not published any more
    restarted.close()


def test_a_client_started_from_a_state_saved_again_since_comes_back_from_its_own_fold(harness):
    """Alice's second training client starts from her `latest` (with its optimizer) and trains; her first client
    then saves `latest` again.  The second client was folded right after its load, so a trainer killed now brings
    it back from that fold and its calls since, with the weights it had, and never reads `latest` again."""
    trainer = no_idle_folds(harness.trainer())
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 3, "latest")  # seq_ids 1 to 3
    load, second = load_as(harness, harness.session, 1, f"tinker://{model_id}/weights/latest", TENANT, True)
    run_until(trainer, harness, [load])
    run_until(trainer, harness, [
        harness.gateway.submit(TENANT, "forward_backward", second, 1, _fb(second, 1, [_datum(4)]), "pb"),
        harness.gateway.submit(TENANT, "optim_step", second, 2, _optim(second, 2))])
    run_until(trainer, harness, [
        harness.gateway.submit(TENANT, "forward_backward", model_id, 4, _fb(model_id, 4, [_datum(5)]), "pb"),
        harness.gateway.submit(TENANT, "optim_step", model_id, 5, _optim(model_id, 5)),
        harness.gateway.submit(TENANT, "save_weights", model_id, 6, _save(model_id, 6, "latest", overwrite=True))])
    assert json.loads(harness.store.get(f"sessions/{harness.session}/models/1.fold.json"))["seq_id"] == 0
    second_weights = trainer.engine.weights(model_run_name(second))
    abandon(trainer)  # killed: only the load's fold was written, nothing committed
    restarted = harness.trainer()
    probe = harness.gateway.submit(TENANT, "forward_backward", second, 3, _fb(second, 3, [_datum(6)]), "pb")
    run_until(restarted, harness, [probe])
    data, fmt = harness.result(probe)
    assert fmt == "pb", data  # its output, not an error
    assert_same(restarted.engine.weights(model_run_name(second)), second_weights)  # (a forward_backward: no step)
    restarted.close()


def test_a_trainer_killed_between_a_loads_answer_and_its_fold_replays_the_load_and_its_calls_say_why_it_failed(
        harness, monkeypatch):
    """The load is answered before its fold is written: a trainer killed between the two replays the load from
    the log, with the check that its state is the one it loaded then.  That state deleted since, the client's
    next call names that cause and the way out, not a model that does not exist."""
    trainer = no_idle_folds(harness.trainer())
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 3, "latest")
    load, second = load_as(harness, harness.session, 1, f"tinker://{model_id}/weights/latest", TENANT)
    dies_at_put(monkeypatch, harness.store, f"{harness.session}/models/1.fold.json")
    with pytest.raises(Killed):
        run_until(trainer, harness, [load])
    monkeypatch.undo()
    abandon(trainer)
    assert "error" not in json.loads(harness.result(load)[0])  # answered before the kill
    harness.gateway.delete_checkpoint(TENANT, model_id, "weights/latest")
    restarted = harness.trainer()
    probe = harness.gateway.submit(TENANT, "forward_backward", second, 1, _fb(second, 1, [_datum(6)]), "pb")
    run_until(restarted, harness, [probe])
    error = json.loads(harness.result(probe)[0])["error"]
    assert "saved again, deleted or expired" in error and "load_weights" in error, error
    assert "create_training_client_from_state" in error and "does not exist" not in error and "\n" not in error
    restarted.fold_all()  # refused: not folded, its calls stay in the log
    restarted.close()
    again = harness.trainer()  # the next restart finds the same cause
    later = harness.gateway.submit(TENANT, "forward_backward", second, 2, _fb(second, 2, [_datum(6)]), "pb")
    run_until(again, harness, [later])
    assert "saved again, deleted or expired" in json.loads(harness.result(later)[0])["error"]
    again.close()


def test_snapshots_live_as_long_as_their_session_and_named_sampler_weights_outlive_it(harness, tmp_path):
    """save_weights_and_get_sampling_client's versions are retired by the trainer's sweep once the session ended
    (a grace after it); the version of a named save_weights_for_sampler is a checkpoint and stays."""
    trainer = harness.trainer()
    model_id = harness.create()

    def save(seq: int, path: str | None) -> str:
        body = types.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=seq, path=path,
                                                  sampling_session_seq_id=None if path else seq)
        return harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, seq, body.model_dump_json().encode())

    calls = [save(1, None), harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2)),
             save(3, None), save(4, "kept")]
    run_until(trainer, harness, calls)
    registry = AdapterRegistry(harness.store, model_run_name(model_id))
    snapshots = [json.loads(harness.store.get(f"sessions/{harness.session}/samplers/{seq}.json"))["version"]
                 for seq in (1, 3)]
    kept = checkpoints.read_record(harness.store, parse_tinker_path(f"tinker://{model_id}/sampler_weights/kept"))
    assert sorted([*snapshots, kept["version"]]) == registry.versions() == [1, 2, 3]
    assert trainer.sweep_checkpoints() == 0  # the session lives
    harness.gateway.finish(TENANT, harness.session, "success")
    assert trainer.sweep_checkpoints() == 0  # ended, but within the grace
    harness.store.put(lifecycle.end_key(harness.session), json.dumps(
        {"time": time.time() - lifecycle.END_GRACE_S - 1, "reason": "finished: success"}).encode())  # as long ago
    assert trainer.sweep_checkpoints() == 2
    for version in snapshots:
        with pytest.raises(AdapterNotFoundError, match="the session that made it ended"):
            registry.pull(version, tmp_path / "cache")
    assert registry.pull(kept["version"], tmp_path / "cache").is_dir()
    assert trainer.sweep_checkpoints() == 0  # done with
    trainer.close()


@pytest.mark.parametrize("path", ["kept", None])
def test_a_sampler_save_killed_after_it_published_reuses_that_version_when_replayed(harness, monkeypatch, path):
    """A trainer killed between publishing a save_weights_for_sampler's registry version and naming it (a
    checkpoint, or a sampling session) publishes no second version when the call runs again after its restart."""
    trainer = harness.trainer()
    model_id = harness.create()
    body = types.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=1, path=path,
                                              sampling_session_seq_id=None if path else 1)
    save = harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 1, body.model_dump_json().encode())

    def killed(*args, **kwargs):
        raise Killed("after the publish")

    monkeypatch.setattr(saves.checkpoints if path else saves, "name_sampler_version" if path else "write_sampler",
                        killed)
    with pytest.raises(Killed):
        run_until(trainer, harness, [save])
    monkeypatch.undo()
    abandon(trainer)
    registry = AdapterRegistry(harness.store, model_run_name(model_id))
    assert registry.versions() == [1]  # published, and no result written
    restarted = harness.trainer()
    run_until(restarted, harness, [save])
    assert registry.versions() == [1]
    answer = json.loads(harness.result(save)[0])
    if path:
        kept = checkpoints.read_record(harness.store, parse_tinker_path(answer["path"]))
        assert kept["version"] == 1
    else:
        record = json.loads(harness.store.get(f"sessions/{harness.session}/samplers/1.json"))
        assert (answer["sampling_session_id"], record["version"]) == (record["sampling_session_id"], 1)
    later = types.SaveWeightsForSamplerRequest(model_id=model_id, seq_id=2, path="later")
    run_until(restarted, harness, [harness.gateway.submit(TENANT, "save_weights_for_sampler", model_id, 2,
                                                          later.model_dump_json().encode())])
    assert registry.versions() == [1, 2]  # the next save publishes its own
    restarted.close()


def test_a_state_of_another_rank_is_refused_naming_both_shapes_and_the_call_to_use(harness):
    trainer = harness.trainer()
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 7, "w")
    other = harness.gateway.register_model(TENANT, harness.session, 1, harness.base_model, 8, {}, None)
    harness.gateway.submit(TENANT, "create_model", other, None, types.CreateModelRequest(
        session_id=harness.session, model_seq_id=1, base_model=harness.base_model,
        lora_config=types.LoraConfig(rank=8, seed=3)).model_dump_json().encode())
    load = types.LoadWeightsRequest(model_id=other, seq_id=1, path=f"tinker://{model_id}/weights/w", optimizer=False)
    request_id = harness.gateway.submit(TENANT, "load_weights", other, 1, load.model_dump_json().encode())
    run_until(trainer, harness, [request_id])
    answer = json.loads(harness.result(request_id)[0])
    assert answer["category"] == "user"
    assert answer["error"].startswith(f"tinker://{model_id}/weights/w holds a rank 4 (alpha 32, modules ")
    assert "and this training client a rank 8 (alpha 32" in answer["error"]
    assert answer["error"].endswith("start a training client from it instead (create_training_client_from_state)")
    trainer.close()


def test_a_parked_client_whose_reload_fails_for_a_moment_is_reloaded_later_and_one_that_keeps_failing_says_so(
        harness, monkeypatch):
    """A store read that times out (or memory short for a moment) while a parked client is reloaded is no corrupt
    fold: the reload is tried again at the next rounds and the calls run.  Only a reload failing for
    ``reload_retry_s`` answers the client's calls with a server error naming it."""
    trainer = harness.trainer()
    model_id = harness.create()
    first = [_datum(71)]
    run_until(trainer, harness, [harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                                        _fb(model_id, 1, first), "pb")])
    trainer.idle_unload_s = 0.0
    trainer.expire_sessions()  # parked
    trainer.idle_unload_s = 600.0
    get, failures = harness.store.get, []

    def flaky_get(key, *args, **kwargs):
        if ".fold." in key and key.endswith(".safetensors") and len(failures) < failing[0]:
            failures.append(key)
            raise ConnectionError("the bucket timed out")
        return get(key, *args, **kwargs)

    failing = [1]
    monkeypatch.setattr(harness.store, "get", flaky_get)
    second = [_datum(72)]
    calls = [harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, second), "pb"),
             harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))]
    run_until(trainer, harness, calls)
    assert len(failures) == 1 and all(harness.result(c)[1] == "pb" or "metrics" in json.loads(harness.result(c)[0])
                                      for c in calls)
    assert_same(trainer.engine.weights(model_run_name(model_id)),
                reference_weights(harness.base_model, [first, second]))
    trainer.idle_unload_s = 0.0
    trainer.expire_sessions()  # parked again; now every read fails
    trainer.idle_unload_s, trainer.reload_retry_s, failing[0] = 600.0, 0.0, 10**6
    late = harness.gateway.submit(TENANT, "optim_step", model_id, 4, _optim(model_id, 4))
    run_until(trainer, harness, [late])
    answer = json.loads(harness.result(late)[0])
    assert answer["category"] == "server" and "could not be reloaded" in answer["error"]
    assert "ConnectionError" in answer["error"]
    trainer.close()


def test_calls_beyond_the_limit_waiting_behind_a_gap_are_answered_at_once(harness):
    """A client that skips a seq_id and sends on would park every later call in the trainer's memory, holding the
    log's offsets back for every tenant: beyond ``max_waiting_calls`` they are answered with a user error."""
    trainer = harness.trainer()
    trainer.max_waiting_calls = 3
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    sent = {seq: harness.gateway.submit(TENANT, "forward_backward", model_id, seq, _fb(model_id, seq, [_datum(seq)]),
                                        "pb") for seq in range(2, 7)}  # seq_id 1 never sent
    run_until(trainer, harness, [sent[5], sent[6]])
    for seq in (5, 6):
        answer = json.loads(harness.result(sent[seq])[0])
        assert answer["category"] == "user" and "3 calls of" in answer["error"] and "seq_id 1" in answer["error"]
    assert sorted(trainer.models[model_id].pending) == [2, 3, 4] and harness.result(sent[2]) is None
    trainer.close()


def test_calls_waiting_for_a_seq_id_a_live_client_gave_up_on_are_answered_and_free_the_log(harness):
    """A request of a split call whose retries ran out (a lost connection) makes the SDK give up the call (and
    poison its training client) before it sends the first request: the others wait for a seq_id that never comes
    while the session lives on (its other clients heartbeat).  After ``gap_give_up_s`` they are answered, so the
    log's offsets move on; a lapsed session's calls still wait (a laptop asleep)."""
    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    stranded = harness.gateway.submit(TENANT, "forward_backward", model_id, 3, _fb(model_id, 3, [_datum(81)]), "pb")
    harness.gateway.heartbeat(TENANT, harness.session)
    trainer.step()
    trainer.expire_sessions()
    assert harness.result(stranded) is None and trainer.models[model_id].pending  # it waits for seq_id 1 and 2
    trainer.models[model_id].gap_since -= 100.0  # it has waited 100 s, then the laptop sleeps
    trainer.gap_give_up_s = 0.0
    trainer.session_timeout_s = 0.0  # lapsed: still waiting
    trainer.expire_sessions()
    assert harness.result(stranded) is None
    trainer.session_timeout_s, trainer.gap_give_up_s = 300.0, 5.0
    harness.gateway.heartbeat(TENANT, harness.session)  # back from its sleep: the wait counts from now
    trainer.expire_sessions()
    assert harness.result(stranded) is None
    trainer.gap_give_up_s = 0.0  # live, and waited long enough: given up on
    trainer.expire_sessions()
    answer = json.loads(harness.result(stranded)[0])
    assert answer["category"] == "user" and "seq_id 1" in answer["error"] and "never arrived" in answer["error"]
    assert not trainer.models[model_id].pending
    offsets = trainer.consumer.positions()
    trainer.fold_all()
    assert trainer._committed == offsets  # nothing held back any more
    trainer.close()


def test_a_split_call_whose_later_request_the_gateway_refused_is_answered_at_once_and_trains_nothing(harness):
    """The SDK sends a split forward_backward's first request only once the others were accepted: when the gateway
    refuses a later one (413 over-size), the first never comes.  The refusal on the log tells the trainer so: the
    call's requests are answered at once, not after ``gap_give_up_s``, none of them trains, and a request of the
    call still on its way is answered as it arrives."""
    from pipeline.api.wire import forward_backward_prefix

    trainer = harness.trainer()
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    accepted = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, [_datum(71)]), "pb")
    header = forward_backward_prefix(_fb(model_id, 3, [_datum(72)] * 50)[:1024])
    harness.gateway.refuse(TENANT, "forward_backward", header, "pb", "request body over 4096 bytes; send smaller")
    refused = f"{harness.session}.train.0.3"  # seq_id 1, the call's first request, is never sent
    run_until(trainer, harness, [accepted, refused], timeout_s=30.0)
    assert "4096 bytes" in json.loads(harness.result(refused)[0])["error"]
    answer = json.loads(harness.result(accepted)[0])
    assert answer["category"] == "user" and "did not run" in answer["error"] and "seq_id 3" in answer["error"]
    late = harness.gateway.submit(TENANT, "forward_backward", model_id, 4, _fb(model_id, 4, [_datum(73)]), "pb")
    run_until(trainer, harness, [late], timeout_s=30.0)
    assert "did not run" in json.loads(harness.result(late)[0])["error"]
    model = trainer.models[model_id]
    assert not model.pending and not model.has_gradients
    assert not trainer.engine.has_gradients(ops.adapter_name(model_id))  # nothing of the call was trained
    trainer.close()


def test_trainers_of_one_base_model_in_two_namespaces_read_in_groups_of_their_own(harness):
    # A consumer group is the broker's, not a namespace's: had a base model's trainers in two namespaces one group,
    # the second one's join would stall the first in a rebalance (the dev stack's broker never assigns it at all).
    staging = harness.trainer()
    prod_bus = harness.bus.model_copy(update={"namespace": f"{harness.bus.namespace}-prod"})
    prod = TrainerWorker(harness.store, prod_bus, harness.base_model, TrainingEngine(harness.base_model, device="cpu"),
                         consumer_options=harness.fast_group)
    try:
        assert staging.consumer.wait_for_assignment() == [(f"{harness.bus.namespace}.requests", 0)]
        deadline, staging_rebalanced = time.monotonic() + 20.0, False
        while not prod.consumer.assignment() and time.monotonic() < deadline:
            staging.step(poll_timeout_s=0.1)  # the staging trainer works on meanwhile
            staging_rebalanced |= staging.consumer.rebalancing
            prod.consumer.wait_for_assignment(timeout_s=1.0)  # (a join needs polls longer than 0.1 s to finish)
        assert prod.consumer.assignment() == [(f"{prod_bus.namespace}.requests", 0)], "prod never got its partition"
        assert not staging_rebalanced, "prod's trainer joining stalled staging's in a rebalance"
        assert staging.consumer.group_id != prod.consumer.group_id
        harness.create()
        run_until(staging, harness, [f"{harness.session}.train.0.create"])
        staging.fold_all()
        assert staging.consumer.committed() == {0: 1}, "staging's trainer commits in its own group undisturbed"
    finally:
        staging.close()
        prod.close()


def test_a_trainer_upgraded_from_the_unnamespaced_group_starts_where_that_group_had_committed(harness):
    # A trainer of an earlier release read in api-trainer-<digest>, whatever its namespace: here one stand-in reads
    # in that group, executes and folds the first two calls (committed: offset 2), and goes away.
    earlier = harness.trainer()
    earlier.consumer.close()
    digest = hashlib.sha256(harness.base_model.encode()).hexdigest()[:16]
    earlier.consumer = request_reader(harness.bus, f"api-trainer-{digest}", harness.fast_group)
    model_id = harness.create()
    chunk = [_datum(7)]
    run_until(earlier, harness, [f"{harness.session}.train.0.create",
                                 harness.gateway.submit(TENANT, "forward_backward", model_id, 1,
                                                        _fb(model_id, 1, chunk), "pb")])
    earlier.fold_all()
    assert earlier.consumer.committed() == {0: 2}
    earlier.close()
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 2, _optim(model_id, 2))
    trainer = harness.trainer()
    try:
        assert trainer.consumer.committed() == {0: 2}, "the namespaced group starts where the former one stopped"
        deadline, read = time.monotonic() + 20.0, []
        while not read and time.monotonic() < deadline:
            read = trainer.consumer.poll(timeout_s=1.0)
        assert [event.offset for event in read] == [2], "calls the former group had done are not read again"
        for event in read:
            trainer.accept(event)
        run_until(trainer, harness, [step])
        assert_same(trainer.engine.weights(f"{harness.session}.train.0"),
                    reference_weights(harness.base_model, [chunk]))
    finally:
        trainer.close()


def test_a_state_of_another_base_model_is_refused_by_the_trainer_naming_both(harness):
    """A save records its base model; the trainer refuses to load a state trained on another base model (the
    adapter's shapes may match, and the weights then mean nothing), whether its record says so or, for a state saved
    without it, its training client's record does.  The gateway refuses such a load first where it can read the
    state; the trainer checks what reaches it anyway."""
    trainer = harness.trainer()
    model_id = harness.create()
    train_and_save(harness, trainer, model_id, 7, "w")
    saved = parse_tinker_path(f"tinker://{model_id}/weights/w")
    assert checkpoints.read_record(harness.store, saved)["base_model"] == harness.base_model
    other_model = "/models/other"
    harness.store.put(f"sessions/{harness.session}/models/5.json", json.dumps({"base_model": other_model}).encode())
    foreign = parse_tinker_path(f"tinker://{harness.session}:train:5/weights/old")  # saved without a base_model
    harness.store.put(checkpoints.weights_key(foreign), harness.store.get(checkpoints.weights_key(saved)))
    checkpoints.write_record(harness.store, foreign, 1, request_id="r")
    relabelled = parse_tinker_path(f"tinker://{model_id}/weights/relabelled")  # its record names another base
    harness.store.put(checkpoints.weights_key(relabelled), harness.store.get(checkpoints.weights_key(saved)))
    checkpoints.write_record(harness.store, relabelled, 1, request_id="r", base_model=other_model)
    loads = [harness.gateway.submit(TENANT, "load_weights", model_id, seq, types.LoadWeightsRequest(
        model_id=model_id, seq_id=seq, path=str(path), optimizer=False).model_dump_json().encode())
        for seq, path in ((4, foreign), (5, relabelled), (6, saved))]
    run_until(trainer, harness, loads)
    for request_id, path in zip(loads[:2], (foreign, relabelled), strict=True):
        answer = json.loads(harness.result(request_id)[0])
        assert answer["category"] == "user"
        assert answer["error"].startswith(f"{path} holds LoRA weights trained on {other_model}, which mean nothing "
                                          f"on {harness.base_model}; load it into a training client of {other_model}")
    assert json.loads(harness.result(loads[2])[0])["type"] == "load_weights"  # its own base model's state loads
    trainer.close()


def count_engine_calls(monkeypatch) -> dict[str, int]:
    """How many forward_backward and optim_step calls reach the engine from now on (the translation's, counted)."""
    counts = {"forward_backward": 0, "optim_step": 0}
    for op in counts:
        real = getattr(ops, op)

        def counted(*args, _op=op, _real=real, **kwargs):
            counts[_op] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(ops, op, counted)
    return counts


def test_calls_of_a_session_that_ended_before_their_turn_do_not_run_and_a_replay_skips_them_too(harness, monkeypatch):
    """A client that sent a step and went away (its session finished) leaves calls whose results nobody reads: they
    are answered with a user error naming the end instead of holding the trainer from other tenants' calls, and
    they change nothing.  A trainer restarted from the fold before them runs again what ran before the end (the
    model's state is rebuilt as it was) and leaves the calls answered so as they are."""
    trainer = no_idle_folds(harness.trainer())
    trainer.liveness.live_check_s = 0.0  # (an end is seen up to END_CHECK_S late)
    trainer._last_expiry = float("inf")  # no unload (and its fold) between the calls
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    trainer.fold_all()
    fb1 = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(41)]), "pb")
    run_until(trainer, harness, [fb1])
    counts = count_engine_calls(monkeypatch)
    fb2 = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, [_datum(42)]), "pb")
    step = harness.gateway.submit(TENANT, "optim_step", model_id, 3, _optim(model_id, 3))
    harness.gateway.finish(TENANT, harness.session, "success")
    run_until(trainer, harness, [fb2, step])
    assert counts == {"forward_backward": 0, "optim_step": 0}
    for request_id, op in ((fb2, "forward_backward"), (step, "optim_step")):
        answer = json.loads(harness.result(request_id)[0])
        assert answer == {"error": f"{op} did not run: session {harness.session} ended (finished: success) before "
                                   "its turn; send it again from a live ServiceClient", "category": "user"}
    abandon(trainer)  # nothing folded past the creation
    restarted = harness.trainer()
    restarted._last_expiry = float("inf")  # its session ended: an expiry would drop the model once replayed
    step_until(restarted, lambda: model_id in restarted.models and restarted.models[model_id].next_seq == 4,
               "the restarted trainer did not replay the model's calls")
    assert counts == {"forward_backward": 1, "optim_step": 0}  # fb1 again (it ran before the end), not the others
    assert restarted.models[model_id].has_gradients  # fb1's
    assert json.loads(harness.result(step)[0])["category"] == "user"
    restarted.close()


def test_calls_of_an_ended_session_whose_model_is_parked_are_answered_without_loading_it(harness, monkeypatch):
    """A parked model (its fold on the store, out of the engine) is not loaded again only to answer that its session
    ended: that load would push a live tenant's adapter out of a full engine for nothing."""
    trainer = no_idle_folds(harness.trainer())
    trainer.liveness.live_check_s = 0.0
    trainer._last_expiry = float("inf")
    model_id = harness.create()
    run_until(trainer, harness, [f"{harness.session}.train.0.create"])
    fb1 = harness.gateway.submit(TENANT, "forward_backward", model_id, 1, _fb(model_id, 1, [_datum(41)]), "pb")
    run_until(trainer, harness, [fb1])
    trainer._park(trainer.models[model_id], "idle")
    counts = count_engine_calls(monkeypatch)
    fb2 = harness.gateway.submit(TENANT, "forward_backward", model_id, 2, _fb(model_id, 2, [_datum(42)]), "pb")
    harness.gateway.finish(TENANT, harness.session, "success")
    run_until(trainer, harness, [fb2])
    model = trainer.models[model_id]
    assert model.parked and not model.loaded and model.next_seq == 3
    assert counts == {"forward_backward": 0, "optim_step": 0}
    assert "ended (finished: success) before its turn" in json.loads(harness.result(fb2)[0])["error"]
    trainer.close()
