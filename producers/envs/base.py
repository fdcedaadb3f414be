"""The multi-turn text environment interface every rlpipe environment implements.

A rollout worker drives every environment the same way: ``reset(seed)`` gives the
first observation text, ``step(answer_text)`` parses the model's answer, applies
up to ``max_actions_per_turn`` actions and returns the next observation, the
turn's reward, ``terminated``, ``truncated`` and an info dict.  Bad answers cost
a format penalty; they never raise.  An answer holding more actions than the
episode has left (``max_actions_total``) plays those that fit and ends the episode
truncated, without the penalty: it followed the rules, the episode ran out.

Subclasses implement four small hooks (``_reset``, ``_parse_action``,
``_apply_action``, ``_render``) and get the answer parsing, the action limits,
the format penalty and the step records for the RLDS-like steps table from
:class:`TextEnv`.  Why one base class: the limits and penalties are the part of
an environment that is easiest to get subtly different between environments,
and the worker relies on them being identical.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from producers.envs.parsing import parse_answer

ActionT = TypeVar("ActionT")
REJECTED_SHOWN_CHARS = 80  # of an action that is no action here, as much is kept to name it

ANSWER_FORMAT = (
    "You may think inside <think>...</think>. Give your answer inside "
    "<answer>...</answer>; separate several actions with ||."
)


def checked_seed(env_name: str, seed: int) -> int:
    """``seed`` as an int; ValueError naming the fix when it is negative.

    Seeds are 0 or more: numpy's generators refuse a negative seed, and ``random.Random(-n)``
    would quietly replay the episode of ``n``.
    """
    value = int(seed)
    if value < 0:
        raise ValueError(f"{env_name}: seed must be 0 or more, got {value}; use a seed >= 0")
    return value


class EnvConfig(BaseModel):
    """Settings every environment shares; subclasses add their own fields."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_turns: int = Field(6, ge=1, le=100_000, description="Turns (model answers) per episode.")
    max_actions_per_turn: int = Field(5, ge=1, le=1_000, description="Actions applied from one answer.")
    max_actions_total: int = Field(10, ge=1, le=1_000_000, description="Actions applied in one episode.")
    max_env_steps: int = Field(100, ge=1, le=10_000_000, description="Environment steps before truncation.")
    format_penalty: float = Field(-0.1, le=0.0, description="Reward for a missing/unparsable answer or invalid action.")
    history_turns: int = Field(
        0, ge=0, le=64,
        description="For per-turn prompts (long-horizon envs): recent turns the producer keeps in context.",
    )


