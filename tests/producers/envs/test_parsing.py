"""The shared answer parser and the action limits, fuzzed."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from producers.envs.base import ActionOutcome, TextEnv
from producers.envs.parsing import ACTION_SEPARATOR, MAX_ACTION_CHARS, format_answer, match_action, parse_answer
from producers.envs.registry import env_names, make_env


def test_basic_answers():
    assert parse_answer("<think>hmm</think><answer>Up || Left</answer>", 5).actions == ("Up", "Left")
    assert parse_answer("<answer> Up </answer>", 5).ok
    assert parse_answer("no tags", 5).error == "missing <answer>"
    assert parse_answer("<answer>Up", 5).error == "missing </answer>"
    assert parse_answer("<answer></answer>", 5).error == "empty answer"
    assert parse_answer("<answer>a || || b</answer>", 5).error == "empty action"


def test_thinking_cannot_smuggle_an_answer():
    # only what follows the last </think> counts
    parsed = parse_answer("<think><answer>Down</answer></think><answer>Up</answer>", 5)
    assert parsed.actions == ("Up",)
    assert not parse_answer("<think><answer>Down</answer></think>", 5).ok


def test_an_unclosed_thought_cannot_smuggle_an_answer():
    # a turn cut by max_tokens mid-thought: the answer it was weighing is no answer
    parsed = parse_answer("<think>maybe <answer>Down</answer>, or else", 5)
    assert parsed.actions == () and not parsed.ok and parsed.error == "unclosed <think>"
    assert parse_answer("<think>a</think><think>b <answer>Down</answer>", 5).error == "unclosed <think>"
    # an answer given before a new thought opens stands, and so does one that merely mentions the tag
    assert parse_answer("<answer>Up</answer><think>more", 5).actions == ("Up",)
    assert parse_answer("<answer>SELECT '<think>' FROM t</answer>", 1, split=False).actions == ("SELECT '<think>' FROM t",)


def test_too_many_actions_keeps_the_first_and_flags_it():
    parsed = parse_answer("<answer>a || b || c</answer>", 2)
    assert parsed.actions == ("a", "b") and not parsed.ok and parsed.error == "too many actions"


def test_no_split_keeps_sql_concatenation():
    parsed = parse_answer("<answer>SELECT a || b FROM t</answer>", 1, split=False)
    assert parsed.actions == ("SELECT a || b FROM t",) and parsed.ok


def test_match_action_order():
    names = ("Up", "Down", "Left", "Right")
    assert match_action("Up", names) == "Up"
    assert match_action("rIgHt", names) == "Right"
    assert match_action("3", names) == "Left"
    assert match_action("5", names) is None and match_action("0", names) is None


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(text=st.text(max_size=2000), limit=st.integers(min_value=-3, max_value=12), split=st.booleans())
def test_fuzz_never_raises_and_respects_the_limit(text, limit, split):
    parsed = parse_answer(text, limit, split=split)
    assert len(parsed.actions) <= max(limit, 0)
    assert all(0 < len(a) <= MAX_ACTION_CHARS for a in parsed.actions)


@settings(max_examples=200, deadline=None)
@given(actions=st.lists(st.text(alphabet=st.characters(blacklist_characters="|<>"), min_size=1, max_size=20)
                        .map(str.strip).filter(bool), min_size=1, max_size=6))
def test_format_then_parse_round_trip(actions):
    assert parse_answer(format_answer(actions), len(actions)).actions == tuple(actions)


def test_huge_answers_are_linear_and_bounded():
    huge = "<answer>" + ("Up " + ACTION_SEPARATOR + " ") * 200_000 + "Up</answer>"
    parsed = parse_answer(huge, 5)
    assert len(parsed.actions) == 5 and not parsed.ok
    assert not parse_answer("<answer>" + "x" * (MAX_ACTION_CHARS + 1) + "</answer>", 5).ok
    assert parse_answer("<" * 5_000_000, 5).error == "missing <answer>"


@pytest.mark.parametrize("name", env_names())
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(answers=st.lists(st.one_of(st.text(max_size=300), st.builds(lambda a: f"<answer>{a}</answer>",
                                                                    st.text(max_size=60))), min_size=1, max_size=4))
def test_every_env_survives_garbage_within_limits(name, answers):
    env = make_env(name)
    env.reset(3)
    for answer in answers:
        if env.done:
            break
        result = env.step(answer)
        assert isinstance(result.reward, float)
        assert result.info["actions_used"] <= env.config.max_actions_per_turn
        assert env.actions_used <= env.config.max_actions_total
        if not result.info["action_is_valid"]:
            assert result.reward <= 0.0 or name in ("text2sql",)


@pytest.mark.parametrize("name", env_names())
def test_every_env_is_deterministic(name):
    def play(seed):
        env = make_env(name)
        trace = [env.reset(seed)]
        for _ in range(5):
            result = env.step(env.heuristic_answer())
            trace += [result.observation, result.reward, result.terminated, result.truncated]
            if result.terminated or result.truncated:
                break
        return trace

    assert play(11) == play(11)


class Counter(TextEnv[str]):
    """A tiny environment for the limits: the action ``a`` earns +1, anything else is no action."""

    name = "counter"
    description = "Say a."

    def _reset(self, seed: int) -> None:
        pass

    def _parse_action(self, text: str) -> str | None:
        return text if text == "a" else None

    def _apply_action(self, action: str) -> ActionOutcome:
        return ActionOutcome(1.0)

    def _render(self) -> str:
        return f"{self.actions_used} said"


def test_an_answer_past_the_episodes_action_budget_plays_what_fits_and_ends_truncated_without_the_penalty():
    """5 actions per answer, 3 in all: after 2, an answer of 3 (within the per-answer rule) plays 1 and ends the
    episode truncated; the 2 cut off by the episode's budget are no format error (+1, not 1 - 0.1)."""
    env = Counter(max_actions_per_turn=5, max_actions_total=3, max_turns=10)
    env.reset(0)
    assert env.step(format_answer(["a", "a"])).reward == 2.0
    result = env.step(format_answer(["a", "a", "a"]))
    assert result.reward == 1.0 and result.truncated and not result.terminated
    assert result.info["action_is_valid"] and result.info["format_error"] == ""
    assert result.info["actions_used"] == 1 and result.info["actions_cut"] == 2 and env.actions_used == 3
    assert any("budget" in note for note in result.info["notes"])
    assert env.episode_return == 3.0


def test_an_answer_past_the_per_answer_limit_is_still_a_format_error():
    """The rules say how many actions one answer may hold: 6 of 5 plays 5 and costs the penalty (5 - 0.1)."""
    env = Counter(max_actions_per_turn=5, max_actions_total=100, max_turns=10)
    env.reset(0)
    result = env.step(format_answer(["a"] * 6))
    assert result.reward == pytest.approx(4.9) and not result.truncated
    assert not result.info["action_is_valid"] and result.info["format_error"] == "too many actions"
    assert result.info["actions_used"] == 5 and result.info["actions_cut"] == 0


@pytest.mark.parametrize("name", env_names())
def test_every_env_refuses_a_negative_seed_in_one_line_and_stays_usable(name):
    """Seeds are 0 or more: -1 is refused before the episode changes (it was a numpy traceback for the building and
    silently the episode of seed 1 elsewhere)."""
    env = make_env(name)
    with pytest.raises(ValueError, match=r"seed must be 0 or more, got -1") as refused:
        env.reset(-1)
    assert "\n" not in str(refused.value) and env.done
    assert env.reset(1) == make_env(name).reset(1)
