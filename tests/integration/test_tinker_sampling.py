"""Sampling through the Tinker-compatible API end to end: the real ``tinker==0.38.0`` SDK against real processes.

The pattern of ``test_tinker_api``: one server per module on the session's Tansu
broker and a file:// store, here with one trainer (``python -m consumers.api.worker``)
and one sampler (``python -m producers.api_sampler``, the transformers engine)
for the tiny model, and the gateway (``rlpipe serve --role gateway``), which hands
sample calls to the sampler directly as well as through the log, as ``rlpipe serve``
does (``pipeline.api.direct``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import string
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from pipeline.devstack.process import free_port
from pipeline.io.bus import GROUP_TIMINGS_ENV
from pipeline.io.store import ObjectStore
from tests.integration.test_tinker_api import BOB, FAST_GROUP_MS, Server

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

PROMPT = [5, 17, 42, 9, 33, 8]


class SamplingServer(Server):
    def start_sampler(self, direct_port: int | None = None) -> subprocess.Popen[bytes]:
        log = open(self.logs / "sampler.log", "ab")  # noqa: SIM115 - the child owns it
        process = subprocess.Popen(
            [sys.executable, "-m", "producers.api_sampler", "--base-model", self.base_model, "--store",
             self.store.root, "--bootstrap", self.env["RLPIPE_BUS__BOOTSTRAP_SERVERS"], "--namespace",
             self.env["RLPIPE_BUS__NAMESPACE"], "--backend", "transformers",
             # every round looks at its session, and says so in the log (at DEBUG), so a test sees a call's rounds
             "--session-check-s", "0", "--log-level", "DEBUG",
             *(["--direct-port", str(direct_port)] if direct_port else [])],
            env=self.env, stdout=log, stderr=subprocess.STDOUT)
        self.processes.append(process)
        return process


@contextlib.contextmanager
def sampling_server(bootstrap_servers: str, model_dir: str, folder: Path) -> Iterator[SamplingServer]:
    """A trainer, a sampler and the gateway for ``model_dir`` on the broker and a file:// store in ``folder``."""
    env = {**os.environ, "RLPIPE_BUS__BOOTSTRAP_SERVERS": bootstrap_servers,
           "RLPIPE_BUS__NAMESPACE": f"t{uuid.uuid4().hex[:12]}", "RLPIPE_STORE__ROOT": f"file://{folder}/store",
           "RLPIPE_HOME": str(folder / "home"), GROUP_TIMINGS_ENV: json.dumps(FAST_GROUP_MS),
           "OMP_NUM_THREADS": "1"}
    server = SamplingServer(f"http://127.0.0.1:{free_port()}", model_dir, model_dir,
                            ObjectStore(f"file://{folder}/store"), env, folder)
    direct_port = free_port()
    server.gateway_args = ["--direct-sampler", f"http://127.0.0.1:{direct_port}"] * 2  # base_model == second_model
    server.start_trainer()
    server.start_sampler(direct_port)
    try:
        server.start_gateway()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def server(kafka_broker, tiny_model_dir, tmp_path_factory) -> Iterator[SamplingServer]:
    os.environ["TINKER_TELEMETRY"] = "0"
    with sampling_server(kafka_broker.bootstrap_servers, tiny_model_dir,
                         tmp_path_factory.mktemp("tinker-sampling")) as server:
        yield server


def _params(**given) -> types.SamplingParams:
    return types.SamplingParams(**{"max_tokens": 6, "temperature": 1.0, "seed": 7, **given})


def test_sampling_from_the_base_model(server):
    sampling = server.service().create_sampling_client(base_model=server.base_model).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    first = sampling.sample(prompt, 3, _params(stop=[])).result()
    again = sampling.sample(prompt, 3, _params(stop=[])).result()
    assert [s.tokens for s in first.sequences] == [s.tokens for s in again.sequences]  # a seed fixes the draw
    assert all(len(s.tokens) == len(s.logprobs) == 6 and s.stop_reason == "length" for s in first.sequences)
    # top_k 1 leaves one token to draw: every sample is the greedy continuation, each token of logprob 0
    greedy = sampling.sample(prompt, 1, _params(stop=[], temperature=0.0)).result().sequences[0]
    top_1 = sampling.sample(prompt, 3, _params(stop=[], top_k=1)).result().sequences
    assert all(s.tokens == greedy.tokens and np.allclose(s.logprobs, 0.0, atol=1e-6) for s in top_1)
    logprobs = sampling.compute_logprobs(prompt).result()
    assert logprobs[0] is None and len(logprobs) == len(PROMPT) and all(np.isfinite(logprobs[1:]))
    context = server.service().get_server_capabilities().supported_models[0].max_context_length
    with pytest.raises(tinker.BadRequestError, match=f"context of {context} tokens"):  # at submit, not in the future
        sampling.compute_logprobs(types.ModelInput.from_ints([5] * context)).result(timeout=60)
    assert "taking calls directly" in (server.logs / "sampler.log").read_text()  # the gateway's direct path is on


