"""Logged building steps -> the online prompt, and token trajectories for ``rlpipe replay --train``.

Why next to the environments: a logged building step must become exactly the prompt the
online ``building-hvac`` environment shows for that state, so the renderer is the
environment itself (``BuildingHVAC.load_state_from_telemetry``), and the answer is
written in the format the environment parses.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import math
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from pipeline.io.datasets import DatasetCard, iter_partitions, read_card
from pipeline.io.store import ObjectStore
from pipeline.units import same_unit
from producers.envs.building import (
    COOL,
    HEAT,
    OFF,
    PASSIVE,
    BuildingConfig,
    BuildingHVAC,
    thermostat_modes,
    to_normalized,
)
from producers.envs.parsing import format_answer
from producers.offline.episodes import DatasetImportError
from producers.offline.generation import REWARD_UNITS, SIM_ACTIONS, SIM_REWARDS
from producers.offline.smart_buildings import ROLE_PREFIX
from schemas.names import validate_name
from schemas.trajectory import discounted_returns

# The previous step's reward line of the prompt comes from these dataset columns.
TELEMETRY_REWARD_COLUMNS = {telemetry: ROLE_PREFIX["reward"] + rid for rid, telemetry in SIM_REWARDS.items()}
WATER_ACTION, AIR_ACTION = (ROLE_PREFIX["action"] + name for name in SIM_ACTIONS)


def building_env_for(card: DatasetCard, overrides: Mapping[str, Any] | None = None) -> BuildingHVAC:
    """The building environment a dataset was logged with (its recorded settings, then ``overrides``)."""
    return BuildingHVAC(**(dict(card.extras.get("env_overrides") or {}) | dict(overrides or {})))


def required_building_columns(env: BuildingHVAC) -> list[str]:
    """Dataset columns the prompt of a logged state needs (the telemetry names, the actions, the rewards)."""
    names = [n for n, _ in BuildingHVAC.telemetry_fields(env.config) if not n.startswith(("reward@", "time@"))]
    return [*names, WATER_ACTION, AIR_ACTION, *TELEMETRY_REWARD_COLUMNS.values()]


def check_building_dataset(card: DatasetCard, env: BuildingHVAC) -> None:
    """Refuse, in one line, a dataset whose columns cannot be shown as building-hvac prompts."""
    present = {f.name for f in card.fields}
    missing = [c for c in required_building_columns(env) if c not in present]
    if missing:
        raise DatasetImportError(
            f"dataset {card.name} lacks {len(missing)} columns the building-hvac prompt needs (e.g. {missing[0]!r}); "
            "use a dataset from `rlpipe datasets generate building-hvac` or name its columns like the simulator's"
        )
    units = card.units()
    for column, unit in building_column_units(env).items():
        stated = units.get(column)
        if stated is not None and not same_unit(stated, unit):
            raise DatasetImportError(
                f"dataset {card.name} logs {column} in {stated}, the building-hvac prompt shows it in {unit}; "
                f"convert the column to {unit} and import it again"
            )


def building_column_units(env: BuildingHVAC) -> dict[str, str]:
    """The unit of each column ``required_building_columns`` names, as the simulator logs it."""
    known = dict(BuildingHVAC.telemetry_fields(env.config)) | {WATER_ACTION: "K", AIR_ACTION: "K"}
    known |= {column: REWARD_UNITS[rid] for rid, column in ((rid, ROLE_PREFIX["reward"] + rid) for rid in SIM_REWARDS)}
    return {column: known[column] for column in required_building_columns(env)}


@dataclass(frozen=True)
class RenderedStep:
    """One logged step as the model would have seen and answered it online."""

    observation: str
    answer: str
    reward: float
    timestamp: float  # UTC epoch seconds


def is_comfort_time(config: BuildingConfig, local: dt.datetime) -> bool:
    """Comfort hours (the thermostat's comfort band applies), as the environment decides them."""
    return local.weekday() < 5 and config.comfort_start_hour <= local.hour < config.comfort_end_hour


def _next_modes(
    env: BuildingHVAC, temp_Z: np.ndarray, modes_Z: np.ndarray, timestamp: float, comfort_before: bool | None
) -> tuple[np.ndarray, bool]:
    """The thermostat modes a step starting at ``timestamp`` uses (as ``BuildingHVAC`` sets them)."""
    comfort = is_comfort_time(env.config, env.local_time(timestamp))
    band = env.config.comfort_band_k if comfort else env.config.eco_band_k
    return thermostat_modes(temp_Z, modes_Z, band, comfort, comfort_before), comfort


def _evidence_modes(row: Mapping[str, float], zones: Sequence[str], replayed: np.ndarray | None) -> np.ndarray:
    """Modes the boxes show (valve open: heating; damper open: cooling); an idle box keeps a replayed
    night drift, which the boxes cannot show."""
    valve = np.array([row[f"{z}@reheat_valve_percentage_command"] for z in zones]) >= 50.0
    damper = np.array([row[f"{z}@supply_air_damper_percentage_command"] for z in zones]) >= 50.0
    idle = np.full(len(zones), OFF) if replayed is None else np.where(replayed == PASSIVE, PASSIVE, OFF)
    return np.where(valve, HEAT, np.where(damper, COOL, idle))


AnswerFormat = Literal["kelvin", "normalized"]
DEFAULT_ANSWER_DECIMALS: dict[str, int] = {"kelvin": 0, "normalized": 1}


def setpoint_answer(
    config: BuildingConfig, water_k: float, air_k: float, answer_format: AnswerFormat = "kelvin",
    decimals: int | None = None,
) -> str:
    """The answer text that sets ``water_k`` and ``air_k`` in the environment's own format.

    ``kelvin``: ``<answer>330K, 292K</answer>``.  ``normalized``: each setpoint as the value in
    [-1, 1] the environment's parser maps onto its range (``to_kelvin`` inverted: -1 = lowest),
    e.g. ``<answer>0.3, -0.9</answer>``.  Rounded to ``decimals`` (default 0 for kelvin, 1 for
    normalized), so the environment applies the setpoint within half a rounding step: 0.5 K,
    or ``0.025 x`` the range with one decimal (1.1 K of the water's 45 K, 0.4 K of the air's 15 K).
    Why normalized: every value has the same short shape (``[-]d.d``) with one digit (and the
    sign) that matters, where a kelvin value needs three digits right and a dropped digit
    (``33K``) is a different setpoint; a small model writes the short shape more reliably.
    """
    places = DEFAULT_ANSWER_DECIMALS[answer_format] if decimals is None else decimals
    if answer_format == "kelvin":
        return format_answer([f"{water_k:.{places}f}K, {air_k:.{places}f}K"])
    units = [min(max(to_normalized(kelvin, bounds), -1.0), 1.0) for kelvin, bounds in
             ((water_k, config.supply_water_range_k), (air_k, config.supply_air_heating_range_k))]
    # + 0.0 turns a rounded -0.0 into 0.0 (one spelling per value)
    return format_answer([", ".join(f"{round(u, places) + 0.0:.{places}f}" for u in units)])


def render_building_episode(
    env: BuildingHVAC, episode: pa.Table, answer_decimals: int | None = None, answer_format: AnswerFormat = "kelvin",
) -> list[RenderedStep]:
    """Each logged step of one episode as the online prompt text and the logged action as the answer.

    The thermostat modes are not logged; they are replayed with the environment's own
    rule along the episode (from the reset state when it starts at the episode's first
    step), and the boxes' damper and valve settings overrule the replay where they show
    heating or cooling.  The answer is the logged setpoints (``setpoint_answer``): in kelvin,
    whole by default (``<answer>330K, 292K</answer>``: short answers are easier to learn, and
    half a kelvin is below what the plant resolves), or normalised to [-1, 1] with one decimal.
    """
    cols = episode.to_pydict()
    obs_names = [n for n, _ in BuildingHVAC.telemetry_fields(env.config) if not n.startswith(("reward@", "time@"))]
    zones = env.zone_names
    steps: list[RenderedStep] = []
    modes: np.ndarray | None = None
    comfort_before: bool | None = None
    for i in range(episode.num_rows):
        row = {name: float(cols[name][i]) for name in obs_names}
        timestamp = cols["timestamp"][i].timestamp()
        row["time@timestamp"] = timestamp
        for telemetry, column in TELEMETRY_REWARD_COLUMNS.items():
            row[telemetry] = float(cols[column][i - 1]) if i > 0 else 0.0
        if i == 0:
            step_index = env.steps_since_start_hour(timestamp)
            modes = np.full(len(zones), OFF) if step_index == 0 else _evidence_modes(row, zones, None)
        else:
            previous = np.array([cols[f"{z}@zone_air_temperature_sensor"][i - 1] for z in zones], dtype=np.float64)
            replayed, comfort_before = _next_modes(env, previous, modes, timestamp - env.config.step_seconds,
                                                   comfort_before)
            modes = _evidence_modes(row, zones, replayed)
        observation = env.load_state_from_telemetry(row, modes=modes)
        water, air = cols[WATER_ACTION][i], cols[AIR_ACTION][i]
        answer = setpoint_answer(env.config, water, air, answer_format, answer_decimals)
        steps.append(RenderedStep(observation, answer, float(cols["reward"][i]), timestamp))
    return steps


class TrajectoryOptions(BaseModel):
    """How logged episodes become trajectory batches (one batch = one learner step when it holds
    at least ``learner.batch_rows`` rows)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    episodes_per_batch: int = Field(8, ge=1, le=100_000, description="episodes (days) whose turns share a batch")
    turns_per_batch: int = Field(24, ge=1, le=100_000, description="turns of each episode per batch, spread over it")
    epochs: int = Field(1, ge=1, le=1_000, description="passes over the data (each a new batch order)")
    discount: float = Field(1.0, ge=0.0, le=1.0, description="gamma of the return-to-go")
    history_turns: int | None = Field(None, ge=0, le=64, description="earlier turns in each prompt; None: the env's")
    max_episodes: int | None = Field(None, ge=1, description="use only the first N episodes (smoke tests)")
    seed: int = Field(0, ge=0, description="seeds the batch order")
    answer_format: AnswerFormat = Field("kelvin", description="answers in kelvin (330K) or normalised to [-1, 1]")
    answer_decimals: int | None = Field(None, ge=0, le=6,
                                        description="decimals of each answer value; None: 0 (kelvin), 1 (normalized)")
    with_text: bool = Field(False, description="also store each row's decoded text (larger files)")


@dataclass
class RenderedEpisode:
    """One logged episode, rendered: its steps and their discounted returns-to-go."""

    episode_id: str
    env_seed: int
    steps: list[RenderedStep]
    returns_to_go: np.ndarray
    terminated: bool


@dataclass(frozen=True)
class ConversionReport:
    """What ``dataset_to_trajectories`` wrote."""

    run_id: str
    dataset: str
    episodes: int
    batches: int
    rows: int
    tokens: int
    generated_tokens: int
    summary_key: str
    smallest_batch_rows: int  # learner.batch_rows at most this: each batch is one optimizer step on its own


def turn_messages(system: str, steps: Sequence[RenderedStep], turn: int, history_turns: int) -> list[dict[str, str]]:
    """The conversation the producer builds for ``turn`` (``producers.episode.Episode.next_prompt``):
    the system prompt, up to ``history_turns`` earlier (observation, answer) pairs, the observation."""
    messages = [{"role": "system", "content": system}]
    for past in steps[max(0, turn - history_turns):turn] if history_turns else []:
        messages += [{"role": "user", "content": past.observation}, {"role": "assistant", "content": past.answer}]
    messages.append({"role": "user", "content": steps[turn].observation})
    return messages


def plan_batches(
    turns_E: Sequence[int], episodes_per_batch: int, turns_per_batch: int, epochs: int, seed: int
) -> list[list[tuple[int, int]]]:
    """(episode, turn) pairs per batch: shuffled groups of episodes, each batch holding every
    k-th turn of each, so all the rows a return-to-go baseline compares (same turn, other
    episodes) train in the same step.  Each (episode, turn) appears once per epoch."""
    rng = np.random.default_rng(seed)
    plan: list[list[tuple[int, int]]] = []
    for _ in range(epochs):
        epoch: list[list[tuple[int, int]]] = []
        order = rng.permutation(len(turns_E))
        for lo in range(0, len(order), episodes_per_batch):
            chunk = [int(e) for e in order[lo:lo + episodes_per_batch]]
            stride = max(1, math.ceil(max(turns_E[e] for e in chunk) / turns_per_batch))
            for phase in range(stride):
                items = [(e, t) for e in chunk for t in range(phase, turns_E[e], stride)]
                if items:
                    epoch.append(items)
        plan += [epoch[i] for i in rng.permutation(len(epoch))]
    return plan


def load_rendered_episodes(
    store: ObjectStore, card: DatasetCard, env: BuildingHVAC, discount: float, max_episodes: int | None = None,
    answer_decimals: int | None = None,
    answer_format: AnswerFormat = "kelvin",
) -> list[RenderedEpisode]:
    """Every episode of the dataset rendered as online prompts (partition files digest-checked)."""
    days = {item["start"]: int(item["day"]) for item in card.extras.get("episodes", [])}
    episodes: list[RenderedEpisode] = []
    for _, table in iter_partitions(store, card, verify=True):
        firsts = np.flatnonzero(table["is_first"].to_numpy(zero_copy_only=False))
        for lo, hi in zip(firsts, [*firsts[1:], table.num_rows], strict=True):
            if max_episodes is not None and len(episodes) >= max_episodes:
                return episodes
            episode = table.slice(int(lo), int(hi - lo))
            steps = render_building_episode(env, episode, answer_decimals, answer_format)
            start = episode["timestamp"][0].as_py()
            episodes.append(RenderedEpisode(
                episode_id=f"{card.name}/{episode['episode_id'][0].as_py()}",
                env_seed=days.get(start.isoformat(), start.date().toordinal()),
                steps=steps, returns_to_go=np.asarray(discounted_returns([s.reward for s in steps], discount)),
                terminated=bool(episode["is_terminal"][-1].as_py()),
            ))
    return episodes


def time_of_day_group(prefix: str, local: dt.datetime) -> str:
    """The group of a logged step: kind of day and local time, e.g. ``hvac@workday@14:05``.

    Why: the learner's return-to-go baseline averages the rows of one (group, turn).
    Logged days share no environment seed, so the meaningful comparison is the same
    time on days of the same kind (occupied workdays, empty weekends): a step is good
    if what followed it beat what followed the same hour on similar days.
    """
    return f"{prefix}@{'workday' if local.weekday() < 5 else 'weekend'}@{local:%H:%M}"


def trajectory_table(
    items: Sequence[tuple[int, int]],
    episodes: Sequence[RenderedEpisode],
    tokenizer: Any,
    env: BuildingHVAC,
    ids: Mapping[str, str],
    created_at: dt.datetime,
    with_text: bool = False,
) -> pa.Table:
    """The trajectory rows of one batch: prompt tokens (mask 0) + answer tokens and end-of-turn (mask 1).

    ``ids``: run_id, batch_id, producer_id, group_prefix.  Logged data has no sampler:
    logprobs are 0, ``policy_version`` 0 and ``adapter_sha256`` the base model's.  The
    group is ``time_of_day_group``.  An answer ends as a demonstration's does
    (``ChatFormat.answer_end_id``): with the template's closing token, where sampling stops a turn.
    """
    from producers.episode import ChatFormat, prompt_ids
    from schemas.trajectory import NO_ADAPTER_SHA, TRAJECTORY_SCHEMA

    system, history = env.system_prompt(), env.config.history_turns
    answer_end = ChatFormat.from_tokenizer(tokenizer).answer_end_id(tokenizer)
    columns: dict[str, list[Any]] = {f.name: [] for f in TRAJECTORY_SCHEMA}
    for e, t in items:
        episode = episodes[e]
        step = episode.steps[t]
        prompt = prompt_ids(tokenizer, turn_messages(system, episode.steps, t, history))
        answer = [*tokenizer.encode(step.answer, add_special_tokens=False), int(answer_end)]
        tokens = [*prompt, *answer]
        row = {
            "run_id": ids["run_id"], "batch_id": ids["batch_id"], "episode_id": episode.episode_id,
            "group_id": time_of_day_group(ids["group_prefix"], env.local_time(step.timestamp)), "env": env.name,
            "env_seed": episode.env_seed, "producer_id": ids["producer_id"], "policy_version": 0,
            "adapter_sha256": NO_ADAPTER_SHA, "tokens": tokens, "loss_mask": [0] * len(prompt) + [1] * len(answer),
            "logprobs": [0.0] * len(tokens), "temperature": 1.0, "top_p": 1.0, "top_k": 0, "turn_rewards": [step.reward],
            "reward": float(sum(s.reward for s in episode.steps)), "turn": t,
            "return_to_go": float(episode.returns_to_go[t]), "num_turns": len(episode.steps), "success": False,
            "terminated": episode.terminated, "truncated": not episode.terminated, "created_at": created_at,
            "weight": None, "text": tokenizer.decode(tokens, skip_special_tokens=False) if with_text else None,
            "state": None,  # logged rows are rendered text; gae advantages need a producer's rows
        }  # fmt: skip
        for name, value in row.items():
            columns[name].append(value)
    return pa.Table.from_pydict(columns, schema=TRAJECTORY_SCHEMA)


def conversion_batch_id(dataset: str, index: int) -> str:
    """Batch ``index`` of a conversion of ``dataset``: ``<its first 40 characters>-<10 hex of its name's
    sha256>-<index:06d>``, at most 64 characters (a valid name), readable, and distinct for distinct dataset
    names even where they share a long prefix: the learner trains each batch id of a run once, so two datasets'
    batches in one run must never share an id."""
    digest = hashlib.sha256(dataset.encode()).hexdigest()[:10]
    return validate_name(f"{dataset[:40]}-{digest}-{index:06d}", "batch_id")


def dataset_to_trajectories(
    store: ObjectStore,
    name: str,
    run_id: str,
    tokenizer: Any,
    options: TrajectoryOptions | None = None,
    model: str = "",
    progress: Callable[[int, int], None] | None = None,
) -> ConversionReport:
    """Write dataset ``name`` as trajectory batches of run ``run_id`` (for ``rlpipe replay --train``).

    Batch ids are ``conversion_batch_id``s in a date folder fixed by the dataset's card, so a
    second conversion of the same dataset into the same run fails on its first batch instead
    of mixing data, and other datasets converted into the run never collide with it.
    A marker (``runs/<run>/offline/<dataset>.converting``) is written first, create-only, and
    the summary (``runs/<run>/offline/<dataset>.json``) last: ``rlpipe replay`` refuses a run
    whose conversion was cut short (a marker without its summary).  A conversion refused
    before it wrote a batch leaves the run as it found it (no marker of its own).
    """
    from pipeline.io.archive import TrajectoryArchive
    from pipeline.io.archive_layout import conversion_keys

    options = options or TrajectoryOptions()
    validate_name(run_id, "run_id")
    card = read_card(store, name)
    marker_key, summary_key = conversion_keys(run_id, name)
    _require_unconverted(store, name, run_id)  # before the days are read and rendered (minutes for a long log)
    overrides = {} if options.history_turns is None else {"history_turns": options.history_turns}
    env = building_env_for(card, overrides)
    check_building_dataset(card, env)
    episodes = load_rendered_episodes(store, card, env, options.discount, options.max_episodes,
                                      options.answer_decimals, options.answer_format)
    plan = plan_batches([len(e.steps) for e in episodes], options.episodes_per_batch, options.turns_per_batch,
                        options.epochs, options.seed)
    archive = TrajectoryArchive(store)
    producer_id = validate_name(f"dataset-{name}"[:64].rstrip("-."), "producer_id")
    # this attempt's own id in the marker: create-once then finds a retried create (gs://) whose first attempt
    # landed as its own, and still refuses the marker of any other conversion
    marker = {"dataset": name, "batches": len(plan), "attempt": uuid.uuid4().hex}
    try:
        store.put_create_once(marker_key, (json.dumps(marker) + "\n").encode())
    except FileExistsError:
        raise FileExistsError(_unfinished_conversion(name, run_id)) from None
    rows = tokens = generated = 0
    smallest = None
    for index, items in enumerate(plan):
        batch_id = conversion_batch_id(name, index)
        ids = {"run_id": run_id, "batch_id": batch_id, "producer_id": producer_id, "group_prefix": name}
        table = trajectory_table(items, episodes, tokenizer, env, ids, card.created_at, options.with_text)
        try:
            info = archive.write_batch(run_id, table, batch_id=batch_id, created=card.created_at)
        except FileExistsError:  # batches of this dataset without its summary: a conversion cut short
            if index == 0:  # nothing written by this one: leave no marker that would block the run's replay
                store.delete(marker_key, missing_ok=True)
            raise FileExistsError(_unfinished_conversion(name, run_id)) from None
        rows, tokens, generated = rows + info.num_rows, tokens + info.num_tokens, generated + info.num_generated_tokens
        smallest = info.num_rows if smallest is None else min(smallest, info.num_rows)
        if progress is not None:
            progress(index + 1, len(plan))
    summary = {
        "dataset": name, "dataset_created_at": card.created_at.isoformat(), "model": model,
        "options": options.model_dump(mode="json"), "env": env.name,
        "env_overrides": dict(card.extras.get("env_overrides") or {}) | overrides,
        "episodes": len(episodes), "batches": len(plan), "rows": rows, "tokens": tokens,
        "generated_tokens": generated, "created_at": dt.datetime.now(dt.UTC).isoformat(),
    }  # fmt: skip
    store.put_create_once(summary_key, (json.dumps(summary, indent=2) + "\n").encode())  # its created_at: ours
    store.delete(marker_key, missing_ok=True)
    return ConversionReport(run_id, name, len(episodes), len(plan), rows, tokens, generated, summary_key,
                            smallest or 0)


def _require_unconverted(store: ObjectStore, name: str, run_id: str) -> None:
    """Refuse (``FileExistsError`` naming the fix) a run that holds dataset ``name`` already, whole or cut short."""
    from pipeline.io.archive_layout import conversion_keys

    marker_key, summary_key = conversion_keys(run_id, name)
    if store.exists(summary_key):
        raise FileExistsError(f"run {run_id} already holds dataset {name}; convert into a new --run")
    if store.exists(marker_key):
        raise FileExistsError(_unfinished_conversion(name, run_id))


def _unfinished_conversion(name: str, run_id: str) -> str:
    return (f"an earlier conversion of dataset {name} into run {run_id} did not finish; delete the run with "
            f"`rlpipe runs delete --run {run_id} --yes` (its other datasets too) and convert again, or convert "
            "into a new --run")