class LongHorizonConfig(EnvConfig):
    """Settings of an environment played one action a turn, whose every limit is its truncation limit.

    ``max_turns`` and ``max_actions_total`` not given follow a given ``max_env_steps``: a truncation
    limit set alone is the episode's length, rather than one the default turn limit cuts short
    (which would also leave the episode's success, reaching the limit, out of reach).
    """

    @model_validator(mode="before")
    @classmethod
    def _limits_follow_env_steps(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_env_steps" in data:
            steps = data["max_env_steps"]
            return {"max_turns": steps, "max_actions_total": steps} | data
        return data


@dataclass(frozen=True)
class ActionOutcome:
    """What one applied action did to the environment."""

    reward: float
    effective: bool = True  # the state changed
    terminated: bool = False
    success: bool = False
    note: str = ""  # how the action was taken when not as written (a setpoint clipped to its range)


@dataclass
class StepResult:
    """What ``TextEnv.step`` returns for one turn (one model answer)."""

    observation: str
    reward: float
    terminated: bool
    truncated: bool
    info: dict[str, Any] = field(default_factory=dict)


class TextEnv(abc.ABC, Generic[ActionT]):
    """Base class: answer parsing, limits, format penalty, step records.

    Subclasses set ``name``, ``description`` and ``Config`` and implement the hooks.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    Config: ClassVar[type[EnvConfig]] = EnvConfig
    split_actions: ClassVar[bool] = True  # False: the whole answer is one action (e.g. SQL)
    # True: too long for one context; the producer starts a fresh prompt each turn
    # (system prompt, the last ``history_turns`` turns, the current state) and writes a row per turn.
    long_horizon: ClassVar[bool] = False

    def __init__(self, config: EnvConfig | None = None, **overrides: Any) -> None:
        base = config if config is not None else self.Config()
        if not isinstance(base, self.Config):
            raise TypeError(f"{self.name}: config must be {self.Config.__name__}, got {type(base).__name__}")
        # Re-validate from the fields that were set, so fields a config derives from
        # others (e.g. limits from an episode length) are derived again.
        self.config = (
            self.Config.model_validate({**base.model_dump(exclude_unset=True), **overrides}) if overrides else base
        )
        self.rng = random.Random(0)
        self.seed: int | None = None
        self.turn = 0
        self.actions_used = 0
        self.env_steps = 0
        self.done = True
        self.episode_return = 0.0
        self.step_records: list[dict[str, Any]] = []

    # ---- hooks ------------------------------------------------------------
    @abc.abstractmethod
    def _reset(self, seed: int) -> None:
        """Build the episode's initial state from ``seed`` (use ``self.rng``)."""

    @abc.abstractmethod
    def _parse_action(self, text: str) -> ActionT | None:
        """One action's text to an action, or None if it is not a valid action."""

    @abc.abstractmethod
    def _apply_action(self, action: ActionT) -> ActionOutcome:
        """Advance the environment by one action (one environment step)."""

    @abc.abstractmethod
    def _render(self) -> str:
        """The current state as text (no instructions)."""

    def system_prompt(self) -> str:
        """Rules, legend and answer format; the first message of a conversation."""
        return f"{self.description}\n{ANSWER_FORMAT}"

    def action_help(self) -> str:
        """What one valid action looks like, in a few words (told to a player whose action was not one)."""
        return "see the rules for the actions"

    def numeric_state(self) -> list[float]:
        """The state as numbers for the steps table ([] when there is none)."""
        return []

    def action_vector(self, action: ActionT) -> list[float]:
        """An action as numbers for the steps table."""
        return []

    def features(self) -> dict[str, float]:
        """Extra named numeric features of the current state (steps table)."""
        return {}

    def heuristic_answer(self) -> str:
        """The scripted/heuristic policy's answer text for the current state."""
        raise NotImplementedError(f"{self.name} has no heuristic policy")

    def random_answer(self, rng: random.Random) -> str:
        """A uniformly random valid answer text for the current state."""
        raise NotImplementedError(f"{self.name} has no random policy")

    @classmethod
    def held_out_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        """The settings of this environment's held-out (evaluation) episodes, given the training run's ``overrides``.

        By default the same: a seed the run never trained on is an episode it never saw.  An environment whose seeds
        index a finite set (text-to-SQL's tasks) overrides this to play a held-out part of that set instead.
        """
        return dict(overrides)

    def per_turn_prompts(self) -> bool:
        """Whether each turn is its own prompt and row (long-horizon envs) rather than one growing chat."""
        return self.long_horizon

    def answer_choices(self) -> list[str] | None:
        """Every answer ``random_answer`` draws from, when that set is small and finite; else None.

        Weighted demonstrations (``producers.demonstrations``) write one row per choice,
        weighted by the noisy teacher's probability of it.
        """
        return None

    # ---- driver -----------------------------------------------------------
    def reset(self, seed: int) -> str:
        """Start the episode for ``seed`` (0 or more; same seed, same episode); return the first observation."""
        self.seed = checked_seed(self.name, seed)
        self.rng = random.Random(self.seed)
        self.turn = self.actions_used = self.env_steps = 0
        self.done = False
        self.episode_return = 0.0
        self.step_records = []
        self._reset(self.seed)
        return self.observation()

    def observation(self) -> str:
        """The observation text shown to the model for the current state."""
        return self._render()

    def step(self, answer_text: str) -> StepResult:
        """Apply one model answer; bad answers cost ``format_penalty`` and never raise."""
        if self.done:
            raise RuntimeError(f"{self.name}: step() after the episode ended; call reset(seed) first")
        cfg = self.config
        # More actions than one answer may hold breaks a stated rule (format penalty); more than the episode has
        # left (>= 1 while it runs) is a well-formed answer the episode's end cuts short: no penalty.
        parsed = parse_answer(answer_text, max_actions=cfg.max_actions_per_turn, split=self.split_actions)
        actions_left = cfg.max_actions_total - self.actions_used
        cut = max(0, len(parsed.actions) - actions_left)
        reward = 0.0
        valid = parsed.ok
        effective = False
        terminated = success = False
        applied = 0
        rejected: str | None = None
        notes = [f"{cut} action(s) not played: the episode's {cfg.max_actions_total}-action budget ran out"] if cut else []
        for action_text in parsed.actions[:actions_left]:
            action = self._parse_action(action_text)
            if action is None:
                valid, rejected = False, action_text.strip()[:REJECTED_SHOWN_CHARS]
                break
            outcome = self._take(action)
            applied += 1
            reward += outcome.reward
            effective = effective or outcome.effective
            notes += [outcome.note] if outcome.note else []
            terminated, success = outcome.terminated, outcome.success
            if terminated or self.env_steps >= cfg.max_env_steps:
                break
        if not valid:
            reward += cfg.format_penalty
            idle = self._idle_action() if applied == 0 else None
            if idle is not None:  # time passes all the same: sitting a long episode out must not pay
                outcome = self._take(idle)
                reward += outcome.reward
                terminated, success = outcome.terminated, outcome.success
                notes.append(f"no valid action: time passed as with {self._describe_idle(idle)}")
        self.actions_used += applied
        self.turn += 1
        truncated = not terminated and (
            self.turn >= cfg.max_turns
            or self.actions_used >= cfg.max_actions_total
            or self.env_steps >= cfg.max_env_steps
        )
        self.done = terminated or truncated
        if self.step_records and self.done:
            self.step_records[-1]["is_last"] = True
            self.step_records[-1]["is_terminal"] = terminated
        self.episode_return += reward
        info = {
            "success": success,
            "action_is_valid": valid,
            "action_is_effective": effective,
            "actions_used": applied,
            "actions_total": self.actions_used,
            "actions_cut": cut,  # actions of a well-formed answer past the episode's action budget, never read
            "env_steps": self.env_steps,
            "format_error": parsed.error,
            "rejected_action": rejected,  # the action text that is no action here (None when every one was)
            "notes": notes,  # how actions were taken when not as written
        }
        return StepResult(self.observation(), reward, terminated, truncated, info)

    def _take(self, action: ActionT) -> ActionOutcome:
        """Apply one action: the environment's step, counted and recorded."""
        numeric_before = self.numeric_state()
        outcome = self._apply_action(action)
        self.env_steps += 1
        self._record_step(numeric_before, action, outcome)
        return outcome

    def _idle_action(self) -> ActionT | None:
        """What happens in a turn whose answer applied no action, for a task whose time runs on regardless (the
        acrobot's torque 0, the building's setpoints held); None (the default): the turn moves nothing.

        Where every step costs more than the format penalty, a turn that moves nothing would make never
        answering validly score better than playing; the idle action makes it cost the step and the penalty.
        """
        return None

    def _describe_idle(self, action: ActionT) -> str:
        return str(action)

    def _record_step(self, observation: list[float], action: ActionT, outcome: ActionOutcome) -> None:
        self.step_records.append(
            {
                "step": len(self.step_records),
                "is_first": not self.step_records,
                "is_last": False,
                "is_terminal": False,
                "observation": observation,
                "action": self.action_vector(action),
                "reward": float(outcome.reward),
                "discount": 0.0 if outcome.terminated else 1.0,
                "features": self.features(),
            }
        )
