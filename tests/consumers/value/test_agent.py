"""DQN and C51 agents: initialisation, acting, one training step checked against the targets, state round trips."""

import numpy as np
import pydantic
import pytest
import safetensors.torch
import torch

from consumers.value.agent import C51Agent, DQNAgent, build_agent, linearly_decaying_epsilon
from consumers.value.config import ValueLearnerConfig
from consumers.value.targets import categorical_cross_entropy, categorical_targets, double_q_targets, huber_loss

OBS, ACTIONS = 3, 2


def batch(size=8, seed=0):
    rng = np.random.default_rng(seed)
    return {
        "observation": rng.normal(size=(size, OBS)).astype(np.float32),
        "action": rng.integers(0, ACTIONS, size=size),
        "reward": rng.normal(size=size).astype(np.float32),
        "discount": np.full(size, 0.9, np.float32),
        "next_observation": rng.normal(size=(size, OBS)).astype(np.float32),
        "terminal": np.arange(size) % 3 == 0,
    }


def params(agent):
    return [p.detach().clone() for p in agent.online.parameters()]


def test_initialisation_is_a_function_of_the_seed():
    a, b = DQNAgent(ValueLearnerConfig(seed=1), OBS, ACTIONS), DQNAgent(ValueLearnerConfig(seed=1), OBS, ACTIONS)
    c = DQNAgent(ValueLearnerConfig(seed=2), OBS, ACTIONS)
    assert all(torch.equal(x, y) for x, y in zip(params(a), params(b), strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(params(a), params(c), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(params(a), a.target.parameters(), strict=True))


def test_act_is_greedy_at_epsilon_zero_and_uniform_at_one():
    agent = DQNAgent(ValueLearnerConfig(), OBS, ACTIONS)
    rng = np.random.default_rng(0)
    obs = np.array([0.3, -1.0, 2.0], np.float32)
    greedy = int(agent.online(torch.as_tensor(obs)[None]).argmax())
    assert {agent.act(obs, 0.0, rng) for _ in range(20)} == {greedy}
    counts = np.bincount([agent.act(obs, 1.0, rng) for _ in range(2000)], minlength=ACTIONS)
    assert abs(counts[0] / 2000 - 0.5) < 0.05


def test_dqn_loss_is_the_huber_of_the_double_q_td_error():
    agent = DQNAgent(ValueLearnerConfig(huber_delta=1.0), OBS, ACTIONS)
    data = batch()
    with torch.no_grad():
        obs, nxt = torch.as_tensor(data["observation"]), torch.as_tensor(data["next_observation"])
        q_B = agent.online(obs)[torch.arange(8), torch.as_tensor(data["action"])]
        bootstrap_B = 0.9 * (1.0 - torch.as_tensor(data["terminal"], dtype=torch.float32))
        y_B = double_q_targets(torch.as_tensor(data["reward"]), bootstrap_B, agent.target(nxt), agent.online(nxt))
    metrics = agent.train_step(data)
    assert metrics.loss == pytest.approx(float(huber_loss(y_B - q_B).mean()), rel=1e-5)
    np.testing.assert_allclose(metrics.priorities_B, (y_B - q_B).abs().numpy() + 1e-6, rtol=1e-5)
    assert metrics.q_mean == pytest.approx(float(q_B.mean()), rel=1e-5)


def test_c51_loss_is_the_cross_entropy_to_the_projected_target():
    config = ValueLearnerConfig(agent="c51", num_atoms=5, v_min=-2.0, v_max=2.0, double_q=False)
    agent = C51Agent(config, OBS, ACTIONS)
    data = batch()
    with torch.no_grad():
        nxt = torch.as_tensor(data["next_observation"])
        next_probs_BAN = torch.softmax(agent.target(nxt), dim=-1)
        best_B = agent.target.q_values(nxt).argmax(-1)
        bootstrap_B = 0.9 * (1.0 - torch.as_tensor(data["terminal"], dtype=torch.float32))
        target_BN = categorical_targets(
            torch.as_tensor(data["reward"]), bootstrap_B, next_probs_BAN[torch.arange(8), best_B], agent.online.support_N
        )
        logits_BN = agent.online(torch.as_tensor(data["observation"]))[torch.arange(8), torch.as_tensor(data["action"])]
    metrics = agent.train_step(data)
    assert metrics.loss == pytest.approx(float(categorical_cross_entropy(target_BN, logits_BN).mean()), rel=1e-5)
    q_BA = agent.online.q_values(torch.as_tensor(data["observation"]))
    assert bool((q_BA >= -2.0).all() and (q_BA <= 2.0).all())  # expectations over the support


def test_zero_importance_weights_leave_the_network_unchanged():
    agent = DQNAgent(ValueLearnerConfig(), OBS, ACTIONS)
    before = params(agent)
    agent.train_step({**batch(), "weights": np.zeros(8, np.float32)})
    assert all(torch.equal(x, y) for x, y in zip(before, params(agent), strict=True))


def test_target_network_syncs_every_period():
    agent = DQNAgent(ValueLearnerConfig(target_update_period=3, learning_rate=0.01), OBS, ACTIONS)
    synced = [agent.train_step(batch(seed=i)).target_synced for i in range(6)]
    assert synced == [False, False, True, False, False, True]
    assert all(torch.equal(x, y) for x, y in zip(params(agent), agent.target.parameters(), strict=True))
    agent.train_step(batch(seed=9))
    assert not all(torch.equal(x, y) for x, y in zip(params(agent), agent.target.parameters(), strict=True))


@pytest.mark.parametrize("kind", ["dqn", "c51"])
def test_state_round_trips_through_safetensors_and_training_continues_identically(kind):
    config = ValueLearnerConfig(agent=kind, target_update_period=2)
    agent = build_agent(config, OBS, ACTIONS)
    for i in range(3):
        agent.train_step(batch(seed=i))
    blob = safetensors.torch.save(agent.state_dict())
    restored = build_agent(config, OBS, ACTIONS)
    restored.load_state_dict(safetensors.torch.load(blob))
    assert restored.training_steps == 3
    a, b = agent.train_step(batch(seed=7)), restored.train_step(batch(seed=7))
    assert a.loss == b.loss
    assert all(torch.equal(x, y) for x, y in zip(params(agent), params(restored), strict=True))
    assert all(torch.equal(x, y) for x, y in zip(agent.target.parameters(), restored.target.parameters(), strict=True))


def test_a_batch_missing_fields_names_the_fix():
    with pytest.raises(ValueError, match=r"lacks \['terminal'\]"):
        DQNAgent(ValueLearnerConfig(), OBS, ACTIONS).train_step({k: v for k, v in batch().items() if k != "terminal"})


def test_config_refuses_unknown_keys_and_an_empty_support():
    with pytest.raises(pydantic.ValidationError, match="extra"):
        ValueLearnerConfig(target_update=5)
    with pytest.raises(pydantic.ValidationError, match="v_min"):
        ValueLearnerConfig(v_min=1.0, v_max=1.0)
    with pytest.raises(pydantic.ValidationError, match="batch_size"):
        ValueLearnerConfig(batch_size=100, replay_capacity=10)


def test_epsilon_is_one_through_warm_up_then_decays_linearly_to_its_floor():
    # warm-up 100, decay over 200 steps to 0.1: at 200, halfway: 0.1 + 0.9 * 0.5 = 0.55
    schedule = [linearly_decaying_epsilon(t, 200, 100, 0.1) for t in (0, 100, 200, 300, 10_000)]
    assert schedule == pytest.approx([1.0, 1.0, 0.55, 0.1, 0.1])
