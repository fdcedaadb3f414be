"""The SDK loops end their session when they stop (``session_ended_on_exit`` in both examples): a finished,
failed or interrupted loop tells the server so at once, as the SDK's ``with ServiceClient()`` does, instead of
leaving its clients loaded until the session lapses; a Ctrl-C is one line, not a traceback.

The loops themselves run against a real server in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import sys
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import tinker

from tests.examples import example_module

EXAMPLES = ["tinker_cartpole", "tinker_text2sql"]


class RecordingService(tinker.ServiceClient):
    """The SDK's ServiceClient (its own ``__enter__``/``__exit__``), whose ``close`` records the reason it is
    given instead of telling a server; its first call raises ``error``."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(base_url="http://127.0.0.1:9", api_key="tml-test")
        self.error, self.closed_as = error, []

    def create_sampling_client(self, *args, **kwargs):
        raise self.error

    def close(self, status, detail=None):
        self.closed_as.append(status)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _run(example: str, service: RecordingService, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--base-model", "tiny"])
    with example_module(example) as module:
        monkeypatch.setattr(module, "connect", lambda args: SimpleNamespace(service=service, evaluate=print))
        module.main()


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_ctrl_c_ends_the_session_as_interrupted_in_one_line(example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = RecordingService(KeyboardInterrupt())
    stopped: BaseException | None = None
    try:
        _run(example, service, monkeypatch)
    except BaseException as exc:  # a KeyboardInterrupt that escapes would stop pytest itself
        stopped = exc
    assert isinstance(stopped, SystemExit), f"{stopped!r} escaped the loop"
    message = str(stopped.code)
    assert service.closed_as == ["interrupted"]
    assert "\n" not in message and message.startswith("interrupted") and "tinker checkpoint list" in message, message


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_loop_that_fails_ends_its_session_as_errored_and_shows_the_error(
        example: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = RecordingService(RuntimeError("the sampler said no"))
    with pytest.raises(RuntimeError, match="the sampler said no"):
        _run(example, service, monkeypatch)
    assert service.closed_as == ["errored"]
