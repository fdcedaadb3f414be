"""Experiment tracking: every learner step's numbers to TensorBoard and, when set up, Weights & Biases.

The learner hands each step's metrics dict to a ``MetricLogger`` once
(``Learner.step``); this module decides which entries are scalars and where they
go, so training code never touches a file format.  The store stays the record
of a run (``rlpipe report`` reads only the store); trackers are views of it.

Scalars: every finite number of the step except its ``step`` (the x axis) and
its timestamps (``finished_at`` is the event's wall time); a dict of numbers,
such as ``staleness_histogram``, becomes one scalar per entry
(``staleness_histogram/0``), and the histogram also gives ``staleness_mean``
(versions behind, over the rows that reached the step, dropped ones included).

Backends:

- TensorBoard (always): event files in the run's own folder of the store when the
  store is local (``<store>/runs/<run>/tensorboard``), else under
  ``$RLPIPE_HOME/tensorboard/<run>`` on the learner's machine; ``learner.tensorboard_dir``
  names another folder (each run in ``<dir>/<run>``).  The writer opens at the
  first logged step with ``purge_step`` set to it, so after a crash TensorBoard
  drops the steps an earlier process logged but never checkpointed (they are
  trained again).  Each step is flushed at once.
- Weights & Biases, when ``wandb`` is importable and the environment configures it
  (``WANDB_MODE`` other than ``disabled``, ``WANDB_PROJECT`` or ``WANDB_API_KEY``;
  ``WANDB_MODE=offline`` writes a local run to sync later).  The W&B run id is the
  rlpipe run id, resumed by a restarted learner; the project defaults to ``rlpipe``.  W&B cannot rewrite
  a step, so steps a restarted learner trains again keep there the values first logged (``WandbLogger``).

A backend that fails is logged once and dropped: tracking never stops training.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from pipeline.io.store import ObjectStore
from schemas.config import RunConfig
from schemas.names import validate_name

log = logging.getLogger("rlpipe.tracking")

NOT_SCALARS = ("step", "started_at", "finished_at")  # the x axis and the wall-clock stamps
WANDB_PROJECT_DEFAULT = "rlpipe"
_WANDB_SETTINGS = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_API_KEY")


class MetricLogger(Protocol):
    """Receives one learner step's metrics (``Learner.step``'s dict) at a time."""

    def log(self, metrics: Mapping[str, Any]) -> None: ...
    def close(self) -> None: ...


def step_scalars(metrics: Mapping[str, Any]) -> tuple[int, dict[str, float]]:
    """(step, tag -> value) of the scalars of one step's metrics (see the module docstring)."""
    scalars: dict[str, float] = {}
    for key, value in metrics.items():
        if key in NOT_SCALARS:
            continue
        if isinstance(value, Mapping):
            scalars.update({f"{key}/{sub}": float(v) for sub, v in value.items() if _is_finite_number(v)})
        elif _is_finite_number(value):
            scalars[key] = float(value)
    rows_by_staleness = {int(k): float(v) for k, v in metrics.get("staleness_histogram", {}).items()}
    if sum(rows_by_staleness.values()) > 0:  # one curve to watch beside the per-version counts
        scalars["staleness_mean"] = sum(k * v for k, v in rows_by_staleness.items()) / sum(rows_by_staleness.values())
    return int(metrics["step"]), scalars


