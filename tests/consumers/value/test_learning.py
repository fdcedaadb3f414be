"""DQN and C51 learn rlpipe's CartPole (200-step version) from steps tables, on one CPU core.

The loop is the pipeline's in miniature: the environment records its numeric steps
(``TextEnv.step_records``), each finished episode becomes a steps table that the
replay memory turns into transitions, and the agent trains one batch per
environment step (feeding priorities back when replay is prioritized).  Greedy evaluation on held-out seeds every 1,000 steps; the run
passes once the mean evaluation return reaches 150 within 20,000 steps (it
typically gets there in 2,000-4,000 steps and under 15 s).
"""

import time

import numpy as np
import pytest
import torch

from consumers.value.agent import ValueAgent, build_agent, linearly_decaying_epsilon
from consumers.value.config import ValueLearnerConfig
from consumers.value.replay import build_replay_memory
from producers.envs.classic import CartPole
from schemas.steps import steps_to_table

MAX_ENV_STEPS = 20_000
EVAL_EVERY, EVAL_SEEDS, TARGET_RETURN = 1_000, range(10**6, 10**6 + 5), 150.0
EPSILON_DECAY_STEPS, EPSILON_FINAL = 4_000, 0.05


def play_episode(env: CartPole, agent: ValueAgent, seed: int, epsilon: float, rng, on_step=None) -> float:
    """One episode: observe the numeric state, act epsilon-greedily, step the environment."""
    choices = env.answer_choices()
    env.reset(seed)
    done = False
    while not done:
        action = agent.act(np.asarray(env.numeric_state(), np.float32), epsilon, rng)
        result = env.step(choices[action])
        done = result.terminated or result.truncated
        if on_step is not None:
            on_step()
    return env.episode_return


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [
        ValueLearnerConfig(seed=0),
        # C51's support covers CartPole's discounted returns, at most 1 / (1 - 0.99) = 100.
        ValueLearnerConfig(seed=0, agent="c51", v_min=0.0, v_max=100.0, replay_scheme="prioritized", n_step=3),
    ],
    ids=["dqn-uniform", "c51-prioritized-3step"],
)
def test_agent_reaches_150_on_cartpole_within_a_bounded_number_of_steps(config: ValueLearnerConfig):
    torch.set_num_threads(1)
    agent = build_agent(config, observation_size=4, num_actions=2)
    memory = build_replay_memory(config, observation_size=4)
    env, eval_env, rng = CartPole(), CartPole(), np.random.default_rng(0)
    env_steps, episodes, evaluations, start = 0, 0, [], time.perf_counter()

    def train_after_step() -> None:
        nonlocal env_steps
        env_steps += 1
        if len(memory) >= config.min_replay_size:
            batch = memory.sample(config.batch_size, rng, beta=config.priority_beta)
            memory.update_priorities(batch["indices"], agent.train_step(batch).priorities_B)

    while env_steps < MAX_ENV_STEPS:
        epsilon = linearly_decaying_epsilon(env_steps, EPSILON_DECAY_STEPS, 0, EPSILON_FINAL)
        play_episode(env, agent, seed=episodes, epsilon=epsilon, rng=rng, on_step=train_after_step)
        memory.add_steps_table(steps_to_table({**row, "episode_id": f"train-{episodes}"} for row in env.step_records))
        episodes += 1
        if env_steps >= EVAL_EVERY * (len(evaluations) + 1):
            evaluations.append(float(np.mean([play_episode(eval_env, agent, s, 0.0, rng) for s in EVAL_SEEDS])))
            if evaluations[-1] >= TARGET_RETURN:
                break
    seconds = time.perf_counter() - start
    print(f"{config.agent} CartPole: {evaluations} after {env_steps} env steps, {agent.training_steps} updates, {seconds:.1f} s")
    assert evaluations and evaluations[-1] >= TARGET_RETURN, f"evaluation returns {evaluations} within {env_steps} steps"
