"""Run configuration: one model per component, nested like the package tree.

Launcher -> ``<root>/runs/<run_id>/run.json`` -> producers and learner.  Every
field has a description and bounds, unknown keys are refused (a typo should not
silently fall back to a default), and secrets are ``SecretStr`` so they print as
``***``.  Layering from files, flags and ``RLPIPE_`` environment variables is done
in ``pipeline.config``; this module only validates.  The sections saying where the
event log and the store are (``BusConfig``, ``StoreConfig``) are ``schemas.connections``'s,
imported here too.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from schemas.connections import BusConfig, StoreConfig
from schemas.fields import ConfigSection as _Section
from schemas.names import validate_name
from schemas.trajectory import MIN_SAMPLING_TEMPERATURE, behaviour_policy_problem
from schemas.value import ValueLearnerConfig, ValueRunConfig

PRODUCER_SLOTS = 256  # training seed ranges per run: one per producer ordinal (num_producers' bound)
_DEVICE = re.compile(r"auto|cpu|mps|(cuda|xpu)(:[0-9]+)?")  # learner.device: what torch.device() opens
_ORDINAL = re.compile(r"-p?(\d{1,3})$")  # the launcher's <run>-p<i>, a StatefulSet pod's <name>-<i>


class ModelConfig(_Section):
    """The base model the producers serve and the learner adapts."""

    base_model: str = Field("tiny", max_length=4096, description="'tiny' (built locally), a local path or a hub id")
    tiny_dir: str = Field("", max_length=4096, description="where the tiny model is built/cached; empty = default")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="base weights dtype in the learner and the sampler (auto = the checkpoint's own); "
        "LoRA weights, optimizer state and logprobs are float32 always",
    )


class EnvSpec(_Section):
    """Which environment and its overrides (see `rlpipe envs list`)."""

    name: str = Field("cartpole", max_length=64, description="registered environment name")
    overrides: dict[str, Any] = Field(default_factory=dict, description="environment config fields to change")
    eval_seed_offset: int = Field(
        1_000_000, ge=0, le=2**62,
        description="held-out evaluation seeds start here (at most 2^62: seeds are int64 in trajectory rows)",
    )
    step_delay_s: float = Field(
        0.0, ge=0.0, le=60.0,
        description="seconds each environment step takes on top of the simulation, e.g. a remote reward service",
    )


LoraRankSlot = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]  # the max_lora_rank values vLLM accepts
LORA_RANK_SLOTS: tuple[int, ...] = get_args(LoraRankSlot)
MAX_BATCH_SEQUENCES = 4096  # sampler.max_batch_sequences' bound


def lora_rank_slot(rank: int) -> int:
    """The smallest vLLM ``max_lora_rank`` slot that holds LoRA rank ``rank`` (the largest slot above them all)."""
    return min((slot for slot in LORA_RANK_SLOTS if slot >= rank), default=LORA_RANK_SLOTS[-1])


def check_sampler_holds_rank(sampler: SamplerConfig, lora_rank: int, run_id: str, whose: str) -> None:
    """Refuse, in one line naming both settings, a vLLM sampler whose ``max_lora_rank`` is below the rank run
    ``run_id`` trains at: it would refuse every adapter version of the run once sampling started.

    ``whose`` names the sampler: "this producer's", "the shared engine's (run a's)".
    """
    if sampler.backend == "vllm" and lora_rank > sampler.max_lora_rank:
        raise ValueError(
            f"run {run_id} trains at learner.lora_rank {lora_rank}, above {whose} sampler.max_lora_rank "
            f"{sampler.max_lora_rank}: vLLM would refuse every adapter version; start the producer with "
            f"--set sampler.max_lora_rank={lora_rank_slot(lora_rank)}"
        )


class SamplerConfig(_Section):
    """How the producer samples from the policy."""

    backend: Literal["vllm", "transformers"] = Field("vllm", description="inference engine")
    engine: Literal["blocking", "async"] = Field(
        "async", description=(
            "how a one-run producer drives the backend: 'async' through the sampling engine (vLLM's AsyncLLM, "
            "continuous batching), every episode's turn its own request; 'blocking' decodes the episodes waiting "
            "as one call (vLLM's LLM.generate); packed producers always use the engine"
        ),
    )
    temperature: float = Field(1.0, ge=0.0, le=10.0, description="sampling temperature (0 = greedy; otherwise at "
                               "least 0.01, below which vLLM samples at 0.01 whatever it is given)")

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        if 0.0 < value < MIN_SAMPLING_TEMPERATURE:
            raise ValueError(f"sampler.temperature {value:g}: use 0 (greedy) or at least {MIN_SAMPLING_TEMPERATURE:g}; "
                             f"vLLM samples at {MIN_SAMPLING_TEMPERATURE:g} below it, and the rows would record "
                             f"{value:g}")
        return value
    top_p: float = Field(
        1.0, gt=0.0, le=1.0, description="nucleus sampling mass (below 1 only with losses without importance ratios)"
    )
    max_new_tokens: int = Field(32, ge=1, le=65_536, description="tokens generated per turn")
    max_model_len: int = Field(2048, ge=64, le=1_048_576, description="context length the engine allows")
    gpu_memory_utilization: float = Field(0.2, gt=0.0, le=1.0, description="vLLM memory share (KV cache on CPU)")
    max_loras: int = Field(3, ge=1, le=64, description="adapter versions kept loaded (>= max_staleness + 1)")
    max_lora_rank: LoraRankSlot = Field(8, description="vLLM LoRA rank slot")
    max_batch_sequences: int | None = Field(
        None, ge=1, le=MAX_BATCH_SEQUENCES, description=(
            "transformers backend: the most sequences decoded together, as one batch of waiting calls that share "
            "the weights and sampling settings (a call of more runs whole, alone); a smaller batch lets other "
            "callers' calls in sooner, a larger one decodes more per step. None = 16 (the transformers "
            "sampler's decode batch). vLLM batches continuously and ignores it"
        ),
    )
    seed: int = Field(0, ge=0, description="sampling seed")


class ProducerConfig(_Section):
    """Rollout worker settings."""

    producer_id: str | None = Field(
        None, description="stable id; None = hostname-pid; an ordinal suffix (-p3, -3) picks the training seed range"
    )
    group_size: int = Field(4, ge=1, le=1024, description="samples per environment seed (GRPO group)")
    groups_per_batch: int = Field(4, ge=1, le=100_000, description="groups written in one Parquet batch")
    concurrent_groups: int = Field(4, ge=1, le=4096, description="groups in flight at once (batched generation)")
    batch_timeout_s: float = Field(60.0, gt=0, le=86_400, description="write a partial batch after this long")
    max_staleness: int = Field(2, ge=0, le=1000, description="do not start groups more versions behind than this")
    staleness_wait_s: float = Field(120.0, ge=0, le=86_400, description="longest wait for a newer adapter")
    max_backlog_steps: float | None = Field(
        1.0, gt=0, le=1e6,
        description="pause new groups while the learner's unconsumed rows exceed this many steps "
        "(x learner.batch_rows); None = never pause",
    )
    heartbeat_interval_s: float = Field(5.0, gt=0, le=3600, description="seconds between heartbeats")
    env_workers: int = Field(4, ge=1, le=256, description="threads stepping environments")
    max_groups: int | None = Field(None, ge=1, description="stop after this many groups (None = run until stopped)")
    seed_start: int = Field(
        0, ge=0, description="first training seed; each producer plays its own slice of [seed_start, eval_seed_offset)"
    )
    health_port: int | None = Field(None, ge=0, le=65535, description="port for /healthz, /readyz, /metrics")

    @field_validator("producer_id")
    @classmethod
    def _producer_id(cls, value: str | None) -> str | None:
        return None if value is None else validate_name(value, "producer_id")


IMPORTANCE_LOSSES = ("importance_sampling", "ppo")  # the losses that divide by the sampler's logprobs


class LearnerConfig(_Section):
    """Off-policy learner settings."""

    loss: Literal["importance_sampling", "ppo", "cross_entropy", "awr", "filtered_bc"] = Field(
        "importance_sampling", description="training objective"
    )
    advantage: Literal["group", "raw", "return_to_go", "gae"] = Field(
        "group", description="how advantages are formed (gae: per-turn rows of an environment with a numeric state)"
    )
    normalize_advantage_std: bool = Field(False, description="divide group advantages by the group std")
    return_to_go_baseline: Literal["group_turn", "step", "none"] = Field(
        "group_turn",
        description="return_to_go baseline: mean of the same (group, turn), mean of the whole step, or none",
    )
    discount: float = Field(
        1.0, gt=0.0, le=1.0,
        description="discount of return_to_go and gae advantages (refused below 1 with the others, which read the "
        "undiscounted reward); below 1 the learner recomputes the return-to-go per episode",
    )
    gae_lambda: float = Field(
        0.5, ge=0.0, le=1.0,
        description="gae: 0 judges a turn by the state it leads to (one-step TD), 1 by its whole return-to-go",
    )
    init_from: str | None = Field(
        None, max_length=200,
        description="warm start: RUN or RUN@VERSION whose adapter a fresh learner starts from (published as v1)",
    )
    is_cap: float = Field(2.0, ge=1.0, le=100.0, description="truncation cap of importance ratios")
    ppo_clip: float = Field(0.2, gt=0.0, le=1.0, description="PPO clip epsilon")
    ratio_mask_low: float = Field(0.125, gt=0.0, le=1.0, description="tokens with ratio below are masked")
    ratio_mask_high: float = Field(8.0, ge=1.0, le=1000.0, description="tokens with ratio above are masked")
    awr_beta: float = Field(1.0, gt=0.0, le=1000.0, description="AWR temperature: weight = exp(A / beta)")
    awr_max_weight: float = Field(20.0, gt=0.0, le=1e6, description="AWR weight cap")
    filtered_bc_fraction: float = Field(0.5, gt=0.0, le=1.0, description="top fraction by return kept")
    learning_rate: float = Field(1e-3, gt=0.0, le=1.0, description="AdamW learning rate")
    weight_decay: float = Field(0.0, ge=0.0, le=1.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0.0, le=1e6, description="max gradient norm")
    lr_schedule: Literal["constant", "linear", "cosine"] = Field("constant", description="learning-rate schedule")
    warmup_steps: int = Field(0, ge=0, le=1_000_000, description="linear warm-up steps")
    lora_rank: int = Field(8, ge=1, le=512, description="LoRA rank")
    lora_alpha: float = Field(16.0, gt=0.0, le=4096.0, description="LoRA alpha")
    lora_dropout: float = Field(0.0, ge=0.0, lt=1.0, description="LoRA dropout")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        description="modules that get LoRA",
    )
    batch_rows: int = Field(16, ge=1, le=1_000_000, description="trajectory rows per optimizer step")
    micro_batch_tokens: int = Field(4096, ge=16, le=10_000_000, description="tokens per forward/backward")
    gradient_checkpointing: bool = Field(
        False, description="keep one hidden state per decoder layer and recompute the rest in the backward pass: "
                           "far less activation memory for about a third more compute (rlpipe plan --checkpointing)",
    )
    shard: bool = Field(
        False, description="under torchrun, shard the frozen base weights over the ranks with FSDP2: each rank holds "
                           "1/N of them, LoRA weights and AdamW state stay whole; no effect on one process "
                           "(rlpipe plan --shard)",
    )
    publish_every: int = Field(1, ge=1, le=1_000_000, description="optimizer steps between adapter versions")
    checkpoint_every: int = Field(1, ge=1, le=1_000_000, description="optimizer steps between checkpoints")
    keep_checkpoints: int = Field(
        3, ge=1, le=1_000_000, description="newest complete checkpoints kept; older ones are deleted after a save"
    )
    keep_versions: int | None = Field(
        None, ge=1, le=1_000_000,
        description="newest published adapter versions whose files the registry keeps; older ones are retired after "
        "each publish (their numbers and manifests stay, a pull names why; a warm start's v1 is kept); None = all",
    )
    max_steps: int | None = Field(None, ge=1, description="stop after this many optimizer steps")
    max_staleness: int = Field(2, ge=0, le=1000, description="rows more versions behind than this are dropped")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="torch seed")
    device: str = Field("auto", max_length=32, description="auto, cpu, cuda, cuda:N (also mps, xpu, xpu:N)")
    torch_threads: int | None = Field(
        None, ge=1, le=1024, description="CPU threads for training (None = torch's default); 1 beside a CPU sampler"
    )
    health_port: int | None = Field(None, ge=0, le=65535, description="port for /healthz, /readyz, /metrics")
    tensorboard_dir: str | None = Field(
        None, max_length=4096,
        description="folder of TensorBoard event files, one subfolder per run; None = the run's folder of a local store, "
        "else $RLPIPE_HOME/tensorboard",
    )
    # Remedies against collapse (consumers.collapse, consumers.losses); all off by default.
    entropy_coef: float = Field(
        0.0, ge=0.0, le=10.0,
        description="entropy bonus: loss -= coef x policy entropy summed over each row's generated tokens, averaged "
        "over rows, as the policy loss is (so it grows with answer length; 0 = off)",
    )
    kl_coef: float = Field(
        0.0, ge=0.0, le=100.0,
        description="KL penalty to the starting policy (the warm start, else the base model): "
        "loss += coef x k3 estimate summed over each row's sampled tokens, averaged over rows (its value estimates "
        "KL(policy||ref), its gradient that of KL(ref||policy); 0 = off; one extra no-grad forward per micro-batch)",
    )
    ppo_clip_low: float | None = Field(
        None, gt=0.0, lt=1.0, description="PPO lower clip: ratio floor 1 - ppo_clip_low (None = ppo_clip)"
    )
    ppo_clip_high: float | None = Field(
        None, gt=0.0, le=10.0,
        description="PPO upper clip: ratio ceiling 1 + ppo_clip_high (None = ppo_clip; higher keeps exploring)",
    )
    max_step_kl: float | None = Field(
        None, gt=0.0, le=100.0,
        description="trust region: the most one optimizer step may move the policy, as KL(before || after) over the "
        "next-token distribution summed over an answer's tokens, averaged over sampled rows; a larger step is halved "
        "until within (consumers.trust_region; None = off)",
    )
    trust_region_rows: int = Field(
        128, ge=1, le=100_000, description="rows of each step sampled to measure its KL (with max_step_kl)"
    )
    keep_uncertain_groups: float = Field(
        1.0, gt=0.0, le=1.0,
        description="train only this top fraction of each step's groups by reward spread (1 = all groups)",
    )
    # Signs of collapse: the learner logs a warning once each time one crosses its threshold.
    warn_identical_group_share: float = Field(
        0.5, ge=0.0, le=1.0, description="warn when more than this share of groups sampled identical answers"
    )
    warn_zero_advantage_share: float = Field(
        0.8, ge=0.0, le=1.0, description="warn when more than this share of rows has advantage 0"
    )
    warn_entropy_fraction: float = Field(
        0.2, ge=0.0, le=1.0, description="warn when the policy entropy falls below this fraction of its first steps'"
    )
    warn_reward_spread_fraction: float = Field(
        0.25, ge=0.0, le=1.0,
        description="warn when the mean within-group reward spread falls below this fraction of its first steps'",
    )
    collapse_baseline_steps: int = Field(
        3, ge=1, le=1000, description="first trained steps whose entropy and reward spread are the reference"
    )

    @field_validator("target_modules")
    @classmethod
    def _target_modules(cls, value: list[str]) -> list[str]:
        if not value or not all(name.strip() for name in value):
            raise ValueError(f"learner.target_modules {value!r} names no module for LoRA; name at least one "
                             "(e.g. q_proj, v_proj)")
        return value

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError(f"learner.device {value!r} is not a device the learner can train on; use auto, cpu, "
                             "cuda, cuda:N, mps, xpu or xpu:N")
        return value

    @field_validator("init_from")
    @classmethod
    def _init_from(cls, value: str | None) -> str | None:
        if value is not None:
            parse_init_from(value)
        return value

    @model_validator(mode="after")
    def _keeps_what_producers_sample(self) -> LearnerConfig:
        # a producer may still start groups on a version max_staleness behind the newest (and pull it when it
        # restarts): those versions' files must stay
        if self.keep_versions is not None and self.keep_versions <= self.max_staleness:
            raise ValueError(
                f"learner.keep_versions {self.keep_versions} would delete versions that learner.max_staleness "
                f"{self.max_staleness} still trains from; set learner.keep_versions to at least "
                f"{self.max_staleness + 1} (or leave it unset to keep every version)"
            )
        return self

    @model_validator(mode="after")
    def _discounted(self) -> LearnerConfig:
        if self.discount < 1.0 and self.advantage not in ("return_to_go", "gae"):
            raise ValueError(
                f"learner.discount {self.discount:g} has no effect on learner.advantage {self.advantage}, which reads "
                "each row's undiscounted reward; set learner.advantage=return_to_go (or gae) or learner.discount=1"
            )
        return self


class RunConfig(_Section):
    """A whole run: what is learned, where the data goes, and how each component behaves."""

    run_id: str = Field("demo", description="run name; becomes store paths and event keys")
    env: EnvSpec = Field(default_factory=EnvSpec)
    model: ModelConfig = Field(default_factory=ModelConfig)
    bus: BusConfig = Field(default_factory=BusConfig)
    store: StoreConfig = Field(default_factory=StoreConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    producer: ProducerConfig = Field(default_factory=ProducerConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    num_producers: int = Field(1, ge=0, le=PRODUCER_SLOTS, description="producer processes `rlpipe run` starts")
    value: ValueRunConfig | None = Field(
        None, description="a value-based run: producers are numeric actors and the learner trains DQN/C51 (not LoRA)"
    )

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_name(value, "run_id")

    @model_validator(mode="after")
    def _seed_ranges(self) -> RunConfig:
        if self.env.eval_seed_offset - self.producer.seed_start < PRODUCER_SLOTS:
            raise ValueError(
                f"training seeds from producer.seed_start ({self.producer.seed_start}) must end below the held-out "
                f"evaluation seeds at env.eval_seed_offset ({self.env.eval_seed_offset}) with room for "
                f"{PRODUCER_SLOTS} producer ranges; lower producer.seed_start or raise env.eval_seed_offset"
            )
        return self

    def training_seeds(self, producer_id: str) -> range:
        """The environment seeds producer ``producer_id`` plays (it wraps around at the end).

        ``[seed_start, eval_seed_offset)`` is cut into ``PRODUCER_SLOTS`` equal
        ranges, so no producer ever plays a held-out evaluation seed.  The slot is
        the ordinal at the end of the id (the launcher's ``<run>-p<i>``, a
        StatefulSet pod's ``<name>-<i>``): producers numbered that way get
        disjoint ranges with no setting at all.  Any other id gets a slot from a
        hash of the id: stable across restarts, distinct from the others' only by
        chance.
        """
        match = _ORDINAL.search(producer_id)
        if match and int(match.group(1)) < PRODUCER_SLOTS:
            slot = int(match.group(1))
        else:
            slot = int.from_bytes(hashlib.sha256(producer_id.encode()).digest()[:8], "little") % PRODUCER_SLOTS
        width = (self.env.eval_seed_offset - self.producer.seed_start) // PRODUCER_SLOTS
        start = self.producer.seed_start + slot * width
        return range(start, start + width)

    @model_validator(mode="after")
    def _compatible(self) -> RunConfig:
        if self.sampler.max_loras < self.producer.max_staleness + 1:
            raise ValueError(
                f"sampler.max_loras ({self.sampler.max_loras}) must be at least producer.max_staleness + 1 "
                f"({self.producer.max_staleness + 1}) so in-flight requests keep their adapter"
            )
        if self.learner.lora_rank > self.sampler.max_lora_rank:
            raise ValueError(
                f"learner.lora_rank ({self.learner.lora_rank}) exceeds sampler.max_lora_rank "
                f"({self.sampler.max_lora_rank}); raise sampler.max_lora_rank"
            )
        problem = behaviour_policy_problem(self.sampler.temperature, self.sampler.top_p, 0)
        if problem and self.learner.loss in IMPORTANCE_LOSSES:
            raise ValueError(
                f"learner.loss {self.learner.loss} cannot use sampler.temperature {self.sampler.temperature:g} with "
                f"sampler.top_p {self.sampler.top_p:g}: {problem}; sample with temperature > 0 and top_p 1, "
                "or train with cross_entropy, awr or filtered_bc"
            )
        return self

    @model_validator(mode="after")
    def _trainable(self) -> RunConfig:
        """Refuse combinations that run but cannot learn (every advantage 0, every row dropped)."""
        learner = self.learner
        baseline = {"group": "the group mean", "return_to_go": "the (group, turn) mean"}
        if (self.producer.group_size == 1 and learner.loss != "cross_entropy" and learner.advantage in baseline
                and not (learner.advantage == "return_to_go" and learner.return_to_go_baseline != "group_turn")):
            raise ValueError(
                f"producer.group_size 1 with learner.advantage {learner.advantage} makes every advantage 0 (a row "
                f"minus {baseline[learner.advantage]} of itself); raise producer.group_size to 2 or more, or set "
                "learner.advantage=raw"
            )
        if self.producer.max_staleness > learner.max_staleness:
            raise ValueError(
                f"producer.max_staleness ({self.producer.max_staleness}) exceeds learner.max_staleness "
                f"({learner.max_staleness}): rows sampled that far behind are all dropped by the learner; "
                "lower producer.max_staleness or raise learner.max_staleness"
            )
        return self


def parse_init_from(value: str) -> tuple[str, int | None]:
    """``RUN`` or ``RUN@VERSION`` (``@latest`` = no version) -> (run id, version or None for the newest)."""
    run, _, version = value.partition("@")
    validate_name(run, "learner.init_from run")
    if version in ("", "latest"):
        return run, None
    if not version.isdigit() or int(version) < 1:
        raise ValueError(f"learner.init_from={value!r}: the version after @ must be a number >= 1 or 'latest'")
    return run, int(version)


def check_packable(configs: list[RunConfig], shared: tuple[str, ...], what: str) -> None:
    """Refuse, in one line, runs that cannot be packed into one process: no run, a run named twice, or a
    setting of ``shared`` (dotted ``section.field`` names) that differs from the first run's; ``what`` names
    what the runs would share (e.g. "one sampling engine and event log")."""
    if not configs:
        raise ValueError("no run to pack; name at least one run")
    runs = [c.run_id for c in configs]
    if len(set(runs)) != len(runs):
        raise ValueError(f"runs {runs} name a run twice; pack each run once")
    first = configs[0]
    for cfg in configs[1:]:
        for name in shared:
            section, field = name.split(".")
            ours, theirs = getattr(getattr(first, section), field), getattr(getattr(cfg, section), field)
            if ours != theirs:
                raise ValueError(f"runs {first.run_id} and {cfg.run_id} differ in {name} ({ours} vs {theirs}); "
                                 f"packed runs share {what}: start them separately")


def active_learner(config: RunConfig) -> LearnerConfig | ValueLearnerConfig:
    """The learner that trains the run: a value run's value learner, any other run's LoRA learner."""
    return config.value.learner if config.value is not None else config.learner


# where ``step_budget`` reads a run's budget from, as a configuration change names its fields (dotted paths)
STEP_BUDGET_FIELDS = ("learner.max_steps", "value.learner.max_steps")


def step_budget(config: RunConfig) -> int | None:
    """The run's ``max_steps``: its active learner's (``active_learner``)."""
    return active_learner(config).max_steps
