"""Finished episodes -> trajectory rows (pure).

Whole-episode rows for short multi-turn environments; one row per turn, with
the turn's reward and the return-to-go, for long-horizon ones.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from producers.episode import Episode


def episode_rows(
    episode: Episode, *, run_id: str, batch_id: str, producer_id: str, env_name: str, created_at: datetime,
    with_text: bool = True,
) -> list[dict[str, Any]]:
    """The trajectory rows (dicts matching ``TrajectoryRecord``) of a finished episode."""
    common = {
        "run_id": run_id,
        "batch_id": batch_id,
        "episode_id": episode.episode_id,
        "group_id": episode.group_id,
        "env": env_name,
        "env_seed": episode.seed,
        "producer_id": producer_id,
        "policy_version": episode.policy_version,
        "adapter_sha256": episode.adapter_sha256,
        "temperature": episode.temperature,
        "top_p": episode.top_p,
        "top_k": 0,  # the samplers never cut to the top k
        "reward": episode.episode_return,
        "num_turns": len(episode.turns),
        "success": episode.success,
        "terminated": episode.terminated,
        "truncated": episode.truncated,
        "created_at": created_at,
    }
    decode = episode.tokenizer.decode
    if not episode.per_turn:
        return [{
            **common,
            "tokens": episode.tokens,
            "loss_mask": episode.loss_mask,
            "logprobs": episode.logprobs,
            "turn_rewards": episode.turn_rewards,
            "turn": 0,
            "return_to_go": episode.episode_return,
            "text": decode(episode.tokens, skip_special_tokens=False) if with_text else None,
        }]
    rows = []
    rewards = episode.turn_rewards
    for index, turn in enumerate(episode.turns):
        tokens = turn.prompt_ids + turn.generated_ids
        rows.append({
            **common,
            "tokens": tokens,
            "loss_mask": [0] * len(turn.prompt_ids) + [1] * len(turn.generated_ids),
            "logprobs": [0.0] * len(turn.prompt_ids) + turn.generated_logprobs,
            "turn_rewards": [turn.reward],
            "turn": index,
            "return_to_go": float(sum(rewards[index:])),  # undiscounted G_t = sum_{k>=t} r_k
            "state": turn.state,
            "text": decode(tokens, skip_special_tokens=False) if with_text else None,
        })
    return rows
