"""The gateway's HTTP API with an in-memory store and a recording publisher (no engine behind it)."""

import uuid

import pytest
from fastapi.testclient import TestClient

from pipeline.api.app import create_app
from pipeline.api.gateway import Gateway, ServedModel
from pipeline.api.tenants import Tenants
from pipeline.io.store import ObjectStore


def gateway_client(store: ObjectStore | None = None, models: list[ServedModel] | None = None,
                   **app_options) -> TestClient:
    """A test client of an app serving ``models`` (the tiny model by default) on ``store`` (a fresh memory store by
    default); ``.store`` is its store and ``.published`` the (key, event) pairs it logged; ``app_options`` go to
    ``create_app``."""
    store = store or ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    published: list = []
    gateway = Gateway(store, lambda event, key: published.append((key, event)),
                      models or [ServedModel("/models/base/tiny", "/models/base/tiny")])
    client = TestClient(create_app(gateway, Tenants(), poll_hold_s=0.05, **app_options))
    client.store, client.published = store, published  # type: ignore[attr-defined]
    return client


@pytest.fixture
def api() -> TestClient:
    return gateway_client()
