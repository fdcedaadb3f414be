"""``rlpipe run``'s launcher: what it tells the user about the embedded stack it starts."""

from __future__ import annotations

import logging
from datetime import UTC, datetime
from pathlib import Path

import pytest

from pipeline.devstack import launcher
from pipeline.devstack.stack import StackState
from schemas.config import RunConfig


def _state(home: Path) -> StackState:
    return StackState(pid=4242, bootstrap_servers="127.0.0.1:19092", store_root=(home / "store").as_uri(),
                      home=str(home), log_dir=str(home / "logs"), started_at=datetime.now(UTC))


def test_starting_the_embedded_stack_says_so_and_how_to_stop_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(launcher, "read_stack_state", lambda: None)
    monkeypatch.setattr(launcher, "start_background", lambda **kwargs: _state(tmp_path))
    with caplog.at_level(logging.INFO, logger="rlpipe.run"):
        started = launcher.ensure_stack(RunConfig())
    assert started is not None and started.pid == 4242
    text = caplog.text
    assert "started the embedded stack" in text and "127.0.0.1:19092" in text and "pid 4242" in text
    assert "rlpipe down" in text and "keeps running" in text


def test_a_configured_or_running_broker_starts_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(**kwargs: object) -> StackState:
        raise AssertionError("no stack should be started")

    monkeypatch.setattr(launcher, "start_background", refuse)
    monkeypatch.setattr(launcher, "read_stack_state", lambda: _state(tmp_path))
    assert launcher.ensure_stack(RunConfig()) is None
    monkeypatch.setattr(launcher, "read_stack_state", lambda: None)
    assert launcher.ensure_stack(RunConfig.model_validate({"bus": {"bootstrap_servers": "kafka:9092"}})) is None
