"""The Tinker-compatible API end to end: the real ``tinker==0.38.0`` SDK against ``rlpipe serve``.

One server per module: the gateway (``rlpipe serve --role gateway``, a real
process) and one trainer per base model (``python -m consumers.api.worker``, the
command ``rlpipe serve`` starts for each), on the session's Tansu broker and a
file:// store, serving two base models of different shapes: the tiny model and
a smaller one.  The crash tests at the end SIGKILL the trainer after a
``forward_backward``, after an ``optim_step`` and after a sampler save, and
start a new one.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from safetensors.torch import load as load_safetensors

from pipeline.devstack.process import free_port
from pipeline.io.bus import GROUP_TIMINGS_ENV
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from schemas.config import SamplerConfig

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

ALICE, BOB = "tml-alice", "tml-bob"
MAX_CALL_TOKENS = 4096  # the gateway's cap on one request's tokens: above every other test's calls (3,072 at most)
FAST_GROUP_MS = {"session_timeout_ms": 6000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 60_000}


@dataclass
class Server:
    url: str
    base_model: str
    second_model: str
    store: ObjectStore
    env: dict[str, str]
    logs: Path
    trainer: subprocess.Popen[bytes] | None = None
    trainer_log: Path | None = None
    gateway: subprocess.Popen[bytes] | None = None
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)
    gateway_args: list[str] = field(default_factory=list)  # further options of ``rlpipe serve --role gateway``

    def start_trainer(self, base_model: str | None = None) -> subprocess.Popen[bytes]:
        """A trainer for ``base_model`` (default: the first model; it becomes ``self.trainer``)."""
        path = self.logs / f"trainer-{len(self.processes)}.log"
        log = open(path, "ab")  # noqa: SIM115 - the child owns it
        process = subprocess.Popen(
            [sys.executable, "-m", "consumers.api.worker", "--base-model", base_model or self.base_model, "--store",
             self.store.root, "--bootstrap", self.env["RLPIPE_BUS__BOOTSTRAP_SERVERS"], "--namespace",
             self.env["RLPIPE_BUS__NAMESPACE"], "--device", "cpu"], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        if base_model is None:
            self.trainer, self.trainer_log = process, path
        return process

    def start_gateway(self) -> None:
        log = open(self.logs / "gateway.log", "ab")  # noqa: SIM115 - the child owns it
        self.gateway = subprocess.Popen(
            [sys.executable, "-c", "from pipeline.cli.main import main; main()", "serve", "--role", "gateway",
             "--base-model", self.base_model, "--base-model", self.second_model, "--port",
             self.url.rsplit(":", 1)[1], *self.gateway_args], env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(self.gateway)
        deadline = time.monotonic() + 90
        while True:
            assert self.gateway.poll() is None, (self.logs / "gateway.log").read_text()[-2000:]
            try:
                if httpx.get(f"{self.url}/api/v1/healthz", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the gateway did not answer within 90 s"
            time.sleep(0.5)

    def service(self, key: str = ALICE) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.url, api_key=key)

    def stop(self) -> None:
        """Terminate every process started (kill what does not stop within 30 s)."""
        # the SDK clients made here keep heartbeating from their own threads after the server is gone;
        # their warnings would land in what later tests capture from stdout
        logging.getLogger("tinker").setLevel(logging.CRITICAL)
        for process in self.processes:
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()


@pytest.fixture(scope="module")
def server(kafka_broker, tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    os.environ["TINKER_TELEMETRY"] = "0"
    folder = tmp_path_factory.mktemp("tinker-api")
    env = {**os.environ, "RLPIPE_BUS__BOOTSTRAP_SERVERS": kafka_broker.bootstrap_servers,
           "RLPIPE_BUS__NAMESPACE": f"t{uuid.uuid4().hex[:12]}", "RLPIPE_STORE__ROOT": f"file://{folder}/store",
           "RLPIPE_HOME": str(folder / "home"), GROUP_TIMINGS_ENV: json.dumps(FAST_GROUP_MS),
           "OMP_NUM_THREADS": "1", "RLPIPE_API_MAX_CALL_TOKENS": str(MAX_CALL_TOKENS)}
    from producers.tiny_model import build_tiny_model

    second = str(build_tiny_model(folder / "models" / "small", pretrain=False, hidden_size=64, num_heads=2,
                                  num_kv_heads=1, num_layers=2, intermediate_size=128))
    port = free_port()
    server = Server(f"http://127.0.0.1:{port}", tiny_model_dir, second, ObjectStore(f"file://{folder}/store"), env,
                    folder)
    server.start_trainer()
    server.start_trainer(second)
    try:
        server.start_gateway()
        yield server
    finally:
        server.stop()


def _data(seed: int, count: int = 3, n: int = 8) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for _ in range(count):
        tokens = rng.integers(3, 250, n + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * n}))
    return data


def _logprobs(output: types.ForwardBackwardOutput) -> list[list[float]]:
    return [o["logprobs"].data for o in output.loss_fn_outputs]


def _adapter(store: ObjectStore, path: str) -> dict[str, torch.Tensor]:
    model_id, _, name = path.removeprefix("tinker://").split("/")
    run = model_id.replace(":", ".")
    tensors = load_safetensors(store.get(f"runs/{run}/weights/{name}.safetensors"))
    return {k: v for k, v in tensors.items() if k.startswith("adapter.")}


def test_training_client_calls_checkpoints_and_rest_client(server):
    service = server.service()
    supported = tinker.RestClient(base_url=server.url, api_key=ALICE).get_server_capabilities().result()
    supported = supported.supported_models
    assert [m.model_name for m in supported] == [server.base_model, server.second_model]
    assert supported[0].max_context_length == SamplerConfig().max_model_len  # what the samplers allow
    training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    assert training.get_tokenizer().encode("hello")  # tokenizer_id is a folder the client loads offline
    data = _data(1)
    before = training.forward(data, "cross_entropy").result()
    output = training.forward_backward(data, "cross_entropy").result()
    assert _logprobs(output) == _logprobs(before)  # forward changed nothing
    assert [len(lp) for lp in _logprobs(output)] == [8, 8, 8]
    assert output.metrics["loss:sum"] == pytest.approx(-sum(map(sum, _logprobs(output))), rel=1e-5)
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    after = training.forward(data, "cross_entropy").result()
    assert _logprobs(after) != _logprobs(before)

    state = training.save_state("w1").result().path
    model_id = training.model_id
    assert state == f"tinker://{model_id}/weights/w1"
    sampler = training.save_weights_for_sampler("s1").result().path
    assert sampler == f"tinker://{model_id}/sampler_weights/s1"
    assert AdapterRegistry(server.store, model_id.replace(":", ".")).versions() == [1]

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    assert resumed.model_id != model_id
    assert _logprobs(resumed.forward(data, "cross_entropy").result()) == _logprobs(after)

    rest = tinker.RestClient(base_url=server.url, api_key=ALICE)
    listed = rest.list_checkpoints(model_id).result().checkpoints
    assert sorted(c.tinker_path for c in listed) == sorted([state, sampler])
    assert all(c.size_bytes for c in listed)  # sampler weights too: their adapter files' bytes
    assert rest.get_training_run(model_id).result().base_model == server.base_model
    rest.delete_checkpoint_from_tinker_path(sampler).result()
    assert [c.tinker_path for c in rest.list_checkpoints(model_id).result().checkpoints] == [state]


def test_the_rest_clients_listings_show_a_tenant_its_own_runs_and_checkpoints(server):
    carol, dave = f"tml-carol-{uuid.uuid4().hex[:6]}", f"tml-dave-{uuid.uuid4().hex[:6]}"
    service = server.service(carol)
    first = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    second = service.create_lora_training_client(base_model=server.second_model, rank=4).result()
    state = first.save_state("listed").result().path
    rest = tinker.RestClient(base_url=server.url, api_key=carol)
    runs = rest.list_training_runs().result()
    assert sorted(r.training_run_id for r in runs.training_runs) == sorted([first.model_id, second.model_id])
    assert runs.cursor.total_count == 2 and len(rest.list_training_runs(limit=1).result().training_runs) == 1
    assert [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints] == [state]
    (session_id,) = rest.list_sessions().result().sessions
    assert rest.get_session(session_id).result().training_run_ids == [first.model_id, second.model_id]
    other = tinker.RestClient(base_url=server.url, api_key=dave)
    assert other.list_training_runs().result().training_runs == []
    assert other.list_user_checkpoints().result().checkpoints == [] and other.list_sessions().result().sessions == []
    with pytest.raises(tinker.APIStatusError, match="no session"):
        other.get_session(session_id).result()
    unserved = httpx.get(f"{server.url}/api/v1/no_such_call", headers={"X-API-Key": carol})
    assert unserved.status_code == 404 and "not served by rlpipe" in unserved.json()["error"]


@pytest.mark.filterwarnings("ignore:.*tie_word_embeddings:UserWarning")  # peft on the tiny model's tied head
def test_weights_leave_the_server_by_the_tinker_cli_and_score_in_peft_as_in_training(server, tmp_path):
    """`tinker checkpoint download` of a training state: the CLI loads it into a new training client, exports it
    as external weights (a PEFT folder) with a one-hour TTL, downloads each file by its signed URL and deletes
    the export.  peft loads the folder onto the base model and gives the logprobs the training client gave.
    `tinker checkpoint publish` lets another key start from the state; `unpublish` takes that back."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    erin = f"tml-erin-{uuid.uuid4().hex[:6]}"
    training = server.service(erin).create_lora_training_client(base_model=server.base_model, rank=4).result()
    data = _data(5)
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    trained = _logprobs(training.forward(data, "cross_entropy").result())
    state = training.save_state("final").result().path
    env = {**server.env, "TINKER_BASE_URL": server.url, "TINKER_API_KEY": erin}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        """`tinker checkpoint ARGS` in its own process, as a user runs it; its effects are checked after it.  On a
        loaded machine tinker 0.38's CLI can abort as its interpreter exits, its work done (README, field notes):
        that exit is let pass, with faulthandler's report to tell it from a crash in the work."""
        done = subprocess.run([sys.executable, "-X", "faulthandler", "-m", "tinker.cli", "checkpoint", *args],
                              env=env, capture_output=True, text=True, timeout=300)
        aborted_at_exit = done.returncode == -signal.SIGABRT and "<no Python frame>" in done.stderr
        assert done.returncode == 0 or aborted_at_exit, done.stdout + done.stderr
        return done

    done = cli("download", state, "--output", str(tmp_path))
    folder = tmp_path / state.removeprefix("tinker://").replace("/", "_")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    rest = tinker.RestClient(base_url=server.url, api_key=erin)
    left = [(c.checkpoint_type, c.tinker_path) for c in rest.list_user_checkpoints().result().checkpoints]
    assert left == [("training", state)], done.stderr[-3000:]  # the CLI deleted its temporary export

    # published, Alice's key may start a training client from Erin's state; taken back, it may not
    cli("publish", state)
    assert [c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [True]
    borrowed = server.service(ALICE).create_training_client_from_state(state).result()
    assert _logprobs(borrowed.forward(data, "cross_entropy").result()) == trained
    cli("unpublish", state)
    assert [c.public for c in rest.list_checkpoints(training.model_id).result().checkpoints] == [False]
    with pytest.raises(tinker.APIStatusError, match="no session"):
        server.service(ALICE).create_training_client_from_state(state).result()

    base = AutoModelForCausalLM.from_pretrained(server.base_model, torch_dtype=torch.float32)
    model = PeftModel.from_pretrained(base, folder).eval()
    untrained = _logprobs(server.service(erin).create_lora_training_client(
        base_model=server.base_model, rank=4).result().forward(data, "cross_entropy").result())
    with torch.no_grad():
        for datum, expected, before in zip(data, trained, untrained, strict=True):
            logits = model(torch.tensor([datum.model_input.to_ints()])).logits[0].float()
            targets = torch.tensor(datum.loss_fn_inputs["target_tokens"].data)
            scored = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0].tolist()
            assert np.allclose(scored, expected, atol=1e-4), (scored, expected)
            assert not np.allclose(scored, before, atol=1e-3)  # the training step is in the download


