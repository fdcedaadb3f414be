"""Configuration of value-based runs: the learner (DQN/C51 and its service) and the numeric actors.

Launcher -> ``RunConfig.value`` -> value learner (``consumers.value``) and actors
(``producers.value_actor``); the network's shape also travels with every published
version (``pipeline.value_network.NetworkSpec``).  Unknown keys are refused so a
typo never falls back to a default.  The defaults are a small DQN for CartPole;
``agent="c51"`` switches the head to a categorical one over ``num_atoms`` atoms
evenly spaced on [v_min, v_max]; ``agent="slateq"`` learns one value per item of a
slate environment (RecSim) and needs the run's ``slate`` section (``SlateSpec``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from schemas.fields import NoYesNoNumbers

# A value-network version's metric (+ producer id): how many of that actor's batches the learner had read,
# trained or dead-lettered (value learner -> actors, through the registry; what max_batches_ahead compares with).
READ_BY_PRODUCER_METRIC = "batches_read/"


class ValueLearnerConfig(NoYesNoNumbers):
    """A DQN-family agent: network, targets, optimizer and replay memory."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    agent: Literal["dqn", "c51", "slateq"] = Field(
        "dqn", description="dqn (expected Q), c51 (categorical return distribution) or slateq (item values of a slate)"
    )
    seed: int = Field(0, ge=0, le=2**31 - 1, description="seeds network initialisation and the replay sampling")
    hidden_sizes: tuple[int, ...] = Field(
        (64, 64), min_length=1, max_length=8, description="widths of the MLP's hidden layers (ReLU between them)"
    )
    num_atoms: int = Field(51, ge=2, le=1001, description="C51: atoms of the return distribution's support")
    v_min: float = Field(-10.0, ge=-1e6, le=1e6, description="C51: lowest atom of the support")
    v_max: float = Field(10.0, ge=-1e6, le=1e6, description="C51: highest atom of the support")
    gamma: float = Field(0.99, ge=0.0, le=1.0, description="discount per environment step")
    n_step: int = Field(1, ge=1, le=100, description="steps summed into one transition's return (the n in n-step)")
    double_q: bool = Field(True, description="pick the next action with the online network, score it with the target")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0, description="Adam learning rate")
    adam_eps: float = Field(1e-8, gt=0.0, le=1.0, description="Adam epsilon (Dopamine uses 3.125e-4 on Atari)")
    max_grad_norm: float = Field(10.0, gt=0.0, le=1e6, description="clip the global gradient norm to this")
    huber_delta: float = Field(1.0, gt=0.0, le=1e6, description="DQN: TD errors beyond this are penalised linearly")
    batch_size: int = Field(64, ge=1, le=65_536, description="transitions per training step")
    target_update_period: int = Field(
        200, ge=1, le=10_000_000, description="copy the online network into the target every this many training steps"
    )
    replay_capacity: int = Field(
        50_000, ge=1, le=10_000_000, description="transitions the replay memory holds (oldest overwritten)"
    )
    replay_scheme: Literal["uniform", "prioritized"] = Field("uniform", description="how transitions are sampled")
    priority_alpha: float = Field(0.5, ge=0.0, le=1.0, description="prioritized: P(i) proportional to p_i^alpha")
    priority_beta: float = Field(0.5, ge=0.0, le=1.0, description="prioritized: importance weights (N P(i))^-beta")
    priority_epsilon: float = Field(1e-6, gt=0.0, le=1.0, description="prioritized: added to |TD| so no p_i is 0")
    min_replay_size: int = Field(500, ge=1, le=10_000_000, description="transitions stored before training starts")
    # The service around the agent (consumers.value.learner): one step per ingested steps batch.
    updates_per_transition: float = Field(
        1.0, gt=0.0, le=1_000.0, description="gradient updates per transition ingested (Dopamine: 1 per env step)"
    )
    publish_every: int = Field(
        1, ge=1, le=1_000_000,
        description="batches read between published versions (online: trained or dead-lettered; offline: steps)",
    )
    checkpoint_every: int = Field(5, ge=1, le=1_000_000, description="steps between checkpoints")
    keep_checkpoints: int | None = Field(3, ge=1, le=10_000, description="complete checkpoints kept (None = all)")
    keep_versions: int | None = Field(
        None, ge=1, le=1_000_000,
        description="newest published value-network versions whose files the registry keeps; older ones are retired "
        "after each publish (their numbers and manifests stay; actors load only the newest), online or offline "
        "CQL; None = all",
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many steps (ingested batches)")

    @model_validator(mode="after")
    def _consistent(self) -> ValueLearnerConfig:
        if self.v_min >= self.v_max:
            raise ValueError(f"v_min ({self.v_min}) must be below v_max ({self.v_max}); widen the support")
        if any(width < 1 or width > 65_536 for width in self.hidden_sizes):
            raise ValueError(f"hidden_sizes {self.hidden_sizes} must each be between 1 and 65536")
        if self.batch_size > self.replay_capacity:
            raise ValueError(f"batch_size {self.batch_size} exceeds replay_capacity {self.replay_capacity}; lower it")
        if self.min_replay_size > self.replay_capacity:  # the memory never holds that many: no update would run
            raise ValueError(f"min_replay_size {self.min_replay_size} exceeds replay_capacity {self.replay_capacity}, "
                             "so training would never start; lower min_replay_size")
        if self.agent == "slateq" and self.replay_scheme != "uniform":
            raise ValueError("slateq samples its replay memory uniformly; set replay_scheme: uniform")
        return self


class ValueActorConfig(NoYesNoNumbers):
    """How one numeric actor explores and batches its steps."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps_per_batch: int = Field(200, ge=1, le=1_000_000, description="write a batch once its episodes hold this many steps")
    epsilon_decay_steps: int = Field(4_000, ge=1, le=100_000_000, description="steps over which epsilon falls to its floor")
    epsilon_warmup_steps: int = Field(0, ge=0, le=100_000_000, description="steps at epsilon 1 before the decay starts")
    final_epsilon: float = Field(0.05, ge=0.0, le=1.0, description="epsilon after the decay")
    seed: int = Field(
        0, ge=0, le=2**31 - 1,
        description="seeds the exploration; the environment seeds are the run's training seeds "
        "(RunConfig.training_seeds), or for an actor built without them slot seed mod 256 of the default run's "
        "training seeds (below the held-out ones)",
    )
    registry_poll_s: float = Field(1.0, ge=0.0, le=3600.0, description="look for a newer version this often")
    max_batches_ahead: int | None = Field(
        None, ge=1, le=1_000_000,
        description="pause while this actor has written this many batches more than the learner had read of them "
        "at its newest version (per actor: with N actors the learner's backlog is at most N times this; None: "
        "never wait; set it when the actors outrun the learner and would explore on stale versions)",
    )


class OfflineValueConfig(NoYesNoNumbers):
    """Offline CQL on a logged building dataset (``rlpipe replay --run DATASET --train``, preset ``cql-building``).

    The value learner's network (``learner``: DQN head, gamma, n-step, optimiser) learns from the
    dataset's steps with the CQL(H) regulariser; the two continuous setpoints become a grid of
    ``levels`` x ``levels`` cells (``pipeline.building_policy.SetpointGrid``).  One learner step is
    ``updates_per_step`` gradient updates; ``learner.max_steps`` steps in all.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    cql_alpha: float = Field(0.1, ge=0.0, le=1e6, description="weight of the CQL(H) regulariser (0: plain DQN)")
    levels: int = Field(5, ge=2, le=101, description="grid levels per setpoint (levels^2 actions)")
    water_range_k: tuple[float, float] = Field(
        (310.0, 355.0), description="supply-water setpoint range (K), the grid's ends (the dataset's env_overrides win)"
    )
    air_range_k: tuple[float, float] = Field(
        (285.0, 300.0), description="supply-air heating setpoint range (K), the grid's ends (as water_range_k)"
    )
    support_threshold: float = Field(
        0.0, ge=0.0, le=1.0,
        description="act only on cells whose behaviour-cloning probability is at least this times the most likely "
        "cell's (0: no filter; discrete BCQ's tau)",
    )
    updates_per_step: int = Field(500, ge=1, le=1_000_000, description="gradient updates per learner step")
    dataset: str | None = Field(None, description="the dataset trained on (set by rlpipe replay from --run)")

    @model_validator(mode="after")
    def _ranges(self) -> OfflineValueConfig:
        for name in ("water_range_k", "air_range_k"):
            low, high = getattr(self, name)
            if low >= high:
                raise ValueError(f"{name} ({low}, {high}) must be (low, high) with low below high; swap or widen it")
        return self


class SlateSpec(NoYesNoNumbers):
    """A slate environment's shape and choice model: what SlateQ's learner and actors need of it.

    The values must be the environment's own (RecSim's ``InterestEvolutionConfig``); an actor
    refuses an environment that differs.  The observation an actor records is the user's
    interest per topic first and the candidates' topics last (anything between, such as
    RecSim's time budget, is hidden from the agent).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_topics: int = Field(20, ge=2, le=1_000, description="topics; an item's features are its one-hot topic")
    num_candidates: int = Field(5, ge=1, le=100, description="candidate items shown each step")
    slate_size: int = Field(2, ge=1, le=100, description="items recommended each step")
    choice_model: Literal["proportional", "softmax"] = Field("proportional", description="the user's choice model")
    no_click_mass: float = Field(1.0, ge=-1e3, le=1e3, description="score of the no-click option")
    min_normalizer: float = Field(-1.0, ge=-1e3, le=0.0, description="subtracted from every score (proportional)")
    selection: Literal["optimal", "topk", "greedy"] = Field(
        "optimal", description="how actors, eval and the learner's Q-learning target pick a slate from the item values "
        "(optimal: every k-subset)"
    )

    @model_validator(mode="after")
    def _consistent(self) -> SlateSpec:
        if self.slate_size > self.num_candidates:
            raise ValueError(f"slate_size {self.slate_size} exceeds num_candidates {self.num_candidates}; lower it")
        if self.selection == "optimal" and math.comb(self.num_candidates, self.slate_size) > 100_000:
            raise ValueError(f"C({self.num_candidates}, {self.slate_size}) slates are too many to enumerate; "
                             "use selection: greedy or topk")
        return self


class ValueRunConfig(NoYesNoNumbers):
    """A value-based run: ``rlpipe run`` starts actors and a value learner instead of producers and a LoRA learner."""

    model_config = ConfigDict(extra="forbid")

    observation_size: int = Field(ge=1, le=1_000_000, description="numbers in the environment's observation vector")
    num_actions: int = Field(ge=2, le=1_000_000, description="discrete actions (the environment's answer choices)")
    learner: ValueLearnerConfig = Field(default_factory=ValueLearnerConfig)
    actor: ValueActorConfig = Field(default_factory=ValueActorConfig)
    offline: OfflineValueConfig | None = Field(None, description="offline CQL on a logged building dataset")
    slate: SlateSpec | None = Field(None, description="slateq: the slate environment's shape and choice model")

    @model_validator(mode="after")
    def _slate_matches(self) -> ValueRunConfig:
        slate, agent = self.slate, self.learner.agent
        if (agent == "slateq") != (slate is not None):
            raise ValueError(f"agent {agent} with{'' if slate else 'out'} a slate section: slateq needs value.slate "
                             "(the environment's choice model), dqn and c51 take none")
        if slate is not None and self.num_actions != slate.num_candidates:
            raise ValueError(f"num_actions {self.num_actions} must equal slate.num_candidates {slate.num_candidates} "
                             "(slateq scores each candidate)")
        if slate is not None and self.observation_size < slate.num_topics + slate.num_candidates:
            raise ValueError(f"observation_size {self.observation_size} cannot hold {slate.num_topics} interests and "
                             f"{slate.num_candidates} candidate topics; fix value.observation_size")
        ahead, publish_every = self.actor.max_batches_ahead, self.learner.publish_every
        # After a version at B of its batches read an actor writes up to B + ahead; the next version comes
        # publish_every reads later (trained or dead-lettered, any actor's), so a smaller bound stops a lone actor
        # for good.  With several, all waiting means N * ahead >= publish_every unread: a version always comes.
        if ahead is not None and ahead < publish_every:
            raise ValueError(f"actor.max_batches_ahead {ahead} would stop the actor before the learner publishes its "
                             f"next version; raise it to at least learner.publish_every ({publish_every})")
        return self
