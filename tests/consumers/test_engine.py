"""The training engine: many LoRA adapters on one base model, each trained as if it were alone."""

from __future__ import annotations

import json
import math
import random
import threading
from collections.abc import Callable

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load as load_safetensors
from transformers import AutoModelForCausalLM

from consumers.batching import micro_batches
from consumers.engine import LOSSES, AdamParams, TrainingEngine
from consumers.engine_data import Datum, EngineError
from consumers.losses import cross_entropy_loss, loss_from_logprobs
from consumers.policy import LoraPolicy
from pipeline.io.tensors import save_tensors
from schemas.config import LearnerConfig

TARGETS = ("q_proj", "v_proj")
ADAM = AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-8)


def datums(seed: int, count: int = 4, vocab: int = 1000, loss: str = "cross_entropy") -> list[Datum]:
    """Sequences of different lengths, loss on the second half, with weights (and RL inputs for ratio losses)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.randint(5, 12)
        sequence = [rng.randrange(vocab) for _ in range(n + 1)]
        weights = [0.0] * (n // 2) + [rng.uniform(0.5, 1.5) for _ in range(n - n // 2)]
        extra = {}
        if loss != "cross_entropy":
            extra = {"logprobs": [rng.uniform(-8, -6) if w else 0.0 for w in weights],
                     "advantages": [rng.choice((-1.0, 1.0)) if w else 0.0 for w in weights]}
        out.append(Datum(sequence[:-1], sequence[1:], weights=weights, **extra))
    return out


@pytest.fixture
def engine(tiny_model_dir) -> TrainingEngine:
    return TrainingEngine(tiny_model_dir, device="cpu")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def snapshot(engine: TrainingEngine, name: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Weights, optimizer state and RNG (the saved state) and the accumulated gradients."""
    return engine.save_state(name), engine.gradients(name)


def same_snapshot(a: tuple[bytes, dict[str, torch.Tensor]], b: tuple[bytes, dict[str, torch.Tensor]]) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def test_interleaved_adapters_end_with_the_weights_each_reaches_alone(tiny_model_dir):
    """A with dropout (its own RNG) and B with another shape, their calls interleaved, gradients pending together."""
    specs = {"a": dict(rank=4, alpha=8, target_modules=TARGETS, seed=1, dropout=0.1),
             "b": dict(rank=2, alpha=4, target_modules=("q_proj", "k_proj", "o_proj"), seed=2)}
    data = {"a": [datums(10 + i) for i in range(3)], "b": [datums(20 + i) for i in range(3)]}
    packed = TrainingEngine(tiny_model_dir, device="cpu")
    for name, spec in specs.items():
        packed.create_adapter(name, **spec)
    for step in range(3):
        packed.forward_backward("a", data["a"][step][:2], "cross_entropy")
        packed.forward_backward("b", data["b"][step], "cross_entropy")
        packed.forward_backward("a", data["a"][step][2:], "cross_entropy")
        packed.optim_step("a", ADAM)
        packed.forward("b", data["a"][step], "cross_entropy")
        packed.optim_step("b", ADAM)
    for name, spec in specs.items():
        alone = TrainingEngine(tiny_model_dir, device="cpu")
        alone.create_adapter(name, **spec)
        for step in range(3):
            alone.forward_backward(name, data[name][step][:2] if name == "a" else data[name][step], "cross_entropy")
            if name == "a":
                alone.forward_backward(name, data[name][step][2:], "cross_entropy")
            alone.optim_step(name, ADAM)
        assert max_difference(packed.weights(name), alone.weights(name)) <= 1e-6


