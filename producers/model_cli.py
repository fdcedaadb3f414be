"""``rlpipe model``: build the tiny local base model.

Thin: it calls ``producers.tiny_model.build_tiny_model`` and shows a progress
bar while the model pre-trains.  Mistakes (an occupied folder, a bad value)
end with one line on stderr and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Annotated

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from pipeline.cli.common import EXIT_FAILURE, EXIT_USAGE, console, err_console, fail
from pipeline.models import record_tiny_model
from producers.tiny_model import TinyModelSpec, build_tiny_model, default_tiny_dir, read_marker

app = typer.Typer(
    name="model",
    help="Build the local tiny base model.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
_DEFAULTS = TinyModelSpec()


@app.callback()
def _group() -> None:
    """Build the local tiny base model."""


@app.command("init-tiny")
def init_tiny(
    out: Annotated[
        Path | None, typer.Option("--out", "-o", help="folder to build into; default $RLPIPE_HOME/models/tiny-<hash>")
    ] = None,
    steps: Annotated[
        int, typer.Option("--steps", min=0, max=1_000_000, help="pre-training steps (0 = random weights)")
    ] = _DEFAULTS.steps,
    seed: Annotated[int, typer.Option("--seed", min=0, help="seed of the whole build")] = 0,
    force: Annotated[bool, typer.Option("--force", help="rebuild even if the folder holds a model")] = False,
) -> None:
    """Build the tiny Qwen2-style model: tokenizer, weights, short pre-training on environment transcripts.

    Reuses a folder built with the same parameters; without --out, records it for the learner side.

    Example: rlpipe model init-tiny --out ./tiny --steps 150
    """
    for logger in ("producers.tiny_model", "producers.tiny_corpus"):  # skipped envs come back as warnings
        logging.getLogger(logger).setLevel(logging.ERROR)
    _quiet_transformers()
    overrides = {"steps": steps, "pretrain": steps > 0}
    target = out if out is not None else default_tiny_dir(TinyModelSpec(seed=seed, **overrides))
    started = time.monotonic()
    with _progress() as progress:
        task = progress.add_task("pre-training", total=max(steps, 1), loss=float("nan"))
        every = max(1, steps // 10)

        def on_step(done: int, total: int, loss: float) -> None:
            if done == 0:  # the build starts (a model already built is reused without one)
                progress.console.print(f"building the tiny model in {target} (transcripts, tokenizer, {steps} "
                                       "pre-training steps: 2-3 minutes on 2 idle cores; built once)",
                                       markup=False, soft_wrap=True)
                return
            progress.update(task, completed=done, total=total, loss=loss)
            if not err_console.is_terminal and (done % every == 0 or done == total):  # no bar in a log: lines
                err_console.print(f"pre-training {done}/{total} steps, loss {loss:.3f}, "
                                  f"{time.monotonic() - started:.0f} s", markup=False)

        try:
            path = build_tiny_model(target, seed=seed, force=force, progress=on_step, **overrides)
        except (FileExistsError, NotADirectoryError) as exc:
            fail(str(exc), EXIT_USAGE)
        except (RuntimeError, OSError) as exc:
            fail(f"{type(exc).__name__}: {exc}", EXIT_FAILURE)
    if out is None:  # the default location: the learner side finds it through the pointer
        record_tiny_model(path)
    _report(path)


def _quiet_transformers() -> None:
    """transformers' own bars (writing shards) would interleave with ours."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _progress() -> Progress:
    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]:.3f}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=err_console,
        transient=True,
    )


def _report(path: Path) -> None:
    marker = read_marker(path) or {}
    final = marker.get("final_loss")
    console.print(f"tiny model: {path}", markup=False)
    console.print(f"parameters: {marker.get('params', 0):,}; vocabulary: {marker.get('vocab_size')}", markup=False)
    console.print(f"final loss: {'n/a (no pre-training)' if final is None else f'{final:.4f}'}", markup=False)
    skipped = marker.get("skipped_envs") or {}
    if skipped:
        err_console.print(f"warning: built without environments {', '.join(sorted(skipped))} (they failed to import)")


if __name__ == "__main__":
    app()
