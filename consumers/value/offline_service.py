"""Offline CQL as a run: ``rlpipe replay --run DATASET --train --preset cql-building``.

A logged building dataset (``rlpipe datasets generate building-hvac ...``) -> the CQL agent of
``consumers.value.offline`` -> checkpoints and published value-network versions of the run, which
``rlpipe eval`` plays on held-out days and ``rlpipe report`` reads like any value run's.

1. set up: the dataset's steps as discrete, normalised n-step transitions (``prepare_offline_data``),
   the run's ``run.json`` (with ``value.offline.dataset`` filled in), the run's learner lease;
2. resume: the newest checkpoint's agent tensors, step, version and sampling RNG (none: step 0);
3. per learner step, until ``learner.max_steps``: ``offline.updates_per_step`` CQL updates (and as
   many behaviour-cloning updates with ``offline.support_threshold`` above 0), one step-log
   entry, a version every ``publish_every`` steps and a checkpoint every ``checkpoint_every``
   (both at the last step too); with ``value.learner.keep_versions`` set, the versions older than
   the newest N are retired after each publish (``consumers.retention``), as the online learner's.
A version is the network's two files (``pipeline.value_network``) plus the setpoint grid and
the observation scaler (``pipeline.building_policy``; with a threshold, the behaviour-cloning
network too), so it plays again without this module.
Training is a pure function of the seed and the data: a run stopped and resumed from a
checkpoint ends with the weights an uninterrupted one has.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from consumers.checkpoint import CheckpointStore
from consumers.lease import FencedStore, LearnerLease
from consumers.retention import VersionRetention
from consumers.value.networks import network_spec
from consumers.value.offline import (
    BehaviourCloningAgent,
    CQLAgent,
    OfflineData,
    offline_memory,
    prepare_offline_data,
    train_updates,
)
from consumers.value.replay import ReplayMemory
from pipeline.building_policy import BuildingPolicySpec, SetpointGrid, building_policy_files, network_columns
from pipeline.io.datasets import DatasetCard, read_card, read_dataset
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.runtime import create_run, open_store
from pipeline.units import same_unit
from pipeline.value_network import network_files
from schemas.checkpoint import LearnerState
from schemas.config import RunConfig
from schemas.value import OfflineValueConfig

log = logging.getLogger("rlpipe.value")
BUILDING_ENV = "building-hvac"
BEHAVIOUR = "behaviour/"  # prefix of the behaviour-cloning agent's tensors in a checkpoint


@dataclass
class OfflineRun:
    """What one offline run trains with: the run's configuration, the data and where results go."""

    config: RunConfig
    offline: OfflineValueConfig
    data: OfflineData
    card: DatasetCard
    agent: CQLAgent
    memory: ReplayMemory
    registry: AdapterRegistry
    checkpoints: CheckpointStore
    state: LearnerState
    rng: np.random.Generator
    retention: VersionRetention  # value.learner.keep_versions, after each publish
    # with offline.support_threshold > 0: behaviour cloning trained alongside, its logits filter the published
    # policy's cells (its own sampling generator, seeded like the CQL agent's, as bench/offline_value_building.py)
    behaviour: BehaviourCloningAgent | None = None
    behaviour_rng: np.random.Generator | None = None


def check_offline_config(config: RunConfig) -> OfflineValueConfig:
    """The run's ``value.offline`` section, if the run can train offline CQL; else an error naming the fix."""
    if config.value is None or config.value.offline is None:
        raise ValueError(f"run {config.run_id} has no value.offline section; use the cql-building preset")
    if config.env.name != BUILDING_ENV:
        raise ValueError(f"offline CQL learns from logged {BUILDING_ENV} days; set env.name={BUILDING_ENV}")
    if config.value.learner.agent != "dqn":
        raise ValueError(f"offline CQL trains a DQN head, not {config.value.learner.agent}; "
                         "set value.learner.agent=dqn")
    if config.value.learner.max_steps is None:
        raise ValueError("offline training needs a budget: set value.learner.max_steps (learner steps)")
    return config.value.offline


def building_grid(card: DatasetCard, offline: OfflineValueConfig) -> SetpointGrid:
    """The ``levels`` x ``levels`` grid over the building's setpoint ranges (the dataset's own if it changed them)."""
    overrides = card.extras.get("env_overrides") or {}
    water = tuple(overrides.get("supply_water_range_k", offline.water_range_k))
    air = tuple(overrides.get("supply_air_heating_range_k", offline.air_range_k))
    return SetpointGrid(water, air, offline.levels, offline.levels)  # type: ignore[arg-type]


