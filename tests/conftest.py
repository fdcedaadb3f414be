"""Shared fixtures: the real broker and the real GCS emulator, one per test session."""

import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")

pytest_plugins = [
    "tests.fixtures.fsync", "tests.fixtures.gcs", "tests.fixtures.kafka", "tests.fixtures.models",
    "tests.fixtures.vllm",
]