def test_forward_changes_nothing_and_returns_the_forward_backward_logprobs(engine):
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    engine.optim_step("a", ADAM)
    trained = engine.forward_backward("a", datums(2), "cross_entropy")  # pending gradients, optimizer state
    before = snapshot(engine, "a")
    result = engine.forward("a", datums(2), "cross_entropy")
    assert same_snapshot(before, snapshot(engine, "a"))
    assert result.loss == pytest.approx(trained.loss, abs=1e-6)
    assert [len(x) for x in result.logprobs] == [len(d) for d in datums(2)]
    assert max(float((x - y).abs().max()) for x, y in zip(result.logprobs, trained.logprobs, strict=True)) <= 1e-6
    assert result.metrics()["loss:sum"] == result.loss


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "ppo"])
def test_a_batch_split_over_calls_or_micro_batches_gives_the_gradients_of_one_call(tiny_model_dir, loss):
    whole = TrainingEngine(tiny_model_dir, device="cpu")
    small = TrainingEngine(tiny_model_dir, device="cpu", max_batch_tokens=12)  # one or two datums per micro-batch
    batch = datums(5, count=5, loss=loss)
    for engine in (whole, small):
        engine.create_adapter("one", rank=4, alpha=8, target_modules=TARGETS, seed=3)
        engine.create_adapter("split", rank=4, alpha=8, target_modules=TARGETS, seed=3)
        engine.optim_step("one", ADAM)  # no gradients yet: nothing moves
    one = whole.forward_backward("one", batch, loss)
    first, second = whole.forward_backward("split", batch[:2], loss), whole.forward_backward("split", batch[2:], loss)
    assert first.loss + second.loss == pytest.approx(one.loss, abs=1e-5)
    assert first.stats.num_tokens + second.stats.num_tokens == one.stats.num_tokens
    # float32 sums taken in another order (micro-batches, the thread count earlier tests left) differ by a few
    # ulps of the largest gradient; a lost or doubled chunk would differ by the size of the gradients themselves
    scale = float(max(g.abs().max() for g in whole.gradients("one").values()))
    assert scale > 0
    assert max_difference(whole.gradients("one"), whole.gradients("split")) <= 1e-5 * scale
    small.forward_backward("one", batch, loss)
    assert max_difference(whole.gradients("one"), small.gradients("one")) <= 1e-5 * scale


def reference_peft_adamw(model_dir: str, seed: int, steps: list[list[Datum]], adams: list[AdamParams]) -> dict:
    """A plain peft + torch AdamW loop in float64: full logits, log-softmax, -(logp * weights).sum(), clip, step."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=list(TARGETS), task_type="CAUSAL_LM"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    for data, adam in zip(steps, adams, strict=True):
        for datum in data:
            logits = model(input_ids=datum.tokens[None]).logits[0]
            logp = torch.log_softmax(logits, -1).gather(-1, datum.target_tokens[:, None])[:, 0]
            (-(logp * datum.weights).sum()).backward()
        if adam.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        optimizer.param_groups[0].update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                         weight_decay=adam.weight_decay)
        optimizer.step()
        optimizer.zero_grad()
    return {k.replace(".default.", "."): p.detach() for k, p in model.named_parameters() if p.requires_grad}


def test_five_steps_with_per_call_adam_params_equal_a_plain_peft_adamw_loop(tiny_model_dir):
    """In float64 on both sides: Adam divides by the gradients' size, which turns float32 rounding into ~1e-5."""
    engine = TrainingEngine(tiny_model_dir, device="cpu", dtype="float64")
    adams = [ADAM, AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.9, eps=1e-6, weight_decay=0.1),
             AdamParams(learning_rate=2e-2, eps=1e-8, grad_clip_norm=0.01), ADAM,
             AdamParams(learning_rate=1e-3, beta1=0.5, beta2=0.999, eps=1e-7, weight_decay=0.5, grad_clip_norm=1.0)]
    steps = [datums(30 + i) for i in range(5)]
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=7)
    norms = []
    for data, adam in zip(steps, adams, strict=True):
        engine.forward_backward("a", data, "cross_entropy")
        norms.append(engine.optim_step("a", adam).grad_norm)
    assert max_difference(engine.weights("a"), reference_peft_adamw(tiny_model_dir, 7, steps, adams)) <= 1e-6
    assert norms[2] > 0.01  # the clip at 0.01 was binding, and still matched