def policy_spec(card: DatasetCard, data: OfflineData, support_threshold: float = 0.0) -> BuildingPolicySpec:
    """What a published version needs to play the building: grid, local time, columns, and the data's days."""
    days = [int(e["day"]) for e in card.extras.get("episodes", [])]
    return BuildingPolicySpec(
        water_range_k=data.grid.water_range_k, air_range_k=data.grid.air_range_k,
        water_levels=data.grid.water_levels, air_levels=data.grid.air_levels,
        utc_offset_hours=data.utc_offset_hours,
        observation_columns=data.observation_columns,
        dataset=card.name, first_held_out_day=max(days) + 1 if days else 0,
        env_overrides=dict(card.extras.get("env_overrides") or {}), support_threshold=support_threshold,
    )


# ==== set up =========================================================================================
def open_offline_run(config: RunConfig, dataset: str) -> OfflineRun:
    """Read and discretise ``dataset``, write the run's ``run.json``, take the lease, build the agent."""
    offline = check_offline_config(config)
    store = open_store(config.store)
    card = _building_card(store, dataset)
    assert config.value is not None  # check_offline_config
    learner_cfg = config.value.learner
    data = prepare_offline_data(read_dataset(store, card), building_grid(card, offline),
                                float(card.extras.get("utc_offset_hours", 0.0)), learner_cfg.n_step, learner_cfg.gamma,
                                card.observation_columns, network_columns(card.observation_columns, card.action_columns))
    if (config.value.observation_size, config.value.num_actions) != (data.observation_size, data.grid.num_actions):
        raise ValueError(
            f"dataset {dataset} gives {data.observation_size} features and {data.grid.num_actions} grid cells, the run "
            f"has value.observation_size={config.value.observation_size} and value.num_actions="
            f"{config.value.num_actions}; set them to {data.observation_size} and {data.grid.num_actions}")
    offline = offline.model_copy(update={"dataset": dataset})
    config = config.model_copy(update={"value": config.value.model_copy(update={"offline": offline})})
    create_run(store, config, BUILDING_ENV)  # run.json names the dataset, so eval finds its held-out days
    lease = LearnerLease(store, config.run_id)
    lease.acquire()
    fenced: Any = FencedStore(store, lease)
    registry = AdapterRegistry(fenced, config.run_id)
    agent = CQLAgent(learner_cfg, data.observation_size, data.grid.num_actions, cql_alpha=offline.cql_alpha)
    behaviour = None
    if offline.support_threshold > 0.0:
        behaviour = BehaviourCloningAgent(learner_cfg, data.observation_size, data.grid.num_actions)
    return OfflineRun(
        config=config, offline=offline, data=data, card=card, agent=agent, memory=offline_memory(data),
        registry=registry, checkpoints=CheckpointStore(fenced, config.run_id, keep=learner_cfg.keep_checkpoints),
        state=LearnerState(), rng=np.random.default_rng(learner_cfg.seed),
        retention=VersionRetention(registry, "value.learner.keep_versions", learner_cfg.keep_versions),
        behaviour=behaviour,
        behaviour_rng=np.random.default_rng(learner_cfg.seed) if behaviour is not None else None,
    )


def _building_card(store: ObjectStore, dataset: str) -> DatasetCard:
    try:
        card = read_card(store, dataset)
    except FileNotFoundError:
        raise ValueError(f"no dataset {dataset!r} in the store; make one with rlpipe datasets generate building-hvac "
                         f"--days 14 --policy mixed --seed 1 --name {dataset}") from None
    if card.extras.get("env") not in (None, BUILDING_ENV) or len(card.action_columns) != 2:
        raise ValueError(f"dataset {dataset} is not a {BUILDING_ENV} log (two setpoints per step); offline CQL "
                         "needs one")
    units = card.units()
    for column in card.action_columns:  # the setpoint grid is in kelvin; another unit would land on its ends
        unit = units.get(column)
        if unit is not None and not same_unit(unit, "K"):
            raise ValueError(f"dataset {dataset} logs setpoint {column} in {unit}; offline CQL's setpoint grid is in "
                             "kelvin: convert the column to K (degC + 273.15) and import it again")
    return card


def resume(run: OfflineRun) -> None:
    """Continue from the newest complete checkpoint: agent tensors, step, version, sampling RNG."""
    checkpoint = run.checkpoints.latest()
    if checkpoint is None:
        log.info("no checkpoint for run %s: starting at step 0", run.config.run_id)
        return
    behaviour = {k[len(BEHAVIOUR):]: v for k, v in checkpoint.adapter.items() if k.startswith(BEHAVIOUR)}
    if run.behaviour is not None and not behaviour:  # cloning trains alongside from step 1, or not at all
        raise ValueError(f"run {run.config.run_id} trained {checkpoint.state.step} steps without the support filter, so "
                         "it has no behaviour-cloning network to go on with; keep value.offline.support_threshold at 0 "
                         "or start a new run_id")
    run.agent.load_state_dict({k: v for k, v in checkpoint.adapter.items() if not k.startswith(BEHAVIOUR)})
    run.state = checkpoint.state
    run.rng.bit_generator.state = checkpoint.scalars["rng"]
    if run.behaviour is not None and run.behaviour_rng is not None:
        run.behaviour.load_state_dict(behaviour)
        run.behaviour_rng.bit_generator.state = checkpoint.scalars["behaviour_rng"]
    log.info("resumed from %s: step %d, version %d", checkpoint.key, run.state.step, run.state.version)


