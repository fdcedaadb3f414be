"""Evaluate a policy (the base model or an adapter version) on held-out seeds.

Uses the very rollout worker the producers run (same prompts, same token
handling, same batched generation), with one episode per seed, seeds starting
at ``env.eval_seed_offset`` so they never overlap training seeds (and, where seeds index a finite set, on
the environment's held-out part of it: ``TextEnv.held_out_overrides``), and a sink
that keeps the rows in memory instead of writing a batch.  Results are stored as
``runs/<run>/eval/<name>.json`` for ``rlpipe report``.  Every held-out seed must have
played its episode (a result's episode i is seed ``seed_start + i``): an evaluation
whose worker dropped a group (its prompt did not fit the context, a value not finite)
is refused rather than stored with its later returns under the wrong seeds.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore, read_json_records
from producers.envs.registry import held_out_env, held_out_spec
from producers.rollout import FixedAdapter, RolloutWorker
from producers.samplers import sampler_for_run
from producers.samplers.base import AdapterHandle, Sampler
from schemas.config import RunConfig
from schemas.evaluation import (
    EvalResult,
    ValidationPlayed,
    eval_key,
    eval_to_bytes,
    validation_from_bytes,
    validation_key,
    validation_prefix,
    validation_to_bytes,
)
from schemas.versions import NewerSchemaError

log = logging.getLogger("rlpipe.eval")

# Held-out episodes played at once (one batched generate call per turn for all of them).  On vLLM
# on the CPU a turn's cost grows with the batch, so 32 at once is barely faster than 8
# (bench/eval_in_flight.py: x1.04 on a demo run's last version); on a GPU a larger batch is close
# to free.  `rlpipe eval --in-flight` lowers it where the model's memory is short.
IN_FLIGHT = 32


class _MemorySink:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def commit(self, rows: list[dict[str, Any]], batch_id: str) -> None:
        self.rows.extend(rows)


def episode_results(rows: list[dict[str, Any]]) -> list[tuple[int, float, bool]]:
    """(seed, return, success) per episode, in seed order (per-turn rows count once)."""
    episodes: dict[str, tuple[int, float, bool]] = {}
    for row in rows:
        episodes.setdefault(row["episode_id"], (row["env_seed"], float(row["reward"]), bool(row["success"])))
    return sorted(episodes.values())


def check_every_seed_played(seeds: list[int], seed_start: int, episodes: int) -> None:
    """Refuse an evaluation that lacks an episode of some held-out seed: a result's episode i is seed
    ``seed_start + i``, so the returns after a gap would be stored under the wrong seeds (and a paired comparison
    with another policy would pair different episodes).  The worker drops a group whose first prompt did not fit
    the context or that holds a value that is not finite (the log names each)."""
    missing = sorted(set(range(seed_start, seed_start + episodes)) - set(seeds))
    if missing:
        shown = ", ".join(map(str, missing[:5])) + (", ..." if len(missing) > 5 else "")
        raise ValueError(f"only {episodes - len(missing)} of {episodes} held-out episodes were played: no episode of "
                         f"seed {shown} (its first prompt did not fit sampler.max_model_len, or a value was not "
                         "finite: the log above names each); fix that and evaluate again")


def pull_handle(registry: AdapterRegistry, version: int, cache: Path) -> AdapterHandle | None:
    """The adapter of ``version`` as a sampler handle (None for version 0, the base model)."""
    if version == 0:
        return None
    folder = registry.pull(version, cache)
    return AdapterHandle(version=version, lora_int_id=version, name=f"eval-v{version}", path=str(folder),
                         sha256=registry.adapter_sha256(version))


def evaluate_version(
    config: RunConfig,
    store: ObjectStore,
    model_path: str,
    version: int,
    episodes: int,
    sampler: Sampler | None = None,
    temperature: float | None = None,
    in_flight: int = IN_FLIGHT,
) -> EvalResult:
    """Play ``episodes`` held-out episodes with adapter ``version`` (0 = base model), ``in_flight`` at once."""
    import uuid

    from pipeline.devstack.stack import rlpipe_home

    registry = AdapterRegistry(store, config.run_id)
    cache = rlpipe_home() / "adapter-cache" / f"eval-{uuid.uuid4().hex[:8]}"  # this call's own: removed at the end
    try:
        return _evaluate_pulled(config, model_path, version, episodes, sampler, temperature,
                                pull_handle(registry, version, cache), in_flight)
    finally:
        shutil.rmtree(cache, ignore_errors=True)


def _evaluate_pulled(
    config: RunConfig,
    model_path: str,
    version: int,
    episodes: int,
    sampler: Sampler | None,
    temperature: float | None,
    handle: AdapterHandle | None,
    in_flight: int = IN_FLIGHT,
) -> EvalResult:
    from transformers import AutoTokenizer

    own_sampler = sampler is None
    sampler = sampler or sampler_for_run(config, model_path)
    if handle is not None:
        sampler.load_adapter(handle)
    sampling = config.sampler if temperature is None else config.sampler.model_copy(update={"temperature": temperature})
    producer = config.producer.model_copy(update={
        "group_size": 1, "max_groups": episodes, "groups_per_batch": episodes,
        "concurrent_groups": max(1, min(episodes, in_flight)),
        "seed_start": config.env.eval_seed_offset, "max_staleness": 1000, "producer_id": "eval",
    })
    sink = _MemorySink()
    worker = RolloutWorker(
        run_id=config.run_id, producer_id="eval", env_name=config.env.name,
        make_env=lambda: held_out_env(config.env),
        tokenizer=AutoTokenizer.from_pretrained(model_path), sampler=sampler, adapters=FixedAdapter(handle), sink=sink,
        producer=producer, sampling=sampling, incarnation=0,  # the same draws every time: a score reproduces
    )
    try:
        worker.run()
    finally:
        if own_sampler:
            sampler.close()
        elif handle is not None:  # its folder is removed next; the same version evaluated again pulls a new one
            sampler.unload_adapter(handle)
    results = episode_results(sink.rows)
    check_every_seed_played([seed for seed, _, _ in results], config.env.eval_seed_offset, episodes)
    return EvalResult.from_episodes(
        run_id=config.run_id, env=config.env.name, version=version, seed_start=config.env.eval_seed_offset,
        returns=[r for _, r, _ in results], successes=[s for _, _, s in results],
        policy="base" if version == 0 else "adapter",
    )


def save_result(store: ObjectStore, result: EvalResult) -> str:
    """Store ``result`` under ``runs/<run>/eval/`` (create-only: nothing is overwritten)."""
    key = eval_key(result)
    store.put_create_once(key, eval_to_bytes(result))  # once: a retried create (gs://) of our own result
    return key


def save_validation(store: ObjectStore, played: ValidationPlayed) -> str:
    """Record the seeds a validation played under ``runs/<run>/validation/`` (create-only; the same range again
    is the same bytes, so a repeated validation writes nothing new)."""
    key = validation_key(played)
    store.put_create_once(key, validation_to_bytes(played))
    return key


def read_validations(store: ObjectStore,
                     run_id: str) -> tuple[list[ValidationPlayed], list[ValueError | FileNotFoundError]]:
    """Every readable record of seeds a validation of the run played, and why each other one could not be read
    (``read_json_records``: each error names its key)."""
    return read_json_records(store, validation_prefix(run_id), lambda data, key: validation_from_bytes(data, where=key))


def validated_ranges(played: list[ValidationPlayed], env: str, first_seed: int, episodes: int) -> list[tuple[int, int]]:
    """The seeds of ``env`` among ``first_seed .. first_seed + episodes - 1`` (a held-out evaluation's) that
    validations played, as ``held_out_ranges`` gives them: reporting on those would report on what was chosen on."""
    end = first_seed + episodes
    return [(low, min(high, end - 1)) for low, high in held_out_ranges(played, env, first_seed) if low < end]


def validated_overlap(store: ObjectStore, run_id: str, env: str, first_seed: int,
                      episodes: int) -> tuple[list[tuple[int, int]], int]:
    """The seeds of ``env`` among ``first_seed .. first_seed + episodes - 1`` that validations of the run played
    (``validated_ranges``), and one past the last seed of ``env`` any of them played (``first_seed`` if none).

    A record that cannot be read is refused (``ValueError``): the seeds it played are unknown, so held-out
    episodes might report on them.  One a newer rlpipe wrote is not damaged (deleting it would lose which seeds
    runs were chosen on): the refusal says to upgrade, not to delete it."""
    played, unreadable = read_validations(store, run_id)
    if unreadable:
        raise ValueError(unreadable_refusal(unreadable[0], "the seeds that validation played",
                                            "held-out episodes might report on them",
                                            f"{store.root} (validate again to record them)"))
    past = max((p.seed_start + p.episodes for p in played if p.env == env), default=first_seed)
    return validated_ranges(played, env, first_seed, episodes), past


def unreadable_refusal(error: ValueError | FileNotFoundError, played: str, risk: str, delete_from: str) -> str:
    """The line refusing to go on while a stored record whose seeds matter cannot be read (``error``, naming its
    key): ``played`` names those seeds and ``risk`` what playing on without them might do.  The fix follows from
    the error: a record a newer rlpipe wrote is not damaged, so upgrade to read it (its line ends "upgrade
    rlpipe"; deleting it would lose the seeds); any other is to be deleted from ``delete_from``."""
    if isinstance(error, NewerSchemaError):
        return f"{error} to read {played} ({risk})"
    return f"{error}: {played} are unknown, so {risk}; delete it from {delete_from}"


def validated_refusal(run_id: str, unit: str, overlap: list[tuple[int, int]], fixes: list[str]) -> str:
    """The one line refusing held-out ``unit`` (seeds, days) in ``overlap`` that a validation played, with ``fixes``
    (each a way to keep off them) joined by ``or``."""
    ranges = " and ".join(f"{low}-{high}" for low, high in overlap)
    return (f"run {run_id!r} was validated on held-out {unit} {ranges} (rlpipe eval --validation), so these episodes "
            f"would report on what runs were chosen on; {', or '.join(fixes)}")


def held_out_ranges(results: Sequence[EvalResult | ValidationPlayed], env: str,
                    first_seed: int) -> list[tuple[int, int]]:
    """The seeds of ``env`` from ``first_seed`` on that stored results (or validations) played, as (first, last)
    ranges, ascending, overlapping and adjacent ones merged: a result that starts before ``first_seed`` counts from
    it, and the gaps between results (one stored with a raised ``env.eval_seed_offset``) stay gaps."""
    spans = sorted((max(r.seed_start, first_seed), r.seed_start + r.episodes - 1)
                   for r in results if r.env == env and r.seed_start + r.episodes > first_seed)
    merged: list[tuple[int, int]] = []
    for low, high in spans:
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], high))
        else:
            merged.append((low, high))
    return merged


