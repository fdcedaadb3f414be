"""``examples/tinker_text2sql.py``'s own options: a ``--tasks`` file it cannot train on is one line naming
``--tasks``, before the server is asked for anything.

The loop itself runs against a real server in ``tests/integration/test_tinker_sampling.py``.
"""

from __future__ import annotations

import json
import socket
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from producers.envs.sql import SHIPPED_TASKS_PATH
from tests.examples import example_module


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _shipped_lines(count: int) -> str:
    return "".join(SHIPPED_TASKS_PATH.read_text(encoding="utf-8").splitlines(keepends=True)[:count])


@pytest.mark.parametrize(("content", "wanted"), [
    (None, "no such file"),  # a typo in the path
    (lambda: "{not json\n", "not JSON"),
    (lambda: json.dumps({"id": "a", "question": "how many?"}) + "\n", "db_id"),
    (lambda: _shipped_lines(4), "at least 5 tasks"),  # every 5th task is the test split: 4 leave it empty
])
def test_a_tasks_file_it_cannot_train_on_is_one_line_naming_tasks_before_the_server_is_asked(
        content: Callable[[], str] | None, wanted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tasks = tmp_path / "tasks.jsonl"
    if content is not None:
        tasks.write_text(content(), encoding="utf-8")
    port = _closed_port()  # nothing answers there: a message about the server would mean the file was read late
    monkeypatch.setattr(sys, "argv", ["tinker_text2sql.py", "--base-url", f"http://127.0.0.1:{port}",
                                      "--base-model", "tiny", "--tasks", str(tasks)])
    with example_module("tinker_text2sql") as module, pytest.raises(SystemExit) as stopped:
        module.main()
    message = str(stopped.value.code)
    assert "\n" not in message and message.startswith("error: --tasks") and str(tasks) in message, message
    assert wanted in message and "rlpipe serve" not in message and "tasks_path" not in message, message


def test_the_shipped_tasks_and_a_file_of_five_pass_the_check(tmp_path: Path) -> None:
    five = tmp_path / "five.jsonl"
    five.write_text(_shipped_lines(5), encoding="utf-8")
    with example_module("tinker_text2sql") as module:
        assert module.count_tasks(None) == (36, 8)  # the shipped 44: positions 4, 9, ..., 39 held out
        assert module.count_tasks(str(five)) == (4, 1)
