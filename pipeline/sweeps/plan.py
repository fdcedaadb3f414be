"""A sweep's plan and its folder: the grid, the experiments it expands to, and which have finished.

A sweep runs one script (a researcher's loop written against the Tinker SDK,
e.g. ``examples/tinker_cartpole.py``) once per grid point and seed.  The script
is called as ``python SCRIPT --KEY VALUE ... --seed S --result-file PATH`` with
every ``--set`` and one value of every ``--grid`` key, and writes a JSON object
to ``PATH`` whose ``samples`` are its held-out scores (one number per evaluation
episode of its final weights; higher is better).  Optional ``evaluations``
(``{label: [numbers]}``, e.g. its base model's) appear in the leaderboard beside it.

The folder (``sweep.json`` the plan, ``exp-NNN/`` one per experiment with its
``config.json``, its output in ``log.txt`` (stdout) and ``stderr.txt``, and, once
it has finished, ``result.json``) is the
sweep's whole state: a sweep started again on the same folder runs only the
experiments without a ``result.json``.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

PLAN_FILE = "sweep.json"
RESULT_FILE = "result.json"
PARTIAL_RESULT_FILE = "result.partial.json"
FAILURE_FILE = "failed.json"
LOG_FILE = "log.txt"
STDERR_FILE = "stderr.txt"
LOCK_FILE = ".lock"
KEY = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
RESERVED = ("seed", "result-file")  # the sweep passes these itself


class SweepSpec(BaseModel):
    """What a sweep runs: ``script`` over ``grid`` (every combination) x ``seeds``, with ``fixed`` settings."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    script: str
    grid: dict[str, list[str]]
    fixed: dict[str, str | None] = {}
    seeds: list[int] = [0]
    python: str = sys.executable

    @field_validator("grid")
    @classmethod
    def _grid(cls, grid: dict[str, list[str]]) -> dict[str, list[str]]:
        if not grid:
            raise ValueError("a sweep needs at least one --grid KEY=V1,V2")
        for key, values in grid.items():
            if not values or any(not v for v in values):
                raise ValueError(f"--grid {key}: give one or more non-empty values, e.g. --grid {key}=1e-3,3e-4")
            if len(set(values)) != len(values):
                raise ValueError(f"--grid {key}: a value is given twice in {','.join(values)}")
        return grid

    @field_validator("seeds")
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError(f"--seeds: give distinct seeds, e.g. --seeds 0,1,2 (got {seeds})")
        return seeds

    @model_validator(mode="after")
    def _keys(self) -> SweepSpec:
        for key in [*self.grid, *self.fixed]:
            if not KEY.match(key):
                raise ValueError(f"{key!r} is not an option name: use lowercase letters, digits, - and _ "
                                 "(the script's option without its leading --)")
            if key in RESERVED:
                raise ValueError(f"the sweep passes --{key} itself: use --seeds for seeds, and drop --{key}")
        both = sorted(set(self.grid) & set(self.fixed))
        if both:
            raise ValueError(f"{', '.join(both)} is both swept (--grid) and fixed (--set): keep one")
        return self


@dataclass(frozen=True)
class Experiment:
    """One run of the script: a grid point and a seed."""

    index: int
    config: dict[str, str]
    seed: int

    @property
    def name(self) -> str:
        return f"exp-{self.index:03d}"

    @property
    def label(self) -> str:
        """The grid point, e.g. ``rl-lr=1e-3 loss=ppo`` (the leaderboard's row)."""
        return config_label(self.config)

    def argv(self, spec: SweepSpec, result_path: Path) -> list[str]:
        """The command line: the interpreter, the script, every setting, the seed and the result file."""
        args = [spec.python, spec.script]
        for key, value in [*spec.fixed.items(), *self.config.items()]:
            args += [f"--{key}"] if value is None else [f"--{key}", value]
        return [*args, "--seed", str(self.seed), "--result-file", str(result_path)]


def config_label(config: dict[str, str]) -> str:
    return " ".join(f"{key}={value}" for key, value in config.items())


def experiments(spec: SweepSpec) -> list[Experiment]:
    """Every grid point (in the order the values were given, the last key fastest) times every seed."""
    points = [dict(zip(spec.grid, values, strict=True)) for values in itertools.product(*spec.grid.values())]
    return [Experiment(index, point, seed)
            for index, (point, seed) in enumerate((p, s) for p in points for s in spec.seeds)]


