"""Demonstrations: a scripted policy's episodes as token trajectories, for supervised warm starts.

The episodes go through the producer's own ``Episode`` bookkeeping, so the
prompts are exactly the ones a sampler would see, and the answers are the
policy's text tokenized once and closed with the stop token.  ``noise`` is the
share of turns answered by the random policy instead of the heuristic (a
deliberately imperfect teacher).  Rows carry ``policy_version`` 0 and zero
logprobs: there was no sampler, so they are for ``cross_entropy``-style losses
(behaviour cloning, filtered BC, AWR), not for importance sampling.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime
from typing import Any

from pipeline.archive import BatchInfo, TrajectoryArchive
from producers.envs.registry import make_env
from producers.episode import ChatFormat, ChatTokenizer, Episode
from producers.rows import episode_rows
from schemas.trajectory import NO_ADAPTER_SHA


def demonstration_episode(
    env_name: str, overrides: dict[str, Any], tokenizer: ChatTokenizer, chat: ChatFormat, seed: int, noise: float,
    group_id: str, max_model_len: int = 2048,
) -> Episode:
    """Play one episode with the heuristic (random with probability ``noise`` per turn), token by token."""
    env = make_env(env_name, overrides)
    episode = Episode(env=env, tokenizer=tokenizer, chat=chat, seed=seed, episode_id=uuid.uuid4().hex,
                      group_id=group_id, policy_version=0, adapter_sha256=NO_ADAPTER_SHA,
                      per_turn=env.long_horizon, history_turns=env.config.history_turns, max_model_len=max_model_len)
    episode.start()
    rng = random.Random(f"demo:{seed}")
    while not episode.done:
        answer = env.random_answer(rng) if rng.random() < noise else env.heuristic_answer()
        ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        episode.record_generation(episode.next_prompt(), ids, [0.0] * len(ids))
        episode.apply_step(env.step(answer))
    return episode


def record_demonstrations(
    archive: TrajectoryArchive, run_id: str, env_name: str, overrides: dict[str, Any], tokenizer: ChatTokenizer,
    episodes: int, noise: float, seed_start: int = 0, episodes_per_batch: int = 16,
) -> list[BatchInfo]:
    """Write ``episodes`` demonstration episodes of ``env_name`` as trajectory batches of ``run_id``."""
    chat = ChatFormat.from_tokenizer(tokenizer)
    infos = []
    for first in range(0, episodes, episodes_per_batch):
        batch_id = f"demo-{uuid.uuid4().hex[:16]}"
        created = datetime.now(UTC)
        rows = []
        for seed in range(seed_start + first, seed_start + min(episodes, first + episodes_per_batch)):
            episode = demonstration_episode(env_name, overrides, tokenizer, chat, seed, noise, f"{batch_id}-s{seed}")
            rows += episode_rows(episode, run_id=run_id, batch_id=batch_id, producer_id="demonstrations",
                                 env_name=env_name, created_at=created, with_text=False)
        infos.append(archive.write_batch(run_id, rows, batch_id=batch_id, created=created))
    return infos