def test_two_base_models_served_at_once_each_client_on_its_own(server):
    service = server.service()
    first = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    second = service.create_lora_training_client(base_model=server.second_model, rank=4).result()
    data = _data(11)
    pending = [client.forward_backward(data, "cross_entropy") for client in (first, second)]  # at the same time
    outputs = [future.result() for future in pending]
    assert [len(lp) for lp in _logprobs(outputs[1])] == [8, 8, 8]
    assert _logprobs(outputs[0]) != _logprobs(outputs[1])  # two different networks
    for client in (first, second):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert second.get_info().model_data.model_name == server.second_model


def test_the_calls_are_on_the_log_and_the_sessions_in_the_store(server):
    from typer.testing import CliRunner

    from pipeline.cli.main import app

    runner = CliRunner()
    where = ["--bootstrap", server.env["RLPIPE_BUS__BOOTSTRAP_SERVERS"], "--namespace", server.env["RLPIPE_BUS__NAMESPACE"]]
    tailed = runner.invoke(app, ["topics", "tail", "requests", "-n", "100", "--json", *where])
    assert tailed.exit_code == 0, tailed.output
    records = json.loads(tailed.stdout)
    assert not [r for r in records if "event" not in r], records[:1]
    ops = {record["event"]["payload"]["op"] for record in records}
    assert {"create_model", "forward_backward", "optim_step", "save_weights", "load_weights"} <= ops
    listed = runner.invoke(app, ["sessions", "list", "--json", "--set", f"store.root={server.store.root}"])
    assert listed.exit_code == 0, listed.output
    sessions = json.loads(listed.stdout)
    assert sessions and all(s["requests"] == s["results"] and not s["pending"] for s in sessions)