def test_stop_ids_and_strings_are_kept_with_aligned_logprobs(server):
    sampling = server.service().create_sampling_client(base_model=server.base_model).result()
    tokenizer = AutoTokenizer.from_pretrained(server.base_model)
    prompt = types.ModelInput.from_ints(PROMPT)
    by_id = sampling.sample(prompt, 2, _params(stop=list(range(len(tokenizer))))).result()
    assert all(len(s.tokens) == len(s.logprobs) == 1 and s.stop_reason == "stop" for s in by_id.sequences)
    stops = list(string.ascii_letters + string.digits)
    by_string = sampling.sample(prompt, 4, _params(stop=stops, max_tokens=12)).result()
    for sequence in by_string.sequences:
        assert len(sequence.tokens) == len(sequence.logprobs)
        if sequence.stop_reason == "stop":
            assert any(s in tokenizer.decode(sequence.tokens) for s in stops)
            assert not any(s in tokenizer.decode(sequence.tokens[:-1]) for s in stops)
    assert any(s.stop_reason == "stop" for s in by_string.sequences)


def test_topk_logprobs_come_back_through_the_sdk(server):
    """The K most likely tokens at each prompt position (the prompt logprobs' distribution) and at each sampled one
    (the distribution it was drawn from), as the SDK decodes them; K past the bound is refused at submit."""
    sampling = server.service().create_sampling_client(base_model=server.base_model).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    response = sampling.sample(prompt, 2, _params(stop=[]), include_prompt_logprobs=True, topk_prompt_logprobs=4,
                               topk_sample_logprobs=3).result()
    rows = response.topk_prompt_logprobs
    assert rows is not None and len(rows) == len(PROMPT) and rows[0] is None
    for p, row in enumerate(rows[1:], 1):
        values = [logprob for _, logprob in row]
        assert len(row) == 4 and values == sorted(values, reverse=True)
        assert response.prompt_logprobs[p] <= values[0] + 1e-6  # the prompt's token is at most the likeliest
        if PROMPT[p] in dict(row):
            assert dict(row)[PROMPT[p]] == pytest.approx(response.prompt_logprobs[p], abs=1e-6)
    for sequence in response.sequences:  # temperature 1, no cut: three tokens could be drawn at every position
        assert sequence.topk_logprobs is not None and len(sequence.topk_logprobs) == len(sequence.tokens) == 6
        for token, logprob, row in zip(sequence.tokens, sequence.logprobs, sequence.topk_logprobs, strict=True):
            assert len(row) == 3
            assert dict(row)[token] == pytest.approx(logprob, abs=1e-6) if token in dict(row) else logprob <= row[-1][1]
    greedy = sampling.sample(prompt, 1, _params(stop=[], temperature=0.0), topk_sample_logprobs=1).result()
    assert [row[0][0] for row in greedy.sequences[0].topk_logprobs] == greedy.sequences[0].tokens  # top-1: argmax
    last_two = sampling.sample(prompt, 1, _params(), include_prompt_logprobs=True, topk_prompt_logprobs=2,
                               prompt_logprobs_last_n=2).result()
    assert last_two.topk_prompt_logprobs[:-2] == [None] * (len(PROMPT) - 2)
    assert all(len(row) == 2 for row in last_two.topk_prompt_logprobs[-2:])
    plain = sampling.sample(prompt, 1, _params()).result()
    assert plain.topk_prompt_logprobs is None and plain.sequences[0].topk_logprobs is None
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs=21: ask for 0 to 20"):
        sampling.sample(prompt, 1, _params(), topk_prompt_logprobs=21).result(timeout=60)


