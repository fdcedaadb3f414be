"""Evaluation of offline-trained adapters in the online environment: held-out simulated days
played by the adapter, the base model, the logged (behaviour) controller, the heuristic
and the random policy, each stored as an ``EvalResult`` under ``runs/<run>/eval/``.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.io.datasets import DatasetCard
from pipeline.io.store import ObjectStore
from producers.envs.building import BuildingConfig, BuildingHVAC, parse_setpoint_values, to_kelvin
from producers.envs.parsing import format_answer, parse_answer
from producers.offline.episodes import DatasetImportError
from producers.offline.generation import GenerationSpec, day_env, day_policy, policy_answer


@dataclass
class DayOutcome:
    """One evaluated day: the return and what it was made of (sums over the day's steps)."""

    day: int
    episode_return: float = 0.0
    steps: int = 0
    invalid: int = 0
    comfort: float = 0.0  # normalised comfort regret (reward weight 0.2 by default)
    energy: float = 0.0  # normalised energy cost (weight 0.4)
    carbon: float = 0.0  # normalised carbon (weight 0.4)
    energy_usd: float = 0.0
    carbon_kg: float = 0.0
    productivity_usd: float = 0.0

    def add(self, env: BuildingHVAC, reward: float, valid: bool) -> None:
        """Count one step (``reward`` already includes any format penalty)."""
        b = env.breakdown
        self.episode_return += reward
        self.steps += 1
        self.invalid += not valid
        self.comfort += b.comfort
        self.energy += b.energy_cost
        self.carbon += b.carbon
        self.energy_usd += b.electricity_cost_usd + b.gas_cost_usd
        self.carbon_kg += b.carbon_kg
        self.productivity_usd += b.productivity_usd


def hold_answer(env: BuildingHVAC) -> str:
    """An answer that keeps the setpoints in force."""
    return format_answer([f"{env.setpoints.water_k:.6f}K, {env.setpoints.air_k:.6f}K"])


def applicable_answer(env: BuildingHVAC, text: str) -> tuple[str, bool]:
    """``(text, True)`` when the environment would accept ``text``, else ``(hold_answer, False)``.

    Every policy runs the same simulated day; an invalid answer keeps the previous setpoints
    for that step and still pays the penalty, as the environment itself does online.
    """
    parsed = parse_answer(text, max_actions=env.config.max_actions_per_turn)
    ok = parsed.ok and all(_is_setpoint_pair(env.config, action) for action in parsed.actions)
    return (text, True) if ok else (hold_answer(env), False)


def _is_setpoint_pair(cfg: BuildingConfig, action: str) -> bool:
    """Whether the environment's parser accepts ``action`` (two setpoints, each a value it can place)."""
    values = parse_setpoint_values(action)
    return (values is not None and to_kelvin(values[0], cfg.supply_water_range_k) is not None
            and to_kelvin(values[1], cfg.supply_air_heating_range_k) is not None)


DayDone = Callable[[DayOutcome], None]  # told of each day as it ends (progress)


def scripted_outcomes(
    policy_of_day: Callable[[int], str], days: Sequence[int], seed: int, overrides: Mapping[str, Any] | None = None,
    on_day: DayDone | None = None,
) -> list[DayOutcome]:
    """Days played by scripted controllers (``heuristic`` or ``random`` per day)."""
    outcomes = []
    for day in days:
        env = day_env(day, overrides)
        env.reset(day)
        rng = random.Random(f"rlpipe-eval:{seed}:{day}")
        policy = policy_of_day(day)
        outcome = DayOutcome(day)
        while not env.done:
            result = env.step(policy_answer(env, policy, rng))
            outcome.add(env, result.reward, bool(result.info["action_is_valid"]))
        outcomes.append(outcome)
        if on_day is not None:
            on_day(outcome)
    return outcomes


def controller_outcomes(
    controller: Callable[[BuildingHVAC], str], days: Sequence[int], overrides: Mapping[str, Any] | None = None
) -> list[DayOutcome]:
    """Days played by a controller given as a function of the environment (its answer each step);
    an answer the environment would refuse keeps the setpoints and pays the format penalty."""
    outcomes = []
    for day in days:
        env = day_env(day, overrides)
        env.reset(day)
        outcome = DayOutcome(day)
        while not env.done:
            answer, valid = applicable_answer(env, controller(env))
            result = env.step(answer)
            outcome.add(env, result.reward + (0.0 if valid else env.config.format_penalty), valid)
        outcomes.append(outcome)
    return outcomes


def numeric_controller(
    setpoints: Callable[[np.ndarray, float], tuple[float, float]], observation_columns: Sequence[str]
) -> Callable[[BuildingHVAC], str]:
    """A controller from a numeric policy: (observation vector as the dataset logs it, UTC epoch second)
    -> (supply water K, supply air K).  The vector is the telemetry row's ``observation_columns``."""
    columns = list(observation_columns)

    def answer(env: BuildingHVAC) -> str:
        row = env.telemetry()
        water, air = setpoints(np.array([row[c] for c in columns], dtype=np.float64), env.current_timestamp)
        return format_answer([f"{water:.3f}K, {air:.3f}K"])

    return answer


@dataclass(frozen=True)
class SamplingSettings:
    """How the language-model policy samples during evaluation."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    seed: int = 0


def model_outcomes(
    sampler: Any,
    tokenizer: Any,
    adapter: Any,
    days: Sequence[int],
    overrides: Mapping[str, Any] | None = None,
    sampling: SamplingSettings | None = None,
    on_day: DayDone | None = None,
) -> list[DayOutcome]:
    """Days played by the language model (``adapter`` None: the base model), all days in lockstep
    so each turn is one batched generation; prompts are built by the producer's own ``Episode``."""
    from producers.episode import ChatFormat, Episode
    from producers.samplers.base import SampleRequest
    from schemas.trajectory import NO_ADAPTER_SHA

    sampling = sampling or SamplingSettings()
    chat = ChatFormat.from_tokenizer(tokenizer)
    episodes, outcomes = [], []
    for day in days:
        env = day_env(day, overrides)
        episode = Episode(
            env=env, tokenizer=tokenizer, chat=chat, seed=day, episode_id=f"eval-{day}", group_id=f"eval-{day}",
            policy_version=getattr(adapter, "version", 0), adapter_sha256=getattr(adapter, "sha256", NO_ADAPTER_SHA),
            per_turn=True, history_turns=env.config.history_turns, max_model_len=sampler.max_model_len,
        )
        episode.start()
        episodes.append(episode)
        outcomes.append(DayOutcome(day))
    turn = 0
    while live := [i for i, episode in enumerate(episodes) if not episode.done]:
        prompts = [episodes[i].next_prompt() for i in live]
        requests = [SampleRequest(p, sampling.max_new_tokens, chat.turn_stop_ids) for p in prompts]
        outputs = sampler.generate(requests, adapter, sampling.temperature, sampling.top_p,
                                   seed=sampling.seed * 1_000_003 + turn)
        for i, prompt, output in zip(live, prompts, outputs, strict=True):
            episode, env = episodes[i], episodes[i].env
            text = episode.record_generation(prompt, output.token_ids, output.logprobs)
            answer, valid = applicable_answer(env, text)
            result = env.step(answer)
            episode.apply_step(result)
            outcomes[i].add(env, result.reward + (0.0 if valid else env.config.format_penalty), valid)
            if episode.done and on_day is not None:
                on_day(outcomes[i])
        turn += 1
    return outcomes


def outcome_breakdown(outcomes: Sequence[DayOutcome]) -> dict[str, float]:
    """Per-day means of the reward's parts and their physical amounts, and the invalid-answer rate."""
    n = len(outcomes)
    steps = sum(o.steps for o in outcomes)
    mean = {key: sum(getattr(o, key) for o in outcomes) / n
            for key in ("comfort", "energy", "carbon", "energy_usd", "carbon_kg", "productivity_usd")}
    return {**mean, "invalid_rate": sum(o.invalid for o in outcomes) / max(steps, 1),
            "mean_step_reward": sum(o.episode_return for o in outcomes) / max(steps, 1)}


def eval_result(run_id: str, policy: str, version: int, outcomes: Sequence[DayOutcome]) -> Any:
    """The ``EvalResult`` of some evaluated days (seed = day index; ``seed_start`` the first day)."""
    from schemas.evaluation import EvalResult

    ordered = sorted(outcomes, key=lambda o: o.day)
    days = [o.day for o in ordered]
    if days != list(range(days[0], days[0] + len(days))):
        raise ValueError("evaluated days must be consecutive (episode i used seed_start + i)")
    return EvalResult.from_episodes(
        run_id=run_id, env=BuildingHVAC.name, version=version, seed_start=days[0],
        returns=[o.episode_return for o in ordered], successes=[False] * len(ordered), policy=policy,
        breakdown=outcome_breakdown(ordered),
    )


def store_eval_result(store: ObjectStore, result: Any) -> str:
    """Write one result create-only under ``runs/<run>/eval/``; return its key."""
    from schemas.evaluation import eval_key, eval_to_bytes

    key = eval_key(result)
    store.put_create_once(key, eval_to_bytes(result))  # once: a retried create (gs://) of our own result
    return key


def behaviour_spec(card: DatasetCard) -> GenerationSpec:
    """The logged (behaviour) controller of a generated dataset; refused for data the simulator did not log."""
    generation = card.extras.get("generation")
    if not generation:
        raise DatasetImportError(f"dataset {card.name} was not generated by the simulator: its controller is unknown")
    return GenerationSpec.model_validate(generation)


def held_out_days(card: DatasetCard, count: int, first_day: int | None = None) -> list[int]:
    """``count`` consecutive day indices after the dataset's own (or from ``first_day``)."""
    if first_day is None:
        generation = card.extras.get("generation") or {}
        first_day = int(generation.get("first_day", 0)) + int(generation.get("days", 0))
        first_day = first_day or 1_000_000
    return list(range(first_day, first_day + count))


EVAL_POLICIES = ("adapter", "base", "behaviour", "heuristic", "random")


def evaluate_building(
    store: ObjectStore,
    run_id: str,
    policies: Sequence[str],
    days: Sequence[int],
    *,
    card: DatasetCard | None = None,
    model_path: str | None = None,
    version: int | None = None,
    sampling: SamplingSettings | None = None,
    history_turns: int | None = None,
    env_overrides: Mapping[str, Any] | None = None,
    cache_dir: str | Path | None = None,
    store_results: bool = True,
    progress: Callable[[str], None] | None = None,
) -> list[Any]:
    """Play ``days`` with each policy and store one ``EvalResult`` each under ``runs/<run_id>/eval/``.

    ``adapter``: the run's adapter ``version`` (default: latest) on ``model_path``;
    ``base``: the model without adapter; ``behaviour``: the controller that logged ``card``;
    ``heuristic`` / ``random``: the environment's own.  The environment settings are the
    dataset's (so the model sees the prompts it was trained on), then ``env_overrides`` and
    ``history_turns``.  What a policy needs (the model, the adapter version, the dataset and, for
    ``behaviour``, the controller that logged it) is checked before any day is played, and so, when results are
    stored, that no validation of the run played those days (``refuse_validated_days``); ``progress`` is told of
    each day played.
    """
    unknown = [p for p in policies if p not in EVAL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {', '.join(EVAL_POLICIES)}")
    needs_model = [p for p in policies if p in ("adapter", "base")]
    if needs_model and model_path is None:
        raise ValueError(f"policy {needs_model[0]!r} needs a model (--model PATH or tiny)")
    if "behaviour" in policies and card is None:
        raise ValueError("the behaviour policy needs the dataset (--dataset) whose controller it replays")
    behaviour = behaviour_spec(card) if "behaviour" in policies else None  # refuses a log it cannot replay
    adapter = _adapter_handle(store, run_id, version, cache_dir) if "adapter" in policies else None
    if store_results and days:
        refuse_validated_days(store, run_id, days)
    overrides = dict(card.extras.get("env_overrides") or {}) if card is not None else {}
    overrides |= dict(env_overrides or {})
    if history_turns is not None:
        overrides["history_turns"] = history_turns
    sampling = sampling or SamplingSettings()
    results = []
    for policy in policies:
        on_day = _day_reporter(progress, policy, len(days)) if progress is not None else None
        outcomes, policy_version = _policy_outcomes(policy, days, behaviour, model_path, adapter, sampling,
                                                    overrides, on_day)
        result = eval_result(run_id, policy, policy_version, outcomes)
        if store_results:
            store_eval_result(store, result)
        results.append(result)
    return results


def refuse_validated_days(store: ObjectStore, run_id: str, days: Sequence[int]) -> None:
    """Refuse held-out results of ``days`` (consecutive) for the run's report when a validation of the run
    (``rlpipe eval --validation``, recorded under ``runs/RUN/validation/``) played some of them: runs were chosen on
    those, so reporting on them would report on the choice (as ``rlpipe eval`` refuses)."""
    from producers.evaluation import validated_overlap, validated_refusal

    overlap, past = validated_overlap(store, run_id, BuildingHVAC.name, days[0], len(days))
    if not overlap:
        return
    fixes = [f"--days {overlap[0][0] - days[0]} or fewer stays before them"] if overlap[0][0] > days[0] else []
    fixes.append(f"--first-day {past} plays after every validated day")
    raise ValueError(validated_refusal(run_id, "days", overlap, fixes))


def _day_reporter(progress: Callable[[str], None], policy: str, total: int) -> DayDone:
    played = 0

    def report(outcome: DayOutcome) -> None:
        nonlocal played
        played += 1
        progress(f"{policy}: day {played} of {total} played (day {outcome.day}, return {outcome.episode_return:.3f})")

    return report


def _policy_outcomes(
    policy: str, days: Sequence[int], behaviour: GenerationSpec | None, model_path: str | None, adapter: Any,
    sampling: SamplingSettings, overrides: dict[str, Any], on_day: DayDone | None,
) -> tuple[list[DayOutcome], int]:
    if policy in ("heuristic", "random"):
        return scripted_outcomes(lambda day: policy, days, sampling.seed, overrides, on_day), 0
    if policy == "behaviour":
        assert behaviour is not None  # checked by evaluate_building
        return scripted_outcomes(lambda day: day_policy(behaviour, day), days, sampling.seed, overrides, on_day), 0
    from producers.samplers import make_sampler
    from schemas.config import SamplerConfig

    assert model_path is not None  # checked by evaluate_building
    adapter = adapter if policy == "adapter" else None
    tokenizer = model_tokenizer(model_path)
    config = SamplerConfig(backend="transformers", temperature=sampling.temperature, top_p=sampling.top_p,
                           max_new_tokens=sampling.max_new_tokens, seed=sampling.seed)
    with make_sampler("transformers", model_path, config, max_batch=max(1, min(len(days), 32))) as sampler:
        outcomes = model_outcomes(sampler, tokenizer, adapter, days, overrides, sampling, on_day)
        return outcomes, getattr(adapter, "version", 0)


def model_tokenizer(model_path: str) -> Any:
    """The tokenizer of the model folder ``model_path``; a ``ValueError`` naming the fix when it has none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except (OSError, ValueError, KeyError):  # no tokenizer files, an unknown model type (messages run to pages)
        raise ValueError(f"cannot load a tokenizer from {model_path}; pass a model folder with its tokenizer files "
                         "(tokenizer.json, tokenizer_config.json), or 'tiny'") from None


def adapter_version(store: ObjectStore, run_id: str, version: int | None) -> int:
    """``version`` (None: the latest) when the run has it, else a ``ValueError`` naming the fix; asked before the
    base model is loaded (or the tiny one built), which takes far longer than this listing."""
    from pipeline.io.registry import AdapterRegistry

    versions = AdapterRegistry(store, run_id).versions()
    if not versions:
        raise ValueError(f"run {run_id!r} has no adapter versions; train it first (`rlpipe replay --train`)")
    if version is None:
        return versions[-1]
    if version not in versions:
        raise ValueError(f"run {run_id!r} has no adapter version {version}; its versions: {_version_list(versions)} "
                         "(leave out --version for the latest)")
    return version


def _adapter_handle(store: ObjectStore, run_id: str, version: int | None, cache_dir: str | Path | None) -> Any:
    """The run's adapter ``version`` (None: the latest) pulled, digest-checked, into a local folder."""
    from pipeline.devstack.stack import rlpipe_home
    from pipeline.io.registry import AdapterRegistry
    from producers.samplers.base import AdapterHandle

    registry = AdapterRegistry(store, run_id)
    version = adapter_version(store, run_id, version)
    folder = registry.pull(version, Path(cache_dir) if cache_dir else rlpipe_home() / "cache" / "adapters")
    return AdapterHandle.for_version(version, str(folder), registry.adapter_sha256(version))


def _version_list(versions: Sequence[int], most: int = 12) -> str:
    """``1, 2, 3``; a long run's as its first and last few (``1, 2, 3 ... 98, 99, 100``)."""
    if len(versions) <= most:
        return ", ".join(map(str, versions))
    return f"{', '.join(map(str, versions[:3]))} ... {', '.join(map(str, versions[-3:]))}"