def test_out_of_order_chunks_and_resent_calls(server):
    from tinker.proto.request_conv import forward_backward_request_to_proto

    service = server.service()
    training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    model_id, headers = training.model_id, {"X-API-Key": ALICE, "Content-Type": "application/x-protobuf"}

    def post(seq: int, data: list[types.Datum]) -> str:
        request = types.ForwardBackwardRequest(types.ForwardBackwardInput(data, "cross_entropy"), model_id, seq)
        body = forward_backward_request_to_proto(request).SerializeToString()
        answer = httpx.post(f"{server.url}/api/v1/forward_backward", content=body, headers=headers, timeout=10)
        return answer.json()["request_id"]

    def poll(request_id: str, hold: float = 30) -> httpx.Response:
        return httpx.post(f"{server.url}/api/v1/retrieve_future", headers={"X-API-Key": ALICE},
                          json={"request_id": request_id, "allow_metadata_only": True}, timeout=hold + 10)

    second = post(2, _data(3))
    time.sleep(2.0)
    assert poll(second).json()["type"] == "try_again"  # seq_id 1 has not arrived: the gap is waited for
    first = post(1, _data(2))
    assert post(1, _data(2)) == first  # a resent call is the same request
    assert poll(second).headers["content-type"] == "application/x-protobuf"
    assert poll(first).headers["content-type"] == "application/x-protobuf"