def test_save_and_load_state_continue_training_identically(engine, tiny_model_dir):
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1, dropout=0.1)
    for i in range(2):
        engine.forward_backward("a", datums(i), "cross_entropy")
        engine.optim_step("a", ADAM)
    state = engine.save_state("a")
    other = TrainingEngine(tiny_model_dir, device="cpu")
    other.create_adapter("x", rank=2, alpha=4, target_modules=("k_proj",), seed=0)
    other.load_state("restored", state)
    weights_only = TrainingEngine(tiny_model_dir, device="cpu")
    weights_only.load_state("a", state, with_optimizer=False)
    for target in (engine, other):
        for i in range(2, 4):
            target.forward_backward("restored" if target is other else "a", datums(i), "cross_entropy")
            step = target.optim_step("restored" if target is other else "a", ADAM)
        assert step.step == 4
    assert max_difference(engine.weights("a"), other.weights("restored")) == 0.0
    weights_only.forward_backward("a", datums(2), "cross_entropy")
    assert weights_only.optim_step("a", ADAM).step == 1  # Adam started afresh
    with pytest.raises(EngineError, match="cannot load into adapter 'x'"):
        other.load_state("x", state)
    with pytest.raises(EngineError, match="not a training-engine state"):
        other.load_state("y", b"\x00" * 16)


def test_export_for_sampling_is_a_peft_folder_that_scores_like_the_engine(engine, tiny_model_dir, tmp_path):
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    engine.optim_step("a", ADAM)
    folder = engine.export_for_sampling("a", tmp_path / "v1")
    assert sorted(p.name for p in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder)).eval()
    datum = datums(2)[0]
    with torch.no_grad():
        logits = model(input_ids=datum.tokens[None]).logits[0].float()
    expected = torch.log_softmax(logits, -1).gather(-1, datum.target_tokens[:, None])[:, 0]
    assert float((engine.forward("a", [datum], "cross_entropy").logprobs[0] - expected).abs().max()) <= 1e-5


def test_an_exported_adapter_is_the_folder_a_run_alone_publishes(engine, tiny_model_dir):
    """A packed run publishes through the engine: its adapter_config.json is the one its own learner (LoraPolicy,
    as peft's save_pretrained: ``inference_mode`` on) writes for the same LoRA settings, and its weights are the
    adapter's as they are now, gradients pending or not (the export neither includes nor drops them)."""
    config = LearnerConfig(device="cpu", lora_rank=4, lora_alpha=8, target_modules=list(TARGETS))
    alone = LoraPolicy(tiny_model_dir, config).adapter_snapshot().files()["adapter_config.json"]
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    engine.optim_step("a", ADAM)
    engine.forward_backward("a", datums(2), "cross_entropy")
    pending = engine.gradients("a")
    snapshot = engine.adapter_snapshot("a")
    assert json.loads(snapshot.files()["adapter_config.json"]) == json.loads(alone)
    assert max_difference(snapshot.weights, engine.weights("a")) == 0.0
    assert max_difference(pending, engine.gradients("a")) == 0.0


