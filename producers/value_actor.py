"""Numeric actors: play an environment's numeric form with the newest published Q-network, write steps batches.

Registry (kind ``value-network``) -> ``ValueNetworkWatcher`` -> ``ValueActor`` ->
steps table in the store -> ``TrajectoryBatchCommitted`` on ``<ns>.trajectories``
-> value learner (``consumers.value.service``).

Per environment step the actor reads ``env.numeric_state()``, picks an action
epsilon-greedily (Dopamine's linearly decaying schedule over this actor's own
environment steps; before the first version is published every action is
uniform) and applies it as the environment's answer text for that action
(``env.answer_choices()``), so the environment records the steps table row itself
(``TextEnv.step_records``), with ``action`` the index of the chosen answer (Acrobot's
torques -1, 0, +1 are actions 0, 1, 2): the discrete action a Q-network scores.  Whole episodes only: a batch is every episode finished
since the last one, written once it holds at least ``steps_per_batch`` steps, so
the learner can form every n-step transition of an episode from one table.  Actors
do not wait for the learner unless ``max_batches_ahead`` is set: then an actor pauses
while it has written that many batches more than the learner had read of them (trained or
dead-lettered) at its newest version (from the first version on).  The bound is per actor:
the learner's backlog is at most the actors' number times it.

Layout of a batch: ``runs/<run>/env-steps/date=YYYY-MM-DD/<batch_id>.parquet``
(create-only; the event carries its sha256).  Each row carries the actor's policy
version and epsilon as features (``actor@policy_version``, ``actor@epsilon``).
The event's ``reward_*`` fields are per finished episode (its return), and
``success_rate`` the share of episodes the environment counted as a success.  The
event's fields (less path and digest) are also in the file's metadata
(``rlpipe.batch_summary``), so a batch whose actor died before announcing it is
announced as it would have been by the run's next actor to start (``steps_orphan_sweep``).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from datetime import UTC, date, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import torch
from torch import nn

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.archive_layout import new_batch_id, steps_prefix
from pipeline.io.bus.errors import BusError
from pipeline.io.registry import AdapterRegistry, RegistryError, version_folder
from pipeline.runtime import RateMeter
from pipeline.value_network import NetworkSpec, linearly_decaying_epsilon, load_network
from producers.envs.base import TextEnv
from producers.sink import OrphanSweep, OwedBatchEvents, batch_events, logged_batches
from schemas.config import PRODUCER_SLOTS, EnvSpec, RunConfig
from schemas.events import Payload, ProducerHeartbeat, TrajectoryBatchCommitted
from schemas.names import validate_name
from schemas.steps import BATCH_SUMMARY_KEY, steps_to_table
from schemas.value import READ_BY_PRODUCER_METRIC, ValueActorConfig, ValueRunConfig

if TYPE_CHECKING:
    from pipeline.io.bus import RunLog

log = logging.getLogger("rlpipe.actor")

VERSION_FEATURE, EPSILON_FEATURE = "actor@policy_version", "actor@epsilon"


def steps_batch_key(run_id: str, day: date, batch_id: str) -> str:
    """``runs/<run>/env-steps/date=YYYY-MM-DD/<batch_id>.parquet``."""
    return f"{steps_prefix(run_id)}/date={day.isoformat()}/{validate_name(batch_id, 'batch_id')}.parquet"


class ValueNetworkWatcher:
    """The newest verified value-network version of a run, pulled and loaded (or None before the first)."""

    def __init__(self, registry: AdapterRegistry, cache_dir: str | Path, poll_s: float = 1.0) -> None:
        self.registry, self.cache_dir, self.poll_s = registry, Path(cache_dir), poll_s
        self.version = 0
        self.newest_known = 0  # the newest version known committed: polls probe the numbers above it
        self.spec: NetworkSpec | None = None
        self.network: nn.Module | None = None
        self.polled_at = float("-inf")

    def refresh(self, force: bool = False) -> bool:
        """Load the newest published version if it is newer than the loaded one; True if it switched."""
        now = time.monotonic()
        if not force and now - self.polled_at < self.poll_s:
            return False
        self.polled_at = now
        self.newest_known = version = self.registry.newest_from(self.newest_known)  # a listing at the first poll only
        if version <= self.version:
            return False
        try:
            folder = self.registry.pull(version, self.cache_dir, kind="value-network")
            self.spec, self.network = load_network(folder)
        except (OSError, ValueError, LookupError, RegistryError) as exc:
            log.warning("could not load value network v%d (keeping v%d): %s", version, self.version, exc)
            return False
        if self.version:  # the network is in memory: the folder of the one it replaces is not read again
            shutil.rmtree(folder.parent / version_folder(self.version), ignore_errors=True)
        self.version = version
        log.info("acting with value network v%d", version)
        return True


class ValueActor:
    """Plays episodes with the newest published Q-network and commits them as steps batches."""

    def __init__(
        self,
        *,
        run_id: str,
        actor_id: str,
        env: TextEnv,
        archive: TrajectoryArchive,
        watcher: ValueNetworkWatcher,
        config: ValueActorConfig,
        announce: Callable[[Payload], Any] = lambda payload: None,
        seeds: range | None = None,
    ) -> None:
        self.run_id, self.actor_id = validate_name(run_id, "run_id"), validate_name(actor_id, "actor_id")
        self.env, self.archive, self.watcher, self.config = env, archive, watcher, config
        # batches stored while the broker was away, announced later (each as the one event made when it was owed)
        self.owed = OwedBatchEvents(run_id, announce)
        self.choices = self.action_choices(env)
        self.seeds = seeds  # environment seeds this actor plays, in turn (None: ``default_training_seeds``)
        self.rng = np.random.default_rng([config.seed, seeds.start if seeds else 0])
        self.env_steps = 0
        self.episodes = 0
        self.batches_written = 0  # by this process
        self.batches_before = 0  # by this actor's earlier processes (``resume``)
        self.orphans: OrphanSweep | None = None  # the start's second look at batches too young to judge then
        self.heartbeat_interval_s = 5.0  # a ProducerHeartbeat at most this often, between batches
        self.busy_s = 0.0  # time spent playing and writing batches (not waiting for the learner)
        self.meter = RateMeter(time.monotonic)
        self.meter.rates(self._totals())

    def resume(self, earlier: Iterable[TrajectoryBatchCommitted]) -> None:
        """Go on from this actor's earlier batches (a restarted actor keeps its id): the exploration schedule
        continues over the steps they hold, episode ids and environment seeds follow theirs, and the exploration
        draws are seeded from that point, so no earlier batch is played again.  Other actors' batches, and a
        batch announced twice, count for nothing."""
        mine = {event.batch_id: event for event in earlier if event.producer_id == self.actor_id}
        if not mine:
            return
        self.env_steps += sum(event.num_rows for event in mine.values())
        self.episodes += sum(event.num_groups for event in mine.values())
        self.batches_before += len(mine)
        self.rng = np.random.default_rng([self.config.seed, self.seeds.start if self.seeds else 0, self.episodes])
        self.meter = RateMeter(time.monotonic)  # rates count from here, not from 0
        self.meter.rates(self._totals())
        log.info("actor %s goes on after %d earlier batches: %d episodes, %d steps, epsilon %.3f once a version "
                 "is loaded", self.actor_id, len(mine), self.episodes, self.env_steps, self.epsilon_at_steps())

    # ---- acting ----------------------------------------------------------------------
    @property
    def announce(self) -> Callable[[Payload], Any]:
        """Where the actor's events go (its owed batches' too)."""
        return self.owed.announce

    @announce.setter
    def announce(self, announce: Callable[[Payload], Any]) -> None:
        self.owed.announce = announce

    def action_choices(self, env: TextEnv) -> list[str]:
        """The answer text of each action index (refusing an environment without a finite set)."""
        choices = env.answer_choices()
        if not choices:
            raise ValueError(f"environment {env.name} has no finite set of actions; "
                             "value actors play cartpole, cartpole-v1 or acrobot (slate actors recsim)")
        return choices

    def answer(self, action: Any) -> str:
        """The environment's answer text for an action ``act`` returned."""
        return self.choices[action]

    def action_vector(self, action: Any, row: dict[str, Any]) -> list[float]:
        """The steps table's ``action`` for a step: the index of the answer (not the environment's own vector)."""
        return [float(action)]

    def epsilon(self) -> float:
        """Exploration now: 1 before a version is loaded, else the schedule over this actor's steps."""
        if self.watcher.network is None:
            return 1.0
        return self.epsilon_at_steps()

    def epsilon_at_steps(self) -> float:
        """The schedule's epsilon after this actor's steps so far."""
        cfg = self.config
        return linearly_decaying_epsilon(self.env_steps, cfg.epsilon_decay_steps, cfg.epsilon_warmup_steps,
                                         cfg.final_epsilon)

    def act(self, observation: list[float], epsilon: float) -> int:
        """Epsilon-greedy on the loaded network's Q-values."""
        if self.watcher.network is None or self.rng.random() < epsilon:
            return int(self.rng.integers(len(self.choices)))
        with torch.no_grad():
            q_A = self.watcher.network.q_values(torch.as_tensor(observation, dtype=torch.float32).view(1, -1))[0]
        return int(q_A.argmax())

    def play_episode(self) -> tuple[list[dict[str, Any]], float, bool]:
        """One episode with the current version: (its steps table rows, its return, success)."""
        self.watcher.refresh()  # a new version is taken between episodes, never within one
        version, episode_id = self.watcher.version, f"{self.actor_id}-e{self.episodes}"
        seeds = self.seeds or default_training_seeds(self.config.seed)
        self.env.reset(seeds[self.episodes % len(seeds)])
        success, epsilons, actions = False, [], []
        while not self.env.done:
            observation = self.env.numeric_state()
            if not observation:
                raise ValueError(f"environment {self.env.name} has no numeric state; value actors need one")
            epsilons.append(self.epsilon())
            actions.append(self.act(observation, epsilons[-1]))
            result = self.env.step(self.answer(actions[-1]))
            self.env_steps += 1
            success = bool(result.info.get("success"))
        rows = [
            {**row, "episode_id": episode_id, "action": self.action_vector(action, row),
             "features": {**row.get("features", {}), VERSION_FEATURE: float(version), EPSILON_FEATURE: eps}}
            for row, eps, action in zip(self.env.step_records, epsilons, actions, strict=True)
        ]
        self.episodes += 1
        return rows, float(self.env.episode_return), success

    # ---- batching --------------------------------------------------------------------
    def collect_batch(self) -> tuple[pa.Table, list[float], list[bool]]:
        """Whole episodes until they hold ``steps_per_batch`` steps: (steps table, returns, successes)."""
        rows: list[dict[str, Any]] = []
        returns, successes = [], []
        while len(rows) < self.config.steps_per_batch:
            episode, episode_return, success = self.play_episode()
            rows += episode
            returns.append(episode_return)
            successes.append(success)
        features = sorted({name for row in rows for name in row["features"]})
        return steps_to_table(rows, features), returns, successes

    def write_batch(self) -> TrajectoryBatchCommitted:
        """Play, write one steps batch create-only, announce it; return the event."""
        started = time.monotonic()
        try:
            return self._write_batch()
        finally:
            self.busy_s += time.monotonic() - started

    def _write_batch(self) -> TrajectoryBatchCommitted:
        table, returns, successes = self.collect_batch()
        created = datetime.now(UTC)
        batch_id = new_batch_id("s")
        key = steps_batch_key(self.run_id, created.date(), batch_id)
        versions = table[VERSION_FEATURE].to_numpy()
        summary = {
            "batch_id": batch_id, "num_rows": table.num_rows, "num_tokens": 0, "num_generated_tokens": 0,
            "num_groups": len(returns), "env": self.env.name, "producer_id": self.actor_id,
            "policy_version_min": int(versions.min()), "policy_version_max": int(versions.max()),
            "reward_mean": float(np.mean(returns)), "reward_min": float(np.min(returns)),
            "reward_max": float(np.max(returns)), "success_rate": float(np.mean(successes)),
            "created_at": created.isoformat(),
        }
        table = table.replace_schema_metadata({**(table.schema.metadata or {}),
                                               BATCH_SUMMARY_KEY: json.dumps(summary).encode()})
        sha256 = self.archive.write_steps(key, table)
        event = TrajectoryBatchCommitted(**summary, path=key, sha256=sha256)
        self.owed.owe(event)  # the broker away: the batch stays stored and owed, and the actor goes on
        self.batches_written += 1
        if self.orphans is not None:
            self.orphans.maybe_sweep()
        log.info("batch %s: %d steps, %d episodes, return %.1f, v%d, epsilon %.3f", batch_id, table.num_rows,
                 len(returns), event.reward_mean, event.policy_version_max, self.epsilon())
        return event

    def run(self, should_stop: Callable[[], bool] = lambda: False, max_batches: int | None = None) -> int:
        """Write batches until stopped or ``max_batches``; return how many were written.  Raises ``PublishError``
        (one line) when batches it stored stay unannounced (the broker still away)."""
        while not should_stop() and (max_batches is None or self.batches_written < max_batches):
            self.wait_for_learner(should_stop)
            if not should_stop():
                self.write_batch()
                self.maybe_beat()
        self.owed.finish()
        return self.batches_written

    # ---- heartbeats ------------------------------------------------------------------
    def _totals(self) -> dict[str, float]:
        return {"episodes": self.episodes, "env_steps": self.env_steps, "busy_s": self.busy_s}

    def maybe_beat(self) -> None:
        """Announce a ``ProducerHeartbeat`` when ``heartbeat_interval_s`` has passed since the last one: episodes
        as samples, environment steps, and the share of the interval spent acting as the busy fraction."""
        if time.monotonic() - self.meter.last_time < self.heartbeat_interval_s:
            return
        rates, interval = self.meter.rates(self._totals())
        self.owed.retry_due()  # the batches whose event the broker refused, at most every few seconds
        try:
            self.announce(ProducerHeartbeat(
                producer_id=self.actor_id, adapter_version=self.watcher.version, samples_total=self.episodes,
                batches_total=self.batches_written, tokens_total=0, env_steps_total=self.env_steps,
                samples_per_s=rates["episodes"], tokens_per_s=0.0, env_steps_per_s=rates["env_steps"],
                busy_fraction=min(1.0, max(0.0, rates["busy_s"])), interval_s=interval,
            ))
        except BusError as exc:  # the broker away: a missed beat, never a stopped actor (the next one is due later)
            log.warning("actor %s: heartbeat not published (%s)", self.actor_id, str(exc).splitlines()[0])

    def wait_for_learner(self, should_stop: Callable[[], bool]) -> None:
        """With ``max_batches_ahead``: pause while this actor is that far ahead of the learner's reads of its batches
        at the newest version (each actor bounds its own batches; the run's backlog is at most N times the bound).

        Not before the first version: the learner is then filling its replay memory, and how many batches that takes
        is not known in advance (an episode cut by the time limit gives fewer transitions than steps), so a wait could
        last for ever.
        """
        limit = self.config.max_batches_ahead
        while limit is not None and not should_stop():
            read = self.learner_read()
            if read is None or self.batches_before + self.batches_written - read < limit:
                return
            time.sleep(max(self.config.registry_poll_s, 0.05))
            self.maybe_beat()

    def learner_read(self) -> int | None:
        """The batches of this actor's the learner had read (trained or dead-lettered) at the newest version, None
        before the first.  A version without per-actor counts (a learner whose source does not name producers, an
        older learner's) gives the run's count: its ``batches_read``, or else its learner step."""
        registry = self.watcher.registry
        self.watcher.newest_known = newest = registry.newest_from(self.watcher.newest_known)
        if not newest:
            return None
        latest = registry.show(newest)
        metrics = latest.metrics
        if any(name.startswith(READ_BY_PRODUCER_METRIC) for name in metrics):
            return int(metrics.get(READ_BY_PRODUCER_METRIC + self.actor_id, 0))
        return int(metrics.get("batches_read", latest.learner_step))