def test_bad_input_is_a_user_error_and_others_carry_on(server):
    alice, bob = server.service(ALICE), server.service(BOB)
    training = alice.create_lora_training_client(base_model=server.base_model, rank=4).result()
    with pytest.raises(tinker.RequestFailedError, match="stable_reinforce"):
        training.forward_backward(_data(1), "stable_reinforce").result()
    vocab = [types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 10**7]})]
    with pytest.raises(tinker.RequestFailedError, match="vocabulary"):
        training.forward_backward(vocab, "cross_entropy").result()
    with pytest.raises(tinker.APIStatusError, match="not served here"):
        alice.create_lora_training_client(base_model="/no/such/model", rank=4).result()
    state = training.save_state("mine").result().path
    with pytest.raises(tinker.APIStatusError, match=r"unknown model|no session"):
        bob.create_training_client_from_state(state).result()
    answer = httpx.post(f"{server.url}/api/v1/get_info", headers={"X-API-Key": BOB},
                        json={"model_id": training.model_id, "type": "get_info"})
    assert answer.status_code == 404 and answer.json()["category"] == "user"
    assert training.forward_backward(_data(1), "cross_entropy").result().metrics["loss:sum"] > 0


def test_a_forward_backward_the_sdk_splits_fails_as_a_whole_and_leaves_no_gradient(server):
    """1,025 datums: the SDK sends them as several requests (at most 1,024 datums, and the gateway's size, each).  A
    bad datum in the last fails the call, named by its place in the call, and the earlier requests' gradients are
    undone with it: the next optim_step finds none (grad_norm 0) and the weights stay."""
    service = server.service()
    training = service.create_lora_training_client(base_model=server.base_model, rank=4, seed=1).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([5, 6]), loss_fn_inputs={"target_tokens": [6, 10**7]})
    data = _data(30, count=1024, n=3) + [bad]
    with pytest.raises(tinker.RequestFailedError) as failed:
        training.forward_backward(data, "cross_entropy").result()
    said = re.search(r"datum (\d+): target_tokens .* in request (\d+) of the (\d+) the SDK split .*its datum 0 is "
                     r"datum (\d+) of the call", str(failed.value))
    assert said and said[2] == said[3] != "1", str(failed.value)  # the last of several requests
    assert int(said[1]) + int(said[4]) == 1024, str(failed.value)  # the bad datum's place in the call
    before = training.save_state("before").result().path
    step = training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert step.metrics["grad_norm:mean"] == 0.0  # before the fix: the first request's gradients were applied
    after = training.save_state("after").result().path
    a, b = _adapter(server.store, before), _adapter(server.store, after)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_a_call_the_gateway_refuses_leaves_the_training_client_usable(server):
    """The SDK numbers a call before sending it: a refused one must not leave a gap the trainer waits on."""
    training = server.service().create_lora_training_client(base_model=server.base_model, rank=4).result()
    with pytest.raises(tinker.APIStatusError, match="checkpoint name"):
        training.save_state("a/b").result()
    with pytest.raises(tinker.APIStatusError, match="learning_rate"):
        training.optim_step(types.AdamParams(learning_rate=float("nan"))).result()
    with pytest.raises(tinker.APIStatusError, match="checkpoint name"):
        training.save_weights_for_sampler("../x").result()
    output = training.forward_backward(_data(1), "cross_entropy").result(timeout=60)
    assert output.metrics["loss:sum"] > 0
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60).metrics