def two_trained_adapters(engine) -> None:
    """Adapters "a" and "b", each one step in with gradients of a second batch accumulated."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.create_adapter("b", rank=4, alpha=8, target_modules=TARGETS, seed=2)
    for name in ("a", "b"):
        engine.forward_backward(name, datums(1), "cross_entropy")
        engine.optim_step(name, ADAM)
        engine.forward_backward(name, datums(2), "cross_entropy")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda e: e.forward_backward("nobody", datums(1), "cross_entropy"), "unknown adapter 'nobody'"),
        (lambda e: e.forward_backward("a", [*datums(1), Datum([1, 2, 3], [2, 3])], "cross_entropy"),
         "datum 4: target_tokens has 2 values, expected 3"),
        (lambda e: e.forward_backward("a", [Datum([1, 2], [2, 3], weights=[1.0])], "cross_entropy"),
         "datum 0: weights has 1 values, expected 2"),
        (lambda e: e.forward_backward("a", [Datum([1, 5000], [2, 3])], "cross_entropy"),
         "datum 0: tokens holds id 5000, outside the model's vocabulary"),
        (lambda e: e.forward("a", [Datum([1, 2], [2, -1])], "cross_entropy"), "target_tokens holds id -1"),
        (lambda e: e.forward_backward("a", [Datum([1] * (e.max_length + 1), [2] * (e.max_length + 1))],
                                      "cross_entropy"), r"datum 0 has \d+ tokens; the model takes at most \d+"),
        (lambda e: e.forward_backward("a", datums(1), "importance_sampling"), "needs logprobs"),
        (lambda e: e.forward_backward("a", datums(1), "dpo"), "unknown loss 'dpo'"),
        (lambda e: e.forward_backward("a", datums(1), "ppo", {"is_cap": 2.0}), "does not take"),
        (lambda e: e.optim_step("nobody", ADAM), "unknown adapter"),
        (lambda e: e.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=0), "already exists"),
        (lambda e: e.create_adapter("../x", rank=4, alpha=8, target_modules=TARGETS, seed=0), "not allowed"),
    ],
)
def test_a_bad_request_fails_in_one_line_and_changes_nothing(engine, call, message):
    two_trained_adapters(engine)
    before = {name: snapshot(engine, name) for name in ("a", "b")}
    with pytest.raises(ValueError, match=message) as error:
        call(engine)
    assert "\n" not in str(error.value)
    assert all(same_snapshot(before[name], snapshot(engine, name)) for name in ("a", "b"))
    assert engine.adapters() == ["a", "b"]


def test_adam_params_out_of_range_are_refused():
    with pytest.raises(EngineError, match="adam eps=0"):
        AdamParams(eps=0.0)


def test_deleted_adapters_free_their_name_and_leave_the_others(engine):
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.create_adapter("b", rank=4, alpha=8, target_modules=TARGETS, seed=2)
    kept = engine.weights("b")
    engine.delete_adapter("a")
    engine.delete_adapter("b")
    engine.create_adapter("b", rank=4, alpha=8, target_modules=TARGETS, seed=2)
    assert engine.adapters() == ["b"] and max_difference(engine.weights("b"), kept) == 0.0
    assert engine.forward_backward("b", datums(1), "cross_entropy").loss > 0


def test_rlpipe_rows_as_datums_score_and_lose_like_the_learners_policy(engine, tiny_model_dir):
    """At initialisation (LoRA B = 0) any adapter is the base model, so LoraPolicy and the engine must agree."""
    rows, masks = [[3, 4, 5, 6, 7], [8, 9, 10]], [[0, 0, 1, 1, 1], [0, 1, 1]]
    sampler = [[0.0, 0.0, -6.5, -7.0, -6.8], [0.0, -7.2, -6.9]]
    advantages, temperatures = [1.0, -0.5], [0.7, 1.0]
    config = LearnerConfig(device="cpu", lora_rank=4, loss="importance_sampling")
    policy = LoraPolicy(tiny_model_dir, config)
    batch = micro_batches(rows, masks, sampler, advantages, 1000, temperatures_R=temperatures)[0]
    with torch.no_grad():
        logprobs_BT = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
        expected, _ = loss_from_logprobs(config, logprobs_BT, batch, normaliser=2.0)
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=0)
    data = [Datum.from_sequence(row, mask, logprobs=lp, advantages=[a] * len(row), temperature=t)
            for row, mask, lp, a, t in zip(rows, masks, sampler, advantages, temperatures, strict=True)]
    result = engine.forward("a", data, "importance_sampling", {"normaliser": 2.0})
    assert result.loss == pytest.approx(float(expected), abs=1e-6)
    for b, row in enumerate(rows):
        masked = torch.tensor(masks[b][1:]) > 0
        assert torch.allclose(result.logprobs[b][masked], logprobs_BT[b, 1 : len(row)][masked], atol=1e-6)


def test_a_forward_backward_failing_half_way_adds_no_gradient(tiny_model_dir, monkeypatch):
    engine = TrainingEngine(tiny_model_dir, device="cpu", max_batch_tokens=12)  # several micro-batches
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    before = snapshot(engine, "a")
    calls = []

    def fails_on_the_second_micro_batch(logprobs_BT, batch, normaliser):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("CUDA out of memory")
        return cross_entropy_loss(logprobs_BT, batch, normaliser)

    monkeypatch.setitem(LOSSES, "cross_entropy", (fails_on_the_second_micro_batch, frozenset()))
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.forward_backward("a", datums(2), "cross_entropy")
    assert same_snapshot(before, snapshot(engine, "a"))


def test_calls_from_several_threads_run_one_at_a_time(tiny_model_dir):
    specs = {name: dict(rank=4, alpha=8, target_modules=TARGETS, seed=seed, dropout=0.1)
             for name, seed in (("a", 1), ("b", 2), ("c", 3))}

    def train(engine: TrainingEngine, name: str) -> None:
        for step in range(3):
            engine.forward_backward(name, datums(step), "cross_entropy")
            engine.optim_step(name, ADAM)

    shared = TrainingEngine(tiny_model_dir, device="cpu")
    for name, spec in specs.items():
        shared.create_adapter(name, **spec)
    threads = [threading.Thread(target=train, args=(shared, name)) for name in specs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, spec in specs.items():
        alone = TrainingEngine(tiny_model_dir, device="cpu")
        alone.create_adapter(name, **spec)
        train(alone, name)
        assert max_difference(shared.weights(name), alone.weights(name)) <= 1e-6


def test_an_optim_step_failing_half_way_changes_nothing(engine):
    """A step that fails inside AdamW (memory short on the device) after its clip and its updates ran leaves the
    weights, Adam moments, step count and (unclipped) gradients as they were: the call's error stands, a trainer
    replaying the log does not run it again, and the retried step is the one that would have run."""
    two_trained_adapters(engine)
    before = {name: snapshot(engine, name) for name in ("a", "b")}
    state = engine.save_state("a", with_gradients=True)
    clipped = AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3)

    def fails_after_the_update(optimizer, args, kwargs):
        raise RuntimeError("CUDA out of memory")

    hook = engine._get("a").optimizer.register_step_post_hook(fails_after_the_update)
    with pytest.raises(RuntimeError, match="out of memory"):
        engine.optim_step("a", clipped, undo=True)
    assert all(same_snapshot(before[name], snapshot(engine, name)) for name in ("a", "b"))
    hook.remove()
    engine.optim_step("a", clipped)
    twin = TrainingEngine(engine.base_model, device="cpu")
    twin.load_state("a", state)
    twin.optim_step("a", clipped)
    assert engine.save_state("a") == twin.save_state("a")  # weights, moments, step count


def test_a_step_takes_an_undo_point_only_when_asked(engine, monkeypatch):
    """The undo point (copies of weights, gradients and Adam moments) is for the API trainer, whose client may send
    a failed step again; the distributed ``train_batches`` resumes from its checkpoint instead, and the benchmarks
    step without one."""
    import consumers.engine as engine_module

    taken = []
    real_step_undo = engine_module.step_undo
    monkeypatch.setattr(engine_module, "step_undo", lambda *args: taken.append(1) or real_step_undo(*args))
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    engine.optim_step("a", ADAM)
    assert taken == []
    engine.forward_backward("a", datums(2), "cross_entropy")
    engine.optim_step("a", ADAM, undo=True)
    assert taken == [1]


def test_an_optim_step_on_gradients_that_are_not_finite_is_refused_and_they_are_discarded(engine):
    """A loss that overflowed (a ratio far from 1) leaves inf or NaN gradients: the step would write NaN weights."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    weights = engine.weights("a")
    next(iter(engine._get("a").params.values())).grad.view(-1)[0] = math.nan
    with pytest.raises(EngineError, match=r"not finite.*discarded.*unchanged"):
        engine.optim_step("a", ADAM)
    assert max_difference(weights, engine.weights("a")) == 0.0
    assert all(g.abs().max() == 0 for g in engine.gradients("a").values())  # gone: the next step starts clean
    engine.forward_backward("a", datums(2), "cross_entropy")
    assert engine.optim_step("a", ADAM).step == 1  # and the adapter trains on
    assert all(bool(torch.isfinite(w).all()) for w in engine.weights("a").values())


