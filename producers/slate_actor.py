"""Slate actors: a ``ValueActor`` that recommends a slate of k candidates per step (SlateQ on RecSim).

Registry (kind ``value-network``, agent ``slateq``) -> ``ValueNetworkWatcher`` ->
``SlateActor`` -> steps table -> value learner, as for DQN (``producers.value_actor``).
Per step the actor reads ``env.numeric_state()`` (interests, the hidden budget,
candidate topics), picks a slate epsilon-greedily (a uniformly random k-subset with
probability epsilon, else the published version's best slate by its item values and
the choice model, ``pipeline.slate_network.best_slate``) and answers it as the
candidates' numbers.  The environment records the row itself: ``action`` is the
slate's candidate indices (0-based, ascending) and the ``click_position`` feature the
clicked slot (-1: no click), which is what the learner reads back
(``consumers.value.replay.consumed_items``); nothing is added to the steps schema.
"""

from __future__ import annotations

from typing import Any

from pipeline.slate_network import best_slate, random_slate
from producers.envs.base import TextEnv
from producers.envs.parsing import format_answer
from producers.value_actor import ValueActor
from schemas.value import SlateSpec

Slate = tuple[int, ...]
CHOICE_MODEL_FIELDS = ("num_topics", "num_candidates", "slate_size", "choice_model", "no_click_mass", "min_normalizer")


def slate_answer(slate: Slate) -> str:
    """A slate as the environment's answer: candidate numbers from 1, comma-separated."""
    return format_answer([", ".join(str(i + 1) for i in slate)])


class SlateActor(ValueActor):
    """Plays sessions with the newest published item-value network, a slate per step."""

    def action_choices(self, env: TextEnv) -> list[str]:
        if not hasattr(env.config, "slate_size"):
            raise ValueError(f"environment {env.name} recommends no slates; slate actors play "
                             "recsim-interest-evolution")
        return []  # a slate is k of the candidates, not one of a fixed list of answers

    def act(self, observation: list[float], epsilon: float) -> Slate:  # type: ignore[override]
        """Epsilon-greedy over slates: a uniform k-subset, or the loaded version's best slate."""
        network, spec = self.watcher.network, self.watcher.spec
        if network is None or spec is None or spec.slate is None or self.rng.random() < epsilon:
            config = self.env.config
            return random_slate(config.num_candidates, config.slate_size, self.rng)  # type: ignore[attr-defined]
        return best_slate(network, spec.slate, spec.slate.selection, observation)

    def answer(self, action: Any) -> str:
        return slate_answer(action)

    def action_vector(self, action: Any, row: dict[str, Any]) -> list[float]:
        """The environment's own: the slate's candidate indices."""
        return row["action"]


def check_slate_environment(env: TextEnv, observation_size: int, slate: SlateSpec) -> None:
    """Refuse an environment whose observation or choice model differs from the run's ``value`` section."""
    env.reset(0)
    differing = [f"{name} {getattr(env.config, name, None)!r} (run: {getattr(slate, name)!r})"
                 for name in CHOICE_MODEL_FIELDS if getattr(env.config, name, None) != getattr(slate, name)]
    if differing:
        raise ValueError(f"environment {env.name} differs from the run's value.slate: {', '.join(differing)}; "
                         "make value.slate the environment's own values")
    if len(env.numeric_state()) != observation_size:
        raise ValueError(f"environment {env.name} has {len(env.numeric_state())} observation values, the run's value "
                         f"section says {observation_size}; fix value.observation_size")
