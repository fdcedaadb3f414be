"""The training engine: one base model per process, many named LoRA adapters, one operation at a time.

Every operation names one adapter; an adapter owns its LoRA weights, its AdamW
optimizer and state, the gradients accumulated since its last step, a step
count and its own torch RNG state (swapped in for its operations, so dropout
and initialisation do not depend on what other adapters did in between).  The
operations (the Tinker training calls, TINKER.md sections 5 and 10):

  create_adapter    new LoRA adapter (rank, alpha, target modules, seed)
  forward           per-token logprobs and loss, no gradients, nothing changes
  forward_backward  the same, and gradients ADD to the adapter's accumulated ones (a call whose
                    loss is not finite is refused and adds none)
  optim_step        clip (optional), AdamW with this call's hyper-parameters, zero the gradients
                    (gradients that are not finite are discarded and the step refused; without
                    gradients nothing changes and no step is counted; with ``undo``, a step failing
                    part-way is undone)
  save_state        adapter + optimizer + RNG as one safetensors blob (metadata in its JSON header),
                    optionally the accumulated gradients too (what a trainer's fold keeps)
  load_state        the reverse; the optimizer is optional, an unknown name is created from the state
  export_for_sampling  PEFT folder (adapter_config.json + adapter_model.safetensors) for the registry
  delete_adapter    forget it

Losses are those of ``consumers.losses``, SUMS over tokens divided by
``loss_args["normaliser"]`` (default 1, Tinker's convention), so splitting a
batch over several ``forward_backward`` calls gives the same gradients.  There
is no learning-rate schedule: the learning rate comes with each ``optim_step``.

Dropout: the base model's own dropout (GPT-2's ``attn_pdrop``, OPT's ``dropout``, ...)
is zeroed when the model loads (unless ``base_dropout``), so the logprobs of
``forward`` and ``forward_backward`` are a function of the weights, as Tinker's
are.  An adapter's LoRA dropout, when its creator asks for one, runs in
``forward_backward`` (the Tinker API never asks: its LoraConfig has no dropout).

Isolation: peft keeps every adapter's weights in its own parameters and lets
only the active adapter require gradients, so a backward pass touches no other
adapter's ``.grad``; each adapter has its own optimizer over its own
parameters.  A lock serialises the operations and the active adapter is set at
the start of each one.  Requests are validated completely before anything is
touched: a bad one raises ``EngineError`` and changes nothing; a
``forward_backward`` that fails while computing puts the adapter's gradients back
as they were.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoConfig, AutoModelForCausalLM

from consumers.engine_data import (
    AdapterShapeError,
    Datum,
    EngineError,
    collate,
    micro_batch_slices,
    validate_datums,
)
from consumers.engine_state import (
    STATE_FORMAT,
    capture_rng,
    checked_adapter_tensors,
    checked_optimizer,
    checked_rng,
    read_state,
    step_undo,
    swapped_rng,
)
from consumers.logprobs import selected_logprobs
from consumers.losses import (
    LossStats,
    cispo_loss,
    cross_entropy_loss,
    dro_loss,
    gspo_loss,
    importance_sampling_loss,
    logit_divisors,
    ppo_loss,
)
from consumers.policy import (
    AdapterSnapshot,
    check_head_supported,
    optimizer_tensors,
    pick_device,
    weights_dtype,
    zero_dropout,
)
from pipeline.io.tensors import save_tensors as save_safetensors
from schemas.adam import adam_params_problem
from schemas.names import validate_name

# how the refusal of a step on gradients that are not finite begins (it discards them: a replay must too)
NOT_FINITE_STEP = "optim_step refused: the accumulated gradients are not finite"
# loss name -> (function, the keyword arguments it accepts besides the normaliser)
LOSSES: dict[str, tuple[Callable[..., tuple[torch.Tensor, LossStats]], frozenset[str]]] = {
    "cross_entropy": (cross_entropy_loss, frozenset()),
    "importance_sampling": (importance_sampling_loss, frozenset({"is_cap", "ratio_mask_low", "ratio_mask_high"})),
    "ppo": (ppo_loss, frozenset({"clip_eps", "clip_low", "clip_high", "ratio_mask_low", "ratio_mask_high"})),
    "cispo": (cispo_loss, frozenset({"clip_low_threshold", "clip_high_threshold"})),
    "dro": (dro_loss, frozenset({"beta"})),
    "gspo": (gspo_loss, frozenset({"clip_low_threshold", "clip_high_threshold"})),
}


@dataclass(frozen=True)
class AdamParams:
    """One optimizer step's hyper-parameters (Tinker's defaults); ``grad_clip_norm`` 0 = no clipping."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip_norm: float = 0.0

    def __post_init__(self) -> None:
        problem = adam_params_problem(self.learning_rate, self.beta1, self.beta2, self.eps, self.weight_decay,
                                      self.grad_clip_norm)
        if problem is not None:
            raise EngineError(problem)


