"""Loading adapters into the transformers sampler: switching and unloading versions, and refusing a folder that
would change the base model every version shares (another base model's weights, unreadable weights, an
adapter_config.json that is no plain LoRA's) while the model samples on as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from producers.samplers import AdapterHandle, SampleRequest
from producers.samplers.hf_sampler import TransformersSampler
from schemas.config import SamplerConfig
from tests.producers.samplers.reference import LOGPROB_TOL, max_gap


def test_transformers_adapter_switching_and_unloading(tiny_trained_dir, reference, prompts, lora_adapters) -> None:
    v1, v2 = lora_adapters
    sampler = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))
    sampler.load_adapter(v1)
    sampler.load_adapter(v2)
    request = [SampleRequest(prompts[2], 6)]
    for adapter in (v2, None, v1):  # the base model stays reachable while adapters are loaded
        assert max_gap(reference, adapter, prompts[2], sampler.generate(request, adapter, seed=5)[0]) < LOGPROB_TOL
    with pytest.raises(ValueError, match="new name"):
        sampler.load_adapter(AdapterHandle(version=9, lora_int_id=9, name="v1", path=v2.path, sha256=""))
    sampler.unload_adapter(v1)
    sampler.unload_adapter(v2)
    assert max_gap(reference, None, prompts[2], sampler.generate(request, None, seed=5)[0]) < LOGPROB_TOL


def other_base_models_lora(model_dir: Path, out_dir: Path) -> Path:
    """A LoRA adapter (random non-zero A and B) of a model twice as wide as ``model_dir``'s: another base model."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.fixtures.vllm import LORA_TARGETS

    config = AutoConfig.from_pretrained(model_dir)
    config.hidden_size, config.intermediate_size = 2 * config.hidden_size, 2 * config.intermediate_size
    torch.manual_seed(11)
    wide = AutoModelForCausalLM.from_config(config)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS, init_lora_weights=False)
    get_peft_model(wide, lora).save_pretrained(out_dir)
    return out_dir


@pytest.mark.parametrize("first", [True, False])
def test_an_adapter_of_another_base_model_is_refused_in_one_line_and_changes_nothing(
    tiny_trained_dir, reference, prompts, lora_adapters, tmp_path, first
) -> None:
    """peft refuses the weights after it put their layers into the model: the base model (and a loaded version)
    must sample as before, or a producer that keeps its last good version samples from something else."""
    wrong = AdapterHandle.for_version(3, str(other_base_models_lora(tiny_trained_dir, tmp_path / "wide")), "sha-w")
    sampler = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))
    if not first:
        sampler.load_adapter(lora_adapters[0])
    with pytest.raises(ValueError, match=r"peft refused adapter v3 .*size mismatch.*model\.base_model") as refused:
        sampler.load_adapter(wrong)
    assert "\n" not in str(refused.value)
    assert_samples_as_before(sampler, reference, prompts, lora_adapters, first)


def assert_samples_as_before(sampler: TransformersSampler, reference, prompts, lora_adapters, first: bool) -> None:
    """The base model (and, unless ``first``, version 1) sample as the reference does after a refused adapter, and
    the next good version loads and serves."""
    request = [SampleRequest(prompts[2], 6)]
    for adapter in (None,) if first else (None, lora_adapters[0]):
        assert max_gap(reference, adapter, prompts[2], sampler.generate(request, adapter, seed=5)[0]) < LOGPROB_TOL
    sampler.load_adapter(lora_adapters[1])
    assert max_gap(reference, lora_adapters[1], prompts[2],
                   sampler.generate(request, lora_adapters[1], seed=5)[0]) < LOGPROB_TOL


@pytest.mark.parametrize("first", [True, False])
def test_an_adapter_whose_weights_cannot_be_read_leaves_no_layers_behind(
    tiny_trained_dir, reference, prompts, lora_adapters, tmp_path, first
) -> None:
    """peft puts the adapter's layers in, then reading its weights file fails (here a folder in its place: an
    ``OSError``): the error reaches the caller as it is, and the model samples as before it was offered."""
    import shutil

    unreadable = Path(shutil.copytree(lora_adapters[1].path, tmp_path / "unreadable"))
    (unreadable / "adapter_model.safetensors").unlink()
    (unreadable / "adapter_model.safetensors").mkdir()
    sampler = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))
    if not first:
        sampler.load_adapter(lora_adapters[0])
    with pytest.raises(OSError):
        sampler.load_adapter(AdapterHandle.for_version(3, str(unreadable), "sha-u"))
    assert not any("v3" in name for name, _ in sampler._base.named_modules()), "v3's layers are left in the model"
    assert_samples_as_before(sampler, reference, prompts, lora_adapters, first)


@pytest.mark.parametrize("field, value", [("init_lora_weights", "pissa"), ("init_lora_weights", "olora"),
                                          ("layer_replication", [[0, 1]]), ("peft_type", "LOHA"),
                                          ("modules_to_save", ["lm_head"]), ("trainable_token_indices", [0, 1])])
def test_an_adapter_config_that_would_change_the_base_model_is_refused(
    tiny_trained_dir, reference, prompts, lora_adapters, learner_policy, tmp_path, field, value
) -> None:
    """peft applies an adapter_config.json's initialisation and structure on load: PiSSA and OLoRA rewrite the
    base weights (W - BA), layer replication rebuilds the model's layers, another tuner type is no LoRA at all,
    and modules_to_save / trainable_token_indices wrap base modules in copies that outlive the adapter's unload.
    Such a folder (a manifest written past publish, a tampered store) is refused before peft reads it, and the
    base model every other version shares samples as before; the adapter the learner publishes passes."""
    import json
    import shutil

    from producers.samplers.hf_sampler import check_adapter_folder_config

    learners = learner_policy.save_adapter(tmp_path / "learners")
    check_adapter_folder_config(AdapterHandle.for_version(4, str(learners), "sha-l"))

    folder = Path(shutil.copytree(lora_adapters[1].path, tmp_path / "odd"))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, field: value}))
    sampler = TransformersSampler(str(tiny_trained_dir), SamplerConfig(max_model_len=1024))
    with pytest.raises(ValueError, match=rf"adapter v3: adapter_config\.json sets {field}="):
        sampler.load_adapter(AdapterHandle.for_version(3, str(folder), "sha-o"))
    assert_samples_as_before(sampler, reference, prompts, lora_adapters, True)


def test_an_adapter_config_nested_too_deep_to_read_is_one_line(tmp_path) -> None:
    from producers.samplers.hf_sampler import check_adapter_folder_config

    (tmp_path / "adapter_config.json").write_text("[" * 100_000)
    with pytest.raises(ValueError, match=r"adapter v3: .*adapter_config\.json is not JSON") as caught:
        check_adapter_folder_config(AdapterHandle.for_version(3, str(tmp_path), "sha-d"))
    assert len(str(caught.value).splitlines()) == 1
