"""``rlpipe topics``: look at the event log (topics, offsets, consumer lag, the events themselves).

Read-only by design: ``tail`` reads without joining a consumer group, so looking
never moves a producer's or the learner's committed offsets.  Every command takes
``--bootstrap`` and ``--namespace`` (default: the bus configuration from
``RLPIPE_BUS__*`` variables, else the ``rlpipe up`` stack) and ``--json``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from pipeline.cli.common import (
    EXIT_USAGE,
    BootstrapOpt,
    JsonOpt,
    NamespaceOpt,
    bus_config_from_cli,
    console,
    fail,
    fitted_table,
    handle_user_errors,
    left_out_note,
    print_json,
    to_jsonable,
)
from pipeline.io import bus
from pipeline.topics import API_TOPIC_KINDS, TOPIC_KINDS
from schemas.names import validate_name

app = typer.Typer(
    name="topics",
    help="Inspect the event log: topics, offsets, consumer lag and the events themselves.",
    epilog="Example: rlpipe topics tail control -n 20",
    no_args_is_help=True,
)


_SUMMARY_CHARS = 110


@app.command("list", epilog="Example: rlpipe topics list --namespace rlpipe")
@handle_user_errors
def list_topics(
    all_namespaces: Annotated[bool, typer.Option("--all", help="Show topics of every namespace.")] = False,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List the topics of a namespace with their partitions and message counts."""
    config = bus_config_from_cli(bootstrap, namespace)
    topics = [bus.describe_topic(config, name) for name in bus.list_topics(config, all_namespaces=all_namespaces)]
    if as_json:
        print_json([{"name": t.name, "partitions": len(t.partitions), "messages": t.messages} for t in topics])
        return
    if not topics:
        console.print(f"no topics under namespace {config.namespace!r} (they are created on first use)")
        return
    table = Table("topic", "partitions", "messages", title=f"topics ({config.namespace})")
    for topic in topics:
        table.add_row(topic.name, str(len(topic.partitions)), str(topic.messages))
    console.print(table)


