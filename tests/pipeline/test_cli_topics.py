"""`rlpipe topics ...` and the CLI root, through Typer's CliRunner against the live session broker."""

from __future__ import annotations

import importlib
import json
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from pipeline.cli import main as cli_main
from pipeline.cli.main import app
from pipeline.devstack.gcs_emulator import free_port
from pipeline.io import bus
from schemas.config import BusConfig
from schemas.events import RunStopped, make_event

runner = CliRunner()
WIDE = {"COLUMNS": "220"}  # rich tables would otherwise wrap at 80 columns


def _invoke(args: list[str]) -> Any:
    return runner.invoke(app, args, env=WIDE)


def _where(config: BusConfig) -> list[str]:
    return ["--bootstrap", config.bootstrap_servers, "--namespace", config.namespace]


@pytest.fixture
def published(bus_config: BusConfig) -> list[tuple[str, str, int]]:
    """Four events on control (three of run-a, one of run-b) and one poison message: (run, reason, offset)."""
    rows = []
    with bus.EventPublisher(bus_config) as publisher:
        for run, reason in [("run-a", "alpha"), ("run-b", "bravo"), ("run-a", "charlie"), ("run-a", "delta")]:
            _, offset = publisher.publish("control", make_event(run, RunStopped(reason=reason)))
            rows.append((run, reason, offset))
        _, offset = publisher.publish_raw(f"{bus_config.namespace}.control", b"{broken", "run-a")
        rows.append(("run-a", "<poison>", offset))
    return rows


def test_tail_shows_events_from_the_live_broker(bus_config: BusConfig, published: list) -> None:
    result = _invoke(["topics", "tail", "control", *_where(bus_config)])
    assert result.exit_code == 0, result.output
    for _, reason, _ in published[:-1]:
        assert reason in result.stdout
    assert "RunStopped" in result.stdout
    assert "not JSON" in result.stdout, "an undecodable message is shown with why"

    narrow = runner.invoke(app, ["topics", "tail", "control", *_where(bus_config)], env={"COLUMNS": "80"})
    assert narrow.exit_code == 0 and "…" not in narrow.stdout, narrow.stdout  # run ids whole, however narrow
    assert "payload left out to fit 80 columns" in narrow.stdout
    assert {"run-a", "run-b"} <= {line.split("│")[4].strip() for line in narrow.stdout.splitlines()
                                  if line.startswith("│")}

    only_a = _invoke(["topics", "tail", "control", "--run", "run-a", *_where(bus_config)])
    assert only_a.exit_code == 0
    assert "alpha" in only_a.stdout and "delta" in only_a.stdout
    assert "bravo" not in only_a.stdout


def test_tail_json_gives_the_last_n(bus_config: BusConfig, published: list) -> None:
    result = _invoke(["topics", "tail", "control", "-n", "2", "--json", *_where(bus_config)])
    assert result.exit_code == 0, result.output
    records = json.loads(result.stdout)
    assert [r["offset"] for r in records] == [offset for _, _, offset in published[-2:]]
    assert records[0]["event"]["payload"]["reason"] == published[-2][1]
    assert records[1]["raw"] == "{broken" and "not JSON" in records[1]["error"]


