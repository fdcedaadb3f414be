"""A building policy's published form: the grid, the scaler and the columns travel with the network and play again."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pipeline.building_policy import (
    POLICY_FILE,
    SCALER_FILE,
    BuildingPolicy,
    BuildingPolicySpec,
    ObservationScaler,
    building_policy_files,
    load_building_policy,
    network_input,
    support_mask,
)
from pipeline.value_network import NetworkSpec, build_from_spec, network_files

COLUMNS = ("zone_0_0@zone_air_temperature_sensor", "outside@outside_air_temperature_sensor")
SPEC = BuildingPolicySpec(water_range_k=(310.0, 355.0), air_range_k=(285.0, 300.0), water_levels=3, air_levels=2,
                          utc_offset_hours=-6.0, observation_columns=COLUMNS, dataset="hvac", first_held_out_day=14)


def test_network_input_appends_time_features_then_standardises():
    scaler = ObservationScaler(np.array([290.0, 270.0, 0.0, 0.0, 0.0]), np.array([2.0, 10.0, 1.0, 1.0, 1.0]))
    # 1970-01-03 06:00 UTC at UTC-6: Saturday, local midnight -> (sin 0, cos 1, day off 1)
    obs = network_input(np.array([294.0, 260.0]), 2 * 86400 + 6 * 3600, scaler, -6.0)
    torch.testing.assert_close(obs, torch.tensor([[2.0, -1.0, 0.0, 1.0, 1.0]]), atol=1e-6, rtol=0)


def test_published_files_play_again_with_the_same_setpoints(tmp_path):
    network = build_from_spec(NetworkSpec(agent="dqn", observation_size=5, num_actions=6, hidden_sizes=(8,)), seed=3)
    scaler = ObservationScaler(np.array([290.0, 270.0, 0.0, 0.0, 0.5]), np.array([2.0, 10.0, 0.7, 0.7, 0.5]))
    files = network_files(NetworkSpec(agent="dqn", observation_size=5, num_actions=6, hidden_sizes=(8,)), network)
    files |= building_policy_files(SPEC, scaler)
    assert not any(name.endswith((".pt", ".bin", ".pkl")) for name in files)
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    spec, played = load_building_policy(tmp_path)
    assert spec == SPEC and played.grid == SPEC.grid()
    original = BuildingPolicy(network, scaler, SPEC.grid(), SPEC.utc_offset_hours)
    for obs, t in [(np.array([291.0, 265.0]), 1.7e9), (np.array([296.5, 280.0]), 1.7e9 + 5 * 3600)]:
        assert played.setpoints(obs, t) == original.setpoints(obs, t)
        assert played.setpoints(obs, t)[0] in (310.0, 332.5, 355.0) and played.setpoints(obs, t)[1] in (285.0, 300.0)


def test_a_scaler_of_the_wrong_width_and_a_folder_without_a_policy_are_refused(tmp_path):
    with pytest.raises(ValueError, match="2 columns plus 3 time features"):
        building_policy_files(SPEC, ObservationScaler(np.zeros(4), np.ones(4)))
    with pytest.raises(ValueError, match=f"no {POLICY_FILE}"):
        load_building_policy(tmp_path)
    assert SCALER_FILE.endswith(".safetensors")
    with pytest.raises(ValueError, match="low, high"):
        BuildingPolicySpec.model_validate(SPEC.model_dump() | {"air_range_k": (300.0, 285.0)})


def test_support_mask_keeps_cells_at_least_threshold_times_the_most_likely():
    # probabilities 0.5, 0.3, 0.2 (logits are their logs): threshold 0.5 keeps p >= 0.25 -> cells 0 and 1
    logits_BA = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    assert support_mask(logits_BA, 0.5).tolist() == [[True, True, False]]
    assert support_mask(logits_BA, 0.0).tolist() == [[True, True, True]]
    assert support_mask(logits_BA, 1.0).tolist() == [[True, False, False]]


def test_a_filtered_policy_never_takes_an_unsupported_cell():
    spec = NetworkSpec(agent="dqn", observation_size=5, num_actions=6, hidden_sizes=(8,))
    q_net, cloned = build_from_spec(spec, seed=1), build_from_spec(spec, seed=2)
    scaler = ObservationScaler(np.zeros(5), np.ones(5))
    policy = BuildingPolicy(q_net, scaler, SPEC.grid(), 0.0, cloned, 0.9)
    for t in range(0, 86_400, 3_600):
        obs = np.array([290.0 + t / 7200, 270.0])
        kept = support_mask(cloned(network_input(obs, t, scaler, 0.0)), 0.9)[0]
        assert kept[policy.action(obs, t)]
    with pytest.raises(ValueError, match="needs the behaviour-cloning network"):
        building_policy_files(SPEC.model_copy(update={"support_threshold": 0.3}), scaler)