@dataclass
class ForwardResult:
    """Loss (divided by the normaliser), each datum's logprobs of its targets (float32, CPU) and statistics."""

    loss: float
    logprobs: list[torch.Tensor]
    stats: LossStats

    def metrics(self) -> dict[str, float]:
        """``name:reduction`` metrics (the Tinker client merges chunks by the reduction)."""
        return {"loss:sum": self.loss, "num_tokens:sum": float(self.stats.num_tokens),
                "num_sequences:sum": float(self.stats.num_sequences)}


@dataclass
class StepInfo:
    """What one ``optim_step`` did: the gradient norm before clipping, and the adapter's steps so far."""

    grad_norm: float
    learning_rate: float
    step: int


@dataclass
class _Adapter:
    slot: str  # peft's adapter name: "adapter<n>", independent of the caller's name
    lora: LoraConfig
    params: dict[str, torch.nn.Parameter]  # PEFT-format key (no adapter name) -> parameter
    optimizer: torch.optim.AdamW
    rng: dict[str, torch.Tensor] = field(default_factory=dict)
    step: int = 0


class TrainingEngine:
    """One base model and its named LoRA adapters; every public method is one serialised operation."""

    def __init__(
        self, base_model: str, device: str = "auto", dtype: str = "auto", max_batch_tokens: int = 32768,
        base_dropout: bool = False,
    ) -> None:
        """``max_batch_tokens`` bounds one padded micro-batch (datums x longest) inside a call.  ``base_dropout``
        keeps the dropout the base model's config sets (GPT-2's ``attn_pdrop``, OPT's ``dropout``, ...); by
        default it is zeroed at load, so logprobs depend on the weights only (Tinker's semantics)."""
        self.base_model = base_model
        self.device = pick_device(device)
        model_config = AutoConfig.from_pretrained(base_model)
        check_head_supported(base_model, model_config)
        if not base_dropout:
            zero_dropout(model_config)
        self.base = AutoModelForCausalLM.from_pretrained(base_model, config=model_config,
                                                         dtype=weights_dtype(model_config, dtype))
        self.base.to(self.device)
        self.input_vocab = int(self.base.get_input_embeddings().num_embeddings)
        self.output_vocab = int(self.base.get_output_embeddings().out_features)
        # the longest datum it trains: the positions the model was built for (unknown: no bound)
        self.max_length: int | None = getattr(model_config, "max_position_embeddings", None)
        self.max_batch_tokens = max_batch_tokens
        self.autocast = self.device.type == "cuda" and torch.cuda.is_bf16_supported()
        self.model: PeftModel | None = None
        self._adapters: dict[str, _Adapter] = {}
        self._slots = 0
        self._lock = threading.RLock()  # re-entered by clients holding it (``holding``) that call an operation

    # ---- the operations --------------------------------------------------------------------
    def adapters(self) -> list[str]:
        with self._lock:
            return sorted(self._adapters)

    def weights(self, name: str) -> dict[str, torch.Tensor]:
        """Adapter ``name``'s LoRA weights (CPU copies, PEFT names), for inspection and tests."""
        with self._lock:
            return {key: p.detach().to("cpu", copy=True) for key, p in self._get(name).params.items()}

    def has_gradients(self, name: str) -> bool:
        """Whether adapter ``name`` holds gradients accumulated since its last step."""
        with self._lock:
            return any(p.grad is not None for p in self._get(name).params.values())

    def discard_gradients(self, name: str) -> None:
        """Drop adapter ``name``'s accumulated gradients (what a step refused for ``NOT_FINITE_STEP`` did)."""
        with self._lock:
            self._get(name).optimizer.zero_grad(set_to_none=True)

    def gradient_mark(self, name: str) -> dict[str, torch.Tensor | None]:
        """Adapter ``name``'s accumulated gradients as they are now (clones, on its device), for ``restore_gradients``."""
        with self._lock:
            return {key: None if p.grad is None else p.grad.detach().clone()
                    for key, p in self._get(name).params.items()}

    def restore_gradients(self, name: str, mark: dict[str, torch.Tensor | None]) -> None:
        """Put adapter ``name``'s accumulated gradients back as ``gradient_mark`` took them (undo calls since)."""
        with self._lock:
            for key, p in self._get(name).params.items():
                p.grad = mark[key]

    def gradients(self, name: str) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the adapter's last step (CPU copies; absent where none)."""
        with self._lock:
            return {key: p.grad.detach().to("cpu", copy=True)
                    for key, p in self._get(name).params.items() if p.grad is not None}

    def create_adapter(
        self, name: str, rank: int, alpha: float, target_modules: Sequence[str], seed: int, dropout: float = 0.0
    ) -> None:
        """A new adapter, initialised from ``seed`` (the same seed gives the same weights in any engine)."""
        with self._lock:
            validate_name(name, "adapter name")
            if name in self._adapters:
                raise EngineError(f"adapter {name!r} already exists; delete it first or choose another name")
            if rank < 1 or not target_modules or not 0 <= dropout < 1:
                raise EngineError(f"adapter {name!r}: rank must be >= 1, target_modules non-empty, dropout in [0, 1)")
            lora = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                              target_modules=sorted(target_modules), task_type="CAUSAL_LM")
            self._adapters[name] = self._new_adapter(lora, seed)

    def forward(self, name: str, datums: Sequence[Datum], loss: str, loss_args: dict[str, float] | None = None
                ) -> ForwardResult:
        """Logprobs and loss under adapter ``name``; no gradients, no state (weights, optimizer, RNG) changes."""
        with self._lock:
            adapter, loss_fn = self._prepare(name, datums, loss, loss_args or {})
            self.model.eval()
            with torch.no_grad(), swapped_rng(adapter.rng):  # the adapter's RNG is not advanced
                return self._run(datums, loss, loss_fn, backward=False)

    def forward_backward(
        self, name: str, datums: Sequence[Datum], loss: str, loss_args: dict[str, float] | None = None
    ) -> ForwardResult:
        """``forward``, and the loss's gradients are added to those accumulated since the last ``optim_step``."""
        with self._lock:
            adapter, loss_fn = self._prepare(name, datums, loss, loss_args or {})
            self.model.train()
            before = {key: None if p.grad is None else p.grad.clone() for key, p in adapter.params.items()}
            try:
                with swapped_rng(adapter.rng):
                    result = self._run(datums, loss, loss_fn, backward=True)
                    if not math.isfinite(result.loss):  # its gradients are inf or NaN: a step would ruin the weights
                        raise EngineError(f"forward_backward refused: its loss is not finite ({result.loss}; an "
                                          "importance ratio far from 1 overflows exp(lp - q)); no gradient was "
                                          "added: check the datums' sampler logprobs")
                    adapter.rng = capture_rng()
            except Exception:  # a call that fails half-way (e.g. out of memory) adds no gradient at all
                for key, p in adapter.params.items():
                    p.grad = before[key]
                raise
            return result

    def optim_step(self, name: str, adam: AdamParams, undo: bool = False) -> StepInfo:
        """Clip (if ``grad_clip_norm``), one AdamW step with ``adam``'s values, zero the accumulated gradients.

        Without gradients (no ``forward_backward`` since the last step) nothing changes and no step is counted:
        AdamW moves no parameter that has no gradient (nor its moments), so a counted step would only make the
        step count disagree with the steps that trained.  With ``undo`` (the API trainer, whose client may send
        a failed step again) a step that fails part-way (memory short on the device) puts the weights, Adam state
        and unclipped gradients back (``step_undo``), so its retry, or a trainer replaying the log without it,
        goes on from the state before it.  The undo point copies the weights, gradients and Adam's two moments
        (about four adapters' memory on the device, and the time to copy them), so the callers that resume from a
        checkpoint when a step fails (the distributed ``train_batches``) and the benchmarks step without it."""
        with self._lock:
            adapter = self._get(name)
            params = list(adapter.params.values())
            max_norm = adam.grad_clip_norm if adam.grad_clip_norm > 0 else math.inf
            grads = [p for p in params if p.grad is not None]
            if not grads:
                return StepInfo(0.0, adam.learning_rate, adapter.step)
            put_back = step_undo(adapter.params, adapter.optimizer) if undo else None
            try:
                grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
                if math.isfinite(grad_norm):
                    for group in adapter.optimizer.param_groups:
                        group.update(lr=adam.learning_rate, betas=(adam.beta1, adam.beta2), eps=adam.eps,
                                     weight_decay=adam.weight_decay)
                    adapter.optimizer.step()
            except BaseException:
                if put_back is not None:
                    put_back()
                raise
            if not math.isfinite(grad_norm):  # a step would write NaN weights; the gradients are of no use
                adapter.optimizer.zero_grad(set_to_none=True)
                raise EngineError(f"{NOT_FINITE_STEP} (norm {grad_norm}; a loss that overflowed, e.g. an importance "
                                  "ratio far from 1); they were discarded and the weights are unchanged: check the "
                                  "batch's sampler logprobs")
            adapter.optimizer.zero_grad(set_to_none=True)
            adapter.step += 1
            return StepInfo(grad_norm, adam.learning_rate, adapter.step)

    def save_state(self, name: str, with_gradients: bool = False) -> bytes:
        """Adapter weights, AdamW state and RNG as safetensors bytes; configuration in the header's JSON.  With
        ``with_gradients`` also the gradients accumulated since the last step (a trainer's fold; a checkpoint,
        as Tinker's, holds none)."""
        with self._lock:
            adapter = self._get(name)
            tensors = {f"adapter.{key}": p.detach().to("cpu").contiguous() for key, p in adapter.params.items()}
            if with_gradients:
                tensors.update({f"gradient.{key}": p.grad.detach().to("cpu").contiguous()
                                for key, p in adapter.params.items() if p.grad is not None})
            optimizer, param_groups = optimizer_tensors(adapter.optimizer)
            tensors.update({f"optimizer.{key}": value for key, value in optimizer.items()})
            tensors.update({f"rng.{key}": value for key, value in adapter.rng.items()})
            meta = {"format": STATE_FORMAT, "lora": _lora_fields(adapter.lora), "step": adapter.step,
                    "param_names": list(adapter.params), "param_groups": param_groups}
            return save_safetensors(tensors, metadata={"rlpipe": json.dumps(meta)})

    def load_state(self, name: str, state: bytes, with_optimizer: bool = True) -> None:
        """Restore a ``save_state`` blob into ``name`` (created if unknown); without the optimizer, Adam starts afresh.

        Accumulated gradients are replaced by those of the state (none, unless it was saved with them).  All or
        nothing: a damaged state is refused (``EngineError``) before any of the adapter changes.
        """
        with self._lock:
            tensors, meta = read_state(state)
            lora_fields = meta["lora"]
            if name in self._adapters:
                adapter = self._adapters[name]
                if _lora_fields(adapter.lora) != lora_fields:
                    raise AdapterShapeError(f"state for a {lora_fields} adapter cannot load into adapter {name!r} "
                                            f"({_lora_fields(adapter.lora)}); load it under a new name",
                                            lora_fields, _lora_fields(adapter.lora))
                self._load_into(adapter, tensors, meta, with_optimizer)
                return
            validate_name(name, "adapter name")
            adapter = self._new_adapter(LoraConfig(task_type="CAUSAL_LM", **lora_fields), seed=0)
            try:
                self._load_into(adapter, tensors, meta, with_optimizer)
            except Exception:
                self._drop_slot(adapter.slot)
                raise
            self._adapters[name] = adapter

    def export_for_sampling(self, name: str, folder: str | Path) -> Path:
        """Write the PEFT folder a sampler (vLLM, transformers) loads: adapter_config.json, adapter_model.safetensors.

        Written directly (no model card), with PEFT's tensor names.
        """
        return self.adapter_snapshot(name).write(folder)

    def adapter_snapshot(self, name: str) -> AdapterSnapshot:
        """Adapter ``name`` as it is now (its config with ``inference_mode`` on, as a run's own learner and peft write
        it, and copies of its weights under PEFT's names), to write later; its gradients are neither in it nor touched."""
        with self._lock:
            adapter = self._get(name)
            config = copy.deepcopy(adapter.lora)
            config.inference_mode = True
            return AdapterSnapshot(config, {key: p.detach().to("cpu", copy=True).contiguous()
                                            for key, p in adapter.params.items()})

    def delete_adapter(self, name: str) -> None:
        """Forget adapter ``name``: weights, optimizer state, gradients, RNG."""
        with self._lock:
            adapter = self._get(name)
            self._drop_slot(adapter.slot)
            del self._adapters[name]

    @contextlib.contextmanager
    def holding(self, name: str) -> Iterator[tuple[PeftModel, str]]:
        """Hold the engine for a client's own code on adapter ``name``: yields (the model, the adapter's peft name).

        For clients that train with their own code on the shared model (the packed
        learner's per-run policies): the block is one operation, with the adapter's
        LoRA layers active (only they require gradients) and its RNG in place; the
        RNG the block leaves is the adapter's afterwards.
        """
        with self._lock:
            adapter = self._get(name)
            with swapped_rng(adapter.rng):
                try:
                    yield self.model, adapter.slot
                finally:
                    adapter.rng = capture_rng()

    # ---- phases ------------------------------------------------------------------------------
    def _get(self, name: str) -> _Adapter:
        adapter = self._adapters.get(name)
        if adapter is None:
            known = ", ".join(sorted(self._adapters)) or "none"
            raise EngineError(f"unknown adapter {name!r} (known: {known}); create_adapter or load_state it first")
        self.model.set_adapter(adapter.slot)
        return adapter

    def _drop_slot(self, slot: str) -> None:
        with warnings.catch_warnings():  # peft announces the next active adapter; there is none until the next op
            warnings.simplefilter("ignore")
            self.model.delete_adapter(slot)

    def _new_adapter(self, lora: LoraConfig, seed: int) -> _Adapter:
        """Inject the LoRA layers (initialised from ``seed``) and build the adapter's own optimizer."""
        self._slots += 1
        slot = f"adapter{self._slots}"
        lora.base_model_name_or_path = self.base_model  # written into adapter_config.json by export_for_sampling
        with swapped_rng(None):
            torch.manual_seed(seed)
            if self.model is None:
                self.model = get_peft_model(self.base, lora, adapter_name=slot, autocast_adapter_dtype=True)
            else:
                self.model.add_adapter(slot, lora, autocast_adapter_dtype=True)
            self.model.set_adapter(slot)
            adapter_rng = capture_rng()
        marker = f".{slot}."
        params = {key.replace(marker, ".", 1): p for key, p in self.model.named_parameters() if marker in key}
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0)
        return _Adapter(slot, lora, params, optimizer, adapter_rng)

    def _prepare(
        self, name: str, datums: Sequence[Datum], loss: str, loss_args: dict[str, float]
    ) -> tuple[_Adapter, Callable[..., tuple[torch.Tensor, LossStats]]]:
        """Check the whole request (adapter, loss, arguments, datums) before anything runs; activate the adapter."""
        if loss not in LOSSES:
            raise EngineError(f"unknown loss {loss!r}; choose {', '.join(LOSSES)}")
        loss_fn, allowed = LOSSES[loss]
        unknown = set(loss_args) - allowed - {"normaliser"}
        if unknown:
            raise EngineError(f"loss {loss} does not take {sorted(unknown)}; it takes {sorted(allowed | {'normaliser'})}")
        args = dict(loss_args)
        normaliser = float(args.pop("normaliser", 1.0))
        if not (math.isfinite(normaliser) and normaliser > 0):
            raise EngineError(f"normaliser must be a positive number, got {normaliser}")
        validate_datums(datums, loss, self.input_vocab, self.output_vocab, self.max_length)
        return self._get(name), lambda logprobs_BT, batch: loss_fn(logprobs_BT, batch, normaliser, **args)

    def _run(
        self, datums: Sequence[Datum], loss: str, loss_fn: Callable[..., tuple[torch.Tensor, LossStats]],
        backward: bool
    ) -> ForwardResult:
        """Micro-batch by micro-batch: logprobs at every target position, the loss, its backward if asked."""
        total, stats, logprobs = 0.0, LossStats(), []
        for start, stop in micro_batch_slices(datums, self.max_batch_tokens):
            input_ids_BT, batch, lengths_B = collate(datums[start:stop], loss, self.device)
            rows_N, cols_N = (torch.arange(input_ids_BT.shape[1], device=self.device)[None, :]
                              < lengths_B[:, None]).nonzero(as_tuple=True)
            divisors_N = logit_divisors(batch.temperatures_B)[rows_N]
            logprobs_N = selected_logprobs(self.model, input_ids_BT, rows_N, cols_N,
                                           batch.tokens_BT[rows_N, cols_N], divisors_N, self.autocast)
            logprobs_BT = torch.zeros(batch.tokens_BT.shape, dtype=logprobs_N.dtype, device=self.device)
            logprobs_BT = logprobs_BT.index_put((rows_N, cols_N), logprobs_N)
            value, batch_stats = loss_fn(logprobs_BT, batch)
            if backward:
                value.backward()
            total += float(value.detach())
            stats = stats.merge(batch_stats)
            detached = logprobs_BT.detach().to("cpu", torch.float32)
            logprobs.extend(detached[b, : int(n)] for b, n in enumerate(lengths_B.tolist()))
        return ForwardResult(total, logprobs, stats)

    def _load_into(self, adapter: _Adapter, tensors: dict[str, torch.Tensor], meta: dict[str, Any],
                   with_optimizer: bool) -> None:
        """Set ``adapter`` to the state: all of it or, when any part is damaged, none of it (``EngineError``).

        Everything is checked and built aside first (the optimizer is a new one, loaded there); only then is
        the adapter changed, by steps that cannot fail on a state that passed."""
        weights, gradients = checked_adapter_tensors(adapter.params, tensors, meta)
        optimizer = torch.optim.AdamW(list(adapter.params.values()), lr=0.0)  # a fresh Adam unless loaded
        step = 0
        if with_optimizer:
            optimizer, step = checked_optimizer(list(adapter.params.values()), tensors, meta, self.device)
        rng = checked_rng(tensors)
        self.model.set_adapter(adapter.slot)
        with torch.no_grad():
            for key, value in weights.items():
                adapter.params[key].copy_(value.to(adapter.params[key].device))
        for key, p in adapter.params.items():
            p.grad = gradients[key].to(p.device, p.dtype).clone() if key in gradients else None
        adapter.optimizer, adapter.step = optimizer, step
        adapter.rng = rng or adapter.rng


def _lora_fields(lora: LoraConfig) -> dict[str, Any]:
    return {"r": lora.r, "lora_alpha": lora.lora_alpha, "lora_dropout": lora.lora_dropout,
            "target_modules": sorted(lora.target_modules)}
