"""Sokoban: level generation, solver, pushing rules, rewards and answer handling.

Expected rewards are written from the design's numbers (ENVIRONMENTS.md, Sokoban):
-0.1 per action, +1 when a box lands on a target, -1 when one leaves, +10 when all
are placed; a bad answer costs the -0.1 format penalty.
"""

from __future__ import annotations

import random
import time

import pytest

from producers.envs.registry import make_env
from producers.envs.sokoban import (
    Sokoban,
    SokobanLarge,
    SokobanLevel,
    apply_move,
    generate_level,
    reverse_play,
    solve,
)

STEP = -0.1
ON_TARGET = 1.0
OFF_TARGET = -1.0
FINISH = 10.0
FORMAT_PENALTY = -0.1


def env_with(level_text: str, **overrides: object) -> Sokoban:
    env = Sokoban(**overrides)
    env.reset(0)
    env.set_level(SokobanLevel.from_text(level_text))
    return env


def play(env: Sokoban, answer: str) -> tuple[float, dict]:
    result = env.step(answer)
    return result.reward, result.info


def run_episode(env: Sokoban, seed: int, policy: str) -> float:
    env.reset(seed)
    rng = random.Random(seed + 10_000)
    total = 0.0
    while not env.done:
        answer = env.heuristic_answer() if policy == "heuristic" else env.random_answer(rng)
        total += env.step(answer).reward
    return total


# ---- configuration -----------------------------------------------------------
def test_registered_defaults_match_the_design() -> None:
    small, large = make_env("sokoban"), make_env("sokoban-large")
    assert isinstance(small, Sokoban) and isinstance(large, SokobanLarge)
    assert (small.config.dim_room, small.config.num_boxes) == ((6, 6), 1)
    assert (large.config.dim_room, large.config.num_boxes) == ((8, 8), 2)
    cfg = small.config
    assert (cfg.max_turns, cfg.max_actions_per_turn, cfg.max_actions_total, cfg.max_env_steps) == (6, 5, 10, 100)


def test_config_rejects_unknown_and_out_of_range_fields() -> None:
    with pytest.raises(ValueError):
        make_env("sokoban", {"dim_rooms": [6, 6]})
    with pytest.raises(ValueError):
        make_env("sokoban", {"dim_room": [2, 6]})
    assert make_env("sokoban", {"dim_room": [7, 9]}).config.dim_room == (7, 9)


# ---- levels ----------------------------------------------------------------------
def test_text_round_trip_and_legend() -> None:
    text = "#####\n#P√X#\n#_OS#\n#####"
    with pytest.raises(ValueError):  # two players
        SokobanLevel.from_text(text)
    level = SokobanLevel.from_text("#####\n#P√X#\n#_O_#\n#####")
    assert level.render() == "#####\n#P√X#\n#_O_#\n#####"
    assert level.boxes == {(1, 2), (1, 3)} and level.targets == {(1, 2), (2, 2)} and level.player == (1, 1)
    # design's code order: wall, floor, target, box on target, box, player (+ player on target)
    assert level.grid()[1] == [0, 5, 3, 4, 0]
    assert level.grid()[2] == [0, 1, 2, 1, 0]
    on_target = SokobanLevel.from_text("#####\n#S_X#\n#####")
    assert on_target.render() == "#####\n#S_X#\n#####" and on_target.grid()[1][1] == 6


@pytest.mark.parametrize("cls", [Sokoban, SokobanLarge])
def test_generated_levels_are_well_formed(cls: type[Sokoban]) -> None:
    env = cls()
    rows, cols = env.config.dim_room
    for seed in range(30):
        env.reset(seed)
        level = env.level
        grid = level.grid()
        assert len(grid) == rows and all(len(row) == cols for row in grid)
        border = grid[0] + grid[-1] + [row[0] for row in grid] + [row[-1] for row in grid]
        assert set(border) == {0}
        assert len(level.boxes) == len(level.targets) == env.config.num_boxes
        assert level.boxes_on_target == 0  # a scramble with a box left on a target scores 0
        assert set(env.observation().splitlines()[0]) <= set("#_O√XPS")
        assert len(env.numeric_state()) == rows * cols


def test_same_seed_same_episode() -> None:
    def transcript(seed: int) -> list[tuple[str, float]]:
        env = Sokoban()
        out = [(env.reset(seed), 0.0)]
        rng = random.Random(99)
        while not env.done:
            result = env.step(env.random_answer(rng))
            out.append((result.observation, result.reward))
        return out

    assert transcript(5) == transcript(5)
    assert len({Sokoban().reset(seed) for seed in range(10)}) > 1


