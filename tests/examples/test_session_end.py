"""The SDK loops end their session when they stop (``session_ended_on_exit`` in both examples): a finished,
failed or interrupted loop tells the server so at once, as the SDK's ``with ServiceClient()`` does, instead of
leaving its clients loaded until the session lapses; a Ctrl-C is one line, not a traceback.

That holds from the moment the ``ServiceClient`` exists: a stop while the training client is created or the
tokenizer loads ends the session too.  The loops themselves run against a real server in
``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import http.server
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from types import SimpleNamespace

import pytest
import tinker

from tests.examples import example_module

EXAMPLES = ["tinker_cartpole", "tinker_text2sql"]
STAGES = ["training client", "tokenizer", "loop"]  # where the loop is stopped, in the order it gets there


def done(value: object = None) -> Future:
    future: Future = Future()
    future.set_result(value)
    return future


class RecordingService(tinker.ServiceClient):
    """The SDK's ServiceClient (its own ``__enter__``/``__exit__``), whose ``close`` records the reason it is given
    instead of telling a server (raising ``close_error`` when given one); the call at ``stage`` raises ``error``."""

    def __init__(self, error: BaseException, stage: str = "loop", close_error: BaseException | None = None) -> None:
        super().__init__(base_url="http://127.0.0.1:9", api_key="tml-test")
        self.error, self.stage, self.close_error, self.closed_as = error, stage, close_error, []

    def create_lora_training_client(self, *args, **kwargs):
        if self.stage == "training client":
            raise self.error
        return done(SimpleNamespace())

    def create_sampling_client(self, *args, **kwargs):
        raise self.error

    def close(self, status, detail=None):
        self.closed_as.append(status)
        if self.close_error is not None:
            raise self.close_error
        return done()


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """A server that answers (501 to everything), so the loops' check that one listens passes."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()


def _run(example: str, service: RecordingService, base_url: str, monkeypatch: pytest.MonkeyPatch) -> BaseException:
    """What ``example``'s ``main`` ended with, talking to ``service``; a KeyboardInterrupt that escapes is returned
    (raised, it would stop pytest itself)."""
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--base-url", base_url, "--base-model", "tiny"])

    def tokenizer(path: str) -> SimpleNamespace:
        if service.stage == "tokenizer":
            raise service.error
        return SimpleNamespace(eos_token_id=2, chat_template=None)

    with example_module(example) as module:
        monkeypatch.setattr(module.tinker, "ServiceClient", lambda **kwargs: service)
        monkeypatch.setattr(module, "AutoTokenizer", SimpleNamespace(from_pretrained=tokenizer))
        try:
            module.main()
        except BaseException as exc:
            return exc
    raise AssertionError("the loop went on past the error")


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("example", EXAMPLES)
def test_a_ctrl_c_ends_the_session_as_interrupted_in_one_line(example: str, stage: str, base_url: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    service = RecordingService(KeyboardInterrupt(), stage)
    stopped = _run(example, service, base_url, monkeypatch)
    assert isinstance(stopped, SystemExit), f"{stopped!r} escaped the loop"
    message = str(stopped.code)
    assert service.closed_as == ["interrupted"]
    assert "\n" not in message and message.startswith("interrupted") and "tinker checkpoint list" in message, message
    assert "the session is ended" in message


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_loop_that_fails_ends_its_session_as_errored_and_shows_the_error(
        example: str, base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = RecordingService(RuntimeError("the sampler said no"))
    stopped = _run(example, service, base_url, monkeypatch)
    assert isinstance(stopped, RuntimeError) and "the sampler said no" in str(stopped)
    assert service.closed_as == ["errored"]


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_tokenizer_that_cannot_load_ends_the_session_in_one_line_naming_the_base_model(
        example: str, base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    service = RecordingService(OSError("tiny is not a local folder and is not a valid model identifier"), "tokenizer")
    stopped = _run(example, service, base_url, monkeypatch)
    assert isinstance(stopped, SystemExit), f"{stopped!r} escaped the loop"
    message = str(stopped.code)
    assert service.closed_as == ["errored"]
    assert "\n" not in message and message.startswith("error:") and "--base-model tiny" in message, message


@pytest.mark.parametrize("close_error", [KeyboardInterrupt(), RuntimeError("connection refused")])
@pytest.mark.parametrize("example", EXAMPLES)
def test_a_ctrl_c_whose_session_end_fails_says_the_session_was_not_ended(
        example: str, close_error: BaseException, base_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A second Ctrl-C while the session ends, or a server gone: the line must not say the clients were freed."""
    service = RecordingService(KeyboardInterrupt(), close_error=close_error)
    stopped = _run(example, service, base_url, monkeypatch)
    assert isinstance(stopped, SystemExit), f"{stopped!r} escaped the loop"
    message = str(stopped.code)
    assert service.closed_as == ["interrupted"]
    assert "\n" not in message and message.startswith("interrupted") and "tinker checkpoint list" in message, message
    assert "the session is ended" not in message and "not ended" in message and "lapses" in message, message
