"""Checkpoint size and save time early and late in a run: the checkpoint must not grow with the steps.

A synthetic long run drives ``CheckpointStore`` directly with the state a ``Learner`` builds step by
step (one real ``LoraPolicy`` on the tiny model supplies the adapter and AdamW tensors, after one real
optimizer step): per step, ``--batches-per-step`` batch ids named as producers name them, the source
position, and a step-log entry with the keys ``Learner.step`` writes (taken from a real ``train_step``),
appended with ``record_step``.  At step ``--early`` and at step ``--late`` the checkpoint is saved
``--repeats`` times (keeping 3, as the default ``learner.keep_checkpoints``); reported: the bytes of one
checkpoint folder, the median save time, and the median time to load the newest checkpoint (which
rebuilds the trained batch ids from the step log, so it reads one object per step).

For comparison, the old layout (``trained`` and ``step_log`` inline in ``state.json``) is written at the
same steps by the same store: its size and write time are what every checkpoint cost before.

Run: .venv/bin/python bench/checkpoint_size.py [--early 10] [--late 1000] [--batches-per-step 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as save_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from consumers.batching import micro_batches
from consumers.checkpoint import CheckpointStore, capture_rng
from consumers.policy import LoraPolicy
from pipeline.io.store import ObjectStore
from producers.tiny_model import build_tiny_model
from schemas.checkpoint import LearnerState
from schemas.config import LearnerConfig


def trained_policy(model_dir: str) -> tuple[LoraPolicy, dict[str, Any]]:
    """A policy after one real optimizer step (so AdamW holds its state) and that step's loss statistics."""
    policy = LoraPolicy(model_dir, LearnerConfig(lora_rank=8))
    tokens = [[1, 2, 3, 4, 5, 6, 7, 8]] * 4
    batches = micro_batches(tokens, [[0, 0, 0, 0, 1, 1, 1, 1]] * 4, [[-1.0] * 8] * 4, [1.0, -1.0, 0.5, -0.5], 4096)
    result = policy.train_step(batches, normaliser=4.0)
    return policy, result.stats.to_dict()


def step_entry(step: int, batch_ids: list[str], version: int, stats: dict[str, Any]) -> dict[str, Any]:
    """A step-log entry with the keys ``Learner.step`` writes."""
    started = 1.7e9 + 10.0 * step
    return {
        "step": step, "started_at": started, "rows": 64, "tokens": 9_000, "generated_tokens": 1_200, "loss": 0.1234,
        "grad_norm": 0.87, "learning_rate": 1e-3, "reward_mean": 0.42, "success_rate": 0.37,
        "policy_version_min": max(0, version - 2), "policy_version_max": version, **stats,
        "batch_ids": batch_ids, "dropped_stale_rows": 0, "staleness_histogram": {"0": 40, "1": 20, "2": 4},
        "version_trained_from": version, "finished_at": started + 2.5, "tokens_per_s": 3_600.0, "version": version,
    }  # fmt: skip


def advance(checkpoints: CheckpointStore, state: LearnerState, until: int, per_step: int, stats: dict[str, Any],
            history: list[dict[str, Any]]) -> None:
    """What ``Learner.step`` does to the state and the step log, up to step ``until`` (no training)."""
    when = datetime(2026, 1, 1, tzinfo=UTC)
    while state.step < until:
        state.step += 1
        state.version += 1
        stamp = (when + timedelta(seconds=10 * state.step)).strftime("%Y%m%dT%H%M%S")
        ids = [f"producer-{k}-b{stamp}-{uuid.uuid4().hex[:8]}" for k in range(per_step)]
        state.trained.update({batch_id: state.step for batch_id in ids})
        state.positions["rlpipe.trajectories:0"] = state.step * per_step
        entry = step_entry(state.step, ids, state.version, stats)
        checkpoints.record_step(entry)
        history.append(entry)


def save_old_layout(store: ObjectStore, run_id: str, state: LearnerState, history: list[dict[str, Any]],
                    adapter: dict[str, torch.Tensor], optimizer: dict[str, torch.Tensor],
                    scalars: dict[str, Any]) -> str:
    """A checkpoint as written before the step log: everything inline in state.json."""
    rng_tensors, rng_states = capture_rng()
    key = f"runs/{run_id}/old/step-{state.step:06d}-{uuid.uuid4().hex[:8]}"
    inline = {**state.to_json(), "trained": state.trained, "step_log": history}
    files = {
        "adapter.safetensors": save_tensors(adapter),
        "optimizer.safetensors": save_tensors({**optimizer, **rng_tensors}),
        "state.json": json.dumps({"state": inline, "scalars": scalars, "rng": rng_states}, sort_keys=True).encode(),
    }
    digests = {name: store.put_create(f"{key}/{name}", data) for name, data in files.items()}
    store.put_create(f"{key}/manifest.json", json.dumps({"step": state.step, "files": digests}).encode())
    return key