def test_a_seed_s_level_is_generated_once_and_reset_leaves_the_rng_as_generating_it_does(monkeypatch) -> None:
    # a group's episodes share a seed: its level is scrambled once (reverse play is most of a reset)
    import producers.envs.sokoban as sokoban

    sokoban.cached_level.cache_clear()
    calls: list[int] = []
    original = sokoban.generate_level
    monkeypatch.setattr(sokoban, "generate_level", lambda rng, *a: calls.append(1) or original(rng, *a))
    first, second = Sokoban(), Sokoban()
    assert first.reset(7) == second.reset(7) and first.level == second.level
    assert len(calls) == 1
    uncached = random.Random(7)
    level = original(uncached, (6, 6), 1, int(1.7 * 12), 0.35, 300, 1_000)
    assert level == first.level and first.rng.getstate() == second.rng.getstate() == uncached.getstate()
    Sokoban(dim_room=(7, 7)).reset(7)  # another room size is another level
    assert len(calls) == 2


def test_levels_are_always_solvable() -> None:
    start = time.monotonic()
    env = Sokoban()
    for seed in range(200):
        env.reset(seed)
        solution = solve(env.level)
        assert solution, f"seed {seed} has no solution"
        level = env.level
        for action in solution:  # check the solution independently of the solver
            level = apply_move(level, action)
        assert level.solved
    assert time.monotonic() - start < 30


def test_large_levels_are_solvable() -> None:
    env = SokobanLarge()
    for seed in range(15):
        env.reset(seed)
        assert solve(env.level) is not None


def test_reverse_play_pulls_and_scores() -> None:
    # Corridor: box on its target at column 1, player at 2, floor at 3.  The only scramble
    # is one pull right (player to 3, box to 2): 1 box move x distance 1 = score 1.
    solved = SokobanLevel.from_text("#####\n#√P_#\n#####")
    level, score = reverse_play(solved, search_depth=300)
    assert score == 1
    assert level.boxes == {(1, 2)} and level.player == (1, 3)


def test_levels_scoring_zero_are_rejected() -> None:
    # With no room to move (depth 1 keeps only the solved state) every candidate scores 0.
    with pytest.raises(RuntimeError, match="score > 0"):
        generate_level(random.Random(0), (6, 6), 1, 20, 0.35, search_depth=1, max_attempts=5)


def test_solver_finds_shortest_and_reports_unsolvable() -> None:
    assert solve(SokobanLevel.from_text("#######\n#P_X_O#\n#######")) == ["Right", "Right", "Right"]
    assert solve(SokobanLevel.from_text("#####\n#XO_#\n#__P#\n#####")) is None  # box stuck in a corner
    assert solve(SokobanLevel.from_text("####\n#P√#\n####")) == []


# ---- rules and rewards ---------------------------------------------------------------
def test_scripted_solution_rewards() -> None:
    env = env_with("#######\n#P_X_O#\n#######")
    result = env.step("<answer>Right || Right || Right</answer>")
    rewards = [record["reward"] for record in env.step_records]
    assert rewards == pytest.approx([STEP, STEP, STEP + ON_TARGET + FINISH])
    assert result.reward == pytest.approx(3 * STEP + ON_TARGET + FINISH)
    assert result.terminated and not result.truncated and result.info["success"]
    assert result.observation.splitlines()[1] == "#___P√#"
    assert env.step_records[-1]["is_last"] and env.step_records[-1]["discount"] == 0.0


def test_box_leaving_and_landing_on_targets() -> None:
    env = env_with("########\n#P√_OX_#\n########")
    expected = [
        ("#_SXOX_#", STEP + OFF_TARGET),  # the box leaves its target
        ("#_OP√X_#", STEP + ON_TARGET),  # and lands on the other one
        ("#_OP√X_#", STEP),  # a box cannot push another box
    ]
    for row, reward in expected:
        got, info = play(env, "<answer>Right</answer>")
        assert got == pytest.approx(reward)
        assert env.observation().splitlines()[1] == row
        assert info["action_is_valid"] and not info["success"]
    assert not info["action_is_effective"]


def test_pushing_rules() -> None:
    env = env_with("#####\n#P_X#\n#_O_#\n#####")
    assert play(env, "<answer>Up</answer>")[1]["action_is_effective"] is False  # wall
    play(env, "<answer>Right</answer>")
    reward, info = play(env, "<answer>Right</answer>")  # box against the wall
    assert reward == pytest.approx(STEP) and not info["action_is_effective"]
    assert env.level.boxes == {(1, 3)} and env.level.player == (1, 2)
    reward, info = play(env, "<answer>Down</answer>")  # plain walk onto a target
    assert env.observation().splitlines()[2] == "#_S_#" and info["action_is_effective"]


# ---- answers ------------------------------------------------------------------------
@pytest.mark.parametrize(
    "answer",
    ["<answer>Right</answer>", "<answer>right</answer>", "<answer> RIGHT </answer>", "<answer>4</answer>",
     "<think>push? <answer>Up</answer></think><answer>Right</answer>"],
)
def test_action_spellings(answer: str) -> None:
    env = env_with("######\n#P__O#\n#_X__#\n######")
    reward, info = play(env, answer)
    assert info["action_is_valid"] and reward == pytest.approx(STEP)
    assert env.level.player == (1, 2)


