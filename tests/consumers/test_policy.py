"""The learner's policy: the weights dtype from ``model.dtype``, float32 adapter and optimizer, supported heads."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

from consumers.batching import micro_batches
from consumers.policy import LoraPolicy
from consumers.service import build_learner
from pipeline.io.store import ObjectStore
from schemas.config import LearnerConfig, ModelConfig, RunConfig


def one_step(policy: LoraPolicy) -> None:
    rows = [[3, 4, 5, 6], [7, 8, 9]]
    masks = [[0, 0, 1, 1], [0, 1, 1]]
    batch = micro_batches(rows, masks, [[0.0] * len(r) for r in rows], [1.0, -1.0], 1000)
    policy.train_step(batch, normaliser=2.0)


def test_model_dtype_bfloat16_loads_bf16_base_weights_with_float32_lora_and_optimizer(tiny_model_dir, tmp_path):
    config = RunConfig(model=ModelConfig(dtype="bfloat16"), learner=LearnerConfig(device="cpu", lora_rank=4))
    learner = build_learner(config, ObjectStore(tmp_path.as_uri()), source=None, announce=lambda p: None,
                            base_model=tiny_model_dir)
    policy = learner.policy
    frozen = {p.dtype for p in policy.model.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}
    assert policy.params and {p.dtype for p in policy.params} == {torch.float32}
    one_step(policy)
    tensors, _ = policy.optimizer_state()
    moments = {name: t.dtype for name, t in tensors.items() if name.endswith(("exp_avg", "exp_avg_sq"))}
    assert moments and set(moments.values()) == {torch.float32}
    batch = micro_batches([[3, 4, 5]], [[0, 1, 1]], [[0.0] * 3], [1.0], 1000)[0]
    with torch.no_grad():
        logprobs = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
    assert logprobs.dtype == torch.float32 and bool(torch.all(logprobs[0, 1:] < 0))


def test_model_dtype_auto_is_the_checkpoints_own(tiny_model_dir):
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))  # the tiny model is saved in float32
    assert {p.dtype for p in policy.model.parameters()} == {torch.float32}


def test_a_saved_adapter_is_the_folder_peft_writes_without_its_model_card(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    one_step(policy)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():  # weights far from the base model's, so a wrong adapter shows in the logits
        for p in policy.lora_parameters().values():
            p.add_(0.1 * torch.randn(p.shape, generator=generator))
    folder = policy.save_adapter(tmp_path / "v1")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["inference_mode"] is True
    policy.model.save_pretrained(str(tmp_path / "by-peft"))  # what peft itself writes (and a model card)
    by_peft_config = json.loads((tmp_path / "by-peft" / "adapter_config.json").read_text())
    assert set(config.pop("target_modules")) == set(by_peft_config.pop("target_modules"))  # a set, in any order
    assert config == by_peft_config
    by_peft = load_file(str(tmp_path / "by-peft" / "adapter_model.safetensors"))
    saved = load_file(str(folder / "adapter_model.safetensors"))
    assert saved.keys() == by_peft.keys() and all(torch.equal(saved[k], by_peft[k]) for k in saved)
    trained = {name.replace(".default", ""): p for name, p in policy.lora_parameters().items()}
    assert saved.keys() == trained.keys()
    assert all(torch.equal(saved[name], trained[name].detach()) for name in saved)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder))
    tokens = torch.tensor([[3, 4, 5, 6]])
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    policy.model.eval()  # no LoRA dropout in the comparison
    with torch.no_grad():
        ours, theirs = policy.model(tokens).logits, loaded(tokens).logits
        assert (ours - base(tokens).logits).abs().max() > 0.1  # the adapter matters ...
        assert torch.allclose(theirs, ours, atol=1e-4)  # ... and the saved one is the same (float32 sums aside)


def model_with(tiny_model_dir: str, folder: Path, **config_changes: object) -> str:
    """A copy of the tiny model's config (nothing else: the check comes before the weights) with changes."""
    folder.mkdir()
    shutil.copy(Path(tiny_model_dir) / "config.json", folder / "config.json")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **config_changes}))
    return str(folder)


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"final_logit_softcapping": 30.0}, "final_logit_softcapping"),
        ({"logit_scale": 0.0625}, "logit_scale"),
        ({"logits_scaling": 8.0}, "logits_scaling"),
    ],
)
def test_models_that_reshape_their_logits_are_refused(tiny_model_dir, tmp_path, changes, named):
    path = model_with(tiny_model_dir, tmp_path / "model", **changes)
    with pytest.raises(ValueError, match=named) as info:
        LoraPolicy(path, LearnerConfig(device="cpu"))
    assert "\n" not in str(info.value) and "head" in str(info.value)


