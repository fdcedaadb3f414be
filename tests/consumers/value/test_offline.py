"""Offline value learning: the CQL(H) regulariser and its gradient by hand, the setpoint grid's
round trip, and the whole offline path (generate, discretise, train, play held-out days) in small."""

import math

import numpy as np
import pytest
import torch

from consumers.value.config import ValueLearnerConfig
from consumers.value.offline import (
    BehaviourCloningAgent,
    CQLAgent,
    ObservationScaler,
    OfflinePolicy,
    SetpointGrid,
    cql_regulariser,
    prepare_offline_data,
    time_features,
    train_offline,
)
from pipeline.building_policy import network_columns, setpoint_echoes

GRID = SetpointGrid((310.0, 355.0), (285.0, 300.0), water_levels=4, air_levels=3)


def test_cql_regulariser_and_its_gradient_by_hand():
    q_BA = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]], requires_grad=True)
    action_B = torch.tensor([0, 1])
    reg_B = cql_regulariser(q_BA, action_B)
    # row 0: logsumexp(0, ln 3) = ln(1 + 3) = ln 4; minus Q(s, a=0) = 0 -> ln 4
    # row 1: logsumexp(1, 1) = 1 + ln 2; minus Q(s, a=1) = 1 -> ln 2
    torch.testing.assert_close(reg_B, torch.tensor([math.log(4.0), math.log(2.0)]))
    reg_B.sum().backward()
    # d/dQ = softmax(Q) - onehot(a): row 0 softmax (1/4, 3/4) - (1, 0); row 1 (1/2, 1/2) - (0, 1)
    torch.testing.assert_close(q_BA.grad, torch.tensor([[-0.75, 0.75], [0.5, -0.5]]))


def test_cql_loss_adds_alpha_times_the_regulariser_to_the_td_loss():
    config = ValueLearnerConfig(hidden_sizes=(4,), batch_size=2, replay_capacity=2, min_replay_size=2, double_q=False)
    agent = CQLAgent(config, observation_size=1, num_actions=2, cql_alpha=0.5)
    plain = CQLAgent(config, observation_size=1, num_actions=2, cql_alpha=0.0)
    batch = [torch.tensor([[1.0], [-1.0]]), torch.tensor([0, 1]), torch.tensor([0.1, -0.2]),
             torch.tensor([0.9, 0.9]), torch.tensor([[0.5], [0.0]])]
    with_reg_B, _, _ = agent._losses(*batch)
    td_only_B, _, _ = plain._losses(*batch)  # same seed: identical networks
    q_BA = agent.online(batch[0])
    expected_B = td_only_B + 0.5 * (torch.logsumexp(q_BA, -1) - q_BA.gather(-1, batch[1][:, None]).squeeze(-1))
    torch.testing.assert_close(with_reg_B, expected_B)
    with pytest.raises(ValueError, match="cql_alpha"):
        CQLAgent(config, 1, 2, cql_alpha=-1.0)


def test_setpoint_grid_round_trip_and_nearest_cell():
    index = np.arange(GRID.num_actions)
    water, air = GRID.to_setpoints(index)
    np.testing.assert_array_equal(GRID.to_index(water, air), index)
    # water levels 310, 325, 340, 355; air levels 285, 292.5, 300
    assert GRID.to_index(np.array([331.0]), np.array([291.0]))[0] == 1 * 3 + 1
    assert GRID.to_index(np.array([400.0]), np.array([250.0]))[0] == 3 * 3 + 0  # outside the range: its end
    assert GRID.to_setpoints(5) == (325.0, 300.0)
    with pytest.raises(ValueError, match="outside the grid"):
        GRID.to_setpoints(12)


def test_time_features_and_scaler_state_round_trip():
    # 1970-01-03 (Saturday) 06:00 UTC at UTC-6 is local midnight: sin 0, cos 1, day off
    np.testing.assert_allclose(time_features(np.array([2 * 86400 + 6 * 3600]), -6.0), [[0.0, 1.0, 1.0]], atol=1e-12)
    scaler = ObservationScaler.fit(np.array([[1.0, 5.0], [3.0, 5.0]]))
    np.testing.assert_allclose(scaler(np.array([[3.0, 5.0]])), [[1.0, 0.0]])
    again = ObservationScaler.from_state_dict(scaler.state_dict())
    np.testing.assert_array_equal(again.std_O, scaler.std_O)


