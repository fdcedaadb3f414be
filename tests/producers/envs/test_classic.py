"""CartPole and Acrobot against references written here from the published equations and constants.

The references below are deliberately independent of ``producers.envs.classic``:
plain formulas with the constants typed in, so a wrong constant or a wrong
integrator in the environment shows up as a trajectory mismatch.
"""

from __future__ import annotations

import math
import random

import pytest

from producers.envs.classic import (
    Acrobot,
    AcrobotConfig,
    CartPole,
    CartPoleConfig,
    CartPoleV1,
    acrobot_step,
    acrobot_terminated,
    cartpole_step,
    cartpole_terminated,
)
from producers.envs.evaluate import evaluate, random_policy, run_episode
from producers.envs.registry import make_env

# ---- references ---------------------------------------------------------------

G, M_CART, M_POLE, HALF_LEN, FORCE, TAU = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02


def ref_cartpole(s, action):
    """Barto-Sutton-Anderson cart-pole, explicit Euler, published constants."""
    x, xd, th, thd = s
    f = FORCE if action == 1 else -FORCE
    mt = M_CART + M_POLE
    tmp = (f + M_POLE * HALF_LEN * thd * thd * math.sin(th)) / mt
    thacc = (G * math.sin(th) - math.cos(th) * tmp) / (HALF_LEN * (4 / 3 - M_POLE * math.cos(th) ** 2 / mt))
    xacc = tmp - M_POLE * HALF_LEN * thacc * math.cos(th) / mt
    return [x + TAU * xd, xd + TAU * xacc, th + TAU * thd, thd + TAU * thacc]


def ref_acrobot_derivs(y):
    """Sutton & Barto's acrobot (the 'book' variant); unit links, masses and inertias, com at 0.5."""
    t1, t2, d1_, d2_, a = y
    m1 = m2 = l1 = 1.0
    lc1 = lc2 = 0.5
    inertia = 1.0
    d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * math.cos(t2)) + 2 * inertia
    d2 = m2 * (lc2**2 + l1 * lc2 * math.cos(t2)) + inertia
    phi2 = m2 * lc2 * 9.8 * math.cos(t1 + t2 - math.pi / 2)
    phi1 = (
        -m2 * l1 * lc2 * d2_**2 * math.sin(t2)
        - 2 * m2 * l1 * lc2 * d2_ * d1_ * math.sin(t2)
        + (m1 * lc1 + m2 * l1) * 9.8 * math.cos(t1 - math.pi / 2)
        + phi2
    )
    dd2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * d1_**2 * math.sin(t2) - phi2) / (m2 * lc2**2 + inertia - d2**2 / d1)
    dd1 = -(d2 * dd2 + phi1) / d1
    return [d1_, d2_, dd1, dd2, 0.0]


def ref_rk4_unclipped(s, torque, h=0.2):
    y = [*s, torque]
    k1 = ref_acrobot_derivs(y)
    k2 = ref_acrobot_derivs([a + h / 2 * b for a, b in zip(y, k1, strict=True)])
    k3 = ref_acrobot_derivs([a + h / 2 * b for a, b in zip(y, k2, strict=True)])
    k4 = ref_acrobot_derivs([a + h * b for a, b in zip(y, k3, strict=True)])
    return [y[i] + h / 6 * (k1[i] + 2 * k2[i] + 2 * k3[i] + k4[i]) for i in range(4)]


def ref_wrap(x):
    while x > math.pi:
        x -= 2 * math.pi
    while x < -math.pi:
        x += 2 * math.pi
    return x


def ref_acrobot(s, torque):
    t1, t2, d1, d2 = ref_rk4_unclipped(s, torque)
    v1, v2 = 4 * math.pi, 9 * math.pi
    return [ref_wrap(t1), ref_wrap(t2), min(max(d1, -v1), v1), min(max(d2, -v2), v2)]


# ---- CartPole -------------------------------------------------------------------