def test_gemma2_is_refused_by_its_default_softcapping(tmp_path):
    from transformers import Gemma2Config

    Gemma2Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        LoraPolicy(str(tmp_path), LearnerConfig(device="cpu"))


# ---------------------------------------------------------------- entropy bonus and KL penalty on the tiny model


def remedy_batch():
    """Two rows, three generated tokens, advantage 0: only a regulariser can move the weights."""
    rows = [[3, 4, 5, 6, 7], [8, 9, 10, 11]]
    masks = [[0, 0, 1, 1, 1], [0, 0, 0, 1]]
    return micro_batches(rows, masks, [[0.0] * len(r) for r in rows], [0.0, 0.0], 1000, temperatures_R=[1.0, 0.7])[0]


def entropy_and_logprobs(policy: LoraPolicy, batch) -> tuple[float, torch.Tensor]:
    with torch.no_grad():
        logprobs, entropy = policy.generated_logprobs_and_entropy(batch.tokens_BT, batch.loss_mask_BT,
                                                                  batch.temperatures_B)
    return float(entropy.sum() / (batch.loss_mask_BT > 0).sum()), logprobs


def perturbed(policy: LoraPolicy, seed: int) -> LoraPolicy:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    return policy


def test_the_entropy_bonus_raises_the_policys_entropy(tiny_model_dir):
    batch = remedy_batch()
    for coef, rises in ((0.0, False), (1.0, True)):
        policy = perturbed(LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, learning_rate=1e-2,
                                                                    entropy_coef=coef)), seed=0)
        before, _ = entropy_and_logprobs(policy, batch)
        result = policy.train_step([batch], normaliser=2.0)
        after, _ = entropy_and_logprobs(policy, batch)
        assert result.stats.entropy_mean == pytest.approx(before, rel=1e-4)  # the step records its entropy
        assert (after > before + 1e-4) is rises, (coef, before, after)
        if not rises:
            assert after == pytest.approx(before, abs=1e-6)  # advantage 0 and no bonus: nothing to learn


def kl_to(policy: LoraPolicy, batch, reference: torch.Tensor) -> float:
    _, logprobs = entropy_and_logprobs(policy, batch)
    delta = (reference - logprobs)[batch.loss_mask_BT > 0]
    return float((torch.exp(delta) - delta - 1).mean())


def test_the_kl_penalty_pulls_the_policy_back_to_the_base_model(tiny_model_dir):
    batch = remedy_batch()
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, learning_rate=1e-3, kl_coef=1.0))
    _, base = entropy_and_logprobs(policy, batch)  # a fresh adapter (B = 0) is the base model
    torch.testing.assert_close(policy.reference_logprobs(batch), base)
    perturbed(policy, seed=1)
    torch.testing.assert_close(policy.reference_logprobs(batch), base)  # the reference stays the base model
    drifted = kl_to(policy, batch, base)
    assert drifted > 1e-4
    # plain gradient descent shows the gradient's direction (Adam's first step moves every weight by lr alike)
    policy.optimizer = torch.optim.SGD(policy.params, lr=0.05)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
    result = policy.train_step([batch], normaliser=2.0)
    assert result.stats.kl_mean == pytest.approx(drifted, rel=1e-3)
    assert kl_to(policy, batch, base) < drifted


def test_a_kept_reference_is_a_frozen_copy_and_the_weights_come_back(tiny_model_dir):
    batch = remedy_batch()
    policy = perturbed(LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, kl_coef=1.0)), seed=2)
    policy.keep_reference()  # e.g. right after a warm start
    _, warm = entropy_and_logprobs(policy, batch)
    perturbed(policy, seed=3)
    weights = {name: t.clone() for name, t in policy.adapter_tensors().items()}
    torch.testing.assert_close(policy.reference_logprobs(batch), warm)
    assert all(torch.equal(weights[name], t) for name, t in policy.adapter_tensors().items())
    _, now = entropy_and_logprobs(policy, batch)
    assert not torch.allclose(now, warm)