def test_a_forward_backward_over_the_token_cap_is_refused_naming_the_setting_and_the_client_goes_on(server):
    """A datum alone longer than the gateway's cap is refused at once (HTTP 400, which the SDK raises as
    ``APIStatusError``), forward or forward_backward; the training client's next calls run."""
    training = server.service().create_lora_training_client(base_model=server.base_model, rank=4).result()
    big = _data(8, count=1, n=MAX_CALL_TOKENS + 1)
    says = rf"forward_backward of {MAX_CALL_TOKENS + 1:,} tokens .* cap of {MAX_CALL_TOKENS:,} tokens .*shorten it"
    with pytest.raises(tinker.APIStatusError, match=says):
        training.forward_backward(big, "cross_entropy").result(timeout=60)
    with pytest.raises(tinker.APIStatusError, match=r"forward of .*RLPIPE_API_MAX_CALL_TOKENS"):
        training.forward(big, "cross_entropy").result(timeout=60)
    assert training.forward_backward(_data(1), "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    assert training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60).metrics


def test_a_batch_over_the_token_cap_is_split_by_the_sdk_into_requests_within_it(server):
    """The gateway's client config tells the SDK how large a request may be (``fwdbwd_max_chunk_bytes_count``), so
    a batch whose datums together hold more tokens than the cap, each within it, runs as one call, as one request
    would: the same loss."""
    training = server.service().create_lora_training_client(base_model=server.base_model, rank=4).result()
    batch = _data(9, count=5, n=MAX_CALL_TOKENS // 4)  # 5,120 tokens in all
    split = training.forward(batch, "cross_entropy").result(timeout=120)
    parts = [training.forward(batch[i : i + 2], "cross_entropy").result(timeout=120) for i in range(0, 5, 2)]
    assert split.metrics["loss:sum"] == pytest.approx(sum(p.metrics["loss:sum"] for p in parts), rel=1e-5)
    assert len(split.loss_fn_outputs) == 5


def test_a_restarted_gateway_and_the_client_carries_on(server):
    training = server.service().create_lora_training_client(base_model=server.base_model, rank=4).result()
    training.forward_backward(_data(4), "cross_entropy").result()
    server.gateway.terminate()
    server.gateway.wait(timeout=30)
    pending = training.optim_step(types.AdamParams(learning_rate=1e-2))  # the SDK retries until it answers
    server.start_gateway()
    assert pending.result(timeout=120).metrics is not None
    assert training.forward(_data(4), "cross_entropy").result().metrics["loss:sum"] > 0


KILL_POINTS = ("after_forward_backward", "after_optim_step", "after_sampler_save")


def _train_and_save(client, kill: str | None, server: Server) -> str:
    """forward_backward, optim_step, a named sampler save, another step; SIGKILL the trainer at ``kill``."""

    def maybe_kill(point: str) -> None:
        if point == kill:
            time.sleep(0.5)  # let the trainer fold and commit what it can, as it would while idle
            server.trainer.send_signal(signal.SIGKILL)
            server.trainer.wait()
            server.start_trainer()

    def result(future):
        """The call's result; a trainer that died instead fails at once, with its log."""
        deadline = time.monotonic() + 180
        while True:
            try:
                return future.result(timeout=1)
            except TimeoutError:
                assert server.trainer.poll() is None, server.trainer_log.read_text()[-3000:]
                assert time.monotonic() < deadline, "no result within 180 s"

    result(client.forward_backward(_data(7), "cross_entropy"))
    maybe_kill("after_forward_backward")
    result(client.optim_step(types.AdamParams(learning_rate=1e-2)))
    maybe_kill("after_optim_step")
    result(client.save_weights_for_sampler("s1"))
    maybe_kill("after_sampler_save")
    result(client.forward_backward(_data(8), "cross_entropy"))
    result(client.optim_step(types.AdamParams(learning_rate=1e-2)))
    return result(client.save_state("after")).path


@pytest.mark.parametrize("kill", KILL_POINTS)
def test_a_trainer_killed_mid_run_ends_with_the_weights_of_an_uninterrupted_run(server, kill):
    service = server.service()
    # the same seed: a model created without one is seeded from its own id
    crashed = service.create_lora_training_client(base_model=server.base_model, rank=4, seed=11).result()
    steady = service.create_lora_training_client(base_model=server.base_model, rank=4, seed=11).result()
    crashed_state = _train_and_save(crashed, kill, server)
    steady_state = _train_and_save(steady, None, server)
    a, b = _adapter(server.store, crashed_state), _adapter(server.store, steady_state)
    assert a.keys() == b.keys() and max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    # the sampler version was published once, whatever the trainer re-executed after the restart
    assert AdapterRegistry(server.store, crashed.model_id.replace(":", ".")).versions() == [1]


def test_a_client_started_from_a_state_saved_again_since_goes_on_after_a_trainer_crash(server):
    """A second training client starts from `latest` and steps; the first saves `latest` again; the trainer is
    SIGKILLed and restarted.  The second client was folded right after its load, so it goes on from its own state
    (no replay reads `latest` again), with the logprobs it had."""
    service = server.service()
    first = service.create_lora_training_client(base_model=server.base_model, rank=4, seed=1).result()
    first.forward_backward(_data(1), "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    latest = first.save_state("latest").result().path
    second = service.create_training_client_from_state_with_optimizer(latest).result()
    second.forward_backward(_data(2), "cross_entropy").result()
    second.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    first.forward_backward(_data(3), "cross_entropy").result()
    first.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    first.save_state("latest", overwrite=True).result()
    before = _logprobs(second.forward(_data(4), "cross_entropy").result())
    server.trainer.send_signal(signal.SIGKILL)
    server.trainer.wait()
    server.start_trainer()
    after = _logprobs(second.forward(_data(4), "cross_entropy").result(timeout=180))  # raises if it was lost
    assert np.allclose(np.concatenate(after), np.concatenate(before), atol=1e-5)
    second.forward_backward(_data(5), "cross_entropy").result(timeout=180)
    second.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=180)


def test_forward_backward_custom_trains_as_the_same_loss_served_and_a_pairwise_loss_moves_the_pair(server):
    """The SDK's forward_backward_custom (a forward, the loss's gradient on the laptop, then a cross_entropy
    backward weighted by it, negative weights included) against two clients of the same seed: a custom loss equal
    to cross_entropy ends with the weights of forward_backward(cross_entropy); a DPO-like pairwise loss raises the
    chosen sequence's logprob against the rejected one's."""
    import torch as th

    service = server.service()
    custom, served = (service.create_lora_training_client(base_model=server.base_model, rank=4, seed=11).result()
                      for _ in range(2))
    data = _data(5)

    def cross_entropy(batch: list[types.Datum], logprobs: list[th.Tensor]) -> tuple[th.Tensor, dict[str, float]]:
        loss = sum(-(lp * th.tensor(d.loss_fn_inputs["weights"].data)).sum() for d, lp in zip(batch, logprobs, strict=True))
        return loss, {"custom": 1.0}

    out = custom.forward_backward_custom(data, cross_entropy).result()
    reference = served.forward_backward(data, "cross_entropy").result()
    assert out.metrics["loss:sum"] == pytest.approx(reference.metrics["loss:sum"], rel=1e-5)
    assert out.metrics["custom"] == 1.0
    for client in (custom, served):
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    for a, b in zip(_logprobs(custom.forward(data, "cross_entropy").result()),
                    _logprobs(served.forward(data, "cross_entropy").result()), strict=True):
        assert np.allclose(a, b, atol=1e-5)

    chosen, rejected = _data(6, count=2)

    def pairwise(batch: list[types.Datum], logprobs: list[th.Tensor]) -> tuple[th.Tensor, dict[str, float]]:
        margin = logprobs[0].sum() - logprobs[1].sum()
        return -th.nn.functional.logsigmoid(margin), {"margin": float(margin)}

    def margin() -> float:
        first, second = _logprobs(custom.forward([chosen, rejected], "cross_entropy").result())
        return sum(first) - sum(second)

    before = margin()
    for _ in range(3):
        custom.forward_backward_custom([chosen, rejected], pairwise).result()
        custom.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert margin() > before + 1.0


def test_gspo_through_the_sdk_raises_the_better_sequence_and_lowers_the_worse(server):
    """The SDK's forward_backward(loss_fn="gspo") with sequence_ratio_mask: the sampler logprobs are the model's
    own (a forward), advantage +1 on one sequence and -1 on the other; three steps widen their margin."""
    service = server.service()
    training = service.create_lora_training_client(base_model=server.base_model, rank=4, seed=5).result()
    better, worse = _data(7, count=2)

    def rl_data() -> list[types.Datum]:
        sampled = _logprobs(training.forward([better, worse], "cross_entropy").result())
        signs = (1.0, -1.0)
        return [types.Datum(model_input=d.model_input, loss_fn_inputs={
            "target_tokens": d.loss_fn_inputs["target_tokens"], "logprobs": lp, "advantages": [sign] * len(lp),
            "sequence_ratio_mask": [1.0] * len(lp)}) for d, lp, sign in zip((better, worse), sampled, signs, strict=True)]

    def margin() -> float:
        first, second = _logprobs(training.forward([better, worse], "cross_entropy").result())
        return sum(first) - sum(second)

    before = margin()
    for _ in range(3):
        out = training.forward_backward(rl_data(), "gspo", {"clip_low_threshold": 0.9,
                                                            "clip_high_threshold": 1.1}).result()
        assert out.metrics["ratio_max:max"] == pytest.approx(1.0, abs=1e-4)  # fresh samples: every ratio is 1
        assert out.metrics["num_clipped:sum"] == 0
        training.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    assert margin() > before + 1.0
    no_mask = [types.Datum(model_input=d.model_input, loss_fn_inputs={
        k: v for k, v in d.loss_fn_inputs.items() if k != "sequence_ratio_mask"}) for d in rl_data()]
    with pytest.raises(tinker.RequestFailedError, match="sequence_ratio_mask"):
        training.forward_backward(no_mask, "gspo").result()
