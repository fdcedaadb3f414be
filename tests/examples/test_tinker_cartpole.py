"""The CartPole SDK loop's own pieces (``examples/tinker_cartpole.py``): its environment, advantage estimates and step bound.

The loop itself runs against a real server in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from tests.examples import example_module


@pytest.fixture(scope="module")
def loop():
    with example_module("tinker_cartpole") as module:
        yield module


def test_gae_on_a_hand_computed_episode(loop):
    # deltas: 1 + 0.9*1 - 2 = -0.1, 1 + 0.9*0.5 - 1 = 0.45, 1 + 0 - 0.5 = 0.5 (the episode ended: no future)
    assert loop.gae([1, 1, 1], [2, 1, 0.5], 0.0, 0.9, 0.5) == pytest.approx([-0.1 + 0.45 * 0.675, 0.675, 0.5])
    # lambda 1: the discounted return-to-go minus the baseline (2.71 - 2, 1.9 - 1, 1 - 0.5)
    assert loop.gae([1, 1, 1], [2, 1, 0.5], 0.0, 0.9, 1.0) == pytest.approx([0.71, 0.9, 0.5])
    # cut at the step limit: the last state's baseline stands in for the future
    assert loop.gae([1], [2], 3.0, 0.9, 0.5) == pytest.approx([1 + 0.9 * 3 - 2])


def test_the_value_baseline_recovers_a_quadratic_function_of_the_state(loop):
    states = np.random.default_rng(0).normal(0, 0.5, (400, 4)) * loop.STATE_SCALE
    truth = 3 + states[:, 2] * 20 - (states[:, 2] / loop.STATE_SCALE[2] + states[:, 3] / 2) ** 2
    weights = loop.fit_value(states, truth, ridge=1e-8)
    assert loop.features(states) @ weights == pytest.approx(truth, abs=1e-5)


def play(loop, seed: int, agree: float, rng: np.random.Generator):
    """One CartPole episode of a policy that pushes as the heuristic with probability ``agree``."""
    env, episode, right = loop.CartPole(seed, 200), loop.Episode(), []
    while not env.done:
        best, state = env.heuristic(), env.state.copy()
        action = best if rng.random() < agree else 1 - best
        episode.turns.append(loop.Turn([], [1], [0.0], env.step(action), state))
        right.append(action == best)
    episode.cut, episode.last_state = not env.fell, env.state.copy()
    return episode, right


def test_gae_tells_right_pushes_from_wrong_ones_better_than_the_return_to_go(loop):
    """What ``--advantage gae`` is for: a turn's advantage follows whether its push was right.

    With the warm start's policy (the heuristic's push 62% of the time), the discounted
    return-to-go mostly says how far the episode is from its end; judged against a
    baseline of the state, a push is scored by the state it leads to.
    """
    rng, history = np.random.default_rng(1), []
    by_return, by_gae = [], []
    for step in range(6):
        played = [play(loop, 1_000 * step + i, 0.62, rng) for i in range(8)]
        to_go = [e.returns_to_go(0.9) for e, _ in played]
        history = [*history, (np.array([t.state for e, _ in played for t in e.turns]), np.concatenate(to_go))][-3:]
        weights = loop.fit_value(np.concatenate([s for s, _ in history]), np.concatenate([g for _, g in history]))
        advantages = [loop.gae([t.reward for t in e.turns], list(loop.features(np.array([t.state for t in e.turns]))
                                                                 @ weights), 0.0, 0.9, 0.5) for e, _ in played]
        right = np.concatenate([r for _, r in played]).astype(float)
        by_return.append(np.corrcoef(np.concatenate(to_go), right)[0, 1])
        by_gae.append(np.corrcoef(np.concatenate(advantages), right)[0, 1])
    assert np.mean(by_return) < 0.25 < 0.4 < np.mean(by_gae)


def test_a_long_steps_turns_are_subsampled_uniformly_and_short_ones_kept_whole(loop):
    rng = np.random.default_rng(0)
    assert loop.train_subset(300, 512, rng).tolist() == list(range(300))
    picked = loop.train_subset(1500, 512, rng)
    assert len(picked) == 512 == len(set(picked.tolist())) and picked.tolist() == sorted(picked.tolist())
    assert picked.min() >= 0 and picked.max() < 1500
    # uniform: over many draws every turn is picked about 512 / 1500 of the time, the last ones too
    counts = np.zeros(1500)
    for _ in range(200):
        counts[loop.train_subset(1500, 512, rng)] += 1
    assert abs(counts[:500].mean() - counts[-500:].mean()) < 5 and abs(counts.mean() / 200 - 512 / 1500) < 1e-9


def test_an_answer_without_an_action_costs_the_penalty_and_a_turn_and_leaves_the_cart(loop):
    """As in rlpipe's environments: the same state again, -0.1, and it counts towards the turn limit."""
    env = loop.CartPole(3, 4)
    before = env.state.copy()
    assert env.skip() == pytest.approx(-0.1) and not env.done
    assert np.array_equal(env.state, before) and (env.steps, env.turns) == (0, 1)
    env.step(1)
    env.skip()
    assert not env.done and (env.steps, env.turns) == (1, 3)
    env.step(0)
    assert env.done and not env.fell and (env.steps, env.turns) == (2, 4)  # the turn limit, not a fall
    assert loop.parse_action("<answer>up</answer>") is None and loop.parse_action("<answer> Left </answer>") == 0


