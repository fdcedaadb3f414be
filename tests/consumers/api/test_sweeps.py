"""A trainer's sweeps over a long-lived server: what they remember between sweeps stays bounded."""

from __future__ import annotations

import json

from consumers.api.sweeps import Sweeper
from pipeline.api import checkpoints
from pipeline.io.store import ObjectStore
from schemas.api import model_id_for


def test_the_sweeps_forget_the_training_clients_no_index_names_any_more(memory_store: ObjectStore) -> None:
    """Each sweep looks up the base model of every client in its indexes (cached: records are create-only); a
    client leaves the indexes once nothing of it is left to sweep, and then leaves the cache too, so a server
    that saw thousands of sessions does not hold one entry for each of them."""
    sweeper = Sweeper(memory_store, "/models/base/tiny")
    for n in range(20):
        model_id = model_id_for(f"s{n}", "train", 0)
        memory_store.put(f"sessions/s{n}/models/0.json", json.dumps({"base_model": "/models/base/tiny"}).encode())
        checkpoints.mark_expiring(memory_store, model_id)  # a TTL once: its checkpoints already gone
    sweeper.sweep()
    assert memory_store.list(checkpoints.EXPIRING) == []  # nothing left to sweep of any of them
    sweeper.sweep()
    assert len(sweeper._base_models) == 0
    checkpoints.mark_expiring(memory_store, model_id_for("s3", "train", 0))
    sweeper.sweep()
    assert list(sweeper._base_models) == ["sessions/s3/models/0.json"]
