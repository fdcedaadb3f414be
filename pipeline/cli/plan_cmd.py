"""``rlpipe plan --model M --gpus N``: memory per learner rank, and whether it fits a GPU, from the config alone.

The figures come from ``pipeline.sizing`` (the model built on the meta device:
no weights are downloaded or read).  ``--model`` is a hub id, a model folder, a
``config.json``, or ``tiny`` (the tiny model built on this machine).  Exit status
0 when it fits, 1 when it does not, 2 on a bad option.
"""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from pipeline.cli.common import EXIT_USAGE, JsonOpt, console, fail, print_json
from schemas.config import LearnerConfig

_LEARNER = LearnerConfig()  # the adapter a run trains unless configured otherwise
app = typer.Typer(name="plan", add_completion=False, pretty_exceptions_enable=False)


@app.command(
    "plan",
    epilog="Example: rlpipe plan --model Qwen/Qwen2.5-7B-Instruct --gpus 2 --gpu-memory 80 --seq-len 4096",
)
def plan(
    model: Annotated[str, typer.Option(help="hub id, model folder, config.json, or tiny (the tiny model built here)")],
    gpus: Annotated[int, typer.Option(min=1, help="ranks (GPUs) of the learner's torchrun group")] = 1,
    gpu_memory: Annotated[float, typer.Option(min=0.1, help="memory of one GPU, GiB")] = 80.0,
    dtype: Annotated[str, typer.Option(help="base weights' dtype (model.dtype)")] = "bfloat16",
    micro_batch: Annotated[int, typer.Option(min=1, help="sequences per micro-batch")] = 1,
    seq_len: Annotated[int, typer.Option(min=1, help="tokens per sequence")] = 2048,
    lora_rank: Annotated[int, typer.Option(min=1, help="LoRA rank (default: learner.lora_rank's)")] = _LEARNER.lora_rank,
    targets: Annotated[str, typer.Option(help="LoRA target modules, comma-separated (default: "
                                              "learner.target_modules)")] = ",".join(_LEARNER.target_modules),
    shard: Annotated[bool, typer.Option(help="shard the base weights over the ranks (FSDP2; default: "
                                             "learner.shard's)")] = _LEARNER.shard,
    checkpointing: Annotated[bool, typer.Option(help="gradient checkpointing (default: "
                                                     "learner.gradient_checkpointing's)")] = _LEARNER.gradient_checkpointing,
    overhead: Annotated[float, typer.Option(min=0.0, help="runtime overhead per rank, GiB (CUDA context)")] = 1.0,
    as_json: JsonOpt = False,
) -> None:
    """Estimate the memory of one learner rank: weights, LoRA, optimizer, activations, logits."""
    from pipeline.models import ModelNotBuiltError, resolve_base_model
    from pipeline.sizing import GIB, load_model_config, plan_memory
    from schemas.config import ModelConfig

    try:
        where = resolve_base_model(ModelConfig(base_model=model)) if model == "tiny" else model
    except ModelNotBuiltError as exc:
        fail(f"cannot size 'tiny': {exc}", EXIT_USAGE)
    try:
        config = load_model_config(where)
        result = plan_memory(config, gpus, dtype, micro_batch, seq_len, lora_rank, tuple(targets.split(",")),
                             shard, checkpointing, overhead_gib=overhead)
    except (OSError, ValueError, AttributeError) as exc:
        reason = " ".join(str(exc).split())
        fail(f"cannot size {model!r}: {reason}; pass a model folder or its config.json (a hub id needs the hub "
             "or a cached copy)", EXIT_USAGE)
    fits = result.fits(gpu_memory)
    if as_json:
        print_json({"model": model, "gpus": gpus, "parameters": result.parameters, "tokens": result.tokens,
                    "bytes": result.parts(), "gpu_memory_gib": gpu_memory, "fits": fits})
    else:
        table = Table("part", "GiB per rank", title=f"{model}: {counted(result.parameters)} parameters, "
                      f"{gpus} rank(s), {dtype}, {result.tokens} tokens per micro-batch")
        for name, value in result.parts().items():
            table.add_row(name, f"{value / GIB:.3f}")
        console.print(table)
        verdict = "fits" if fits else "does NOT fit"
        console.print(f"{verdict} in {gpu_memory:g} GiB per GPU")
    raise typer.Exit(0 if fits else 1)


def counted(count: int) -> str:
    """``count`` in T, B, M or K (the largest under it), three significant figures: 8.03 B, 1.77 M, 405 B.

    Rounded first, then the unit picked: 999,600 is 1.00 M, not 1000 K (999.6 K rounded up past its unit).
    """
    rounded = float(f"{count:.3g}")  # a whole number from 1000 on: dividing by a power of ten below is exact
    for scale, unit in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if rounded >= scale:
            value = rounded / scale  # in [1, 1000) (up to T): 2, 1 or 0 decimals
            return f"{value:.{max(0, 3 - len(str(int(value))))}f} {unit}"
    return str(count)


# ``rlpipe``'s loader registers a click command as-is.
command = typer.main.get_command(app)