def test_tail_follow_prints_new_events(bus_config: BusConfig, published: list,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # The event is published once the tail has fixed where it starts (the end of the log, with -n 0): published
    # earlier, it would be backlog, which -n 0 leaves out.
    tail_module = importlib.import_module("pipeline.io.bus.tail")
    assign_last, positioned = tail_module._assign_last, threading.Event()

    def assign_and_tell(*args: Any, **kwargs: Any) -> Any:
        ends = assign_last(*args, **kwargs)
        positioned.set()
        return ends

    monkeypatch.setattr(tail_module, "_assign_last", assign_and_tell)

    def publish_once_positioned() -> None:
        positioned.wait(60.0)
        publisher.publish("control", make_event("run-a", RunStopped(reason="fresh-news")))

    with bus.EventPublisher(bus_config, create_topics=False) as publisher:
        thread = threading.Thread(target=publish_once_positioned)
        thread.start()
        result = _invoke(["topics", "tail", "control", "-n", "0", "--follow", "--for", "4", *_where(bus_config)])
        tail_positioned = positioned.is_set()
        positioned.set()  # (ends the thread's wait where the tail failed first)
        thread.join()
    assert result.exit_code == 0, result.output
    assert tail_positioned, "the tail never fixed where it starts"
    assert "fresh-news" in result.stdout
    assert "alpha" not in result.stdout, "-n 0 shows no backlog"


def test_list_and_describe_count_messages(bus_config: BusConfig, published: list) -> None:
    listed = json.loads(_invoke(["topics", "list", "--json", *_where(bus_config)]).stdout)
    counts = {item["name"].rpartition(".")[2]: item["messages"] for item in listed}
    assert counts == {"adapters": 0, "control": len(published), "dlq": 0, "trajectories": 0}

    described = _invoke(["topics", "describe", "control", "--json", *_where(bus_config)])
    assert described.exit_code == 0
    info = json.loads(described.stdout)
    assert info["name"] == f"{bus_config.namespace}.control"
    assert [(p["begin_offset"], p["end_offset"]) for p in info["partitions"]] == [(0, len(published))]

    table = _invoke(["topics", "list", *_where(bus_config)])
    assert f"{bus_config.namespace}.control" in table.stdout


def test_lag_of_a_group(bus_config: BusConfig, published: list, fast_group: dict) -> None:
    topic = f"{bus_config.namespace}.control"
    with bus.EventConsumer(bus_config, "control", "cli-lag", **fast_group) as consumer:
        assert consumer.wait_for_assignment() == [(topic, 0)]
        consumer.commit({(topic, 0): 2})
    result = _invoke(["topics", "lag", "--group", "cli-lag", "--json", *_where(bus_config)])
    assert result.exit_code == 0, result.output
    (row,) = json.loads(result.stdout)
    assert (row["committed"], row["end_offset"], row["lag"]) == (2, len(published), len(published) - 2)
    table = _invoke(["topics", "lag", *_where(bus_config)])
    assert "cli-lag" in table.stdout
    long_group = "rlpipe-learner-cartpole-20261204-141527-a-long-run-name"  # a run's learner group, as named
    with bus.EventConsumer(bus_config, "control", long_group, **fast_group) as consumer:
        assert consumer.wait_for_assignment() == [(topic, 0)]
        assert consumer.commit({(topic, 0): 1}) == {(topic, 0): 1}
    narrow = runner.invoke(app, ["topics", "lag", "--group", long_group, *_where(bus_config)],
                           env={"COLUMNS": "80"})
    assert narrow.exit_code == 0 and "…" not in narrow.stdout, narrow.stdout  # folded over lines, never cut
    first_cells = "".join(line.split("│")[1].strip() for line in narrow.stdout.splitlines() if line.startswith("│"))
    assert first_cells == long_group
    assert "every run's events" in " ".join(narrow.stdout.split())  # what the lag counts on a shared topic


def test_unreachable_broker_is_one_red_line_not_a_traceback() -> None:
    started = time.monotonic()
    port = free_port()
    result = _invoke(["topics", "list", "--bootstrap", f"127.0.0.1:{port}"])
    assert time.monotonic() - started < 15
    assert result.exit_code == 1
    assert result.stderr.strip().count("\n") == 0
    assert result.stderr.startswith(f"error: cannot reach Kafka at 127.0.0.1:{port}")
    assert "Traceback" not in result.output


def test_user_mistakes_exit_2_with_one_line(bus_config: BusConfig, tmp_path: Path, monkeypatch) -> None:
    unknown = _invoke(["topics", "describe", "nope", *_where(bus_config)])
    assert unknown.exit_code == 2
    assert "neither a topic kind" in unknown.stderr
    missing = _invoke(["topics", "describe", "some.topic", *_where(bus_config)])
    assert missing.exit_code == 2 and "does not exist" in missing.stderr
    bad_namespace = _invoke(["topics", "list", "--bootstrap", bus_config.bootstrap_servers, "--namespace", "a/b"])
    assert bad_namespace.exit_code == 2 and "namespace" in bad_namespace.stderr

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", raising=False)
    nothing = _invoke(["topics", "list"])
    assert nothing.exit_code == 2
    assert "rlpipe up" in nothing.stderr and "Traceback" not in nothing.output


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["topics"],
        ["topics", "list"],
        ["topics", "describe"],
        ["topics", "tail"],
        ["topics", "lag"],
        ["up"],
        ["down"],
        ["status"],
    ],
)
def test_every_command_has_help_with_an_example(command: list[str]) -> None:
    result = _invoke([*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Example" in result.stdout


def test_command_groups_are_discovered_and_a_broken_one_breaks_only_itself(monkeypatch) -> None:
    root_help = _invoke(["--help"]).stdout
    for name in ("topics", "up", "down", "status", "envs"):  # envs comes from the rlpipe.commands entry point
        assert name in root_help
    targets = {**cli_main.plugin_targets(), "broken": "no_such_module_for_rlpipe:app"}
    monkeypatch.setattr(cli_main, "plugin_targets", lambda: targets)
    broken = _invoke(["broken", "anything", "--flag"])
    assert broken.exit_code == 1
    assert "could not be loaded" in broken.stderr and "no_such_module_for_rlpipe" in broken.stderr
    assert "Traceback" not in broken.output
    assert _invoke(["topics", "--help"]).exit_code == 0


def test_lag_example_names_the_group_a_learner_joins() -> None:
    from consumers.sources import learner_group_id

    shown = _invoke(["topics", "lag", "--help"])
    assert shown.exit_code == 0, shown.output
    example = shown.stdout[shown.stdout.index("Example"):]
    assert f"--group {learner_group_id('demo')}" in " ".join(example.split())


def test_tail_for_without_follow_is_refused_naming_the_flag() -> None:
    done = _invoke(["topics", "tail", "control", "--for", "5", "--bootstrap", "127.0.0.1:1"])
    assert done.exit_code == 2
    assert done.output.strip().splitlines()[-1] == "error: --for goes with --follow (tail -f --for 5)"


def test_lag_without_any_committed_offsets_says_so_plainly(monkeypatch) -> None:
    monkeypatch.setattr(bus, "list_groups", lambda config: [])
    monkeypatch.setattr(bus, "group_lag", lambda config, group: [])
    everyone = _invoke(["topics", "lag", "--bootstrap", "127.0.0.1:9", "--namespace", "ns"])
    assert everyone.exit_code == 0, everyone.output
    topics = "ns.trajectories, ns.adapters, ns.control, ns.dlq, ns.requests, ns.results"  # what lag shows, no others
    assert " ".join(everyone.stdout.split()) == f"no consumer group has committed offsets on {topics}"
    one = _invoke(["topics", "lag", "--group", "g", "--bootstrap", "127.0.0.1:9", "--namespace", "ns"])
    assert " ".join(one.stdout.split()) == f"group 'g' has no committed offsets on {topics}"


@pytest.mark.parametrize("run", ["Bad Id", "../up", "a/b"])
def test_a_run_no_event_can_name_is_refused_before_reading_the_topic(run: str) -> None:
    """Not 'no messages': the filter could never match, so the mistake is named (and no broker is needed to say so)."""
    result = _invoke(["topics", "tail", "control", "--run", run, "--bootstrap", f"127.0.0.1:{free_port()}"])
    assert result.exit_code == 2 and result.stderr.strip().count("\n") == 0, result.output
    assert f"run_id {run!r} is not allowed" in result.stderr
