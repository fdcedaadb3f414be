"""An adapter vLLM cannot load (a LoRA on the output head) is refused in one line that names the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.samplers.vllm_sampler import check_vllm_can_load


def _adapter(tmp_path: Path, targets, rank: int = 8, **config) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "target_modules": targets,
                                                            **config}))
    return folder


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "lm_head"], "(.*q_proj|lm_head)"])
def test_a_lora_on_the_output_head_is_refused_naming_train_unembed(tmp_path, targets):
    with pytest.raises(ValueError, match="train_unembed=False") as refused:
        check_vllm_can_load(str(_adapter(tmp_path, targets)), 8)
    assert "lm_head" in str(refused.value) and "\n" not in str(refused.value)


def test_linear_layers_only_load(tmp_path):
    check_vllm_can_load(str(_adapter(tmp_path, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])), 8)


def test_a_rank_above_the_engines_slot_is_refused_naming_the_slot_that_takes_it(tmp_path):
    """The rank of the weights, or of any module in peft's rank_pattern; the fix names vLLM's next slot up."""
    check_vllm_can_load(str(_adapter(tmp_path, ["q_proj"], rank=32)), 32)
    with pytest.raises(ValueError, match=r"rank 24, above this vLLM sampler's max_lora_rank 16") as refused:
        check_vllm_can_load(str(_adapter(tmp_path, ["q_proj"], rank=24)), 16)
    assert "--max-lora-rank 32" in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ValueError, match=r"rank 64\b.*--max-lora-rank 64"):
        check_vllm_can_load(str(_adapter(tmp_path, ["q_proj"], rank=8, rank_pattern={"q_proj": 64})), 32)


def _prepare_in_a_process(tmp_path: Path, **env: str) -> str:
    """The VLLM_RPC_BASE_PATH a process that prepares vLLM's environment twice uses (it writes a socket file there)."""
    import os
    import subprocess
    import sys

    code = ("import os; from producers.samplers.vllm_sampler import _prepare_environment\n"
            "_prepare_environment(); first = os.environ['VLLM_RPC_BASE_PATH']; _prepare_environment()\n"
            "assert os.environ['VLLM_RPC_BASE_PATH'] == first and os.path.isdir(first)\n"
            "open(os.path.join(first, 'engine-socket'), 'w').close(); print(first)")
    inherited = {name: value for name, value in os.environ.items() if name != "VLLM_RPC_BASE_PATH"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**inherited, "TMPDIR": str(tmp_path), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.strip().splitlines()[-1]


def test_vllms_socket_files_go_to_a_folder_of_the_process_removed_when_it_exits(tmp_path):
    """vLLM leaves its ZeroMQ socket files in the temporary folder, 7 an engine: they go to the process's own one."""
    folder = Path(_prepare_in_a_process(tmp_path))
    assert folder.parent == tmp_path and folder.name.startswith("rlpipe-vllm-")
    assert not folder.exists() and list(tmp_path.iterdir()) == []
    chosen = tmp_path / "mine"
    chosen.mkdir()
    assert _prepare_in_a_process(tmp_path, VLLM_RPC_BASE_PATH=str(chosen)) == str(chosen)  # a setting of yours wins
    assert (chosen / "engine-socket").exists()
    parents = tmp_path / "rlpipe-vllm-of-a-parent"  # a parent's folder, removed when the parent exits: not this one's
    parents.mkdir()
    own = Path(_prepare_in_a_process(tmp_path, VLLM_RPC_BASE_PATH=str(parents)))
    assert own != parents and not own.exists() and list(parents.iterdir()) == []