def test_an_optim_step_without_gradients_changes_nothing_and_counts_no_step(engine):
    """No forward_backward since the last step: AdamW would move nothing, so the step is not counted either."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    fresh = engine.save_state("a")
    idle = engine.optim_step("a", ADAM)
    assert (idle.step, idle.grad_norm) == (0, 0.0) and engine.save_state("a") == fresh
    engine.forward_backward("a", datums(1), "cross_entropy")
    assert engine.optim_step("a", ADAM).step == 1
    stepped = engine.save_state("a")
    again = engine.optim_step("a", AdamParams(learning_rate=0.5))
    assert (again.step, again.grad_norm) == (1, 0.0) and engine.save_state("a") == stepped


def test_a_forward_backward_whose_loss_is_not_finite_is_refused_and_adds_no_gradient(engine):
    """Sampler logprobs of -500 make exp(lp - q) overflow: the call is refused, and the gradients accumulated by
    the calls before it are kept, so the step can go on without it."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    before = engine.gradients("a")
    absurd = [Datum(d.tokens, d.target_tokens, weights=d.weights, logprobs=[-500.0 if w else 0.0 for w in d.weights],
                    advantages=[1.0 if w else 0.0 for w in d.weights]) for d in datums(2)]
    open_mask = {"is_cap": math.inf, "ratio_mask_low": 0.0, "ratio_mask_high": math.inf}
    with pytest.raises(EngineError, match=r"loss is not finite.*no gradient was added"):
        engine.forward_backward("a", absurd, "importance_sampling", open_mask)
    assert max_difference(before, engine.gradients("a")) == 0.0
    assert engine.optim_step("a", ADAM).step == 1