def test_the_network_reads_no_column_that_echoes_its_own_last_setpoints():
    # the simulator's telemetry: its own record of the action and the devices' setpoints the action sets
    observed = ["zone_0_0@zone_air_temperature_sensor", "zone_0_0@zone_air_heating_temperature_setpoint",
                "boiler_0@supply_water_setpoint", "boiler_0@supply_water_temperature_sensor",
                "ahu_0@supply_air_heating_temperature_setpoint", "ahu_0@supply_air_cooling_temperature_setpoint",
                "action@supply_water_setpoint", "action@supply_air_heating_temperature_setpoint", "action@clipped"]
    actions = ["action:boiler_0@supply_water_setpoint", "action:ahu_0@supply_air_heating_temperature_setpoint"]
    assert setpoint_echoes(observed, actions) == [
        "boiler_0@supply_water_setpoint", "ahu_0@supply_air_heating_temperature_setpoint",
        "action@supply_water_setpoint", "action@supply_air_heating_temperature_setpoint", "action@clipped"]
    # what the building does in response (the water's temperature, the zones' own setpoints) stays, in order
    assert network_columns(observed, actions) == [
        "zone_0_0@zone_air_temperature_sensor", "zone_0_0@zone_air_heating_temperature_setpoint",
        "boiler_0@supply_water_temperature_sensor", "ahu_0@supply_air_cooling_temperature_setpoint"]


def test_offline_pipeline_end_to_end_on_generated_days(tmp_path):
    from pipeline.io.datasets import read_card, read_steps
    from pipeline.io.store import ObjectStore
    from producers.offline.evaluation import controller_outcomes, numeric_controller
    from producers.offline.generation import GenerationSpec, day_env, generate_building_dataset

    store = ObjectStore(tmp_path.resolve().as_uri())
    generate_building_dataset(store, "hvac-smoke", GenerationSpec(days=2, policy="mixed", seed=1))
    card = read_card(store, "hvac-smoke")
    cfg = day_env(0).config
    grid = SetpointGrid(cfg.supply_water_range_k, cfg.supply_air_heating_range_k, 3, 3)
    keep = network_columns(card.observation_columns, card.action_columns)
    data = prepare_offline_data(read_steps(store, "hvac-smoke"), grid, card.extras["utc_offset_hours"], n_step=3,
                                columns=card.observation_columns, keep=keep)
    assert data.transitions["action"].max() < grid.num_actions
    assert data.observation_columns == tuple(keep) and data.observation_size == len(keep) + 3
    with pytest.raises(ValueError, match="observation_columns as columns"):
        prepare_offline_data(read_steps(store, "hvac-smoke"), grid, 0.0, columns=keep, keep=keep)
    config = ValueLearnerConfig(hidden_sizes=(32,), batch_size=32, target_update_period=50, n_step=3)
    for agent in (CQLAgent(config, data.observation_size, grid.num_actions, cql_alpha=0.1),
                  BehaviourCloningAgent(config, data.observation_size, grid.num_actions)):
        log = train_offline(agent, data, steps=200)
        assert math.isfinite(log.loss) and math.isfinite(log.q_mean)
        policy = OfflinePolicy.from_training(agent, data)
        controller = numeric_controller(policy.setpoints, data.observation_columns)
        (outcome,) = controller_outcomes(controller, [2], card.extras.get("env_overrides"))
        assert outcome.steps == 288 and outcome.invalid == 0
        assert all(math.isfinite(v) for v in (outcome.episode_return, outcome.energy, outcome.carbon, outcome.comfort))
        state = policy.state_dict()
        assert {"scaler/mean", "scaler/std", "training_steps"} <= set(state)
        policy.load_state_dict(state)


def test_the_filtered_target_takes_the_argmax_over_supported_cells_only():
    config = ValueLearnerConfig(hidden_sizes=(4,), batch_size=1, replay_capacity=1, min_replay_size=1, double_q=True)
    behaviour = BehaviourCloningAgent(config, observation_size=1, num_actions=3)
    agent = CQLAgent(config, 1, 3, cql_alpha=0.0, behaviour=behaviour, support_threshold=0.5)
    with torch.no_grad():  # online Q(s', .) = (5, 1, 0): cell 0 best, but cloned probabilities (0.1, 0.6, 0.3)
        for net in (agent.online, agent.target, behaviour.online):
            for p in net.parameters():
                p.zero_()
        agent.online.layers[-1].bias.copy_(torch.tensor([5.0, 1.0, 0.0]))
        agent.target.layers[-1].bias.copy_(torch.tensor([7.0, 2.0, 3.0]))
        behaviour.online.layers[-1].bias.copy_(torch.log(torch.tensor([0.1, 0.6, 0.3])))
    obs, action, reward, bootstrap = torch.tensor([[0.0]]), torch.tensor([1]), torch.tensor([0.5]), torch.tensor([0.9])
    _, q_B, td_B = agent._losses(obs, action, reward, bootstrap, obs)
    # kept: p >= 0.5 * 0.6 = 0.3 -> cells 1 and 2; online argmax over them: cell 1 (Q 1 > 0); target Q(s', 1) = 2
    # y = 0.5 + 0.9 * 2 = 2.3; Q(s, a=1) = 1 -> TD 1.3 (unfiltered it would take cell 0: 0.5 + 0.9 * 7 - 1 = 5.8)
    torch.testing.assert_close(q_B, torch.tensor([1.0]))
    torch.testing.assert_close(td_B, torch.tensor([1.3]))
    with pytest.raises(ValueError, match="support_threshold"):
        CQLAgent(config, 1, 3, cql_alpha=0.1, support_threshold=0.5)  # a threshold without a behaviour agent