def default_training_seeds(actor_seed: int) -> range:
    """The environment seeds of an actor built without its run's: slot ``actor_seed`` mod ``PRODUCER_SLOTS`` of the
    training seeds below the default ``env.eval_seed_offset`` (as ``RunConfig.training_seeds`` cuts them), so it
    never plays a held-out evaluation seed and actors of different seeds play different ones."""
    width = EnvSpec.model_fields["eval_seed_offset"].default // PRODUCER_SLOTS
    start = (actor_seed % PRODUCER_SLOTS) * width
    return range(start, start + width)


def stored_events(archive: TrajectoryArchive, keys: Iterable[str]) -> list[TrajectoryBatchCommitted]:
    """The events of stored steps batches, from their files; one that cannot be read is left out (its sweep names it)."""
    events = []
    for key in keys:
        try:
            event = stored_steps_event(archive, key)
        except (OSError, ValueError) as exc:
            log.warning("could not read %s to count it (%s)", key, exc)
            continue
        if event is not None:
            events.append(event)
    return events


def stored_steps_event(archive: TrajectoryArchive, key: str) -> TrajectoryBatchCommitted | None:
    """The event of a stored steps batch, from its file; None for a file without its event's fields (an older
    actor's), which stays unannounced: the value learner does not train it."""
    sha256, summary = archive.describe_steps(key)
    if summary is None:
        log.warning("%s was never announced and holds no batch summary, so it stays unannounced", key)
        return None
    return TrajectoryBatchCommitted(**summary, path=key, sha256=sha256)


