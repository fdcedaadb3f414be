"""The trainable policy: a base model with a peft LoRA adapter, its optimizer and schedule.

One optimizer step = gradient accumulation over token-budget micro-batches,
gradient clipping, AdamW, schedule.  The same code runs on the CPU here and on
a GPU where present (``device="auto"``); bf16 autocast is used where the
hardware has it.  State for checkpoints is exported as plain tensors (for
safetensors) plus JSON-able scalars: nothing is pickled.

Dropout: the base model's own (GPT-2's ``attn_pdrop``, OPT's ``dropout``, ...) is
zeroed when it loads, as in the training engine: samplers never drop, so a training
forward must score the policy that sampled, or every importance ratio is noise
around 1.  Only ``learner.lora_dropout``, when set, runs in training.

Precision: the frozen base weights load in ``model.dtype`` (bfloat16 on GPUs
halves their memory); the LoRA weights, hence the AdamW state, are float32
whatever the base dtype, and the output head and log-softmax run in float32.

The head-only forward (``generated_logprobs``) calls the decoder body and
``lm_head`` directly, so it would silently skip whatever a model's own forward
does to the logits after the head: soft-capping (Gemma 2 and 3), scaling
(Cohere, Granite).  Such models are refused when the policy is built.
"""

from __future__ import annotations

import copy
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, set_peft_model_state_dict
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from consumers.logprobs import position_logprobs
from consumers.losses import LossStats, TokenBatch, entropy_of_logprobs, logit_divisors, loss_from_logprobs
from consumers.trust_region import TrustRegion, TrustRegionResult
from pipeline.io.tensors import save_tensors
from schemas.config import LearnerConfig

# Model config fields that reshape the logits after the output head, and their neutral value.
_LOGIT_RESHAPING_FIELDS: dict[str, float | None] = {
    "final_logit_softcapping": None,  # Gemma 2 / 3: tanh soft-capping
    "logit_scale": 1.0,  # Cohere: logits * logit_scale
    "logits_scaling": 1.0,  # Granite: logits / logits_scaling
    "lm_head_multiplier": 1.0,  # Falcon-H1: logits * multiplier
}