def test_cartpole_defaults_are_the_published_constants():
    cfg = CartPoleConfig()
    assert (cfg.gravity, cfg.cart_mass, cfg.pole_mass, cfg.half_length, cfg.force, cfg.dt) == (
        G, M_CART, M_POLE, HALF_LEN, FORCE, TAU,
    )
    assert (cfg.x_threshold, cfg.angle_threshold_deg, cfg.init_range) == (2.4, 12.0, 0.05)
    assert (cfg.max_env_steps, CartPoleV1.Config().max_env_steps) == (200, 500)
    assert cfg.max_actions_per_turn == 1 and cfg.max_turns == cfg.max_actions_total == cfg.max_env_steps


def test_cartpole_trajectory_matches_euler_reference():
    state = ref = [0.01, -0.2, 0.03, 0.1]
    actions = [1, 0, 0, 1, 1, 1, 0, 1, 0, 0] * 4
    for a in actions:
        state = cartpole_step(state, a, CartPoleConfig())
        ref = ref_cartpole(ref, a)
        assert list(state) == pytest.approx(ref, rel=1e-12, abs=1e-15)
    assert state != [0.01, -0.2, 0.03, 0.1]


def test_cartpole_one_step_by_hand():
    # From rest, pushing right: temp = 10/1.1; thacc = -temp / (0.5 (4/3 - 0.1/1.1)); only velocities change.
    temp = 10 / 1.1
    thacc = -temp / (0.5 * (4 / 3 - 0.1 / 1.1))
    xacc = temp - 0.05 * thacc / 1.1
    assert list(cartpole_step((0.0, 0.0, 0.0, 0.0), 1, CartPoleConfig())) == pytest.approx(
        [0.0, 0.02 * xacc, 0.0, 0.02 * thacc]
    )


@pytest.mark.parametrize(
    ("x", "theta", "done"),
    [
        (2.4, 0.0, False),
        (-2.4, 0.0, False),
        (2.4 + 1e-9, 0.0, True),
        (-2.4 - 1e-9, 0.0, True),
        (0.0, 12 * 2 * math.pi / 360, False),
        (0.0, -12 * 2 * math.pi / 360, False),
        (0.0, 12 * 2 * math.pi / 360 + 1e-9, True),
        (0.0, -12 * 2 * math.pi / 360 - 1e-9, True),
    ],
)
def test_cartpole_terminates_strictly_beyond_thresholds(x, theta, done):
    assert cartpole_terminated((x, 0.0, theta, 0.0), CartPoleConfig()) is done


def test_cartpole_terminal_step_pays_one_and_ends():
    env = CartPole()
    env.reset(0)
    env.state = (2.39, 1.0, 0.0, 0.0)  # x + 0.02 * 1.0 = 2.41 > 2.4 after one step
    result = env.step("<answer>right</answer>")
    assert result.terminated and not result.truncated and result.reward == 1.0
    assert result.info["success"] is False
    assert env.step_records[-1]["is_terminal"] and env.step_records[-1]["discount"] == 0.0


def test_cartpole_env_follows_reference_and_pays_one_per_step():
    env = CartPole()
    env.reset(5)
    ref = list(env.state)
    assert all(abs(v) <= 0.05 for v in ref)
    for a in [1, 1, 0, 1, 0, 0, 0, 1]:
        result = env.step(f"<answer>{['left', 'right'][a]}</answer>")
        ref = ref_cartpole(ref, a)
        assert result.reward == 1.0
        assert list(env.state) == pytest.approx(ref, rel=1e-12, abs=1e-15)
        assert env.step_records[-1]["action"] == [float(a)]


def test_cartpole_truncates_at_200_and_v1_at_500_with_success():
    for cls, limit in [(CartPole, 200), (CartPoleV1, 500)]:
        env = cls()
        result = run_episode(env, lambda e: e.heuristic_answer(), seed=1)
        assert result.truncated and not result.terminated
        assert result.env_steps == result.turns == limit
        assert result.episode_return == limit and result.success


