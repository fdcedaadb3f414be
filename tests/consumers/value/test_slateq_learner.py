"""SlateQ on the value learner: slate steps batches -> replay memory -> SlateQ updates -> item-value versions."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch

from consumers.checkpoint import CheckpointStore
from consumers.sources import BatchRef
from consumers.value.config import ValueLearnerConfig
from consumers.value.learner import ValueLearner
from consumers.value.replay import consumed_items, discrete_actions
from consumers.value.service import replay_train_value
from consumers.value.slateq import SlateQAgent, SlateQConfig, SlateTransitions
from pipeline.config import load_preset
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from pipeline.slate_network import best_slate
from pipeline.value_network import CONFIG_FILE, WEIGHTS_FILE, network_from_files
from producers.envs.recsim import InterestEvolution
from producers.slate_actor import SlateActor
from producers.value_actor import ValueNetworkWatcher
from schemas.config import RunConfig
from schemas.value import SlateSpec, ValueActorConfig, ValueRunConfig
from tests.consumers.value.test_learner import ListSource, assert_same_memory

SLATE = SlateSpec()  # RecSim's defaults: 20 topics, 5 candidates, slates of 2, proportional choice
OBS = 26  # 20 interests, the hidden budget, 5 candidate topics
BATCHES = 6
CONFIG = ValueLearnerConfig(
    agent="slateq", hidden_sizes=(16,), batch_size=8, min_replay_size=32, replay_capacity=600,
    updates_per_transition=0.05, checkpoint_every=3, publish_every=2, target_update_period=5, seed=3,
)


@pytest.fixture(scope="module")
def slate_batches(tmp_path_factory: pytest.TempPathFactory) -> tuple[ObjectStore, list[BatchRef]]:
    """Six RecSim steps batches of random slates (a slate actor before any version), announced in order."""
    root = tmp_path_factory.mktemp("slate-store")
    store = ObjectStore((root / "store").as_uri())
    actor = SlateActor(run_id="actors", actor_id="a0", env=InterestEvolution(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), root / "cache"),
                       config=ValueActorConfig(steps_per_batch=150))
    refs = []
    for index in range(BATCHES):
        event = actor.write_batch()
        refs.append(BatchRef(event.batch_id, event.path, event.sha256, {"mem:0": index + 1}))
    return store, refs


def make_learner(store: ObjectStore, run_id: str, refs: list[BatchRef], **overrides) -> ValueLearner:  # type: ignore[no-untyped-def]
    return ValueLearner(
        run_id=run_id, env_name="recsim-interest-evolution", config=CONFIG.model_copy(update=overrides),
        observation_size=OBS, num_actions=SLATE.num_candidates, archive=TrajectoryArchive(store),
        registry=AdapterRegistry(store, run_id), checkpoints=CheckpointStore(store, run_id),
        source=ListSource(refs), slate=SLATE,
    )


def hand_built_transitions(table: pa.Table, gamma: float) -> list[tuple]:
    """One-step SlateQ transitions read row by row: (interests, topics, consumed, reward, bootstrap, next ...)."""
    rows = table.to_pylist()
    out = []
    for index, row in enumerate(rows):
        slot = int(row["click_position"])
        consumed = int(row["action"][slot]) if slot >= 0 else -1
        interests, topics = row["observation"][:20], [int(t) for t in row["observation"][-5:]]
        if row["is_terminal"]:
            out.append((interests, topics, consumed, row["reward"], 0.0, interests, topics))
        elif not row["is_last"]:  # a truncated session's last step has no next state: not formed
            following = rows[index + 1]["observation"]
            out.append((interests, topics, consumed, row["reward"], gamma, following[:20],
                        [int(t) for t in following[-5:]]))
    return out


def test_a_slate_and_the_consumed_item_read_back_from_a_steps_table(slate_batches) -> None:
    store, refs = slate_batches
    table = TrajectoryArchive(store).read_steps(refs[0].path, refs[0].sha256)
    slate_RK = np.array(table["action"].to_pylist())
    assert slate_RK.shape == (table.num_rows, 2) and (np.diff(slate_RK, axis=1) > 0).all()  # k distinct, ascending
    consumed_R = consumed_items(table)
    clicked_R = np.array(table["clicked"].to_pylist()) == 1.0
    assert ((consumed_R >= 0) == clicked_R).all() and 0 < clicked_R.sum() < table.num_rows
    # The consumed candidate is in the slate, and its topic (from the observation) is the clicked topic.
    topics_RC = np.array(table["observation"].to_pylist())[:, -5:]
    rows = np.flatnonzero(clicked_R)
    assert all(consumed_R[r] in slate_RK[r] for r in rows)
    np.testing.assert_array_equal(topics_RC[rows, consumed_R[rows]], np.array(table["click_topic"].to_pylist())[rows])
    with pytest.raises(ValueError, match="slates"):  # a DQN learner refuses a slate table
        discrete_actions(table)


def test_the_learners_slateq_update_equals_the_slateq_agents_on_the_same_transitions(slate_batches) -> None:
    store, refs = slate_batches
    learner = make_learner(store, "equal", refs[:1], min_replay_size=1, updates_per_transition=0.04)
    learner.run(poll_timeout_s=0.0)
    updates = learner.last_metrics["updates"]
    assert learner.state.step == 1 and updates >= 4

    table = TrajectoryArchive(store).read_steps(refs[0].path, refs[0].sha256)
    memory = hand_built_transitions(table, CONFIG.gamma)
    assert len(memory) == len(learner.memory)
    agent = SlateQAgent(SlateQConfig(hidden_sizes=(16,), batch_size=8, target_update_period=5, seed=3), SLATE)
    rng = np.random.default_rng(CONFIG.seed)  # the learner's sampling generator, uniform replay
    for _ in range(updates):
        picked = [memory[i] for i in rng.integers(0, len(memory), size=CONFIG.batch_size)]
        columns = [np.array(c) for c in zip(*picked, strict=True)]
        agent.train_step(SlateTransitions(
            interests_BT=columns[0], topics_BC=columns[1], clicked_B=columns[2], reward_B=columns[3],
            bootstrap_B=columns[4], next_interests_BT=columns[5], next_topics_BC=columns[6],
            next_slate_BK=np.zeros((CONFIG.batch_size, 2), np.int64),
        ))
    assert agent.steps == learner.agent.training_steps == updates
    for (name, mine), theirs in zip(agent.online.state_dict().items(), learner.agent.online.state_dict().values(),
                                    strict=True):
        torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-6, msg=name)
    assert agent.online.state_dict()["layers.0.weight"].ne(
        SlateQAgent(SlateQConfig(hidden_sizes=(16,), seed=3), SLATE).online.state_dict()["layers.0.weight"]).any()


def test_a_published_version_rebuilt_from_its_json_and_safetensors_gives_the_same_item_values(
    slate_batches, tmp_path: Path
) -> None:
    store, refs = slate_batches
    learner = make_learner(store, "publish", refs)
    learner.run(poll_timeout_s=0.0)
    registry = AdapterRegistry(store, "publish")
    versions = registry.versions()
    assert len(versions) >= 2 and {registry.show(v).kind for v in versions} == {"value-network"}
    folder = registry.pull(versions[-1], tmp_path / "cache", kind="value-network")
    spec, network = network_from_files({name: (folder / name).read_bytes() for name in (CONFIG_FILE, WEIGHTS_FILE)})
    assert (spec.agent, spec.slate, spec.hidden_sizes, spec.observation_size) == ("slateq", SLATE, (16,), OBS)
    interests_BT, topics_BC = torch.rand(7, 20) * 2 - 1, torch.randint(0, 20, (7, 5))
    mine, theirs = network.item_values(interests_BT, topics_BC), learner.agent.online.item_values(interests_BT, topics_BC)
    for a, b in zip(mine, theirs, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    observation = TrajectoryArchive(store).read_steps(refs[0].path)["observation"][5].as_py()
    assert best_slate(network, spec.slate, "optimal", observation) == best_slate(
        learner.agent.online, SLATE, "optimal", observation)


def test_the_replay_memory_rebuilt_from_the_store_equals_the_one_before_the_restart(slate_batches) -> None:
    store, refs = slate_batches
    first = make_learner(store, "rebuild", refs)
    first.resume()
    first.run(poll_timeout_s=0.0)
    assert first.state.step == BATCHES and first.memory.add_count > first.memory.capacity  # it wrapped around
    assert first.agent.training_steps > 0
    before = first.memory.to_state_dict()
    assert (before["action"] == -1).any() and (before["action"] >= 0).any()  # consumed items and no clicks
    second = make_learner(store, "rebuild", refs)
    assert second.resume() is True
    assert_same_memory(second.memory.to_state_dict(), before)
    for name, tensor in first.agent.state_dict().items():
        torch.testing.assert_close(second.agent.state_dict()[name], tensor, rtol=0, atol=0, msg=name)


def test_replay_train_trains_slateq_from_a_runs_stored_slate_batches_once(slate_batches) -> None:
    store, _ = slate_batches
    raw = load_preset("slateq-recsim")
    raw.update(run_id="slateq-offline", store={"root": store.url("")})
    raw["value"]["learner"].update(hidden_sizes=[16], min_replay_size=32, updates_per_transition=0.05,
                                   checkpoint_every=4, publish_every=4)
    raw["value"]["actor"]["max_batches_ahead"] = None  # no actors here
    learner = replay_train_value(RunConfig.model_validate(raw), "actors")
    assert learner.state.step == BATCHES and learner.agent.training_steps > 0
    latest = learner.registry.latest()
    assert latest is not None and latest.learner_step == BATCHES and latest.base_model.startswith("slateq:")
    again = replay_train_value(RunConfig.model_validate(raw), "actors")  # from the checkpoint: nothing left
    assert again.state.step == BATCHES and again.agent.training_steps == learner.agent.training_steps


def test_a_slateq_run_needs_its_slate_section_and_uniform_replay() -> None:
    learner = {"agent": "slateq"}
    with pytest.raises(ValueError, match=r"slateq needs value\.slate"):
        ValueRunConfig(observation_size=OBS, num_actions=5, learner=learner)
    with pytest.raises(ValueError, match="num_candidates"):
        ValueRunConfig(observation_size=OBS, num_actions=4, learner=learner, slate=SLATE)
    with pytest.raises(ValueError, match="replay_scheme: uniform"):
        ValueLearnerConfig(agent="slateq", replay_scheme="prioritized")
    with pytest.raises(ValueError, match="take none"):
        ValueRunConfig(observation_size=4, num_actions=2, slate=SLATE)
    with pytest.raises(ValueError, match="slateq needs"):  # the learner, built without a run configuration
        ValueLearner(run_id="x", env_name="recsim-interest-evolution", config=CONFIG, observation_size=OBS,
                     num_actions=5, archive=None, registry=None, checkpoints=None,  # type: ignore[arg-type]
                     source=ListSource([]))
