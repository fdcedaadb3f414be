"""The Tinker training calls on the engine, against plain peft/torch and the Tinker loss formulas written out here.

Datums are built with the SDK's own types (``tinker.types``), the way a client
builds them: the model input in two text chunks (prompt, completion), position
i of the input predicting ``target_tokens[i]``.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tinker import types
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from consumers.api import ops
from consumers.api.translate import lora_target_modules
from consumers.engine import TrainingEngine
from schemas.api import ApiError

VOCAB = 1000
QWEN_ATTN = ["k_proj", "o_proj", "q_proj", "v_proj"]
QWEN_MLP = ["down_proj", "gate_proj", "up_proj"]


# ---- building requests the way the SDK's users do -----------------------------------------------
def datum(sequence: list[int], prompt: int, **inputs: list[float]) -> types.Datum:
    """Input = sequence[:-1] as a prompt chunk and a completion chunk, targets = sequence[1:]."""
    tokens = sequence[:-1]
    chunks = [types.EncodedTextChunk(tokens=tokens[:prompt]), types.EncodedTextChunk(tokens=tokens[prompt:])]
    return types.Datum(model_input=types.ModelInput(chunks=chunks),
                       loss_fn_inputs={"target_tokens": sequence[1:], **inputs})


def batch(seed: int, loss: str = "cross_entropy", count: int = 4, sampler: list[list[float]] | None = None
          ) -> list[types.Datum]:
    """Sequences of 6-12 targets; the completion half carries weights (SFT) or advantages (RL).

    RL datums get sampler logprobs near the untrained model's (about -log 1000), or ``sampler`` where given.
    """
    rng = random.Random(seed)
    out = []
    for index in range(count):
        n = rng.randint(6, 12)
        sequence = [rng.randrange(VOCAB) for _ in range(n + 1)]
        prompt = n // 2
        if loss == "cross_entropy":
            out.append(datum(sequence, prompt, weights=[0.0] * prompt + [rng.uniform(0.5, 1.5)
                                                                          for _ in range(n - prompt)]))
            continue
        advantages = [0.0] * prompt + [rng.uniform(-1, 1) for _ in range(n - prompt)]
        logprobs = [rng.uniform(-7.3, -6.6) for _ in range(n)]  # drawn either way: the same sequences follow
        logprobs = sampler[index] if sampler else logprobs
        extra = {"sequence_ratio_mask": [0.0] * prompt + [1.0] * (n - prompt)} if loss == "gspo" else {}
        out.append(datum(sequence, prompt, logprobs=logprobs, advantages=advantages, **extra))
    return out


def create(engine: TrainingEngine, model_id: str, rank: int = 4, seed: int = 7, **parts: bool) -> None:
    request = types.CreateModelRequest(session_id=model_id.split(":")[0], model_seq_id=0, base_model="tiny",
                                       lora_config=types.LoraConfig(rank=rank, seed=seed, **parts))
    ops.create_model(engine, model_id, request)


def fb(engine: TrainingEngine, model_id: str, data: list[types.Datum], loss: str = "cross_entropy",
       config: dict | None = None, forward_only: bool = False) -> types.ForwardBackwardOutput:
    call = types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config)
    request = types.ForwardBackwardRequest(forward_backward_input=call, model_id=model_id, seq_id=1)
    return ops.forward_backward(engine, model_id, request, forward_only)


def step(engine: TrainingEngine, model_id: str, adam: types.AdamParams) -> types.OptimStepResponse:
    return ops.optim_step(engine, model_id, types.OptimStepRequest(adam_params=adam, model_id=model_id))


ADAM = types.AdamParams(learning_rate=1e-2, beta1=0.9, beta2=0.99, eps=1e-8)


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TrainingEngine:
    """One float32 engine for the module; every test uses its own model ids."""
    return TrainingEngine(tiny_model_dir, device="cpu")


def max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def snapshot(engine: TrainingEngine, model_id: str) -> tuple[bytes, dict[str, torch.Tensor]]:
    """Weights, optimizer state and RNG (the saved state) and the accumulated gradients."""
    return ops.save_state(engine, model_id), engine.gradients(ops.adapter_name(model_id))


def same_snapshot(a: tuple[bytes, dict[str, torch.Tensor]], b: tuple[bytes, dict[str, torch.Tensor]]) -> bool:
    return a[0] == b[0] and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


# ---- numerics -----------------------------------------------------------------------------------
def test_logprobs_equal_a_direct_peft_forward_of_the_same_datums(engine, tiny_model_dir, tmp_path):
    create(engine, "lp:train:0")
    fb(engine, "lp:train:0", batch(1))
    step(engine, "lp:train:0", ADAM)  # LoRA B leaves 0: the adapter now differs from the base model
    folder = ops.export_for_sampling(engine, "lp:train:0", tmp_path / "v1")
    data = batch(2)
    out = fb(engine, "lp:train:0", data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(folder)).eval()
    assert out.loss_fn_output_type == "ArrayRecord" and len(out.loss_fn_outputs) == len(data)
    expected_loss = 0.0
    for item, output in zip(data, out.loss_fn_outputs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([item.model_input.to_ints()])).logits[0].float()
        targets = item.loss_fn_inputs["target_tokens"].to_torch()
        expected = torch.log_softmax(logits, -1).gather(-1, targets[:, None])[:, 0]  # position i -> target i
        got = output["logprobs"].to_torch()
        assert output["logprobs"].dtype == "float32" and got.shape == (item.model_input.length,)
        assert float((got - expected).abs().max()) <= 1e-5
        expected_loss -= float((expected * item.loss_fn_inputs["weights"].to_torch()).sum())
    assert out.metrics["loss:sum"] == pytest.approx(expected_loss, rel=1e-5)
    assert all(key.count(":") == 1 for key in out.metrics)


def tinker_loss(loss: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> torch.Tensor:
    """The Tinker documentation's formulas, sums over every token of the datum."""
    if loss == "cross_entropy":
        return -(lp * inputs["weights"]).sum()
    q, advantages = inputs["logprobs"], inputs["advantages"]
    ratio = torch.exp(lp - q)
    if loss == "importance_sampling":
        return -(ratio * advantages).sum()
    if loss == "ppo":
        clipped = ratio.clamp(config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2))
        return -torch.minimum(ratio * advantages, clipped * advantages).sum()
    if loss == "cispo":
        return -(ratio.clamp(0.0, 4.0).detach() * lp * advantages).sum()
    if loss == "gspo":  # GSPO-token: the masked tokens' mean log-ratio, each token with its own gradient
        in_ratio = inputs["sequence_ratio_mask"] != 0
        sequence_ratio = torch.exp((lp.detach() - q)[in_ratio].mean() + lp - lp.detach())
        clipped = sequence_ratio.clamp(config["clip_low_threshold"], config["clip_high_threshold"])
        return -torch.minimum(sequence_ratio * advantages, clipped * advantages).sum()
    assert loss == "dro"
    return -(lp * advantages - 0.5 * config["beta"] * (lp - q) ** 2).sum()


