"""What the API's engines share: a call's result is stored, then announced, and a failed announcement
stops nothing (the store is the source of truth; a poll finds the result at its next re-check)."""

from __future__ import annotations

import logging

import pytest

from pipeline.api.engines import write_result
from pipeline.io.bus import PublishError
from pipeline.io.store import ObjectStore
from schemas.api import ApiRequestAccepted, result_path


class Publisher:
    def __init__(self, fails: bool) -> None:
        self.fails, self.published = fails, []

    def publish(self, topic, event, key=None):
        if self.fails:
            raise PublishError("publishing a ApiResultReady to rlpipe.results failed: OutOfOrderSequenceNumberError")
        self.published.append((topic, event, key))
        return 0, len(self.published) - 1


CALL = ApiRequestAccepted(request_id="sess-1.sample.1", tenant="alice", session_id="sess-1", op="sample",
                          model_id="sess-1.sample", seq_id=1, body_path="sessions/sess-1/requests/1.json",
                          body_sha256="0" * 64)


def test_a_result_is_stored_then_announced_once():
    store, publisher = ObjectStore("memory://engines-announce"), Publisher(fails=False)
    write_result(store, publisher, CALL, b"{}", "json")
    write_result(store, publisher, CALL, b"{}", "json")  # executed again after a restart: already there
    assert store.get(result_path("sess-1", "sess-1.sample.1", "json")) == b"{}"
    assert [(topic, event.payload.request_id) for topic, event, _ in publisher.published] == [
        ("results", "sess-1.sample.1")]


def test_a_failed_announcement_keeps_the_engine_serving(caplog: pytest.LogCaptureFixture):
    store = ObjectStore("memory://engines-unannounced")
    with caplog.at_level(logging.WARNING):
        write_result(store, Publisher(fails=True), CALL, b"{}", "json")  # returns: the next call is served
    assert store.get(result_path("sess-1", "sess-1.sample.1", "json")) == b"{}"
    assert "not announced" in caplog.text and "sess-1.sample.1" in caplog.text