def test_a_state_saved_with_its_gradients_continues_as_if_never_saved(engine, tiny_model_dir):
    """What a trainer's fold holds: a state taken between forward_backward and optim_step, gradients included,
    loads into another engine and steps to the weights of the uninterrupted adapter."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=1)
    engine.forward_backward("a", datums(1), "cross_entropy")
    with_gradients, without = engine.save_state("a", with_gradients=True), engine.save_state("a")
    engine.optim_step("a", ADAM)
    other = TrainingEngine(tiny_model_dir, device="cpu")
    other.load_state("b", with_gradients)
    assert other.has_gradients("b")
    other.optim_step("b", ADAM)
    assert max_difference(engine.weights("a"), other.weights("b")) <= 1e-7
    other.load_state("c", without)  # a checkpoint: no gradients
    assert not other.has_gradients("c")
    other.forward_backward("b", datums(2), "cross_entropy")
    other.load_state("b", without)  # a load replaces the whole state: the gradients pending are dropped too
    assert not other.has_gradients("b") and other.optim_step("b", ADAM).step == 0


@pytest.mark.parametrize("loss", ["importance_sampling", "ppo", "cispo", "dro"])
def test_the_ratio_statistics_leave_out_targets_whose_weight_is_zero(engine, loss):
    """Weights mask targets for every loss (docs/api.md): a target of weight 0 trains nothing, so it is no trained
    token in ``num_tokens`` and its ratio (here e^3, far off) moves neither ``ratio_max`` nor ``num_clipped``."""
    engine.create_adapter("a", rank=4, alpha=8, target_modules=TARGETS, seed=3)
    sequence = list(range(10, 21))
    probe = engine.forward("a", [Datum(sequence[:-1], sequence[1:])], "cross_entropy").logprobs[0].tolist()
    weights = [0.0] * 5 + [1.0] * 5
    logprobs = [lp - 3.0 if w == 0 else lp for lp, w in zip(probe, weights, strict=True)]  # ratio e^3 where w = 0
    datum = Datum(sequence[:-1], sequence[1:], weights=weights, logprobs=logprobs, advantages=[1.0] * 10)
    stats = engine.forward("a", [datum], loss).stats
    assert stats.num_tokens == 5 and stats.ratio_max == pytest.approx(1.0, abs=1e-4)
    assert stats.num_clipped == 0


@pytest.fixture(scope="module")
def gpt2_with_dropout_dir(tmp_path_factory) -> str:
    """A tiny random GPT-2 whose config keeps GPT-2's dropout (attention, residual, embeddings: 0.1 each)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=1000, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                        eos_token_id=0)
    assert config.attn_pdrop == config.resid_pdrop == config.embd_pdrop == 0.1
    folder = tmp_path_factory.mktemp("gpt2") / "model"
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    return str(folder)