def test_trained_weights_sample_differently_and_agree_with_forward(server):
    service = server.service()
    training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    rng = np.random.default_rng(3)
    data = []
    for _ in range(3):
        tokens = rng.integers(3, 250, 9).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 8}))
    training.forward_backward(data, "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    trained = training.save_weights_and_get_sampling_client().result()
    base = service.create_sampling_client(base_model=server.base_model).result()
    sequence = PROMPT + [12, 30, 7]
    prompt = types.ModelInput.from_ints(sequence)
    trained_lp, base_lp = trained.compute_logprobs(prompt).result(), base.compute_logprobs(prompt).result()
    assert not np.allclose(trained_lp[1:], base_lp[1:], atol=1e-3)  # the new weights are served
    datum = types.Datum(model_input=types.ModelInput.from_ints(sequence[:-1]),
                        loss_fn_inputs={"target_tokens": sequence[1:]})
    forward = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    assert np.max(np.abs(np.array(forward) - np.array(trained_lp[1:]))) <= 1e-5  # fp32, the same tokens
    samples = trained.sample(types.ModelInput.from_ints(PROMPT), 2, _params(stop=[])).result()
    assert all(len(s.tokens) == len(s.logprobs) == 6 for s in samples.sequences)

    # a named sampler path: sampled by its owner, refused for another tenant
    path = training.save_weights_for_sampler("s1").result().path
    named = service.create_sampling_client(model_path=path).result()
    assert np.allclose(named.compute_logprobs(prompt).result()[1:], trained_lp[1:], atol=1e-5)
    with_base = service.create_sampling_client(model_path=path, base_model=server.base_model).result()
    assert np.allclose(with_base.compute_logprobs(prompt).result()[1:], trained_lp[1:], atol=1e-5)
    with pytest.raises(Exception, match="no session"):
        server.service(BOB).create_sampling_client(model_path=path).result()


def test_the_engines_record_each_sessions_activity_and_the_server_report_draws_it(server, tmp_path):
    import time

    from pipeline.analysis.report.server import SERVER_FIGURE, write_server_report
    from pipeline.api.activity import read_activity

    since, sessions = time.time(), []
    for service in (server.service(), server.service(BOB)):  # two tenants, a session each
        training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                            loss_fn_inputs={"target_tokens": PROMPT[1:], "weights": [1.0] * 5})
        training.forward_backward([datum], "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        sampling = service.create_sampling_client(base_model=server.base_model).result()
        sampling.sample(types.ModelInput.from_ints(PROMPT), 2, _params(stop=[])).result()
        sessions.append(service.holder.get_session_id())
    deadline = time.monotonic() + 30.0  # the engines write their activity every 10 s
    while True:
        mine = [a for a in read_activity(server.store, since) if a.session in sessions]
        seen = {(a.kind, a.session, a.op) for a in mine}
        if all((kind, s, op) in seen for s in sessions for kind, op in (("trainer", "forward_backward"),
                                                                          ("sampler", "sample"))):
            break
        assert time.monotonic() < deadline, f"activity recorded so far: {sorted(seen)}"
        time.sleep(1.0)
    assert {a.op for a in mine if a.kind == "trainer"} >= {"create_model", "forward_backward", "optim_step"}
    assert all(a.end >= a.start >= since for a in mine)
    assert sum(a.tokens for a in mine if a.op == "forward_backward") == 2 * 5
    assert sum(a.tokens for a in mine if a.op == "sample") == 2 * 2 * 6  # two sessions, two samples of 6 tokens
    _, body = write_server_report(server.store, tmp_path, since)
    assert set(sessions) <= set(body["summary"]["sessions"]) and len(set(body["summary"]["tenants"].values())) >= 2
    assert {lane["kind"] for lane in body["duty_cycle"]["lanes"]} == {"trainer", "sampler"}
    assert (tmp_path / SERVER_FIGURE).read_bytes()[:4] == b"\x89PNG"


def test_the_cartpole_example_runs_end_to_end_for_two_steps(server, tmp_path):
    script = Path(__file__).resolve().parents[2] / "examples" / "tinker_cartpole.py"
    env = {**os.environ, "TINKER_API_KEY": "tml-example", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [sys.executable, str(script), "--base-url", server.url, "--base-model", server.base_model, "--max-steps", "5",
         "--demo-episodes", "2", "--sft-steps", "2", "--batch", "8", "--rl-steps", "2", "--groups", "2",
         "--group-size", "2", "--eval-episodes", "3", "--loss", "ppo", "--result-file", str(tmp_path / "r.json")],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "sft step 1" in done.stdout and "rl step 1" in done.stdout and "held-out last version" in done.stdout
    assert re.search(r"final state: tinker://\S+:train:\d+/weights/final ", done.stdout), done.stdout[-2000:]
    rl = [line for line in done.stdout.splitlines() if line.startswith("rl step ")]
    assert len(rl) == 2 and all(", step KL " in line for line in rl), rl  # each step measured against its bound
    result = json.loads((tmp_path / "r.json").read_text())  # what rlpipe sweep reads
    assert set(result["evaluations"]) == {"base model", "warm start"} and len(result["samples"]) == 3
    # 5 turns at most: +1 a push, -0.1 an answer without an action
    assert all(-0.5 <= r <= 5 and abs(r * 10 - round(r * 10)) < 1e-6 for r in result["samples"])
    assert result["tokens"]["sampled"] > 0 and result["tokens"]["trained"] > 0


def test_the_text2sql_recipe_runs_end_to_end_and_logs_the_reward_breakdown(server, tmp_path):
    script = Path(__file__).resolve().parents[2] / "examples" / "tinker_text2sql.py"
    env = {**os.environ, "TINKER_API_KEY": "tml-example", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [sys.executable, str(script), "--base-url", server.url, "--base-model", server.base_model, "--max-tokens", "12",
         "--sft-steps", "1", "--batch", "4", "--rl-steps", "2", "--groups", "2", "--group-size", "2",
         "--eval-episodes", "2", "--result-file", str(tmp_path / "r.json")],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "r.json").read_text())
    assert len(result["samples"]) == 2 and set(result["evaluations"]) == {"base model"}
    lines = done.stdout.splitlines()
    rl = [line for line in lines if line.startswith("rl step ")]
    assert len(rl) == 2, done.stdout
    for line in rl + [line for line in lines if line.startswith("held-out ")]:
        assert "return " in line and "ran " in line and "matched " in line and "unparsed answers " in line, line
    assert "held-out base model" in done.stdout and "held-out last version" in done.stdout
    assert "sft step 0: loss/token" in done.stdout


def test_a_sweep_of_the_cartpole_loop_packs_a_2x2_grid_onto_the_server(server, tmp_path):
    script = Path(__file__).resolve().parents[2] / "examples" / "tinker_cartpole.py"
    folder = tmp_path / "sweep"
    env = {**os.environ, "TINKER_API_KEY": "tml-sweeper", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(
        [sys.executable, "-c", "from pipeline.cli.main import main; main()", "sweep", str(script),
         "--set", f"base-url={server.url}", "--set", f"base-model={server.base_model}", "--set", "max-steps=5",
         "--set", "demo-episodes=2", "--set", "sft-steps=1", "--set", "batch=8", "--set", "rl-steps=2",
         "--set", "groups=1", "--set", "group-size=2", "--set", "eval-episodes=3",
         "--grid", "rl-lr=1e-3,1e-4", "--grid", "loss=importance_sampling,ppo", "--parallel", "4",
         "--dir", str(folder)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    board = json.loads((folder / "leaderboard.json").read_text())
    assert sorted(e["label"] for e in board["entries"]) == [
        "rl-lr=1e-3 loss=importance_sampling", "rl-lr=1e-3 loss=ppo", "rl-lr=1e-4 loss=importance_sampling",
        "rl-lr=1e-4 loss=ppo"]
    for entry in board["entries"]:
        assert entry["finished"] == 1 and entry["samples"] == 3 and -0.5 <= entry["mean"] <= 5
        assert set(entry["evaluations"]) == {"base model", "warm start"}  # beside the score (the last version)
    for index in range(4):  # each experiment trained its own session for two RL steps
        log = (folder / f"exp-{index:03d}" / "log.txt").read_text()
        assert "rl step 1" in log and "held-out last version" in log
    assert (folder / "leaderboard.png").exists() and "leaderboard" in done.stdout


def test_an_expired_session_takes_no_more_calls_and_its_named_weights_outlive_it(server):
    """A session whose heartbeats stopped a day ago has ended: its clients' calls are refused with the reason,
    while weights it saved under a name are sampled from a new session."""
    service = server.service()
    training = service.create_lora_training_client(base_model=server.base_model, rank=4).result()
    snapshot = training.save_weights_and_get_sampling_client().result()
    path = training.save_weights_for_sampler("outlives").result().path
    prompt = types.ModelInput.from_ints(PROMPT)
    assert len(snapshot.sample(prompt, 1, _params(stop=[])).result().sequences) == 1
    session = training.model_id.split(":")[0]
    refused = ""
    for _ in range(5):  # the SDK's own heartbeat may land between the write and the call: then again
        server.store.put(f"sessions/{session}/heartbeat.json", json.dumps({"time": time.time() - 2 * 86400}).encode())
        time.sleep(1.5)  # past the gateway's last look at the session (live_check_s)
        try:
            snapshot.sample(prompt, 1, _params(stop=[])).result()
        except Exception as exc:
            refused = str(exc)
            break
    assert f"session {session} has ended (expired: no heartbeat since" in refused
    assert server.store.exists(f"sessions/{session}/ended.json")  # recorded: no heartbeat brings it back
    with pytest.raises(Exception, match="create a new ServiceClient"):
        training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    named = server.service().create_sampling_client(model_path=path).result()
    assert len(named.sample(prompt, 1, _params(stop=[])).result().sequences) == 1


def test_inflight_sampling_clients_move_to_the_latest_inflight_weights(server):
    """save_weights_and_get_sampling_client(kind="inflight"): a client made earlier samples the weights of the
    latest inflight save, as the SDK's contract says; a snapshot client keeps its own."""
    training = server.service().create_lora_training_client(base_model=server.base_model, rank=4).result()
    prompt = types.ModelInput.from_ints(PROMPT + [12, 30, 7])
    early = training.save_weights_and_get_sampling_client(kind="inflight").result()
    fixed = training.save_weights_and_get_sampling_client().result()
    before = early.compute_logprobs(prompt).result()[1:]
    datum = types.Datum(model_input=types.ModelInput.from_ints(PROMPT[:-1]),
                        loss_fn_inputs={"target_tokens": PROMPT[1:]})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    late = training.save_weights_and_get_sampling_client(kind="inflight").result()
    after = late.compute_logprobs(prompt).result()[1:]
    assert not np.allclose(after, before, atol=1e-4)
    time.sleep(0.6)  # inflight weights propagate within the sampler's INFLIGHT_CHECK_S
    assert np.allclose(early.compute_logprobs(prompt).result()[1:], after, atol=1e-6)
    assert np.allclose(fixed.compute_logprobs(prompt).result()[1:], before, atol=1e-6)


def test_a_sample_call_of_a_session_that_ended_stops_and_another_tenants_call_runs(server):
    """A client gone (here: its session's end recorded as its close records it) leaves its call of 256 samples to
    nobody: the sampler (looking at the session before every round, --session-check-s 0) stops it after the round
    running with a user error the SDK raises, and another tenant's small call is answered without waiting for the
    rest.  The end is recorded once the sampler's log shows the call's first round started."""
    from pipeline.api.lifecycle import record_end

    ghost = server.service().create_sampling_client(base_model=server.base_model).result()
    prompt = types.ModelInput.from_ints(PROMPT)
    session = ghost._sampling_session_id.split(":")[0]
    big = ghost.sample(prompt, 256, _params(stop=[], max_tokens=200))
    deadline = time.monotonic() + 120  # (the sampler may still be loading its engine)
    while f"of session {session}: round 1 of 16" not in (server.logs / "sampler.log").read_text():
        assert time.monotonic() < deadline, "the sample call's first round never started"
        time.sleep(0.05)
    record_end(server.store, session, "finished: success")
    with pytest.raises(tinker.RequestFailedError, match=f"session {session} ended") as failed:
        big.result(timeout=300)
    drawn = int(re.search(r"\((\d+) of 256 samples drawn", str(failed.value)).group(1))
    assert 16 <= drawn < 256 - 16  # the first round ran; of 16 rounds, stopped within a round or two of the end
    other = server.service(BOB).create_sampling_client(base_model=server.base_model).result()
    assert len(other.sample(prompt, 1, _params(stop=[], max_tokens=4)).result(timeout=60).sequences) == 1