def steps_orphan_sweep(archive: TrajectoryArchive, run_id: str, announce: Callable[[Payload], Any],
                       min_age_s: float, announced: Callable[[], Iterable[str]]) -> OrphanSweep:
    """``OrphanSweep`` over the run's steps batches: those stored but never announced get their event."""
    return OrphanSweep(archive, run_id, announce, min_age_s, announced, list_keys=lambda: archive.list_steps(run_id),
                       describe=lambda key: stored_steps_event(archive, key))


def run_history(archive: TrajectoryArchive, run_id: str, announce: Callable[[Payload], Any], min_age_s: float,
                read_log: Callable[[], RunLog]) -> tuple[OrphanSweep, list[TrajectoryBatchCommitted]]:
    """At an actor's start: sweep the run's steps batches stored but never announced, and return the sweep (for
    its second look) with the events of every batch of the run, which a restarted actor goes on from.

    A batch stored before the events the log still holds (its event aged out) is taken as announced, as a
    producer's sweep takes it (``producers.sink``): announced again at every start, it would only have the learner
    read it once more.  Its event comes from the file's summary instead, so the actor's count includes it."""
    swept: list[Payload] = []  # what the sweeps announce for batches a crashed actor stored but never announced

    def announce_orphan(payload: Payload) -> None:
        announce(payload)
        swept.append(payload)

    orphans = steps_orphan_sweep(archive, run_id, announce_orphan, min_age_s, lambda: logged_batches(read_log()))
    history = read_log()
    earlier = batch_events(history.records)
    orphans.sweep(logged_batches(history))
    # a restart goes on where this actor's batches end: those the log names, those the sweep just announced, those
    # too young for the sweep to judge yet (a predecessor restarted at once may have left its last one), and those
    # whose events aged out
    return orphans, [*earlier, *batch_events(swept), *stored_events(archive, [*orphans.pending, *orphans.aged_out])]


