"""The learner's forward runs the columns every row of a micro-batch shares once (``consumers.policy``)."""

from __future__ import annotations

import pytest
import torch

from consumers import logprobs as logprobs_module
from consumers.batching import micro_batches
from consumers.logprobs import shared_prefix_length
from consumers.policy import LoraPolicy
from schemas.config import LearnerConfig


def test_the_shared_prefix_is_the_columns_every_row_starts_with():
    prefix = list(range(5, 45))  # 40 tokens
    rows = torch.tensor([prefix + [1, 2, 3], prefix + [1, 9, 9], prefix + [7, 0, 0]])
    assert shared_prefix_length(rows, first_needed=42) == 40
    assert shared_prefix_length(rows, first_needed=35) == 35  # never past the first position whose output is read
    assert shared_prefix_length(rows[:, 10:], first_needed=40) == 0  # 30 columns: not worth a second pass
    assert shared_prefix_length(rows[:1], first_needed=42) == 0  # one row shares with no one
    assert shared_prefix_length(torch.tensor([prefix + [1], prefix + [1]]), first_needed=40) == 40


def batch_sharing(prefix_len: int):
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(3, 1000, (prefix_len,), generator=generator).tolist()
    rows, masks = [], []
    for length in (12, 17, 9, 14):  # rows of different lengths: padded on the right
        rest = torch.randint(3, 1000, (length,), generator=generator).tolist()
        rows.append(prefix + rest)
        masks.append([0] * (prefix_len + length - 4) + [1] * 4)
    return micro_batches(rows, masks, [[0.0] * len(r) for r in rows], [1.0, -0.5, 0.25, -2.0], 100_000,
                         temperatures_R=[1.0, 0.7, 1.0, 1.3])[0]


def logprobs_and_grads(policy: LoraPolicy, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    policy.model.train()
    policy.optimizer.zero_grad(set_to_none=True)
    logprobs, _ = policy.generated_logprobs_and_entropy(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
    (logprobs.sum(dim=1) * batch.advantages_B).sum().backward()
    return logprobs.detach(), {name: p.grad.clone() for name, p in policy.lora_parameters().items()}


def test_sharing_the_prefix_gives_the_same_logprobs_and_gradients(tiny_model_dir, monkeypatch):
    batch = batch_sharing(48)
    assert batch.tokens_BT.shape[0] == 4
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    with torch.no_grad():
        generator = torch.Generator().manual_seed(1)
        for name, p in policy.lora_parameters().items():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)  # an adapter that changes the outputs
    calls: list[int] = []
    body = policy.model.get_base_model().model
    hook = body.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                          with_kwargs=True)
    shared, shared_grads = logprobs_and_grads(policy, batch)
    assert calls == [48, batch.tokens_BT.shape[1] - 48]  # the prefix once, then every row's rest
    monkeypatch.setattr(logprobs_module, "MIN_SHARED_PREFIX", 10**9)
    calls.clear()
    plain, plain_grads = logprobs_and_grads(policy, batch)
    hook.remove()
    assert calls == [batch.tokens_BT.shape[1]]
    assert int((plain != 0).sum()) == 16
    torch.testing.assert_close(shared, plain, atol=1e-5, rtol=1e-5)
    assert shared_grads.keys() == plain_grads.keys()
    for name, grad in plain_grads.items():
        assert float(grad.abs().max()) > 0, name
        torch.testing.assert_close(shared_grads[name], grad, atol=1e-6, rtol=1e-4)


def test_no_prefix_is_shared_while_dropout_runs(tiny_model_dir):
    batch = batch_sharing(48)
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4, lora_dropout=0.1))
    calls: list[int] = []
    body = policy.model.get_base_model().model
    body.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                   with_kwargs=True)
    logprobs_and_grads(policy, batch)
    assert calls == [batch.tokens_BT.shape[1]]  # one mask per row, as without sharing
    policy.model.eval()
    calls.clear()
    with torch.no_grad():
        policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
    assert calls == [48, batch.tokens_BT.shape[1] - 48]


@pytest.mark.parametrize("prefix_len", [31, 32])
def test_a_short_prefix_is_not_worth_sharing(tiny_model_dir, prefix_len):
    assert (shared_prefix_length(batch_sharing(prefix_len).tokens_BT, 10**6) > 0) is (prefix_len >= 32)


def test_no_prefix_is_shared_under_gradient_checkpointing(tiny_model_dir, monkeypatch):
    batch = batch_sharing(48)
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    policy.model.get_base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    calls: list[int] = []
    body = policy.model.get_base_model().model
    body.register_forward_pre_hook(lambda _m, _a, kwargs: calls.append(kwargs["input_ids"].shape[1]),
                                   with_kwargs=True)
    checkpointed, _ = logprobs_and_grads(policy, batch)
    assert calls == [batch.tokens_BT.shape[1]]  # the cache is off in training: every row through the whole body
    policy.model.get_base_model().gradient_checkpointing_disable()
    calls.clear()
    shared, _ = logprobs_and_grads(policy, batch)
    assert calls == [48, batch.tokens_BT.shape[1] - 48]
    torch.testing.assert_close(checkpointed, shared, atol=1e-5, rtol=1e-5)


def test_a_model_that_does_not_cache_falls_back_to_the_whole_rows(tiny_model_dir, monkeypatch):
    batch = batch_sharing(48)
    policy = LoraPolicy(tiny_model_dir, LearnerConfig(device="cpu", lora_rank=4))
    policy.model.eval()
    with torch.no_grad():
        shared = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
    body = policy.model.get_base_model().model
    forward = body.forward
    monkeypatch.setattr(body, "forward", lambda *a, **k: forward(*a, **{**k, "use_cache": False}))
    with torch.no_grad():
        fallback = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT)
    torch.testing.assert_close(fallback, shared, atol=1e-5, rtol=1e-5)