# ==== the loop =======================================================================================
def replay_train_offline(config: RunConfig, dataset: str) -> OfflineRun:
    """Train ``config.run_id``'s CQL network from ``dataset``'s logged days until ``learner.max_steps``."""
    if config.learner.torch_threads is not None:  # a small MLP: extra threads mostly contend for the CPU
        torch.set_num_threads(config.learner.torch_threads)
    run = open_offline_run(config, dataset)
    resume(run)
    learner_cfg = run.agent.config
    assert learner_cfg.max_steps is not None  # check_offline_config
    log.info("offline CQL on %s: %d transitions, %d features, %d grid cells, alpha %g, %d x %d updates",
             dataset, len(run.memory), run.data.observation_size, run.data.grid.num_actions, run.offline.cql_alpha,
             learner_cfg.max_steps, run.offline.updates_per_step)
    while run.state.step < learner_cfg.max_steps:
        metrics = train_step(run)
        last = run.state.step == learner_cfg.max_steps
        if run.state.step % learner_cfg.publish_every == 0 or last:
            publish(run, metrics)
        metrics["version"] = run.state.version
        run.checkpoints.record_step(run.checkpoints.link_step(run.state, metrics))  # before its checkpoint
        if run.state.step % learner_cfg.checkpoint_every == 0 or last:
            checkpoint(run)
        log.info("step %d v%d loss %.4f td %.3f q %.2f", run.state.step, run.state.version, metrics["loss"],
                 metrics["td_abs_mean"], metrics["q_mean"])
    return run


def train_step(run: OfflineRun) -> dict[str, Any]:
    """One learner step: ``updates_per_step`` CQL updates; the step log's entry (``value_traces`` reads it)."""
    started = time.time()
    train = train_updates(run.agent, run.memory, run.offline.updates_per_step, run.rng)
    metrics = {
        "step": run.state.step + 1, "updates": train.steps, "transitions": 0, "replay_size": len(run.memory),
        "loss": train.loss, "td_abs_mean": train.td_abs_mean, "q_mean": train.q_mean,
        "training_steps": run.agent.training_steps, "batch_ids": [],
    }
    if run.behaviour is not None and run.behaviour_rng is not None:
        metrics["behaviour_loss"] = train_updates(run.behaviour, run.memory, run.offline.updates_per_step,
                                                  run.behaviour_rng).loss
    run.state.step += 1
    return metrics | {"started_at": started, "finished_at": time.time()}


def publish(run: OfflineRun, metrics: dict[str, Any]) -> None:
    """The online network, the grid and the scaler as the run's next value-network version; then the versions
    older than the ``value.learner.keep_versions`` newest are retired (None: none)."""
    assert run.config.value is not None
    files = network_files(network_spec(run.agent.config, run.data.observation_size, run.data.grid.num_actions),
                          run.agent.online)
    behaviour = run.behaviour.online if run.behaviour is not None else None
    files |= building_policy_files(policy_spec(run.card, run.data, run.offline.support_threshold), run.data.scaler,
                                   behaviour)
    scalars = {k: float(v) for k, v in metrics.items() if k in ("loss", "td_abs_mean", "q_mean", "training_steps")}
    manifest = run.registry.publish_files(files, base_model=f"cql:{BUILDING_ENV}", parent_version=run.state.version,
                                          learner_step=run.state.step, metrics=scalars, kind="value-network")
    run.state.version = manifest.version
    log.info("published value network v%d at step %d", manifest.version, run.state.step)
    run.retention.after_publish(manifest.version)


def checkpoint(run: OfflineRun) -> str:
    """Agent tensors (both networks, Adam; the behaviour agent's under ``behaviour/``), step, version, sampling RNGs."""
    tensors, scalars = run.agent.state_dict(), {"rng": run.rng.bit_generator.state}
    if run.behaviour is not None and run.behaviour_rng is not None:
        tensors |= {BEHAVIOUR + k: v for k, v in run.behaviour.state_dict().items()}
        scalars["behaviour_rng"] = run.behaviour_rng.bit_generator.state
    return run.checkpoints.save(run.state, tensors, {}, scalars)
