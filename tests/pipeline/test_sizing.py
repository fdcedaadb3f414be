"""``rlpipe plan``'s memory estimate: known model sizes, and a measured peak on the CPU within a stated tolerance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen2Config
from typer.testing import CliRunner

from pipeline.cli.main import app
from pipeline.sizing import GIB, plan_memory

ROOT = Path(__file__).resolve().parents[2]
# Llama 3.1 8B and 70B shapes (their config.json values that decide the sizes)
LLAMA_8B = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)
LLAMA_70B = LlamaConfig(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                        num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False)
MEASURED_TOLERANCE = 0.30  # estimate within 30 % of the measured peak above the bare process


def test_llama_8b_shaped_config_has_its_known_size_and_fits_one_80_gib_gpu():
    plan = plan_memory(LLAMA_8B, gpus=1)
    assert plan.parameters == pytest.approx(8.03e9, rel=0.005)
    assert plan.weights == 2 * plan.parameters  # bf16
    # LoRA r=16 on q,k,v,o: per layer 16 x ((4096+4096) + (4096+1024) x 2 + (4096+4096)) = 425,984 values, float32
    assert plan.lora == 32 * 425_984 * 4
    assert plan.optimizer == 3 * plan.lora
    assert plan.fits(80)


def test_sharding_divides_the_weights_and_70b_needs_several_gpus():
    one, eight = plan_memory(LLAMA_70B, gpus=1), plan_memory(LLAMA_70B, gpus=8)
    head = 128256 * 8192  # the output head stays whole on every rank
    assert eight.weights == ((one.parameters - head) // 8 + head) * 2
    assert not one.fits(80) and eight.fits(80)
    assert plan_memory(LLAMA_70B, gpus=8, shard=False).weights == one.weights


def test_checkpointing_keeps_fewer_activations():
    assert plan_memory(LLAMA_8B, gradient_checkpointing=True).activations < \
        plan_memory(LLAMA_8B, gradient_checkpointing=False).activations / 10


def test_plan_command_prints_the_parts_and_exits_by_whether_it_fits(tmp_path):
    LLAMA_8B.to_json_file(str(tmp_path / "config.json"))
    runner = CliRunner()
    fits = runner.invoke(app, ["plan", "--model", str(tmp_path), "--gpus", "1", "--gpu-memory", "80", "--json"])
    assert fits.exit_code == 0, fits.output
    report = json.loads(fits.output)
    assert report["fits"] and report["bytes"]["total"] == sum(v for k, v in report["bytes"].items() if k != "total")
    too_small = runner.invoke(app, ["plan", "--model", str(tmp_path / "config.json"), "--gpu-memory", "16"])
    assert too_small.exit_code == 1 and "does NOT fit" in too_small.output
    missing = runner.invoke(app, ["plan", "--model", str(tmp_path / "nothing")])
    assert missing.exit_code == 2


def test_estimate_is_within_tolerance_of_the_measured_peak_on_the_cpu(tmp_path):
    """One torchrun rank trains a Qwen2-shaped model (12 x 512, float32) on 4 x 64 tokens; peak RSS over the bare process."""
    import torch
    from transformers import AutoModelForCausalLM

    config = Qwen2Config(vocab_size=1024, hidden_size=512, intermediate_size=1536, num_hidden_layers=12,
                         num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=True,
                         max_position_embeddings=512)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "model")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--standalone",
               str(ROOT / "tests/consumers/distributed_worker.py"), "--model", str(tmp_path / "model"),
               "--out", str(tmp_path / "out"), "--steps", "2", "--per-batch", "4", "--length", "64"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "rank0.json").read_text())
    measured = report["peak_rss"] - report["bare_rss"]
    estimate = plan_memory(config, gpus=1, dtype="float32", micro_batch=4, seq_len=64, lora_rank=4,
                           target_modules=("q_proj", "v_proj"), gradient_checkpointing=False, overhead_gib=0).total
    print(f"tiny-family model, 1 rank on the CPU: estimate {estimate / 2**20:.0f} MiB, "
          f"measured {measured / 2**20:.0f} MiB")
    assert abs(estimate - measured) <= MEASURED_TOLERANCE * measured
    assert estimate < GIB


def test_plan_sizes_the_adapter_the_learner_trains_by_default(tmp_path):
    from schemas.config import LearnerConfig

    LLAMA_8B.to_json_file(str(tmp_path / "config.json"))
    result = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    learner = LearnerConfig()
    expected = plan_memory(LLAMA_8B, lora_rank=learner.lora_rank, target_modules=learner.target_modules,
                           shard=False, gradient_checkpointing=learner.gradient_checkpointing)
    assert json.loads(result.output)["bytes"] == expected.parts()  # what the learner holds: no sharding
    checkpointed = CliRunner().invoke(app, ["plan", "--model", str(tmp_path), "--json", "--checkpointing"])
    assert json.loads(checkpointed.output)["bytes"]["activations"] < expected.parts()["activations"] / 10


def test_plan_of_a_hub_id_it_cannot_reach_names_the_local_ways(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = CliRunner().invoke(app, ["plan", "--model", "nobody/no-such-model"])
    line = result.output.strip()
    assert result.exit_code == 2 and "model folder" in line and "config.json" in line, line


def test_plan_of_an_unknown_hub_id_fails_in_seconds_without_offline_mode(monkeypatch):
    """The cache is read first and the hub asked once with a short timeout: no minute of retries before the error
    (whether the hub answers "no such model" or cannot be reached at all)."""
    import time

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    started = time.monotonic()
    result = CliRunner().invoke(app, ["plan", "--model", "nobody/no-such-model-rlpipe"])
    elapsed = time.monotonic() - started
    line = result.output.strip().splitlines()[-1]
    assert result.exit_code == 2 and "model folder" in line and "nobody/no-such-model-rlpipe" in line, result.output
    assert elapsed < 15, f"took {elapsed:.0f} s"


def test_plan_of_a_hub_id_in_the_cache_reads_it_without_asking_the_hub(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    repo = tmp_path / "models--rlpipe--cached"
    (repo / "snapshots" / ("0" * 40)).mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    LLAMA_8B.to_json_file(str(repo / "snapshots" / ("0" * 40) / "config.json"))
    result = CliRunner().invoke(app, ["plan", "--model", "rlpipe/cached", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["parameters"] == plan_memory(LLAMA_8B).parameters


def test_plan_of_tiny_sizes_the_tiny_model_built_here_and_says_how_to_build_it_when_it_is_not(tmp_path, monkeypatch):
    from pipeline.models import record_tiny_model

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    missing = CliRunner().invoke(app, ["plan", "--model", "tiny", "--json"])
    assert missing.exit_code == 2 and "rlpipe model init-tiny" in missing.output and "hub" not in missing.output
    built = tmp_path / "tiny"
    built.mkdir()
    LLAMA_8B.to_json_file(str(built / "config.json"))  # the folder the pointer names is what is sized
    record_tiny_model(built)
    result = CliRunner().invoke(app, ["plan", "--model", "tiny", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["parameters"] == plan_memory(LLAMA_8B).parameters


@pytest.mark.parametrize(("shape", "unit"), [(LLAMA_8B, " B parameters"), (
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, tie_word_embeddings=True), " K parameters"), (
    LlamaConfig(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=4, tie_word_embeddings=True), " M parameters")])
def test_plan_states_the_parameter_count_in_a_unit_that_shows_it(tmp_path, shape, unit):
    """A small model is not "0.00 B parameters": the title counts in B, M or K, three significant figures."""
    shape.to_json_file(str(tmp_path / "config.json"))
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "--model", str(tmp_path)])
    count = plan_memory(shape).parameters
    scale = {" B parameters": 1e9, " M parameters": 1e6, " K parameters": 1e3}[unit]
    shown = result.output.split(unit)[0].split()[-1]  # "<model>: 1.23 M parameters, ..."
    assert unit in result.output and len(shown.replace(".", "")) == 3, result.output
    assert float(shown) * scale == pytest.approx(count, rel=0.005), (count, result.output)


@pytest.mark.parametrize(("count", "shown"), [
    (8_030_261_248, "8.03 B"), (1_770_000, "1.77 M"), (405_000_000_000, "405 B"), (12_345, "12.3 K"), (999, "999"),
    # rounded to three figures first, then the unit: 999,600 is 999.6 K, three figures 1.00 M, not "1000 K"
    (999_600, "1.00 M"), (9_996_000_000, "10.0 B"), (99_960, "100 K"), (999_960_000_000, "1.00 T")])
def test_a_parameter_count_is_three_significant_figures_in_the_unit_its_rounded_value_reaches(count, shown):
    from pipeline.cli.plan_cmd import counted

    assert counted(count) == shown


def test_plans_help_names_each_default_learner_setting_without_a_stray_quote() -> None:
    result = CliRunner(env={"COLUMNS": "200"}).invoke(app, ["plan", "--help"])
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.replace("│", " ").split())  # rich wraps and boxes the help
    assert "(default: learner.target_modules)" in text and "target_modules'" not in text, text