def open_watcher(registry: AdapterRegistry, cache_dir: str | Path | None, poll_s: float) -> ValueNetworkWatcher:
    """A watcher caching under ``cache_dir`` (a fresh temporary folder when None)."""
    folder = Path(cache_dir) if cache_dir is not None else Path(tempfile.mkdtemp(prefix="rlpipe-value-"))
    return ValueNetworkWatcher(registry, folder, poll_s)


def check_environment(env: TextEnv, observation_size: int, num_actions: int) -> None:
    """Refuse an environment whose numeric form does not fit the run's network shape."""
    env.reset(0)
    shape = (len(env.numeric_state()), len(env.answer_choices() or []))
    if shape != (observation_size, num_actions):
        raise ValueError(f"environment {env.name} has {shape[0]} observation values and {shape[1]} actions, the run's "
                         f"value section says {observation_size} and {num_actions}; fix value.observation_size "
                         "and value.num_actions")


def check_value_environment(env: TextEnv, value: ValueRunConfig) -> None:
    """Refuse an environment that does not fit a value run's network (for slateq: its slate section), in one line;
    the actors check it at start, ``rlpipe run`` before anything starts."""
    if value.slate is not None:
        from producers.slate_actor import check_slate_environment

        check_slate_environment(env, value.observation_size, value.slate)
    else:
        check_environment(env, value.observation_size, value.num_actions)