def test_a_longer_truncation_limit_alone_lengthens_the_episode():
    """One action per turn: the turn and action limits follow ``max_env_steps`` unless they are given too."""
    env = make_env("cartpole", {"max_env_steps": 300})
    result = run_episode(env, lambda e: e.heuristic_answer(), seed=1)
    assert result.truncated and not result.terminated
    assert result.env_steps == result.turns == 300  # not cut at the default 200 turns
    assert result.episode_return == 300 and result.success
    for cls, steps in [(CartPoleConfig, 700), (AcrobotConfig, 800)]:
        config = cls(max_env_steps=steps)
        assert (config.max_turns, config.max_actions_total) == (steps, steps)
    given = AcrobotConfig(max_env_steps=800, max_turns=20)
    assert (given.max_turns, given.max_actions_total) == (20, 800)  # a limit given is kept
    assert AcrobotConfig().max_turns == 500


def test_cartpole_parses_words_and_digits_case_insensitively():
    env = CartPole()
    for text, action in [("left", 0), ("RIGHT", 1), ("Left", 0), ("0", 0), ("1", 1), (" right ", 1)]:
        assert env._parse_action(text) == action
    env.reset(0)
    before = env.state
    result = env.step("<answer>up</answer>")
    assert not result.info["action_is_valid"] and result.reward == pytest.approx(-0.1)
    assert env.state == before and env.env_steps == 0
    assert env.step("no tags at all").reward == pytest.approx(-0.1)


def test_cartpole_same_seed_same_episode():
    def episode(seed):
        env = CartPole()
        observations = [env.reset(seed)]
        run_episode(env, random_policy(seed), seed, on_step=lambda e, a, r: observations.append(r.observation))
        return observations, env.episode_return

    assert episode(7) == episode(7)
    assert episode(7)[0][0] != episode(8)[0][0]


def test_cartpole_render_shows_state_and_actions():
    env = CartPole()
    text = env.reset(0)
    x = env.state[0]
    assert f"{x:+.3f}" in text and "left" in text and "right" in text
    assert "<answer>" in env.system_prompt()
    assert len(env.numeric_state()) == 4


# ---- Acrobot --------------------------------------------------------------------


def test_acrobot_defaults_are_the_published_constants():
    cfg = AcrobotConfig()
    assert cfg.dt == 0.2 and cfg.max_vel_1 == 4 * math.pi and cfg.max_vel_2 == 9 * math.pi
    assert (cfg.link_length_1, cfg.link_mass_1, cfg.link_mass_2, cfg.link_moi) == (1.0, 1.0, 1.0, 1.0)
    assert cfg.max_env_steps == cfg.max_turns == 500 and cfg.max_actions_per_turn == 1


def test_acrobot_trajectory_matches_rk4_reference():
    state = ref = [0.05, -0.08, 0.02, 0.01]
    rng = random.Random(3)
    for _ in range(60):
        torque = rng.choice([-1.0, 0.0, 1.0])
        state = acrobot_step(state, torque, AcrobotConfig())
        ref = ref_acrobot(ref, torque)
        assert list(state) == pytest.approx(ref, rel=1e-9, abs=1e-12)


def test_acrobot_wraps_angles():
    start = [math.pi - 0.01, -math.pi + 0.01, 2.0, -3.0]  # both angles cross +/-pi within one step
    unwrapped = ref_rk4_unclipped(start, 0.0)
    assert unwrapped[0] > math.pi and unwrapped[1] < -math.pi
    state = acrobot_step(start, 0.0, AcrobotConfig())
    assert -math.pi <= state[0] <= math.pi and -math.pi <= state[1] <= math.pi
    assert list(state) == pytest.approx(ref_acrobot(start, 0.0), rel=1e-9, abs=1e-12)
    assert state[0] == pytest.approx(unwrapped[0] - 2 * math.pi)