@app.command("describe", epilog="Example: rlpipe topics describe trajectories")
@handle_user_errors
def describe(
    topic: Annotated[str, typer.Argument(help="A topic kind (trajectories, adapters, control, dlq) or a full name.")],
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a topic's partitions: leader, replicas and the offsets each one holds."""
    info = bus.describe_topic(bus_config_from_cli(bootstrap, namespace), topic)
    if as_json:
        partitions = [{**to_jsonable(p), "messages": p.messages} for p in info.partitions]
        print_json({"name": info.name, "messages": info.messages, "partitions": partitions})
        return
    table = Table("partition", "leader", "replicas", "begin offset", "end offset", "messages", title=info.name)
    for p in info.partitions:
        replicas = ",".join(map(str, p.replicas))
        table.add_row(
            str(p.partition), str(p.leader), replicas, str(p.begin_offset), str(p.end_offset), str(p.messages)
        )
    console.print(table)


@app.command(
    "tail",
    epilog="Examples: rlpipe topics tail control -n 20 --run demo;  rlpipe topics tail dlq --follow",
)
@handle_user_errors
def tail(
    topic: Annotated[str, typer.Argument(help="A topic kind (trajectories, adapters, control, dlq) or a full name.")],
    n: Annotated[
        int, typer.Option("-n", "--lines", min=0, help="Messages to show from the end of each partition.")
    ] = 10,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new messages (Ctrl-C stops).")] = False,
    run: Annotated[str | None, typer.Option("--run", help="Only this run's events.")] = None,
    follow_for: Annotated[
        float | None, typer.Option("--for", min=0.0, help="With --follow: stop after this many seconds.")
    ] = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the last events of a topic without joining a consumer group (and follow new ones)."""
    if follow_for is not None and not follow:
        fail(f"--for goes with --follow (tail -f --for {follow_for:g})", EXIT_USAGE)
    if run is not None:
        validate_name(run, "run_id")  # a name no run can have matches no event: say so rather than "no messages"
    config = bus_config_from_cli(bootstrap, namespace)
    records = bus.tail(config, topic, n=n, follow=follow, run_id=run, follow_for_s=follow_for)
    try:
        if follow:
            _stream(records, as_json)
        else:
            _print_records(list(records), as_json, title=bus.resolve_topic(config.namespace, topic))
    except KeyboardInterrupt:
        return


def _record_dict(record: bus.TailRecord) -> dict[str, object]:
    item: dict[str, object] = {
        "topic": record.topic,
        "partition": record.partition,
        "offset": record.offset,
        "time": _time(record.timestamp_ms),
        "key": record.key,
    }
    if record.event is not None:
        item["event"] = record.event.model_dump(mode="json")
    else:
        item["error"] = record.error
        item["raw"] = (record.raw or b"")[:2000].decode("utf-8", errors="replace")
    return item


def _time(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def _short_time(timestamp_ms: int) -> str:
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=UTC).strftime("%m-%d %H:%M:%S.%f")[:-3]


def _summary(record: bus.TailRecord) -> Text:
    if record.event is None:
        return Text(f"{record.error}", style="red")
    payload = json.dumps(record.event.payload.model_dump(mode="json"), separators=(",", ":"))
    if len(payload) > _SUMMARY_CHARS:
        payload = payload[: _SUMMARY_CHARS - 1] + "…"
    return Text(payload)


def _print_records(records: list[bus.TailRecord], as_json: bool, title: str) -> None:
    if as_json:
        print_json([_record_dict(r) for r in records])
        return
    if not records:
        console.print(f"no messages on {title}")
        return
    rows = [{"time (UTC)": _short_time(r.timestamp_ms), "p:offset": f"{r.partition}:{r.offset}",
             "type": r.event.type if r.event is not None else Text("invalid", style="red"),
             "run": r.event.run_id if r.event is not None else (r.key or ""), "payload": _summary(r)}
            for r in records]
    table, left_out = fitted_table(title, rows, ["payload"])  # run ids whole; the payload goes first
    console.print(table)
    if left_out:
        console.print(left_out_note(left_out), markup=False)


def _stream(records: Iterator[bus.TailRecord], as_json: bool) -> None:
    for r in records:
        if as_json:
            print_json(_record_dict(r), indent=None)
            continue
        kind = r.event.type if r.event is not None else "invalid"
        run = r.event.run_id if r.event is not None else (r.key or "")
        line = Text(f"{_short_time(r.timestamp_ms)} {r.partition}:{r.offset} {kind} {run} ")
        console.print(line + _summary(r))


@app.command("lag", epilog="Example: rlpipe topics lag --group rlpipe-learner-demo   (run demo's learner)")
@handle_user_errors
def lag(
    group: Annotated[
        str | None, typer.Option("--group", "-g", help="One consumer group (a run's learner: rlpipe-learner-RUN); default: all.")
    ] = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show how far consumer groups are behind: committed offset, end offset and lag per partition."""
    config = bus_config_from_cli(bootstrap, namespace)
    groups = [group] if group else bus.list_groups(config)
    rows = [row for g in groups for row in bus.group_lag(config, g)]
    if as_json:
        print_json([{**to_jsonable(row), "lag": row.lag} for row in rows])
        return
    if not rows:
        which = f"group {group!r} has no" if group else "no consumer group has"
        topics = ", ".join(f"{config.namespace}.{kind}" for kind in TOPIC_KINDS + API_TOPIC_KINDS)
        console.print(f"{which} committed offsets on {topics}")
        return
    table = Table(title=f"consumer lag ({config.namespace})",
                  caption="lag: messages after the committed offset, every run's events on a shared topic "
                          "(a run's learner reads and skips the others')")
    for column in ("group", "topic"):
        table.add_column(column, overflow="fold")  # a long run id folds over lines, never cut short
    for column in ("partition", "committed", "end offset", "lag"):
        table.add_column(column, no_wrap=True)
    for row in rows:
        style = "yellow" if row.lag else None
        table.add_row(
            row.group_id,
            row.topic,
            str(row.partition),
            str(row.committed),
            str(row.end_offset),
            Text(str(row.lag), style=style or ""),
        )
    console.print(table)