def test_head_only_entropies_equal_the_full_logits_path(tiny_model_dir):
    from consumers.losses import token_entropies

    batch = remedy_batch()
    policy = perturbed(LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4)), seed=4)
    with torch.no_grad():
        _, fast = policy.generated_logprobs_and_entropy(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
        full = token_entropies(policy.logits(batch.tokens_BT), batch.temperatures_B) * (batch.loss_mask_BT > 0)
    torch.testing.assert_close(fast, full, atol=1e-5, rtol=1e-5)
    assert int((fast != 0).sum()) == 4


def test_an_adapter_snapshot_writes_the_weights_of_when_it_was_taken(tiny_model_dir, tmp_path):
    # the learner takes a snapshot at the end of a step and writes it while the next step trains
    from safetensors.torch import load_file

    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    one_step(policy)
    before = {name.replace(".default", ""): p.detach().clone() for name, p in policy.lora_parameters().items()}
    snapshot = policy.adapter_snapshot()
    one_step(policy)  # training moves on in place before the snapshot is written
    with torch.no_grad():
        for p in policy.lora_parameters().values():
            p.add_(1.0)
    saved = load_file(str(snapshot.write(tmp_path / "v1") / "adapter_model.safetensors"))
    assert saved.keys() == before.keys() and all(torch.equal(saved[k], before[k]) for k in saved)
    assert json.loads((tmp_path / "v1" / "adapter_config.json").read_text())["inference_mode"] is True


def test_an_adapter_snapshots_files_are_the_folder_peft_writes(tiny_model_dir, tmp_path):
    # the learner publishes these bytes without a folder; a sampler loads the folder they make
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    one_step(policy)
    snapshot = policy.adapter_snapshot()
    files = snapshot.files()
    snapshot.config.save_pretrained(str(tmp_path / "peft"))
    assert files["adapter_config.json"] == (tmp_path / "peft" / "adapter_config.json").read_bytes()
    folder = snapshot.write(tmp_path / "ours")
    assert sorted(p.name for p in folder.iterdir()) == sorted(files)
    assert all((folder / name).read_bytes() == data for name, data in files.items())
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder))
    weights = {n.replace(".default", ""): p for n, p in loaded.named_parameters() if "lora_" in n}
    assert weights.keys() == snapshot.weights.keys()
    assert all(torch.equal(weights[k], snapshot.weights[k]) for k in weights)


def test_gradient_checkpointing_trains_the_same_step_with_the_activations_recomputed(tiny_model_dir):
    """learner.gradient_checkpointing keeps one hidden state per layer and recomputes the rest in the backward
    pass (what `rlpipe plan --checkpointing` sizes): the same loss, gradients and weights as without it."""
    batch = remedy_batch()
    batch = dataclasses.replace(batch, advantages_B=torch.tensor([1.0, -0.5]))
    results, weights = [], []
    for checkpointing in (False, True):
        policy = perturbed(LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, learning_rate=1e-2,
                                                                    loss="cross_entropy",
                                                                    gradient_checkpointing=checkpointing)), seed=3)
        assert policy.model.get_base_model().is_gradient_checkpointing is checkpointing
        results.append(policy.train_step([batch], normaliser=2.0))
        weights.append({name: p.detach().clone() for name, p in policy.lora_parameters().items()})
    assert results[0].loss != 0.0 and results[1].loss == pytest.approx(results[0].loss, rel=1e-6)
    assert results[1].grad_norm == pytest.approx(results[0].grad_norm, rel=1e-5)
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("shared_prefix", [False, True])
def test_position_logprobs_on_a_model_whose_body_is_not_named_model(shared_prefix) -> None:
    """GPT-2's body is ``transformer`` and its head ``lm_head`` by another path than Llama's and Qwen's ``model``:
    the head-at-selected-positions forward uses transformers' generic accessors, and agrees with the full forward."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from consumers.logprobs import position_logprobs

    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50, n_positions=64))
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"])).eval()
    tokens = torch.randint(0, 50, (3, 9))
    if shared_prefix:
        tokens[:, :5] = tokens[0, :5]  # every row starts alike: the prefix runs once
    rows, cols = torch.tensor([0, 1, 2, 2]), torch.tensor([4, 8, 6, 7])
    with torch.no_grad():
        got = position_logprobs(model, tokens, rows, cols, None, autocast=False)
        full = torch.log_softmax(model(input_ids=tokens).logits.float(), dim=-1)[rows, cols]
    torch.testing.assert_close(got, full, atol=1e-5, rtol=1e-5)


def test_the_base_models_dropout_is_off_so_training_logprobs_are_the_samplers(tiny_model_dir, tmp_path):
    # The sampler never runs dropout, so an on-policy row's training logprobs must equal the policy's own:
    # a base model whose config sets dropout (GPT-2's attn_pdrop, here Qwen2's attention_dropout) would make
    # every importance ratio of a training forward noise around 1.
    path = tmp_path / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.5}))
    policy = LoraPolicy(str(path), LearnerConfig(device="cpu", lora_rank=4))
    batch = micro_batches([[3, 4, 5, 6, 7, 8]], [[0, 0, 1, 1, 1, 1]], [[0.0] * 6], [1.0], 1000)[0]
    with torch.no_grad():
        policy.model.eval()
        scored = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
        policy.model.train()
        trained = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
    torch.testing.assert_close(trained, scored)