def run_value_actor(config: RunConfig, stop: Callable[[], bool] = lambda: False) -> ValueActor:
    """One actor process of a value run: play and write batches until stopped (``rlpipe producer start``)."""
    from pipeline.io.bus import EventPublisher, run_log
    from pipeline.runtime import Announcer, open_store, resolved_bus
    from producers.envs.registry import env_from_spec

    if config.value is None:
        raise ValueError(f"run {config.run_id} has no value section; use a value preset such as dqn-cartpole")
    if config.learner.torch_threads is not None:  # tiny forward passes: extra threads only contend for the CPU
        torch.set_num_threads(config.learner.torch_threads)
    env = env_from_spec(config.env)
    check_value_environment(env, config.value)
    actor_class: type[ValueActor] = ValueActor
    if config.value.slate is not None:  # slateq: a slate of candidates per step (producers.slate_actor)
        from producers.slate_actor import SlateActor

        actor_class = SlateActor
    actor_id = config.producer.producer_id or f"{config.run_id}-p0"
    store = open_store(config.store)
    bus = resolved_bus(config.bus)
    publisher = EventPublisher(bus)
    archive, announce = TrajectoryArchive(store), Announcer(publisher, config.run_id)
    orphans, history = run_history(archive, config.run_id, announce, 2 * config.producer.batch_timeout_s,
                                   lambda: run_log(bus, "trajectories", config.run_id))
    watcher = open_watcher(AdapterRegistry(store, config.run_id), None, config.value.actor.registry_poll_s)
    actor = actor_class(run_id=config.run_id, actor_id=actor_id, env=env, archive=archive, watcher=watcher,
                        config=config.value.actor, announce=announce, seeds=config.training_seeds(actor_id))
    actor.resume(history)
    actor.orphans = orphans
    actor.heartbeat_interval_s = config.producer.heartbeat_interval_s
    try:
        actor.run(should_stop=stop)
    finally:
        publisher.close()
        shutil.rmtree(watcher.cache_dir, ignore_errors=True)  # this process's own pulled versions
    return actor