def _is_finite_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class NullMetricLogger:
    """Tracks nothing (a learner built without trackers, e.g. in tests)."""

    def log(self, metrics: Mapping[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class TensorBoardLogger:
    """Scalars of each step to TensorBoard event files in ``log_dir`` (created at the first step)."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir).expanduser()
        self._writer: Any = None

    def log(self, metrics: Mapping[str, Any]) -> None:
        step, scalars = step_scalars(metrics)
        if self._writer is None:
            self._writer = self._open(purge_step=step)
        walltime = metrics.get("finished_at")
        for tag, value in scalars.items():
            self._writer.add_scalar(tag, value, step, walltime=walltime)
        self._writer.flush()

    def _open(self, purge_step: int) -> Any:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only once something is logged

        self.log_dir.mkdir(parents=True, exist_ok=True)
        wait_past_event_files(self.log_dir)
        log.info("TensorBoard event files in %s (view: tensorboard --logdir %s)", self.log_dir, self.log_dir.parent)
        return SummaryWriter(str(self.log_dir), purge_step=purge_step)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def wait_past_event_files(log_dir: Path) -> None:
    """Wait until the clock is past the second of every event file in ``log_dir``.

    TensorBoard reads a folder's files in name order and names them ``events.out.tfevents.<second>.<host>.<pid>.
    <counter>``, the counter not zero-padded: a file opened in the same second as an earlier one (a learner
    restarted at once) could sort before it (".9" after ".10"), and the earlier file's steps would then replace
    the retrained ones.  A file of a later second sorts after them all.
    """
    seconds = [int(parts[3]) for path in log_dir.glob("events.out.tfevents.*")
               if len(parts := path.name.split(".")) > 3 and parts[3].isdigit()]
    latest = max(seconds, default=0)
    while time.time() < latest + 1:
        time.sleep(min(1.0, latest + 1 - time.time()) + 0.01)


class WandbLogger:
    """Scalars of each step to a Weights & Biases run named after the rlpipe run (started at the first step).

    W&B keeps one row per step, in step order, and cannot rewrite one: a resumed W&B run takes only steps from
    ``run.step`` (its last row's step + 1) on, and drops lower ones with a warning per step.  A learner restarted
    from its checkpoint trains the steps after it again; those W&B already holds keep the values the earlier
    process logged (the store and TensorBoard hold the retrained ones), and are skipped here with one note, so
    W&B shows each step once and in order.  Each step is committed as it is logged, not held back until the
    next one, so W&B is never a step behind and a killed learner loses none of the steps it logged.
    """

    def __init__(self, run_id: str, config: Mapping[str, Any] | None = None) -> None:
        self.run_id, self.config = run_id, dict(config or {})
        self._run: Any = None
        self._held: list[int] = []  # steps trained again that the W&B run already holds (noted once)

    def log(self, metrics: Mapping[str, Any]) -> None:
        step, scalars = step_scalars(metrics)
        if self._run is None:
            import wandb

            # create_new (wandb >= 0.19.10): packed runs share a process, each with a W&B run of its own
            self._run = wandb.init(project=os.environ.get("WANDB_PROJECT") or WANDB_PROJECT_DEFAULT,
                                   id=self.run_id, name=self.run_id, resume="allow", config=self.config,
                                   reinit="create_new")
        if step < int(self._run.step or 0):  # logged by a process before this one's restart
            self._held.append(step)
            return
        self._note_held_steps()
        self._run.log(scalars, step=step, commit=True)

    def _note_held_steps(self) -> None:
        if self._held:
            log.info("W&B run %s already holds steps %d-%d from before this learner restarted: they keep the "
                     "values logged then (TensorBoard and the store hold the retrained ones)",
                     self.run_id, self._held[0], self._held[-1])
            self._held = []

    def close(self) -> None:
        self._note_held_steps()
        if self._run is not None:
            self._run.finish()
            self._run = None


class FanOut:
    """Every step to each backend; a backend that raises is logged once and dropped."""

    def __init__(self, backends: Sequence[MetricLogger]) -> None:
        self.backends = list(backends)

    def log(self, metrics: Mapping[str, Any]) -> None:
        for backend in list(self.backends):
            try:
                backend.log(metrics)
            except Exception as exc:  # a tracker is an observer: its failure must not stop training
                log.warning("%s failed (%s: %s); no more metrics go to it", type(backend).__name__,
                            type(exc).__name__, _first_line(exc))
                self.backends.remove(backend)

    def close(self) -> None:
        for backend in self.backends:
            try:
                backend.close()
            except Exception as exc:  # closing at shutdown: report, keep closing the others
                log.warning("closing %s failed: %s", type(backend).__name__, _first_line(exc))
        self.backends = []


def tensorboard_dir(config: RunConfig, store: ObjectStore) -> Path:
    """Where the run's event files go (see the module docstring)."""
    run_id = validate_name(config.run_id, "run_id")
    if config.learner.tensorboard_dir:
        return Path(config.learner.tensorboard_dir).expanduser() / run_id
    if store.is_local:
        return Path(store.path(f"runs/{run_id}/tensorboard"))
    from pipeline.devstack.stack import rlpipe_home  # the dev stack's module: not imported with the learner

    return rlpipe_home() / "tensorboard" / run_id


def wandb_configured(environ: Mapping[str, str] | None = None) -> bool:
    """Whether ``wandb`` is installed and the environment asks for it (``WANDB_MODE=disabled`` turns it off)."""
    environ = os.environ if environ is None else environ
    return _wandb_asked(environ) and importlib.util.find_spec("wandb") is not None


def _wandb_asked(environ: Mapping[str, str]) -> bool:
    """Whether the environment asks for W&B: one of its settings set, and ``WANDB_MODE`` not ``disabled``."""
    if environ.get("WANDB_MODE", "").strip().lower() == "disabled":
        return False
    return any(environ.get(name) for name in _WANDB_SETTINGS)


def open_metric_logger(config: RunConfig, store: ObjectStore) -> FanOut:
    """TensorBoard for ``config.run_id``, plus W&B when configured."""
    backends: list[MetricLogger] = [TensorBoardLogger(tensorboard_dir(config, store))]
    if wandb_configured():
        summary = config.model_dump(mode="json", include={"run_id", "env", "model", "learner"})
        backends.append(WandbLogger(config.run_id, summary))
        log.info("Weights & Biases tracking on (run %s)", config.run_id)
    elif _wandb_asked(os.environ):
        log.warning("%s is set but the wandb package is not installed: logging to TensorBoard only; "
                    "pip install 'wandb>=0.19.10' to log to Weights & Biases too",
                    next(name for name in _WANDB_SETTINGS if os.environ.get(name)))
    return FanOut(backends)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