def pick_device(requested: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu; anything else is taken as given."""
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def weights_dtype(model_config: PretrainedConfig, dtype: str) -> torch.dtype:
    """``model.dtype`` as a torch dtype; "auto" is the checkpoint's own (float32 when it does not say)."""
    if dtype != "auto":
        return getattr(torch, dtype)
    saved = getattr(model_config, "dtype", None)
    if isinstance(saved, str):
        saved = getattr(torch, saved, None)
    return saved if isinstance(saved, torch.dtype) else torch.float32


def zero_dropout(config: PretrainedConfig) -> None:
    """Set every dropout rate of a model config (and of its sub-configs) to 0: the fields named ``*drop*``
    (``attn_pdrop``, ``attention_dropout``, ``hidden_dropout_prob``, OPT's ``layerdrop``, ...), which the
    modules read when they are built."""
    for name, value in list(vars(config).items()):
        if isinstance(value, PretrainedConfig):
            zero_dropout(value)
        elif "drop" in name and isinstance(value, int | float) and not isinstance(value, bool) and value > 0:
            setattr(config, name, 0.0)


def check_head_supported(base_model: str, config: PretrainedConfig) -> None:
    """Refuse, in one line, a model whose logits the head-only forward would get wrong (module docstring)."""
    for section in {id(c): c for c in (config, config.get_text_config())}.values():
        for name, neutral in _LOGIT_RESHAPING_FIELDS.items():
            value = getattr(section, name, neutral)
            if value is not None and value != neutral:
                raise ValueError(
                    f"{base_model}: {type(section).__name__} sets {name}={value}, which reshapes the logits after "
                    "the output head and the learner's head-only forward does not; choose a model without it "
                    "(e.g. Qwen2.5 or Llama)"
                )


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (CPU and CUDA)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], list[dict[str, Any]]]:
    """An optimizer's state as (``state.<param index>.<slot>`` tensors for safetensors, JSON-able param groups)."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    for index, slots in state["state"].items():
        for slot, value in slots.items():
            tensors[f"state.{index}.{slot}"] = torch.as_tensor(value).to("cpu").contiguous()
    return tensors, state["param_groups"]


def load_optimizer_tensors(
    optimizer: torch.optim.Optimizer,
    tensors: dict[str, torch.Tensor],
    param_groups: list[dict[str, Any]],
    device: torch.device,
) -> None:
    """Restore what ``optimizer_tensors`` exported (step counters stay on the CPU, as torch keeps them)."""
    state: dict[int, dict[str, torch.Tensor]] = {}
    for key, value in tensors.items():
        _, index, slot = key.split(".", 2)
        state.setdefault(int(index), {})[slot] = value.to(device) if value.dim() else value
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


@dataclass
class StepResult:
    """What one optimizer step did."""

    loss: float
    grad_norm: float
    learning_rate: float
    stats: LossStats
    trust: TrustRegionResult | None = None  # what learner.max_step_kl did to the step (None = off)


@dataclass(frozen=True)
class AdapterSnapshot:
    """A LoRA adapter as it was at one moment (its config and a copy of its weights), written later.

    Taking one is a memory copy; ``write`` serialises, so a learner takes it at the end of a
    step and writes it in the background while the next step trains in place.
    """

    config: LoraConfig  # a copy of the adapter's
    weights: dict[str, torch.Tensor]  # PEFT's tensor names -> CPU copies

    @classmethod
    def of(cls, config: LoraConfig, parameters: dict[str, torch.Tensor], adapter_name: str) -> AdapterSnapshot:
        """Copies of ``parameters`` (peft's names, adapter ``adapter_name``) under the names PEFT's file uses."""
        weights = {name.replace(f".{adapter_name}.", ".", 1): p.detach().to("cpu", copy=True).contiguous()
                   for name, p in parameters.items()}
        return cls(copy.deepcopy(config), weights)

    def files(self) -> dict[str, bytes]:
        """The PEFT folder's files by name, as ``LoraConfig.save_pretrained`` and peft's weight file write them
        (sets as lists, two-space JSON with sorted keys), for a registry to publish without a folder."""
        config = {key: list(value) if isinstance(value, set) else value for key, value in self.config.to_dict().items()}
        return {"adapter_config.json": json.dumps(config, indent=2, sort_keys=True).encode(),
                "adapter_model.safetensors": save_tensors(self.weights, metadata={"format": "pt"})}

    def write(self, folder: str | Path) -> Path:
        """The PEFT folder (adapter_config.json + adapter_model.safetensors) samplers load."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in self.files().items():
            (folder / name).write_bytes(data)
        return folder


class LoraPolicy:
    """Base model + LoRA adapter + AdamW; knows how to take a step and export its state."""

    def __init__(self, base_model: str, config: LearnerConfig, dtype: str = "auto") -> None:
        """``dtype`` is ``model.dtype``: the base weights' ("auto" = the checkpoint's own)."""
        self.config = config
        self.device = pick_device(config.device)
        if config.torch_threads:
            torch.set_num_threads(config.torch_threads)
        model_config = AutoConfig.from_pretrained(base_model)
        check_head_supported(base_model, model_config)
        zero_dropout(model_config)  # samplers never drop: training logprobs must be the sampled policy's
        seed_everything(config.seed)
        base = AutoModelForCausalLM.from_pretrained(base_model, config=model_config,
                                                    dtype=weights_dtype(model_config, dtype))
        if config.gradient_checkpointing:  # non-reentrant: frozen base inputs need no requires_grad hook
            base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        lora = LoraConfig(
            r=config.lora_rank,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=list(config.target_modules),
            task_type="CAUSAL_LM",
        )
        # autocast_adapter_dtype: LoRA weights (and so AdamW's state) in float32 over bf16/fp16 base weights
        self.model: PeftModel = get_peft_model(base, lora, autocast_adapter_dtype=True).to(self.device)
        # the trained parameters by name, found once: walking the model's modules costs a few ms per call
        self._lora_named = {name: p for name, p in self.model.named_parameters() if p.requires_grad}
        self.params = list(self._lora_named.values())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.autocast = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.reference: dict[str, torch.Tensor] | None = None  # KL reference; None = the base model

    @property
    def input_vocab(self) -> int:
        """Token ids the model reads: below its input embedding's row count."""
        return int(self.model.get_input_embeddings().num_embeddings)

    def _lr_factor(self, step: int) -> float:
        cfg = self.config
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.lr_schedule == "constant" or not cfg.max_steps:
            return 1.0
        progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    def logits(self, tokens_BT: torch.Tensor) -> torch.Tensor:
        """Logits (float32) of the current policy for a padded batch."""
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            out = self.model(input_ids=tokens_BT.to(self.device))
        return out.logits.float()

    def generated_logprobs(
        self, tokens_BT: torch.Tensor, loss_mask_BT: torch.Tensor, temperatures_B: torch.Tensor | None = None
    ) -> torch.Tensor:
        """logp[b, t] of each generated token (mask 1) under the current policy, 0 elsewhere.

        The output head runs only at the positions that predict a generated token:
        with per-turn prompts of a few hundred tokens and answers of a few, this
        skips almost all of the (B, T, V) logits, which dominate the cost of a step.
        Equal to ``token_logprobs(self.logits(tokens), tokens, temperatures_B)`` at
        those positions: row b's logits are divided by its sampling temperature
        (``logit_divisors``), the distribution the sampler drew from and scored.
        """
        return self.generated_logprobs_and_entropy(tokens_BT, loss_mask_BT, temperatures_B, entropy=None)[0]

    def _generated_distributions(
        self, tokens_BT: torch.Tensor, loss_mask_BT: torch.Tensor, temperatures_B: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens_BT on the device, rows_N, cols_N, log p over the vocabulary (N, V)) at the positions that
        predict a generated token: position t-1 predicts token t, at row b's sampling temperature."""
        tokens_BT = tokens_BT.to(self.device)
        rows_N, cols_N = (loss_mask_BT.to(self.device)[:, 1:] > 0).nonzero(as_tuple=True)
        divisors_N = None if temperatures_B is None else logit_divisors(temperatures_B.to(self.device))[rows_N]
        return tokens_BT, rows_N, cols_N, position_logprobs(self.model, tokens_BT, rows_N, cols_N, divisors_N,
                                                            self.autocast)

    def generated_logprobs_and_entropy(
        self,
        tokens_BT: torch.Tensor,
        loss_mask_BT: torch.Tensor,
        temperatures_B: torch.Tensor | None = None,
        entropy: Literal["detached", "grad"] | None = "detached",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``generated_logprobs`` and the policy's entropy H[b, t] at the same positions (0 elsewhere).

        ``entropy``: "detached" for the statistics only, "grad" when an entropy bonus
        trains on it, None to skip it (one more pass over the (N, V) logits).
        """
        tokens_BT, rows_N, cols_N, logprobs_NV = self._generated_distributions(tokens_BT, loss_mask_BT, temperatures_B)
        logprobs_N = logprobs_NV.gather(-1, tokens_BT[rows_N, cols_N + 1].unsqueeze(-1)).squeeze(-1)
        logprobs_BT = torch.zeros(tokens_BT.shape, dtype=torch.float32, device=self.device)
        logprobs_BT = logprobs_BT.index_put((rows_N, cols_N + 1), logprobs_N)
        if entropy is None:
            return logprobs_BT, None
        # from the log-softmax the backward keeps anyway: one more (N, V) temporary, none kept without the bonus
        entropy_N = entropy_of_logprobs(logprobs_NV if entropy == "grad" else logprobs_NV.detach())
        entropy_BT = torch.zeros(tokens_BT.shape, dtype=torch.float32, device=self.device)
        return logprobs_BT, entropy_BT.index_put((rows_N, cols_N + 1), entropy_N)

    # ---- the reference policy of the KL penalty ---------------------------------
    def keep_reference(self) -> None:
        """Freeze a copy of the adapter as it is now as the KL penalty's reference (e.g. right after a warm start).

        Without one the reference is the base model: the adapter switched off
        (``disable_adapter``), which is what a fresh LoRA adapter (B = 0) computes anyway.
        A copy costs the adapter's size once (megabytes), no second model.
        """
        self.reference = {name: p.detach().clone() for name, p in self.lora_parameters().items()}

    def keep_reference_folder(self, folder: str | Path) -> None:
        """Use a published adapter folder as the reference (a resumed warm-started run re-reads its warm start)."""
        current = {name: tensor.clone() for name, tensor in self.adapter_tensors().items()}  # CPU: views otherwise
        self.load_adapter_folder(folder)
        self.keep_reference()
        self._copy_into_adapter(current)

    @torch.no_grad()
    def _copy_into_adapter(self, tensors: dict[str, torch.Tensor]) -> None:
        params = self.lora_parameters()
        for name, tensor in tensors.items():
            params[name].copy_(tensor.to(params[name].device))

    @torch.no_grad()
    def reference_logprobs(self, batch: TokenBatch) -> torch.Tensor:
        """logp_ref[b, t] of each generated token under the reference policy (no gradient).

        The reference weights are swapped into the LoRA parameters for one forward
        and swapped back; call it before the forward that trains, never between
        that forward and its backward.
        """
        training = self.model.training
        self.model.eval()  # no LoRA dropout in the reference
        try:
            if self.reference is None:
                with self.model.disable_adapter():
                    return self.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
            current = {name: p.detach().clone() for name, p in self.lora_parameters().items() if name in self.reference}
            try:
                self._copy_into_adapter(self.reference)
                return self.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
            finally:
                self._copy_into_adapter(current)
        finally:
            self.model.train(training)

    @torch.no_grad()
    def answer_distributions(self, batch: TokenBatch) -> torch.Tensor:
        """log p(. | prefix) over the vocabulary (N, V) at each generated token of ``batch``, row-major, no dropout."""
        training = self.model.training
        self.model.eval()
        try:
            return self._generated_distributions(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)[3]
        finally:
            self.model.train(training)

    def train_step(self, micro_batches: list[TokenBatch], normaliser: float) -> StepResult:
        """Accumulate gradients over ``micro_batches`` (loss / normaliser each), clip, step.

        With ``learner.max_step_kl`` the step is then shrunk into that bound (``consumers.trust_region``).
        """
        trust = None
        if self.config.max_step_kl is not None:
            trust = TrustRegion(self.config.max_step_kl, self.config.trust_region_rows, self.answer_distributions)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        total_loss, stats = 0.0, None
        for batch in micro_batches:
            batch = batch.to(self.device)
            reference_BT = self.reference_logprobs(batch) if self.config.kl_coef > 0 else None
            logprobs_BT, entropy_BT = self.generated_logprobs_and_entropy(
                batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B,
                entropy="grad" if self.config.entropy_coef > 0 else "detached",
            )
            loss, batch_stats = loss_from_logprobs(self.config, logprobs_BT, batch, normaliser, entropy_BT=entropy_BT,
                                                   reference_logprobs_BT=reference_BT)  # fmt: skip
            loss.backward()
            total_loss += float(loss.detach())
            stats = batch_stats if stats is None else stats.merge(batch_stats)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.config.grad_clip))
        learning_rate = self.optimizer.param_groups[0]["lr"]
        previous = [p.detach().clone() for p in self.params] if trust is not None else []
        self.optimizer.step()
        self.scheduler.step()
        if stats is None:
            raise ValueError("train_step needs at least one micro-batch")
        bounded = trust.bound(micro_batches, self.params, previous, self.device) if trust is not None else None
        return StepResult(total_loss, grad_norm, learning_rate, stats, bounded)

    # ---- export / import (checkpoints, publishing) ----------------------------
    def save_adapter(self, folder: str | Path) -> Path:
        """Write the PEFT adapter (adapter_config.json + adapter_model.safetensors) to ``folder``.

        What peft's ``save_pretrained`` writes for a LoRA adapter named ``default`` (its tensor names, its
        config with ``inference_mode`` on), written directly: ``save_pretrained`` also renders a README.md
        model card and walks the model and reloads the base config to build its state dict, together
        three quarters of a publish on the tiny model, for files no reader uses.
        """
        return self.adapter_snapshot().write(folder)

    def adapter_snapshot(self) -> AdapterSnapshot:
        """The adapter of now (config with ``inference_mode`` on, copies of the weights), to write later."""
        snapshot = AdapterSnapshot.of(self.model.peft_config["default"], self.lora_parameters(), "default")
        snapshot.config.inference_mode = True
        return snapshot

    def lora_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The trained LoRA parameters under their checkpoint names (peft's, with the adapter named ``default``)."""
        return dict(self._lora_named)

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """The LoRA weights by name (CPU, contiguous) for safetensors."""
        return {name: p.detach().to("cpu").contiguous() for name, p in self.lora_parameters().items()}

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """AdamW state as (tensors for safetensors, JSON-able scalars)."""
        tensors, param_groups = optimizer_tensors(self.optimizer)
        return tensors, {"param_groups": param_groups, "scheduler": self.scheduler.state_dict()}

    def load_state(
        self, adapter: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor], scalars: dict[str, Any]
    ) -> None:
        """Restore weights, AdamW state and schedule exported by the methods above."""
        params = self.lora_parameters()
        with torch.no_grad():
            for name, value in adapter.items():
                if name not in params:
                    raise ValueError(f"checkpoint tensor {name!r} does not match this model's adapter")
                params[name].copy_(value.to(params[name].device))
        load_optimizer_tensors(self.optimizer, optimizer, scalars["param_groups"], self.device)
        self.scheduler.load_state_dict(scalars["scheduler"])
        self._apply_configured_rates()

    def _apply_configured_rates(self) -> None:
        """This configuration's learning rate, weight decay and schedule from the restored step on.

        The optimizer's groups and the schedule's base rates come back from the checkpoint as they were
        written, but a restart may change ``learning_rate``, ``weight_decay``, ``max_steps`` or the schedule
        (``run.json`` records such changes): without this the old rates would stay, and the next step would
        take the rate the old schedule set for it (0 at the end of a decay to the old ``max_steps``).
        Unchanged settings give the same numbers the checkpoint holds.
        """
        rate = self.config.learning_rate
        self.scheduler.base_lrs = [rate for _ in self.optimizer.param_groups]
        factor = self._lr_factor(self.scheduler.last_epoch)  # as LambdaLR computes it at that step
        for group in self.optimizer.param_groups:
            group.update(initial_lr=rate, lr=rate * factor, weight_decay=self.config.weight_decay)

    def load_adapter_folder(self, folder: str | Path) -> None:
        """Start from a published PEFT adapter folder (e.g. a warm-start version) of this adapter's LoRA shape.

        An adapter of another rank, alpha or set of target modules is refused: peft would load the weights
        whose names match, leave the others as they are and scale them by this adapter's alpha, a different
        policy from the one in the folder.
        """
        set_peft_model_state_dict(self.model, self.checked_adapter_weights(folder))

    def checked_adapter_weights(self, folder: str | Path) -> dict[str, torch.Tensor]:
        """A PEFT folder's weights, refused (``ValueError`` naming the setting) unless of this adapter's LoRA shape."""
        from safetensors.torch import load_file

        folder = Path(folder)
        self.check_adapter_shape(json.loads((folder / "adapter_config.json").read_text()), folder)
        weights = load_file(str(folder / "adapter_model.safetensors"))
        expected = {name.replace(".default.", ".", 1) for name in self.lora_parameters()}  # PEFT's file names
        if set(weights) != expected:
            strays = sorted(set(weights) ^ expected)
            raise ValueError(f"{folder}: its LoRA weights are not this adapter's ({len(strays)} names differ, e.g. "
                             f"{strays[0]}); load an adapter trained with the same learner.target_modules")
        return weights

    def lora_config(self) -> Any:
        """This adapter's peft ``LoraConfig``."""
        return self.model.peft_config["default"]

    def check_adapter_shape(self, adapter_config: dict[str, Any], folder: str | Path) -> None:
        """Refuse an adapter_config.json whose rank, alpha or target modules differ from this adapter's."""
        ours = self.lora_config()
        fields = (("lora_rank", "r", ours.r), ("lora_alpha", "lora_alpha", ours.lora_alpha),
                  ("target_modules", "target_modules", ours.target_modules))
        for setting, key, value in fields:
            theirs = adapter_config.get(key)
            if isinstance(value, set | list | tuple) and isinstance(theirs, list | tuple):
                same = set(theirs) == set(value)
            else:
                same = theirs == value
            if not same:
                shown = sorted(value) if isinstance(value, set | list | tuple) else value
                raise ValueError(f"{folder}: the adapter has {key}={theirs!r} and this learner {setting}={shown!r}; "
                                 f"start from an adapter of the same LoRA shape, or set learner.{setting} to match")