def test_acrobot_clips_velocities():
    start = [0.0, 0.0, 4 * math.pi, 9 * math.pi]
    unclipped = ref_rk4_unclipped(start, 1.0)
    assert abs(unclipped[2]) > 4 * math.pi or abs(unclipped[3]) > 9 * math.pi
    state = acrobot_step(start, 1.0, AcrobotConfig())
    assert abs(state[2]) <= 4 * math.pi and abs(state[3]) <= 9 * math.pi
    assert list(state) == pytest.approx(ref_acrobot(start, 1.0), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("eps", [1e-9, -1e-9])
def test_acrobot_terminates_strictly_above_one(eps):
    # t2 = 0: height = -2 cos t1, so t1 = acos(-(1 + eps) / 2) puts the tip at 1 + eps.
    t1 = math.acos(-(1 + eps) / 2)
    height = -math.cos(t1) - math.cos(t1)
    assert (height > 1) is (eps > 0)
    assert acrobot_terminated((t1, 0.0, 0.0, 0.0)) is (eps > 0)
    assert acrobot_terminated((math.pi, 0.0, 0.0, 0.0)) and not acrobot_terminated((0.0, 0.0, 0.0, 0.0))


def test_acrobot_rewards_minus_one_then_zero_on_goal():
    env = Acrobot()
    result = run_episode(env, lambda e: e.heuristic_answer(), seed=2)
    rewards = [r["reward"] for r in env.step_records]
    assert result.terminated and result.success and not result.truncated
    assert rewards[-1] == 0.0 and all(r == -1.0 for r in rewards[:-1])
    assert result.episode_return == -(result.env_steps - 1)
    state = env.state
    assert -math.cos(state[0]) - math.cos(state[0] + state[1]) > 1.0


def test_acrobot_truncates_at_500():
    env = Acrobot()
    result = run_episode(env, lambda e: "<answer>0</answer>", seed=0)  # no torque never swings up
    assert result.truncated and not result.terminated and not result.success
    assert result.env_steps == 500 and result.episode_return == -500.0


def test_acrobot_env_follows_reference_and_observation():
    env = Acrobot()
    env.reset(4)
    ref = list(env.state)
    assert all(abs(v) <= 0.1 for v in ref)
    for text, torque in [("+1", 1.0), ("-1", -1.0), ("0", 0.0), ("positive", 1.0), ("NEGATIVE", -1.0), ("1", 1.0)]:
        env.step(f"<answer>{text}</answer>")
        ref = ref_acrobot(ref, torque)
        assert list(env.state) == pytest.approx(ref, rel=1e-9, abs=1e-12)
    t1, t2, d1, d2 = ref
    expected = [math.cos(t1), math.sin(t1), math.cos(t2), math.sin(t2), d1, d2]
    assert env.numeric_state() == pytest.approx(expected)
    assert env._parse_action("2") is None and env._parse_action("up") is None


def test_acrobot_same_seed_same_episode():
    a = Acrobot()
    b = Acrobot()
    assert a.reset(11) == b.reset(11)
    rng_a, rng_b = random.Random(1), random.Random(1)
    for _ in range(30):
        assert a.step(a.random_answer(rng_a)).observation == b.step(b.random_answer(rng_b)).observation


# ---- baselines ------------------------------------------------------------------


@pytest.mark.parametrize(("name", "episodes"), [("cartpole", 5), ("cartpole-v1", 3), ("acrobot", 3)])
def test_heuristic_beats_random(name, episodes):
    heuristic = evaluate(name, "heuristic", episodes, seed_start=100)
    rand = evaluate(name, "random", episodes, seed_start=100)
    assert heuristic.mean_return > rand.mean_return + 50
    assert heuristic.success_rate == 1.0


@pytest.mark.parametrize("name", ["acrobot", "building-hvac"])
def test_never_answering_validly_scores_below_playing_where_every_step_costs(name: str) -> None:
    """An answer that moves nothing still lets the environment's time pass (and pays the format penalty), so a
    policy that never answers validly cannot sit out the episode at -0.1 a turn and beat a real controller."""
    from producers.envs.evaluate import evaluate, run_episode
    from producers.envs.registry import make_env

    env = make_env(name)
    garbage = [run_episode(env, lambda env: "I am not sure.", seed) for seed in range(3)]
    random_play = evaluate(name, "random", 3)
    assert all(result.env_steps == result.turns for result in garbage)  # the clock moved every turn
    assert sum(result.episode_return for result in garbage) / 3 < random_play.mean_return
    env.reset(0)
    result = env.step("I am not sure.")
    assert not result.info["action_is_valid"] and result.info["env_steps"] == 1
    assert any("time passed" in note for note in result.info["notes"])