@pytest.mark.parametrize(
    "answer",
    [None, "", "Right", "<answer></answer>", "<answer>Jump</answer>", "<answer>5</answer>", "<answer>0</answer>",
     "<answer>Right", "<answer>" + "x" * 2_000_000 + "</answer>"],
)
def test_bad_answers_cost_the_format_penalty(answer: object) -> None:
    env = env_with("######\n#P__O#\n#_X__#\n######")
    before = env.level
    result = env.step(answer)  # type: ignore[arg-type]
    assert result.reward == pytest.approx(FORMAT_PENALTY)
    assert not result.info["action_is_valid"] and env.level == before
    assert not result.terminated and env.turn == 1


def test_valid_action_then_invalid_one_keeps_the_first() -> None:
    env = env_with("######\n#P__O#\n#_X__#\n######")
    reward, info = play(env, "<answer>Right || Jump || Right</answer>")
    assert reward == pytest.approx(STEP + FORMAT_PENALTY)
    assert env.level.player == (1, 2) and not info["action_is_valid"]


def test_episode_truncates_at_the_action_limit() -> None:
    env = env_with("########\n#P____O#\n#_X____#\n########")
    first = env.step("<answer>Right || Left || Right || Left || Right</answer>")
    second = env.step("<answer>Left || Right || Left || Right || Left</answer>")
    assert not first.truncated and second.truncated and env.done
    assert env.actions_used == 10


# ---- policies -----------------------------------------------------------------------
def test_heuristic_beats_random() -> None:
    env = Sokoban()
    heuristic = [run_episode(env, seed, "heuristic") for seed in range(30)]
    random_ = [run_episode(env, seed, "random") for seed in range(30)]
    assert sum(heuristic) / 30 > sum(random_) / 30 + 3.0


def test_heuristic_follows_a_solution() -> None:
    env = env_with("#######\n#P_X_O#\n#######")
    assert env.heuristic_answer() == "<answer>Right || Right || Right</answer>"


def test_prompt_carries_legend_and_actions() -> None:
    prompt = SokobanLarge().system_prompt()
    for piece in ("# wall", "_ floor", "O target", "√ box on target", "X box", "P player", "S player"):
        assert piece in prompt
    for action in ("Up (1)", "Down (2)", "Left (3)", "Right (4)", "<answer>"):
        assert action in prompt


# ---- the positions observation --------------------------------------------------------
def test_positions_observation_spells_out_the_relations_a_move_depends_on() -> None:
    level = "######\n#P___#\n#__X_#\n#O___#\n######"
    grid_only = env_with(level).observation()
    assert grid_only.splitlines()[0] == "######" and "of you" not in grid_only
    positions = env_with(level, observation="positions").observation().splitlines()
    assert positions == [
        "The box is 1 Down and 2 Right of you.",
        "Its target is 1 Down and 2 Left of it.",
        "Walls next to you: Up, Left.",
        "Boxes on targets: 0/1",
    ]
    both = env_with(level, observation="both").observation().splitlines()
    assert both[:5] == level.split("\n")[:5] and both[5:] == positions


def test_positions_follow_the_moves_and_say_when_the_box_is_placed() -> None:
    env = env_with("#######\n#P_X_O#\n#######", observation="positions")
    assert env.observation().splitlines()[:2] == ["The box is 2 Right of you.", "Its target is 2 Right of it."]
    env.step("<answer>Right</answer>")
    assert env.observation().splitlines()[:2] == ["The box is 1 Right of you.", "Its target is 2 Right of it."]
    env.step("<answer>Right || Right</answer>")
    assert env.observation().splitlines()[:2] == ["The box is 1 Right of you.", "The box is on a target."]


def test_two_boxes_are_numbered_and_each_names_its_nearest_free_target() -> None:
    env = env_with("#########\n#OX_P_XO#\n#########", observation="positions")
    assert env.observation().splitlines()[:4] == [
        "Box 1 is 2 Left of you.", "Its target is 1 Left of it.",
        "Box 2 is 2 Right of you.", "Its target is 1 Right of it.",
    ]


def test_single_move_answers_are_a_small_choice_set_and_per_turn_is_a_setting() -> None:
    assert Sokoban().answer_choices() is None  # several moves per answer: too many to list
    assert not Sokoban().per_turn_prompts()
    env = Sokoban(max_actions_per_turn=1, per_turn=True)
    env.reset(3)
    assert env.answer_choices() == [f"<answer>{a}</answer>" for a in ("Up", "Down", "Left", "Right")]
    assert env.heuristic_answer() in env.answer_choices()
    assert env.per_turn_prompts()