def reference_loop(model_dir: str, seed: int, targets: list[str], steps: list[tuple]) -> dict[str, torch.Tensor]:
    """A plain peft + torch AdamW loop in float64: full logits, log-softmax, the Tinker formula, clip, step."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64)
    lora = LoraConfig(r=4, lora_alpha=ops.LORA_ALPHA, target_modules=targets, task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LoRA on the tied output head, as the engine does
        model = get_peft_model(base, lora)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params)
    for data, loss, config, adam in steps:
        for item in data:
            inputs = {key: value.to_torch() for key, value in item.loss_fn_inputs.items()}
            logits = model(input_ids=torch.tensor([item.model_input.to_ints()])).logits[0]
            lp = torch.log_softmax(logits, -1).gather(-1, inputs.pop("target_tokens")[:, None])[:, 0]
            tinker_loss(loss, lp, {k: v.double() for k, v in inputs.items()}, config).backward()
        if adam.grad_clip_norm:
            torch.nn.utils.clip_grad_norm_(params, adam.grad_clip_norm)
        optimizer.param_groups[0].update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                         weight_decay=adam.weight_decay)
        optimizer.step()
        optimizer.zero_grad()
    return {k.replace(".default.", "."): p.detach() for k, p in model.named_parameters() if p.requires_grad}


def test_a_step_of_each_served_loss_equals_a_plain_peft_adamw_loop(tiny_model_dir):
    """float64 on both sides (Adam divides by the gradients' size, which turns float32 rounding into ~1e-5).

    Each step's sampler logprobs are the model's own (a forward_only call) plus noise, so ratios lie
    around 1 and PPO's clip binds on some tokens.
    """
    engine = TrainingEngine(tiny_model_dir, device="cpu", dtype="float64")
    create(engine, "five:train:0", seed=11)
    plan = [("cross_entropy", None, ADAM),
            ("importance_sampling", None, types.AdamParams(learning_rate=5e-3, beta1=0.8, beta2=0.9, eps=1e-6,
                                                           weight_decay=0.1)),
            ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
             types.AdamParams(learning_rate=2e-2, eps=1e-8, grad_clip_norm=0.01)),
            ("cispo", None, ADAM),
            ("dro", {"beta": 0.3}, types.AdamParams(learning_rate=1e-3, beta1=0.5, beta2=0.999, eps=1e-7,
                                                    weight_decay=0.5, grad_clip_norm=1.0)),
            ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}, ADAM)]
    steps, norms, rng = [], [], random.Random(0)
    for index, (loss, config, adam) in enumerate(plan):
        data = batch(40 + index, loss)
        if loss != "cross_entropy":
            current = fb(engine, "five:train:0", data, loss, config, forward_only=True).loss_fn_outputs
            sampler = [[x + rng.uniform(-0.4, 0.4) for x in out["logprobs"].tolist()] for out in current]
            data = batch(40 + index, loss, sampler=sampler)
        out = fb(engine, "five:train:0", data, loss, config)
        assert set(out.metrics) >= {"loss:sum", "num_tokens:sum"}
        if loss == "gspo":  # the noise moves some sequences' ratios outside [0.95, 1.05] and keeps others inside
            assert 0 < out.metrics["num_clipped:sum"] < out.metrics["num_tokens:sum"]
        norms.append(step(engine, "five:train:0", adam).metrics["grad_norm:mean"])
        steps.append((data, loss, config or {"beta": 0.05}, adam))
    targets = lora_target_modules(engine.base, types.LoraConfig(rank=4))
    reference = reference_loop(tiny_model_dir, 11, targets, steps)
    assert max_difference(engine.weights("five.train.0"), reference) <= 1e-6
    assert norms[2] > 0.01  # the clip at 0.01 was binding, and still matched


@pytest.mark.parametrize("loss", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_a_batch_in_chunks_gives_the_gradients_of_one_call_and_forward_changes_nothing(engine, loss):
    data = batch(5, loss, count=6)
    for model_id in (f"one{loss[:3]}:train:0", f"chunks{loss[:3]}:train:0"):
        create(engine, model_id, seed=3)
    one = fb(engine, f"one{loss[:3]}:train:0", data, loss)
    chunks = [fb(engine, f"chunks{loss[:3]}:train:0", data[i : i + 2], loss) for i in (4, 2, 0)]
    assert sum(c.metrics["loss:sum"] for c in chunks) == pytest.approx(one.metrics["loss:sum"], abs=1e-5)
    assert sum(c.metrics["num_tokens:sum"] for c in chunks) == one.metrics["num_tokens:sum"] > 0
    assert ("ratio_max:max" in one.metrics) == (loss != "cross_entropy")
    grads_one = engine.gradients(f"one{loss[:3]}.train.0")
    largest = max(float(g.abs().max()) for g in grads_one.values())
    assert largest > 0  # float32 sums in another order: equal to 1e-6 of the largest gradient
    assert max_difference(grads_one, engine.gradients(f"chunks{loss[:3]}.train.0")) <= 1e-6 * max(1.0, largest)
    before = snapshot(engine, f"one{loss[:3]}:train:0")
    forward = fb(engine, f"one{loss[:3]}:train:0", data, loss, forward_only=True)
    assert same_snapshot(before, snapshot(engine, f"one{loss[:3]}:train:0"))
    assert forward.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], abs=1e-6)
    for a, b in zip(forward.loss_fn_outputs, one.loss_fn_outputs, strict=True):
        assert float((a["logprobs"].to_torch() - b["logprobs"].to_torch()).abs().max()) <= 1e-6


def test_three_models_trained_interleaved_end_as_each_trained_alone(engine, tiny_model_dir):
    specs = {"ia:train:0": dict(rank=2, seed=1, train_mlp=False, train_unembed=False),
             "ib:train:0": dict(rank=4, seed=2, train_attn=False),
             "ic:train:0": dict(rank=3, seed=3)}
    losses = {"ia:train:0": "cross_entropy", "ib:train:0": "ppo", "ic:train:0": "cispo"}
    data = {model_id: [batch(60 + 10 * i + s, losses[model_id]) for s in range(3)]
            for i, model_id in enumerate(specs)}

    def train_step(target: TrainingEngine, model_id: str, s: int, first_half: bool) -> None:
        chunk = data[model_id][s][:2] if first_half else data[model_id][s][2:]
        fb(target, model_id, chunk, losses[model_id])
        if not first_half:
            step(target, model_id, ADAM)

    for model_id, spec in specs.items():
        create(engine, model_id, **spec)
    for s in range(3):  # every model has pending gradients while the others train
        for first_half in (True, False):
            for model_id in specs:
                train_step(engine, model_id, s, first_half)
    for model_id, spec in specs.items():
        alone = TrainingEngine(tiny_model_dir, device="cpu")
        create(alone, model_id, **spec)
        for s in range(3):
            train_step(alone, model_id, s, True)
            train_step(alone, model_id, s, False)
        name = ops.adapter_name(model_id)
        assert max_difference(engine.weights(name), alone.weights(name)) <= 1e-6


def test_saved_state_continues_training_identically_with_or_without_the_optimizer(engine):
    create(engine, "sv:train:0")
    for s in range(2):
        fb(engine, "sv:train:0", batch(s))
        step(engine, "sv:train:0", ADAM)
    full, weights_only = ops.save_state(engine, "sv:train:0"), ops.save_state(engine, "sv:train:0", False)
    ops.load_state(engine, "sv:train:1", full, with_optimizer=True)
    ops.load_state(engine, "sv:train:2", weights_only, with_optimizer=False)
    assert max_difference(engine.weights("sv.train.0"), engine.weights("sv.train.2")) == 0.0
    for model_id in ("sv:train:0", "sv:train:1", "sv:train:2"):
        fb(engine, model_id, batch(3))
        metrics = step(engine, model_id, ADAM).metrics
    assert metrics["step:max"] == 1.0  # the weights-only copy restarted Adam
    assert max_difference(engine.weights("sv.train.0"), engine.weights("sv.train.1")) == 0.0
    assert max_difference(engine.weights("sv.train.0"), engine.weights("sv.train.2")) > 0
    ops.unload(engine, "sv:train:1")
    assert "sv.train.1" not in engine.adapters()


def test_an_optim_step_with_no_forward_backward_since_the_last_changes_nothing_and_counts_no_step(engine):
    create(engine, "idle:train:0")
    fb(engine, "idle:train:0", batch(1))
    assert step(engine, "idle:train:0", ADAM).metrics["step:max"] == 1.0
    stepped = ops.save_state(engine, "idle:train:0")
    metrics = step(engine, "idle:train:0", ADAM).metrics
    assert (metrics["step:max"], metrics["grad_norm:mean"]) == (1.0, 0.0)
    assert ops.save_state(engine, "idle:train:0") == stepped


def test_an_optim_step_failing_half_way_on_the_trainer_changes_nothing(engine):
    """Memory short inside AdamW: the client's error stands and the step it sends again is the one that would have
    run (weights, Adam moments, step count and unclipped gradients are as before the failed one)."""
    create(engine, "halfway:train:0")
    fb(engine, "halfway:train:0", batch(1))
    step(engine, "halfway:train:0", ADAM)
    fb(engine, "halfway:train:0", batch(2))
    before = snapshot(engine, "halfway:train:0")
    clipped = types.AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3)

    def fails_after_the_update(optimizer, args, kwargs):
        raise RuntimeError("CUDA out of memory")

    optimizer = engine._get(ops.adapter_name("halfway:train:0")).optimizer
    hook = optimizer.register_step_post_hook(fails_after_the_update)
    try:
        with pytest.raises(RuntimeError, match="out of memory"):
            step(engine, "halfway:train:0", clipped)
    finally:
        hook.remove()
    assert same_snapshot(before, snapshot(engine, "halfway:train:0"))


# ---- LoRA modules -------------------------------------------------------------------------------
def test_lora_modules_of_the_tiny_model_and_of_a_gpt2_style_model(engine):
    parts = {"attn": dict(train_mlp=False, train_unembed=False), "mlp": dict(train_attn=False, train_unembed=False),
             "unembed": dict(train_attn=False, train_mlp=False)}
    tiny = {kind: lora_target_modules(engine.base, types.LoraConfig(rank=1, **flags)) for kind, flags in parts.items()}
    assert tiny == {"attn": QWEN_ATTN, "mlp": QWEN_MLP, "unembed": ["lm_head"]}
    assert lora_target_modules(engine.base, types.LoraConfig(rank=1)) == sorted(QWEN_ATTN + QWEN_MLP + ["lm_head"])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=16))
    attn = lora_target_modules(gpt2, types.LoraConfig(rank=1, **parts["attn"]))
    mlp = lora_target_modules(gpt2, types.LoraConfig(rank=1, **parts["mlp"]))
    assert (attn, mlp) == (["attn.c_proj", "c_attn"], ["c_fc", "mlp.c_proj"])  # c_proj is in both: qualified
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # peft notes that GPT-2's Conv1D is fan_in_fan_out
        wrapped = get_peft_model(gpt2, LoraConfig(r=1, target_modules=attn, task_type="CAUSAL_LM"))
    adapted = {path.split("h.0.")[-1] for path, module in wrapped.named_modules() if hasattr(module, "lora_A")}
    assert adapted == {"attn.c_attn", "attn.c_proj"}


# ---- refusals -----------------------------------------------------------------------------------
def image_datum() -> types.Datum:
    image = types.ImageChunk(data=b"\x89PNG", format="png", expected_tokens=2)
    return types.Datum(model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), image]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4, 5]})


def create_request(model_id: str = "bad:train:0", **lora) -> types.CreateModelRequest:
    return types.CreateModelRequest(session_id="bad", model_seq_id=0, base_model="tiny",
                                    lora_config=types.LoraConfig(rank=4, **lora))


BAD_CALLS = {
    "unknown model": (lambda e: fb(e, "nobody:train:0", batch(1)), "unknown model 'nobody:train:0'"),
    "malformed model id": (lambda e: fb(e, "../x", batch(1)), "is not of the form"),
    "model id of another route": (lambda e: ops.forward_backward(e, "bad:train:0", types.ForwardBackwardRequest(
        types.ForwardBackwardInput(batch(1), "cross_entropy"), model_id="other:train:0"), False), "was sent to"),
    "unknown loss": (lambda e: fb(e, "bad:train:0", batch(1), "dpo"), "unknown loss_fn 'dpo'"),
    "stable_reinforce": (lambda e: fb(e, "bad:train:0", batch(1, "ppo"), "stable_reinforce"),
                         "stable_reinforce is not served .* loss_fn=importance_sampling"),
    "unknown loss config": (lambda e: fb(e, "bad:train:0", batch(1, "ppo"), "ppo", {"beta": 0.1}), "does not take"),
    "loss config beyond float32": (lambda e: fb(e, "bad:train:0", batch(1, "ppo"), "ppo", {
        "clip_low_threshold": 0.0, "clip_high_threshold": 1e308}), "clip_high_threshold=1e\\+308 .* float32"),
    "non-numeric loss config": (lambda e: fb(e, "bad:train:0", batch(1, "dro"), "dro", {"beta": "x"}),
                                "not a finite number"),
    "NaN loss config": (lambda e: fb(e, "bad:train:0", batch(1, "ppo"), "ppo", {"clip_low_threshold": float("nan")}),
                        "clip_low_threshold=nan is not a finite number; check the code that computes it"),
    "lengths differ": (lambda e: fb(e, "bad:train:0", [*batch(1), datum([1, 2, 3, 4], 1, weights=[1.0, 1.0])]),
                       "datum 4: weights has 2 values, expected 3"),
    "targets shorter": (lambda e: fb(e, "bad:train:0", [types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3]})]),
        "target_tokens has 2 values, expected 3"),
    "input token outside the vocabulary": (lambda e: fb(e, "bad:train:0", [datum([1, 5000, 3], 1)]),
                                           "tokens holds id 5000, outside the model's vocabulary"),
    "target outside the vocabulary": (lambda e: fb(e, "bad:train:0", [datum([1, 2, 99999], 1)], forward_only=True),
                                      "target_tokens holds id 99999"),
    "negative token": (lambda e: fb(e, "bad:train:0", [datum([1, -1, 3], 1)]), "tokens holds id -1"),
    "image chunk": (lambda e: fb(e, "bad:train:0", [image_datum()]), "chunk 1 is 'image'"),
    "2-D targets": (lambda e: fb(e, "bad:train:0", [types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": types.TensorData.from_torch(torch.ones(2, 3, dtype=torch.long))})]),
                    "2-D inputs are not served"),
    "sparse input of a huge shape": (lambda e: fb(e, "bad:train:0", [types.Datum(  # refused before it is densified
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3], "weights": types.
        TensorData([], "float32", [1, 2**62], sparse_crow_indices=[0, 0], sparse_col_indices=[])})]),
        r"weights has shape \[1, 4611686018427387904\], expected \[2\] .*2-D inputs are not served"),
    "unknown loss input": (lambda e: fb(e, "bad:train:0", [datum([1, 2, 3], 1, mask=types.TensorData([1.0, 1.0], "float32"))]),
                           "\\['mask'\\] are not served"),
    "missing sampler logprobs": (lambda e: fb(e, "bad:train:0", batch(1), "importance_sampling"), "needs logprobs"),
    "gspo without its mask": (lambda e: fb(e, "bad:train:0", batch(1, "ppo"), "gspo"),
                              "loss gspo needs sequence_ratio_mask"),
    "gspo mask marking nothing": (lambda e: fb(e, "bad:train:0", [*batch(1, "gspo"), datum(
        [1, 2, 3], 1, logprobs=[-1.0, -1.0], advantages=[0.0, 1.0], sequence_ratio_mask=[0.0, 0.0])], "gspo"),
        "datum 4: sequence_ratio_mask marks no token"),
    "no datums": (lambda e: fb(e, "bad:train:0", []), "no datums"),
    "optimizer not served": (lambda e: ops.optim_step(e, "bad:train:0", types.OptimStepRequest(
        optim_params=types.DimuonParams(learning_rate=0.1), model_id="bad:train:0")), "'dimuon' is not served"),
    "adam out of range": (lambda e: step(e, "bad:train:0", types.AdamParams(eps=0.0)), "adam eps=0"),
    "adam step size beyond float32": (lambda e: step(e, "bad:train:0", types.AdamParams(learning_rate=1e300)),
                                      "learning_rate=1e\\+300, .* make a step of 1e\\+301, beyond float32"),
    "adam weight decay beyond float32": (lambda e: step(e, "bad:train:0", types.AdamParams(
        learning_rate=1e-3, weight_decay=1e300)), "weight_decay=1e\\+300 make a weight decay of 1e\\+297, beyond"),
    "optim_step of an unknown model": (lambda e: step(e, "nobody:train:0", ADAM), "unknown model"),
    "model exists": (lambda e: ops.create_model(e, "bad:train:0", create_request()), "already exists"),
    "lora seed beyond torch's": (lambda e: ops.create_model(e, "new:train:0", create_request(seed=2**64)),
                                 "lora_config.seed=18446744073709551616: use"),
    "no module selected": (lambda e: ops.create_model(e, "new:train:0", create_request(
        train_attn=False, train_mlp=False, train_unembed=False)), "trains no module"),
    "not a state": (lambda e: ops.load_state(e, "bad:train:0", b"\x00" * 16, True), "not a training-engine state"),
    "weights-only state with the optimizer": (lambda e: ops.load_state(
        e, "new:train:0", ops.save_state(e, "bad:train:0", with_optimizer=False), True), "holds weights only"),
    "state of another shape": (lambda e: ops.load_state(e, "bad:train:1", ops.save_state(e, "bad:train:0"), True),
                               r"this state holds a rank 4 \(alpha 32, modules .*\) adapter and this training "
                               r"client a rank 4 \(alpha 32, modules k_proj.*create_training_client_from_state"),
    "save of an unknown model": (lambda e: ops.save_state(e, "nobody:train:0"), "unknown model"),
}


@pytest.fixture(scope="module")
def bad_engine(engine) -> TrainingEngine:
    """Two models with an optimizer state and pending gradients, so that any change would show."""
    ops.create_model(engine, "bad:train:0", create_request(seed=1))
    ops.create_model(engine, "bad:train:1", create_request(seed=2, train_mlp=False))
    for model_id in ("bad:train:0", "bad:train:1"):
        fb(engine, model_id, batch(1))
        step(engine, model_id, ADAM)
        fb(engine, model_id, batch(2))
    return engine


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_input_is_a_user_error_and_changes_nothing(bad_engine, case):
    call, message = BAD_CALLS[case]
    before = {model_id: snapshot(bad_engine, model_id) for model_id in ("bad:train:0", "bad:train:1")}
    adapters = bad_engine.adapters()
    with pytest.raises(ApiError, match=message) as error:
        call(bad_engine)
    assert error.value.category == "user" and "\n" not in str(error.value)
    assert all(same_snapshot(before[model_id], snapshot(bad_engine, model_id)) for model_id in before)
    assert bad_engine.adapters() == adapters


def test_an_input_of_any_length_is_echoed_cut_short_in_the_trainers_errors(bad_engine):
    """A loss name, a loss_fn_config key or value, a loss input's name: the client's, of any length; an error that
    repeats one cuts it short (``schemas.names.echoed``), as the gateway's do, so answers and logs stay small."""
    long = "x" * 100_000
    calls = {
        "loss": lambda: fb(bad_engine, "bad:train:0", batch(1), long),
        "config key": lambda: fb(bad_engine, "bad:train:0", batch(1, "ppo"), "ppo", {long: 1.0}),
        "config value": lambda: fb(bad_engine, "bad:train:0", batch(1, "dro"), "dro", {"beta": long}),
        "loss input": lambda: fb(bad_engine, "bad:train:0", [datum([1, 2, 3], 1, **{long: types.TensorData([1.0, 1.0], "float32")})]),
    }
    for what, call in calls.items():
        with pytest.raises(ApiError) as error:
            call()
        assert len(str(error.value)) < 500 and "xxx…" in str(error.value), (what, str(error.value)[:300])