def held_out_played(results: list[EvalResult], env: str, first_seed: int) -> int:
    """How far into the held-out seeds of ``env`` (from ``first_seed`` on) stored results reach: one past the last
    seed any of them played, counted from ``first_seed`` (0: none).  ``rlpipe eval --validation`` plays after it,
    so no validation episode repeats a seed a stored held-out result played."""
    ranges = held_out_ranges(results, env, first_seed)
    return ranges[-1][1] + 1 - first_seed if ranges else 0


def validation_reach(results: list[EvalResult], env: str, first_seed: int, episodes: int) -> int:
    """How many seeds of ``env`` from ``first_seed`` on a default ``rlpipe eval --validation`` of ``episodes`` leaves
    alone: past every seed a stored result played, and past the first ``episodes`` seeds from where each held-out
    evaluation starts, ``first_seed`` and every stored result's ``seed_start`` (the ``env.eval_seed_offset`` it was
    made with), since a later ``rlpipe eval --episodes N`` from there plays those.  Counting ``episodes`` from
    ``first_seed`` alone would put a validation right after a result stored with a raised offset, on seeds a
    held-out evaluation of ``episodes`` with that offset plays."""
    starts = [first_seed] + [r.seed_start for r in results if r.env == env]
    return max(max(starts) + episodes - first_seed, held_out_played(results, env, first_seed))


def baseline_result(config: RunConfig, policy: str, episodes: int) -> EvalResult:
    """The scripted heuristic or random policy on the same held-out seeds (for comparison)."""
    from producers.envs.evaluate import evaluate

    summary = evaluate(config.env.name, policy, episodes, seed_start=config.env.eval_seed_offset,
                       overrides=held_out_spec(config.env).overrides)
    return EvalResult.from_episodes(
        run_id=config.run_id, env=config.env.name, version=0, seed_start=config.env.eval_seed_offset,
        returns=[r.episode_return for r in summary.results], successes=[r.success for r in summary.results],
        policy=policy,
    )