def parse_grid(items: list[str]) -> dict[str, list[str]]:
    """``["lr=1e-3,3e-4", "loss=ppo"]`` -> ``{"lr": ["1e-3", "3e-4"], "loss": ["ppo"]}``."""
    grid: dict[str, list[str]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        key = key.strip().removeprefix("--")
        if not sep:
            raise ValueError(f"--grid {item!r}: write KEY=V1,V2,... (e.g. --grid rl-lr=1e-3,3e-4)")
        if key in grid:
            raise ValueError(f"--grid {key} is given twice: list all its values in one --grid {key}=V1,V2")
        grid[key] = [v.strip() for v in values.split(",")]
    return grid


def parse_fixed(items: list[str]) -> dict[str, str | None]:
    """``["rl-steps=2", "verbose"]`` -> ``{"rl-steps": "2", "verbose": None}`` (a flag without a value)."""
    fixed: dict[str, str | None] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip().removeprefix("--")
        if key in fixed:
            raise ValueError(f"--set {key} is given twice: keep one")
        fixed[key] = value if sep else None
    return fixed


class SweepDir:
    """The folder holding a sweep's plan, its experiments' logs and results, and its lock."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def plan(self) -> SweepSpec:
        """The plan recorded in the folder (to resume it)."""
        plan_path = self.path / PLAN_FILE
        if not plan_path.is_file():
            raise FileNotFoundError(f"{self.path} holds no sweep ({PLAN_FILE} is missing): start one with "
                                    "rlpipe sweep SCRIPT --grid ... --dir " + str(self.path))
        return SweepSpec.model_validate_json(plan_path.read_text())

    def create_or_check(self, spec: SweepSpec) -> bool:
        """Record ``spec`` in a new folder (True), or check that it is the folder's plan (False: resuming).

        The interpreter is how the plan runs, not what it runs: a resume with another
        one (a virtualenv made again, a mistyped ``--python`` corrected) records it.
        """
        plan_path = self.path / PLAN_FILE
        if plan_path.is_file():
            recorded = self.plan()
            differing = [name for name in SweepSpec.model_fields
                         if name != "python" and getattr(recorded, name) != getattr(spec, name)]
            if differing:
                raise ValueError(f"{self.path} holds another sweep (its {PLAN_FILE} differs in "
                                 f"{', '.join(differing)}): use a new --dir, or "
                                 f"`rlpipe sweep --resume {self.path}` to continue the one it holds")
            if recorded.python != spec.python:
                _write_atomically(plan_path, spec.model_dump_json(indent=2))
            return False
        if self.path.exists() and any(p.name != LOCK_FILE for p in self.path.iterdir()):
            raise FileExistsError(f"{self.path} is not empty and holds no sweep: use a new --dir")
        self.path.mkdir(parents=True, exist_ok=True)
        _write_atomically(plan_path, spec.model_dump_json(indent=2))
        return True

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Hold the folder for one sweep process at a time (released when the process ends, even killed)."""
        self.path.mkdir(parents=True, exist_ok=True)
        with open(self.path / LOCK_FILE, "a+") as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.seek(0)
                holder = handle.read().strip() or "another process"
                raise ValueError(f"{self.path} is being run by {holder}: wait for it, or stop it first") from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"rlpipe sweep (pid {os.getpid()})")
            handle.flush()
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def folder(self, experiment: Experiment) -> Path:
        return self.path / experiment.name

    def prepare(self, experiment: Experiment) -> Path:
        """The experiment's folder with its ``config.json``, ready for an attempt; the partial result's path."""
        folder = self.folder(experiment)
        folder.mkdir(parents=True, exist_ok=True)
        _write_atomically(folder / "config.json", json.dumps(
            {"name": experiment.name, "config": experiment.config, "seed": experiment.seed}, indent=2))
        for stale in (PARTIAL_RESULT_FILE, FAILURE_FILE):
            (folder / stale).unlink(missing_ok=True)
        return folder / PARTIAL_RESULT_FILE

    def result(self, experiment: Experiment) -> dict[str, Any] | None:
        """The finished experiment's result, or None."""
        path = self.folder(experiment) / RESULT_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def failure(self, experiment: Experiment) -> dict[str, Any] | None:
        path = self.folder(experiment) / FAILURE_FILE
        return json.loads(path.read_text()) if path.is_file() else None

    def accept(self, experiment: Experiment) -> dict[str, Any]:
        """Check the script's result file and make it the experiment's result; ValueError when it is not one."""
        partial = self.folder(experiment) / PARTIAL_RESULT_FILE
        if not partial.is_file():
            raise ValueError("the script exited 0 but wrote no result file: it must write JSON with a "
                             "'samples' list to the path given by --result-file")
        try:
            result = json.loads(partial.read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"the result file is not JSON ({exc})") from None
        check_result(result)
        partial.replace(self.folder(experiment) / RESULT_FILE)
        return result

    def record_failure(self, experiment: Experiment, reason: str, returncode: int | None) -> None:
        _write_atomically(self.folder(experiment) / FAILURE_FILE,
                          json.dumps({"reason": reason, "returncode": returncode}, indent=2))


def check_result(result: Any) -> None:
    """A result is a JSON object whose ``samples`` is a non-empty list of finite numbers."""
    samples = result.get("samples") if isinstance(result, dict) else None
    if not isinstance(samples, list) or not samples or not all(_finite(v) for v in samples):
        raise ValueError("the result file needs 'samples': a non-empty list of finite numbers (held-out scores)")
    evaluations = result.get("evaluations", {})
    if not isinstance(evaluations, dict) or not all(
            isinstance(v, list) and all(_finite(x) for x in v) for v in evaluations.values()):
        raise ValueError("the result file's 'evaluations' must map labels to lists of finite numbers")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