def folder_bytes(store: ObjectStore, key: str) -> int:
    return sum(len(store.get(k)) for k in store.list(key, recursive=True))


def timed(action: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """Median seconds over ``repeats`` calls after one untimed warm-up call, and the last call's result."""
    durations, result = [], action()
    for _ in range(repeats):
        started = time.perf_counter()
        result = action()
        durations.append(time.perf_counter() - started)
    return statistics.median(durations), result


def measure(args: argparse.Namespace, model_dir: str | None = None) -> list[dict[str, Any]]:
    """The figures at ``args.early`` and ``args.late``, in a temporary folder removed afterwards; the policy is
    the tiny model's (built there, untrained) unless ``model_dir`` is given."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-ckpt-bench-") as tmp:
        folder = Path(tmp)
        model = model_dir or str(build_tiny_model(folder / "tiny", pretrain=False))
        return measure_in(args, model, ObjectStore((folder / "store").as_uri()))


def measure_in(args: argparse.Namespace, model_dir: str, store: ObjectStore) -> list[dict[str, Any]]:
    """A synthetic run in ``store`` up to each step, its checkpoint saved and loaded there: one row per step."""
    policy, stats = trained_policy(model_dir)
    adapter = policy.adapter_tensors()
    optimizer, scalars = policy.optimizer_state()
    checkpoints, state, history = CheckpointStore(store, "bench", keep=3), LearnerState(), []
    rows = []
    for step in (args.early, args.late):
        started, before = time.perf_counter(), state.step
        advance(checkpoints, state, step, args.batches_per_step, stats, history)
        record_s = (time.perf_counter() - started) / max(1, state.step - before)
        save_s, key = timed(lambda: checkpoints.save(state, adapter, optimizer, scalars), args.repeats)
        load_s, loaded = timed(checkpoints.latest, args.repeats)
        assert loaded.state.trained == state.trained
        old_s, old_key = timed(lambda: save_old_layout(store, "bench", state, history, adapter, optimizer, scalars),
                               args.repeats)
        rows.append({"step": step, "bytes": folder_bytes(store, key), "save_s": save_s, "load_s": load_s,
                     "record_step_s": record_s, "old_bytes": folder_bytes(store, old_key), "old_save_s": old_s})
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--early", type=positive_int, default=10, help="the early step")
    parser.add_argument("--late", type=positive_int, default=1000, help="the late step")
    parser.add_argument("--batches-per-step", type=positive_int, default=2, help="trajectory batches trained per step")
    parser.add_argument("--repeats", type=positive_int, default=5, help="saves (and loads) timed at each step; median")
    args = parser.parse_args(argv)
    if args.early >= args.late:
        parser.error(f"--early {args.early} must come before --late {args.late}")
    return args


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    with LoadAverage() as load:
        early, late = measure(args)
    print(f"checkpoint of the tiny model's LoRA (rank 8, AdamW state), {args.batches_per_step} batches per step, "
          f"file:// store, median of {args.repeats}")
    print(f"| | step {early['step']:,} | step {late['step']:,} | ratio |")
    print("| --- | ---: | ---: | ---: |")
    for label, name, unit in (("checkpoint bytes", "bytes", ""), ("save s", "save_s", "s"),
                              ("old layout: bytes", "old_bytes", ""), ("old layout: save s", "old_save_s", "s"),
                              ("load newest s (reads the step log)", "load_s", "s")):
        a, b = early[name], late[name]
        cells = (f"{a:,}", f"{b:,}") if not unit else (f"{a:.4f}", f"{b:.4f}")
        print(f"| {label} | {cells[0]} | {cells[1]} | {b / a:.2f}x |")
    print(f"writing one step-log object per step: {late['record_step_s'] * 1e3:.2f} ms (mean over steps "
          f"{early['step'] + 1}..{late['step']}, including the bookkeeping)")
    print(load)


if __name__ == "__main__":
    main()