def test_a_base_model_with_dropout_in_its_config_gives_the_same_logprobs_in_every_call(gpt2_with_dropout_dir):
    """Tinker's forward_backward logprobs are a function of the weights: the base model's own dropout does not run,
    so two forward_backward calls (and a forward) on the same weights agree exactly."""
    engine = TrainingEngine(gpt2_with_dropout_dir, device="cpu")
    engine.create_adapter("a", rank=4, alpha=8, target_modules=("c_attn",), seed=1)
    batch = datums(1)
    first = engine.forward_backward("a", batch, "cross_entropy")
    second = engine.forward_backward("a", batch, "cross_entropy")
    scored = engine.forward("a", batch, "cross_entropy")
    for other in (second, scored):
        assert all(torch.equal(x, y) for x, y in zip(first.logprobs, other.logprobs, strict=True))
    kept = TrainingEngine(gpt2_with_dropout_dir, device="cpu", base_dropout=True)  # kept on request
    kept.create_adapter("a", rank=4, alpha=8, target_modules=("c_attn",), seed=1)
    runs = [kept.forward_backward("a", batch, "cross_entropy").logprobs for _ in range(2)]
    assert not all(torch.equal(x, y) for x, y in zip(*runs, strict=True))


def _damaged(state: bytes, change: Callable[[dict[str, torch.Tensor], dict], None]) -> bytes:
    """``state`` with ``change(tensors, meta)`` applied: a state file damaged in one place, still readable."""
    tensors = load_safetensors(state)
    header = json.loads(state[8 : 8 + int.from_bytes(state[:8], "little")])
    meta = json.loads(header["__metadata__"]["rlpipe"])
    change(tensors, meta)
    return save_tensors(tensors, metadata={"rlpipe": json.dumps(meta)})


def _wrong_gradient(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    key = next(k for k in tensors if k.startswith("gradient."))
    tensors[key] = tensors[key][:1]


def _wrong_moment(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    key = next(k for k in tensors if k.startswith("optimizer.") and k.endswith(".exp_avg"))
    tensors[key] = tensors[key].flatten()[:3]


def _no_param_groups(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    del meta["param_groups"]


def _bad_rng(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    tensors["rng.cpu"] = torch.zeros(3)


@pytest.mark.parametrize("damage", [_wrong_gradient, _wrong_moment, _no_param_groups, _bad_rng])
def test_a_damaged_state_loaded_into_an_adapter_is_refused_and_leaves_it_as_it_was(engine, damage):
    """A load is all or nothing: a state that fails any check (the last ones too) changes none of the adapter's
    weights, optimizer, step count, gradients or RNG."""
    two_trained_adapters(engine)
    before = snapshot(engine, "a")
    bad = _damaged(engine.save_state("b", with_gradients=True), damage)
    with pytest.raises(EngineError, match="damaged"):
        engine.load_state("a", bad)
    assert same_snapshot(before, snapshot(engine, "a"))
    engine.optim_step("a", ADAM)  # and it trains on
