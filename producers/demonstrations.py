"""Demonstrations: a scripted policy's episodes as token trajectories, for supervised warm starts.

The episodes go through the producer's own ``Episode`` bookkeeping, so the
prompts are exactly the ones a sampler would see, and the answers are the
policy's text tokenized once and closed with the stop token.  ``noise`` is the
share of turns answered by the random policy instead of the heuristic (a
deliberately imperfect teacher).  Rows carry ``policy_version`` 0 and zero
logprobs: there was no sampler, so they are for ``cross_entropy``-style losses
(behaviour cloning, filtered BC, AWR), not for importance sampling.

``weighted`` demonstrations record the noisy teacher's whole action distribution
instead of one draw from it: for environments with a small answer set
(``TextEnv.answer_choices``, e.g. CartPole's left/right) every turn becomes one
row per choice, weighted by the teacher's probability of it,
``(1 - noise) * [choice is the heuristic's] + noise / len(choices)``; the episode
itself follows the drawn answer.  Supervised training on them fits that
distribution exactly, without the label noise of single draws, which needs
about ``1 / (1 - noise)^2`` times more rows to average out.
"""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime
from typing import Any

from pipeline.io.archive import BatchInfo, TrajectoryArchive
from producers.envs.registry import make_env
from producers.episode import ChatFormat, ChatTokenizer, Episode
from producers.rows import episode_rows
from schemas.trajectory import NO_ADAPTER_SHA


def demonstration_episode(
    env_name: str, overrides: dict[str, Any], tokenizer: ChatTokenizer, chat: ChatFormat, seed: int, noise: float,
    group_id: str, max_model_len: int = 2048, teacher: list[dict[str, float]] | None = None,
) -> Episode:
    """Play one episode with the heuristic (random with probability ``noise`` per turn), token by token.

    With ``teacher`` (a list), each turn's answer distribution {answer text: probability}
    is appended to it; the environment must have ``answer_choices``.
    """
    env = make_env(env_name, overrides)
    episode = Episode(env=env, tokenizer=tokenizer, chat=chat, seed=seed, episode_id=uuid.uuid4().hex,
                      group_id=group_id, policy_version=0, adapter_sha256=NO_ADAPTER_SHA,
                      per_turn=env.per_turn_prompts(), history_turns=env.config.history_turns, max_model_len=max_model_len)
    episode.start()
    rng = random.Random(f"demo:{seed}")
    while not episode.done:
        if teacher is not None:
            teacher.append(teacher_distribution(env, noise))
        answer = env.random_answer(rng) if rng.random() < noise else env.heuristic_answer()
        ids = [*tokenizer.encode(answer, add_special_tokens=False), chat.answer_end_id(tokenizer)]
        episode.record_generation(episode.next_prompt(), ids, [0.0] * len(ids))
        episode.apply_step(env.step(answer))
    return episode


def teacher_distribution(env: Any, noise: float) -> dict[str, float]:
    """The noisy teacher's probability of each answer in the current state."""
    choices = env.answer_choices()
    if not choices:
        single = type(env)(env.config.model_copy(update={"max_actions_per_turn": 1}))
        hint = (" or with --overrides '{\"max_actions_per_turn\": 1}' (one action per answer)"
                if env.config.max_actions_per_turn > 1 and single.answer_choices() else "")
        raise ValueError(f"{env.name} has no small answer set; record it without --weighted{hint}")
    best = env.heuristic_answer()
    if best not in choices:
        raise ValueError(f"{env.name}: the heuristic answer {best!r} is not one of answer_choices()")
    return {choice: (1.0 - noise) * (choice == best) + noise / len(choices) for choice in choices}


def weighted_rows(rows: list[dict[str, Any]], teacher: list[dict[str, float]], tokenizer: ChatTokenizer,
                  chat: ChatFormat) -> list[dict[str, Any]]:
    """Each per-turn row as one row per answer choice, weighted by the teacher's probability of it."""
    if len(rows) != len(teacher):
        raise ValueError("weighted demonstrations need one row per turn (a long-horizon environment)")
    out = []
    for row, distribution in zip(rows, teacher, strict=True):
        prompt = row["tokens"][: row["loss_mask"].index(1)]
        for answer, probability in distribution.items():
            ids = [*tokenizer.encode(answer, add_special_tokens=False), chat.answer_end_id(tokenizer)]
            out.append({**row, "tokens": prompt + ids, "loss_mask": [0] * len(prompt) + [1] * len(ids),
                        "logprobs": [0.0] * (len(prompt) + len(ids)), "weight": probability})
    return out


def record_demonstrations(
    archive: TrajectoryArchive, run_id: str, env_name: str, overrides: dict[str, Any], tokenizer: ChatTokenizer,
    episodes: int, noise: float, seed_start: int = 0, episodes_per_batch: int = 16, weighted: bool = False,
) -> list[BatchInfo]:
    """Write ``episodes`` demonstration episodes of ``env_name`` as trajectory batches of ``run_id``."""
    chat = ChatFormat.from_tokenizer(tokenizer)
    infos = []
    for first in range(0, episodes, episodes_per_batch):
        batch_id = f"demo-{uuid.uuid4().hex[:16]}"
        created = datetime.now(UTC)
        rows = []
        for seed in range(seed_start + first, seed_start + min(episodes, first + episodes_per_batch)):
            teacher: list[dict[str, float]] | None = [] if weighted else None
            episode = demonstration_episode(env_name, overrides, tokenizer, chat, seed, noise, f"{batch_id}-s{seed}",
                                            teacher=teacher)
            episode_rows_ = episode_rows(episode, run_id=run_id, batch_id=batch_id, producer_id="demonstrations",
                                         env_name=env_name, created_at=created, with_text=False)
            rows += weighted_rows(episode_rows_, teacher, tokenizer, chat) if teacher is not None else episode_rows_
        infos.append(archive.write_batch(run_id, rows, batch_id=batch_id, created=created))
    return infos
