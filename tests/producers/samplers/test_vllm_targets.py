"""An adapter vLLM cannot load (a LoRA on the output head) is refused in one line that names the fix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from producers.samplers.vllm_sampler import check_vllm_can_load


def _adapter(tmp_path: Path, targets) -> Path:
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": targets}))
    return folder


@pytest.mark.parametrize("targets", [["q_proj", "v_proj", "lm_head"], "(.*q_proj|lm_head)"])
def test_a_lora_on_the_output_head_is_refused_naming_train_unembed(tmp_path, targets):
    with pytest.raises(ValueError, match="train_unembed=False") as refused:
        check_vllm_can_load(str(_adapter(tmp_path, targets)))
    assert "lm_head" in str(refused.value) and "\n" not in str(refused.value)


def test_linear_layers_only_load(tmp_path):
    check_vllm_can_load(str(_adapter(tmp_path, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj"])))
