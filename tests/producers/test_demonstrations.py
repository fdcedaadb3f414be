"""Demonstrations: the scripted teacher's episodes as trajectory rows, drawn or weighted."""

from collections import defaultdict

import pytest

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ObjectStore
from producers.demonstrations import record_demonstrations, teacher_distribution
from producers.envs.registry import make_env

RUN = "demos"


@pytest.fixture
def archive(tmp_path):
    return TrajectoryArchive(ObjectStore(tmp_path.as_uri()))


def rows_of(archive, infos):
    return [row for info in infos for row in archive.read_batch(info.path, info.sha256).to_pylist()]


def answer_text(tokenizer, row):
    start = row["loss_mask"].index(1)
    return tokenizer.decode(row["tokens"][start:], skip_special_tokens=True)


def test_noise_free_demonstrations_are_the_heuristic_and_score_as_it_does(archive, tiny_tokenizer):
    infos = record_demonstrations(archive, RUN, "cartpole", {"history_turns": 0}, tiny_tokenizer, 4, noise=0.0)
    rows = rows_of(archive, infos)
    for seed in range(4):  # replay the heuristic on the same seeds: the same number of turns and return
        env = make_env("cartpole", {"history_turns": 0})
        env.reset(seed)
        answers, total, done = [], 0.0, False
        while not done:
            answers.append(env.heuristic_answer())
            step = env.step(answers[-1])
            total, done = total + step.reward, step.terminated or step.truncated
        episode = sorted((r for r in rows if r["env_seed"] == seed), key=lambda r: r["turn"])
        assert [answer_text(tiny_tokenizer, r) for r in episode] == answers
        assert episode[0]["reward"] == pytest.approx(total)
        assert all(r["weight"] is None for r in episode)


def test_weighted_demonstrations_hold_the_teachers_distribution_per_turn(archive, tiny_tokenizer):
    noise = 0.6
    infos = record_demonstrations(archive, RUN, "cartpole", {"history_turns": 0}, tiny_tokenizer, 3, noise=noise,
                                  weighted=True)
    turns = defaultdict(list)
    for row in rows_of(archive, infos):
        turns[(row["episode_id"], row["turn"])].append(row)
    assert turns and all(len(rows) == 2 for rows in turns.values())
    for rows in turns.values():
        prompts = {tuple(r["tokens"][: r["loss_mask"].index(1)]) for r in rows}
        assert len(prompts) == 1  # the same prompt, two answers
        weights = {answer_text(tiny_tokenizer, r): r["weight"] for r in rows}
        assert set(weights) == {"<answer>left</answer>", "<answer>right</answer>"}
        assert sum(weights.values()) == pytest.approx(1.0)
        assert sorted(weights.values()) == pytest.approx([noise / 2, 1 - noise / 2])


def test_teacher_distribution_favours_the_heuristic_answer():
    env = make_env("acrobot")
    env.reset(3)
    distribution = teacher_distribution(env, 0.3)
    assert distribution[env.heuristic_answer()] == pytest.approx(0.7 + 0.1)
    assert sum(distribution.values()) == pytest.approx(1.0)


def test_weighted_demonstrations_need_a_small_answer_set(archive, tiny_tokenizer):
    with pytest.raises(ValueError, match="no small answer set; record it without --weighted"):
        record_demonstrations(archive, RUN, "sokoban", {}, tiny_tokenizer, 1, noise=0.5, weighted=True)
    assert archive.list_batches(RUN) == []  # nothing written


@pytest.mark.parametrize("weighted", [False, True])
def test_a_base_models_demonstrations_end_each_answer_with_the_templates_closing_token(
        archive, base_chatml_tokenizer, weighted):
    """Sampling stops a base model's turn at the chat template's closing token (``<|im_end|>``, not its eos), so a
    demonstration teaches that token as the end of an answer, once, and never eos."""
    tokenizer = base_chatml_tokenizer
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    infos = record_demonstrations(archive, RUN, "cartpole", {"history_turns": 0}, tokenizer, 2, noise=0.5,
                                  weighted=weighted)
    rows = rows_of(archive, infos)
    assert rows
    for row in rows:
        trained = [t for t, m in zip(row["tokens"], row["loss_mask"], strict=True) if m]
        assert trained[-1] == im_end and trained.count(im_end) == 1, tokenizer.decode(trained)
        assert tokenizer.eos_token_id not in trained
