"""How much memory one rank of the learner needs, from a model's configuration alone (``rlpipe plan``).

The model is built on the meta device (shapes, no weights), so a 70B
configuration is sized in a second.  Per rank, for LoRA training with the
distributed training engine (``consumers.distributed``):

  weights      base weights in ``dtype``, divided over the ranks when sharded
               (FSDP2); the output head stays whole on every rank (the head-only
               forward reads its weight directly)
  gathered     sharded only: the decoder layers gathered whole at a time (the
               one running and the one prefetched)
  lora         LoRA weights in float32 (r x (in + out) per targeted linear layer)
  optimizer    their gradients and AdamW's two moments, float32: 3 x lora
  activations  what the backward pass keeps, per token of a micro-batch:
               without checkpointing, each layer's inputs to its norms, attention
               and MLP (about 8 x hidden + 4 x intermediate values per token per
               layer); with checkpointing, one hidden state per layer plus one
               layer's worth; in the compute dtype (bf16 on GPUs, the weights'
               dtype on CPUs)
  logits       the float32 head at every position: logits, log-softmax and its
               gradient (3 x tokens x vocabulary x 4 bytes), and a float32 copy of
               the head's weight when the base weights are not float32
  overhead     the runtime's own (CUDA context, allocator slack): a flat figure

It is an estimate for choosing a GPU count (infra/choosing-n.md), not a
guarantee: attention kernels, allocator fragmentation and the sampler-side cache
are not modelled.  ``tests/pipeline/test_sizing.py`` holds it to measured peaks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import RepositoryNotFoundError
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

GIB = 2**30
HUB_TIMEOUT_S = 5.0  # one look-up of a hub id not in the cache; the hub client alone retries for about 30 s
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
# values kept for the backward pass, per token per decoder layer, as multiples of hidden and intermediate size
ACTIVATION_HIDDEN, ACTIVATION_INTERMEDIATE = 8, 4


@dataclass(frozen=True)
class MemoryPlan:
    """Bytes per rank by part (module docstring); ``total`` sums them."""

    gpus: int
    dtype: str
    tokens: int  # micro-batch x sequence length
    parameters: int  # the base model's, all ranks together
    weights: int
    gathered: int
    lora: int
    optimizer: int
    activations: int
    logits: int
    overhead: int

    @property
    def total(self) -> int:
        return (self.weights + self.gathered + self.lora + self.optimizer + self.activations + self.logits
                + self.overhead)

    def fits(self, gpu_memory_gib: float) -> bool:
        return self.total <= gpu_memory_gib * GIB

    def parts(self) -> dict[str, int]:
        """The byte counts by part, ``total`` last (for tables and JSON)."""
        counted = {k: v for k, v in asdict(self).items() if k not in ("gpus", "dtype", "tokens", "parameters")}
        return {**counted, "total": self.total}


def load_model_config(model: str) -> PretrainedConfig:
    """A hub id, a model folder or a ``config.json`` path -> its configuration (no weights are read).

    A hub id is read from the local cache first.  Only when it is not there is the hub asked, once and with
    ``HUB_TIMEOUT_S``, whether the model exists, so an unknown id or an unreachable hub is an ``OSError`` in
    seconds rather than after the hub client's retries.
    """
    if model.endswith(".json"):
        return AutoConfig.from_pretrained(model.rsplit("/", 1)[0] or ".") if model.endswith("config.json") \
            else PretrainedConfig.from_json_file(model)
    folder = Path(model).expanduser()
    if folder.exists() or model.startswith(("/", ".", "~")):
        if not folder.is_dir():
            raise OSError(f"there is no model folder {str(folder)!r}")
        return AutoConfig.from_pretrained(folder)
    try:
        return AutoConfig.from_pretrained(model, local_files_only=True)
    except OSError:
        if constants.HF_HUB_OFFLINE:
            raise OSError(f"{model!r} is not in the hub cache and HF_HUB_OFFLINE is set") from None
    _check_on_hub(model)
    return AutoConfig.from_pretrained(model)


def _check_on_hub(model: str) -> None:
    """``OSError`` unless the hub answers, within ``HUB_TIMEOUT_S``, that ``model`` exists."""
    try:
        HfApi().model_info(model, timeout=HUB_TIMEOUT_S)
    except RepositoryNotFoundError:
        raise OSError(f"the hub has no model {model!r} (or it is private: log in with `hf auth login`)") from None
    except ValueError:
        raise  # not a valid hub id
    except Exception as exc:  # the hub client's transport errors are requests', httpx' or httpx2's by version
        raise OSError(f"{model!r} is not in the hub cache and the hub at {constants.ENDPOINT} cannot be reached "
                      f"({type(exc).__name__}: {exc})") from None


def plan_memory(
    config: PretrainedConfig, gpus: int = 1, dtype: str = "bfloat16", micro_batch: int = 1, seq_len: int = 2048,
    lora_rank: int = 16, target_modules: Sequence[str] = DEFAULT_TARGETS, shard: bool = True,
    gradient_checkpointing: bool = True, compute_dtype: str | None = None, overhead_gib: float = 1.0,
) -> MemoryPlan:
    """Memory per rank of LoRA training ``config`` on ``gpus`` ranks (module docstring for each part)."""
    if gpus < 1 or micro_batch < 1 or seq_len < 1 or lora_rank < 1:
        raise ValueError("gpus, micro_batch, seq_len and lora_rank must be >= 1")
    weight_bytes = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    act_bytes = torch.empty((), dtype=getattr(torch, compute_dtype or dtype)).element_size()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    text = config.get_text_config()
    hidden, layers, vocab = text.hidden_size, text.num_hidden_layers, text.vocab_size
    intermediate = getattr(text, "intermediate_size", 4 * hidden)
    parameters = sum(p.numel() for p in model.parameters())
    head = model.get_output_embeddings()
    whole = head.weight.numel() if head is not None else 0  # the output head (tied or not) is kept on every rank
    ranks = gpus if shard else 1
    layer_params = max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    lora_params = sum(lora_rank * (m.in_features + m.out_features) for name, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and name.rsplit(".", 1)[-1] in target_modules)
    tokens = micro_batch * seq_len
    per_token_layer = ACTIVATION_HIDDEN * hidden + ACTIVATION_INTERMEDIATE * intermediate
    if gradient_checkpointing:
        activations = tokens * (layers * hidden + per_token_layer) * act_bytes
    else:
        activations = tokens * layers * per_token_layer * act_bytes
    head_copy = vocab * hidden * 4 if weight_bytes < 4 else 0
    return MemoryPlan(
        gpus=gpus, dtype=dtype, tokens=tokens, parameters=parameters,
        weights=((parameters - whole) // ranks + whole) * weight_bytes,
        gathered=2 * layer_params * weight_bytes if ranks > 1 else 0,
        lora=lora_params * 4, optimizer=3 * lora_params * 4,
        activations=activations, logits=3 * tokens * vocab * 4 + head_copy,
        overhead=int(overhead_gib * GIB),
    )
