"""The gateway's HTTP API with an in-memory store and a recording publisher (no engine behind it)."""

import uuid

import pytest
from fastapi.testclient import TestClient

from pipeline.api.app import create_app
from pipeline.api.gateway import Gateway, ServedModel
from pipeline.api.tenants import Tenants
from pipeline.io.store import ObjectStore


@pytest.fixture
def api() -> TestClient:
    """A test client of the app; ``.store`` is its store and ``.published`` the (key, event) pairs it logged."""
    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    published: list = []
    gateway = Gateway(store, lambda event, key: published.append((key, event)),
                      [ServedModel("/models/base/tiny", "/models/base/tiny")])
    client = TestClient(create_app(gateway, Tenants(), poll_hold_s=0.05))
    client.store, client.published = store, published  # type: ignore[attr-defined]
    return client