def test_the_sampled_kl_estimate_on_hand_computed_answers(loop):
    assert loop.sampled_kl([[-0.5, -1.0]], [[-0.5, -1.0]]) == 0.0  # the same policy
    # per token r - 1 - log r: r = e^-1 (a token became less likely) and r = e^0.5
    expected = (np.exp(-1) - 1 + 1) + (np.exp(0.5) - 1 - 0.5)
    assert loop.sampled_kl([[-0.2, -0.7]], [[-1.2, -0.2]]) == pytest.approx(expected)
    assert loop.sampled_kl([[-0.2, -0.7], [-0.3]], [[-1.2, -0.2], [-0.3]]) == pytest.approx(expected / 2)  # per answer
    # an unbiased estimate of the KL: answers drawn from one distribution, scored by another
    p, q = np.array([0.7, 0.2, 0.1]), np.array([0.5, 0.3, 0.2])
    drawn = np.random.default_rng(0).choice(3, 200_000, p=p)
    estimate = loop.sampled_kl([[v] for v in np.log(p[drawn])], [[v] for v in np.log(q[drawn])])
    assert estimate == pytest.approx(float(np.sum(p * np.log(p / q))), rel=0.02)


class OneParameterTrainer:
    """A training client whose policy is one number ``w`` that shifts every logprob: Adam's step moves it by the
    learning rate. ``saved`` and ``calls`` are shared with the clients loaded from its saved states."""

    class Done:
        def __init__(self, value=None):
            self.value = value

        def result(self):
            return self.value

    def __init__(self, w=0.0, saved=None, calls=None, floor=0.0):
        self.w, self.saved, self.calls = w, {} if saved is None else saved, [] if calls is None else calls
        self.floor = floor  # a shift of every logprob that no step undoes (noise between sampler and trainer)

    def forward_backward(self, data, loss):
        self.calls.append("forward_backward")
        return self.Done()

    def optim_step(self, adam):
        self.calls.append(f"optim_step {adam.learning_rate:.4g}")
        self.w += adam.learning_rate
        return self.Done()

    def save_state(self, name, overwrite=False):
        self.saved[name] = self.w
        return self.Done(type("Saved", (), {"path": name}))

    def forward(self, data, loss):
        from tinker import types

        shift = self.w + self.floor
        outputs = [{"logprobs": types.TensorData(data=[lp + shift for lp in d.loss_fn_inputs["logprobs"].tolist()],
                                                 dtype="float32", shape=[d.model_input.length])} for d in data]
        return self.Done(type("Out", (), {"loss_fn_outputs": outputs}))


class Service:
    def __init__(self, trainer):
        self.trainer = trainer

    def create_training_client_from_state_with_optimizer(self, path):
        self.trainer.calls.append("load")
        trainer = self.trainer
        return trainer.Done(OneParameterTrainer(trainer.saved[path], trainer.saved, trainer.calls, trainer.floor))


def bounded_loop(loop, bound, floor=0.0):

    from tinker import types

    turns = [loop.Turn([5, 6], [7, 8], [-0.3, -0.1], 1.0, np.zeros(4)) for _ in range(4)]
    args = argparse.Namespace(max_step_kl=bound, rl_lr=1.0, beta2=0.999, kl_rows=2, loss="importance_sampling")
    runner = loop.Loop.__new__(loop.Loop)  # the loop's update without a server behind it
    runner.args, runner.training, runner.tokens = args, OneParameterTrainer(floor=floor), {"trained": 0}
    runner.service = Service(runner.training)
    data = [types.Datum(model_input=types.ModelInput.from_ints([5, 6, 7]),
                        loss_fn_inputs={"target_tokens": [6, 7, 8], "logprobs": [0.0, -0.3, -0.1],
                                        "advantages": [0.0, 1.0, 1.0]}) for _ in turns]
    line = runner.bounded_update(data, turns)
    return runner.training, line  # the client it went on with


def test_a_step_above_the_kl_bound_is_taken_again_shorter_from_the_state_before_it(loop):
    # w moves each of an answer's 2 tokens' logprob by the step's learning rate: KL per answer 2 (e^w - 1 - w)
    kl = lambda w: 2 * (np.exp(w) - 1 - w)  # noqa: E731
    bound = kl(0.2)
    trainer, line = bounded_loop(loop, bound)
    first = min(0.5, 0.9 * np.sqrt(bound / kl(1.0)))  # the rate scaled for the KL's square law, at least halved
    assert trainer.w == pytest.approx(first) and kl(first) <= bound  # the state before the step, then the shorter one
    assert trainer.calls == ["forward_backward", "optim_step 1", "load", "forward_backward", f"optim_step {first:.4g}"]
    assert line == f", step KL {kl(first):.3f} at {first:.2g} x --rl-lr"
    trainer, line = bounded_loop(loop, bound=10.0)  # within the bound at once: one step, nothing loaded
    assert trainer.w == 1.0 and "load" not in trainer.calls and line == f", step KL {kl(1):.3f}"
    trainer, line = bounded_loop(loop, bound=None)  # no bound: the plain step, no state saved
    assert trainer.w == 1.0 and line == "" and trainer.saved == {}
    trainer, line = bounded_loop(loop, bound=1e-3, floor=0.1)  # never within: the last retry's step is kept
    assert trainer.calls.count("load") == loop.MAX_RETRIES and 0 < trainer.w <= 0.5**loop.MAX_RETRIES


@pytest.mark.parametrize(("dof", "exact"), [(1, 12.7062), (2, 4.3027), (3, 3.1824), (7, 2.3646), (31, 2.0395), (120, 1.9799)])
def test_held_out_intervals_use_students_t(loop, dof, exact):
    # exact: the t table's two-sided 95% values; a normal 1.96 would be 4% narrow at 31 degrees of freedom
    assert loop.t_95(dof) == pytest.approx(exact, rel=2e-3)
