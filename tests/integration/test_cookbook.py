"""tinker-cookbook's own ``rl_loop`` and ``sl_loop`` recipes, unmodified, against rlpipe's server.

The recipes run in the cookbook's client environment (``.venv-cookbook``, built by
``make cookbook-env``; ``make test`` builds it first), as on a researcher's laptop,
through ``examples/cookbook/run_recipe.py``: the local tokenizer, a renderer name
and local data in place of the hub's. The server is ``test_tinker_sampling``'s:
one trainer, one sampler (transformers) and the gateway for the tiny model, on the
session's Tansu broker and a file:// store. The tests skip only when that client
environment could not be built, with the reason its build recorded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors

from tests.integration.test_tinker_sampling import SamplingServer, sampling_server

ROOT = Path(__file__).resolve().parents[2]
COOKBOOK_VENV = ROOT / ".venv-cookbook"
COOKBOOK_PYTHON = COOKBOOK_VENV / "bin" / "python"
WRAPPER = ROOT / "examples" / "cookbook" / "run_recipe.py"
ITERATIONS = 3


def build_failure() -> str | None:
    """Why the client environment is missing (the end of its build log), or ``None`` when it is built."""
    if (COOKBOOK_VENV / ".installed").exists():
        return None
    error = COOKBOOK_VENV / "build-error.txt"
    if error.exists():
        return f"{COOKBOOK_VENV.name} could not be built: {error.read_text().strip()}"
    return f"{COOKBOOK_VENV.name} is not built: run `make cookbook-env`"


# decided at collection, so that a skip starts no broker and no server
pytestmark = pytest.mark.skipif(build_failure() is not None, reason=build_failure() or "")


@pytest.fixture(scope="module")
def server(kafka_broker, tiny_model_dir, tmp_path_factory) -> Iterator[SamplingServer]:
    with sampling_server(kafka_broker.bootstrap_servers, tiny_model_dir, tmp_path_factory.mktemp("cookbook")) as server:
        yield server


def run_recipe(server: SamplingServer, recipe: str, log_path: Path, *args: str) -> list[dict]:
    """Run ``recipe`` through the wrapper with the cookbook's Python; the rows of its ``metrics.jsonl``."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env.update(TINKER_API_KEY="tml-cookbook", TINKER_TELEMETRY="0", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_HOME=str(log_path.parent / "hf-home"), OMP_NUM_THREADS="1")
    done = subprocess.run(
        [str(COOKBOOK_PYTHON), str(WRAPPER), recipe, f"model_name={server.base_model}", f"base_url={server.url}",
         f"log_path={log_path}", f"max_steps={ITERATIONS}", "lora_rank=4", "save_every=0", *args],
        env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def final_checkpoint(server: SamplingServer, log_path: Path) -> dict[str, str]:
    """The recipe's last line in ``checkpoints.jsonl``; both of its paths must name weights in the store."""
    checkpoint = json.loads((log_path / "checkpoints.jsonl").read_text().splitlines()[-1])
    assert checkpoint["name"] == "final"
    for kind in ("state_path", "sampler_path"):
        model_id, folder, name = checkpoint[kind].removeprefix("tinker://").split("/")
        assert server.store.exists(f"runs/{model_id.replace(':', '.')}/{folder}/{name}.json"), checkpoint[kind]
    return checkpoint


def session_of(path: str) -> str:
    """The session of a ``tinker://<session>:train:<n>/...`` path."""
    return path.removeprefix("tinker://").split(":")[0]


def adapter(server: SamplingServer, state_path: str) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a saved state, read from the store."""
    model_id, _, name = state_path.removeprefix("tinker://").split("/")
    tensors = load_safetensors(server.store.get(f"runs/{model_id.replace(':', '.')}/weights/{name}.safetensors"))
    return {key: tensor for key, tensor in tensors.items() if key.startswith("adapter.")}


def test_sl_loop_trains_for_three_steps_and_resumes(server, tmp_path):
    log_path = tmp_path / "sl-loop"
    args = ("batch_size=4", "learning_rate=1e-3")
    rows = run_recipe(server, "sl_loop", log_path, *args)
    assert [row["step"] for row in rows] == list(range(ITERATIONS))
    assert all(math.isfinite(row["train_mean_nll"]) and row["num_sequences"] == 4 for row in rows)
    assert all(math.isfinite(row["grad_norm:mean"]) and row["grad_norm:mean"] > 0 for row in rows)
    # the saved state holds the adapter the three optimizer steps moved (LoRA's B starts at zero)
    first = final_checkpoint(server, log_path)["state_path"]
    trained = adapter(server, first)
    lora_b = [tensor for key, tensor in trained.items() if "lora_B" in key]
    assert lora_b and any(tensor.abs().max() > 0 for tensor in lora_b)

    # run again on the same log_path: the recipe resumes from that state (a new session loads it with its
    # optimizer), finds no batch left and saves it once more, unchanged
    assert len(run_recipe(server, "sl_loop", log_path, *args)) == ITERATIONS
    resumed = final_checkpoint(server, log_path)["state_path"]
    assert len((log_path / "checkpoints.jsonl").read_text().splitlines()) == 2
    assert session_of(resumed) != session_of(first)
    reloaded = adapter(server, resumed)
    assert reloaded.keys() == trained.keys() and all(torch.equal(reloaded[k], trained[k]) for k in trained)


def test_rl_loop_samples_and_logs_three_iterations(server, tmp_path):
    rows = run_recipe(server, "rl_loop", tmp_path / "rl-loop", "batch_size=2", "group_size=4", "max_tokens=24")
    assert [row["progress/batch"] for row in rows] == list(range(ITERATIONS))
    assert all(0.0 <= row["reward/total"] <= 1.0 for row in rows)
    # each iteration sampled from fresh weights: save_weights_and_get_sampling_client made one sampler each
    session = session_of(final_checkpoint(server, tmp_path / "rl-loop")["state_path"])
    samplers = [key for key in server.store.list(f"sessions/{session}/samplers") if key.endswith(".json")]
    assert len(samplers) == ITERATIONS
