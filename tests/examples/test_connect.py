"""The SDK loops' start (``connect``, then ``start_loop``, in ``examples/tinker_cartpole.py`` and
``examples/tinker_text2sql.py``): a server that is not there, or that refuses, is one line naming the fix.

The loops themselves run against a real server in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import argparse
import http.server
import socket
import sys
import threading

import pytest

from tests.examples import example_module

EXAMPLES = ["tinker_cartpole", "tinker_text2sql"]


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _args(base_url: str) -> argparse.Namespace:
    """The options either loop's ``connect`` reads."""
    return argparse.Namespace(base_url=base_url, base_model="tiny", rank=4, train_unembed=False, tasks=None, seed=0)


@pytest.mark.parametrize("example", EXAMPLES)
def test_no_server_at_the_base_url_is_one_line_naming_rlpipe_serve(example: str) -> None:
    """The SDK retries a refused connection without a word: the loop asks once and says what to start."""
    port = _closed_port()
    with example_module(example) as module, pytest.raises(SystemExit) as stopped:
        module.connect(_args(f"http://127.0.0.1:{port}"))
    message = str(stopped.value.code)
    assert "\n" not in message and f"127.0.0.1:{port}" in message and "rlpipe serve --port" in message, message


@pytest.mark.parametrize("example", EXAMPLES)
def test_an_sdk_refusal_at_the_start_is_one_line(example: str, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """No API key: the SDK's own message, as one line instead of a traceback (the session is ended on the way)."""
    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)  # answers 501
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("TINKER_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no key stored by `tinker auth login` either
    try:
        with example_module(example) as module, pytest.raises(SystemExit) as stopped:
            args = _args(f"http://127.0.0.1:{server.server_port}")
            service = module.connect(args)
            with module.session_ended_on_exit(service):
                module.start_loop(args, service)
    finally:
        server.shutdown()
    message = str(stopped.value.code)
    assert "\n" not in message and "TINKER_API_KEY" in message, message


@pytest.mark.parametrize("example", EXAMPLES)
def test_a_result_file_in_a_missing_folder_is_refused_before_the_server_is_asked(
        example: str, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The result file is written when the loop ends, up to an hour later: a typo in its folder is caught first."""
    missing = tmp_path / "no-such-folder" / "result.json"
    port = _closed_port()  # a message about the server would mean the option was checked late
    monkeypatch.setattr(sys, "argv", [f"{example}.py", "--base-url", f"http://127.0.0.1:{port}", "--base-model",
                                      "tiny", "--result-file", str(missing)])
    with example_module(example) as module, pytest.raises(SystemExit) as stopped:
        module.main()
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert stopped.value.code == 2 and "--result-file" in message and str(missing.parent) in message, message
