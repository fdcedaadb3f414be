"""``rlpipe runs list|show|delete``: the runs in a store, how far each got, and removing one;
``rlpipe runs create|stop|resume``: a run's start and stop, for the packed processes that serve it.

Reads the store (``run.json``, the adapter registry, checkpoints) and, unless
``--no-bus``, the control topic with a bounded wait for status and last activity
(``pipeline.analysis.runs``).  ``delete`` asks before it removes anything (``--yes`` skips
the question) and removes only the named run: its objects, checkpoints and
cached adapters, never another run's.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated

import typer
from rich.table import Table

from pipeline.analysis.runs import (
    ACTIVE_WITHIN_S,
    RunActivity,
    RunSummary,
    activity_or_note,
    delete_run,
    list_runs,
    plan_delete,
    run_exists,
    runs_there,
    stored_session_state,
    summarize,
    training_client_session,
)
from pipeline.cli.common import (
    EXIT_USAGE,
    BootstrapOpt,
    GcsEndpointOpt,
    JsonOpt,
    NamespaceOpt,
    StoreRootOpt,
    bus_config_from_cli,
    console,
    err_console,
    fail,
    fitted_table,
    handle_user_errors,
    left_out_note,
    print_json,
    reachable_store,
    shown_model,
)
from pipeline.cli.options import ConfigOpt, PresetOpt, RunOpt, SetOpt, chosen_run, run_config
from pipeline.devstack.stack import rlpipe_home
from pipeline.io.store import ObjectStore
from schemas.config import BusConfig, StoreConfig

app = typer.Typer(
    name="runs",
    help="List the runs in a store, show one, delete one; create, stop or resume one that packed processes follow.",
    epilog="Example: rlpipe runs list && rlpipe runs show --run cartpole-20260101-120000",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

NoBusOpt = Annotated[bool, typer.Option("--no-bus", help="Do not read the event log (status from the store alone).")]
TimeoutOpt = Annotated[float, typer.Option("--bus-timeout", min=0.5, max=120.0, help="Seconds to wait for the broker.")]


def _store(root: str | None, gcs_endpoint: str | None) -> ObjectStore:
    """The store ``--root`` names (default: the embedded stack's), failing fast if the emulator is down."""
    return reachable_store(StoreConfig(root=root or "", gcs_endpoint=gcs_endpoint), quiet=True)


def _known_run(store: ObjectStore, run: str) -> None:
    """Fail unless the store holds ``run`` under that exact id; one differing only in case is named (on a
    case-insensitive filesystem its files would be taken for this run's)."""
    from pipeline.runtime import refuse_case_twin

    refuse_case_twin(store, run)
    if not run_exists(store, run):
        fail(f"run {run!r} not found under {store.root}; {runs_there(store)}", EXIT_USAGE)


def _json(summary: RunSummary) -> dict[str, object]:
    reward = summary.last_reward
    return {
        "run_id": summary.run_id, "status": summary.status, "env": summary.env, "base_model": summary.base_model,
        "steps": summary.steps, "max_steps": summary.max_steps, "versions": summary.versions,
        "last_reward": reward if reward is None or math.isfinite(reward) else None,
        "last_activity": summary.last_activity.isoformat() if summary.last_activity else None,
        "stop_reason": summary.stop_reason, "notes": summary.notes, "kind": summary.kind,
    }


def _when(moment: datetime | None) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S") if moment else "-"


def _steps(summary: RunSummary) -> str:
    return f"{summary.steps}/{summary.max_steps}" if summary.max_steps else str(summary.steps)


def _reward(summary: RunSummary) -> str:
    return "-" if summary.last_reward is None else f"{summary.last_reward:.3f}"


@app.command("list", epilog="Example: rlpipe runs list --root file:///data/rlpipe --no-bus")
@handle_user_errors
def list_command(
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    no_bus: NoBusOpt = False,
    bus_timeout: TimeoutOpt = 3.0,
    as_json: JsonOpt = False,
) -> None:
    """List the runs in the store: status, environment, base model, steps, versions, last reward and activity."""
    store = _store(root, gcs_endpoint)
    activity, note = activity_or_note(None if no_bus else bus_config_from_cli(bootstrap, namespace), bus_timeout)
    summaries = [summarize(store, run, (activity or {}).get(run), activity is not None) for run in list_runs(store)]
    if as_json:
        print_json({"store": store.root, "runs": [_json(s) for s in summaries], "note": note})
        return
    if not summaries:
        console.print(f"no runs under {store.root}; start one with `rlpipe run --preset cartpole`")
        return
    rows = [{"run": s.run_id, "status": s.status, "env": s.env or "-", "base model": shown_model(s.base_model),
             "steps": _steps(s), "versions": str(s.versions), "reward": _reward(s),
             "last active (UTC)": _when(s.last_activity)} for s in summaries]
    table, left_out = fitted_table(f"runs in {store.root}", rows,  # the id whole: it is copied into commands
                                   ["base model", "last active (UTC)", "versions", "env", "reward"], whole=("run",))
    console.print(table)  # a narrow terminal: the least needed columns went
    if left_out:
        console.print(left_out_note(left_out), markup=False)
    for summary in summaries:
        if summary.unreadable:
            console.print(f"note: {summary.notes[0]}", style="yellow", markup=False)
    if note:
        console.print(f"note: {note}", style="yellow", markup=False)


@app.command("show", epilog="Example: rlpipe runs show --run cartpole-20260101-120000 --json")
@handle_user_errors
def show_command(
    run: RunOpt = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    no_bus: NoBusOpt = False,
    bus_timeout: TimeoutOpt = 3.0,
    as_json: JsonOpt = False,
) -> None:
    """Show one run: status, environment, base model, steps, versions, last reward, last activity."""
    name = chosen_run(run, None, "runs show")
    store = _store(root, gcs_endpoint)
    _known_run(store, name)
    bus = None if no_bus else bus_config_from_cli(bootstrap, namespace)
    activity, note = activity_or_note(bus, bus_timeout, name)
    summary = summarize(store, name, (activity or {}).get(name), activity is not None)
    if note:
        summary.notes.append(note)
    if as_json:
        print_json(_json(summary))
        return
    table = Table(title=f"run {name}", show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    for label, value in (
        ("status", _status(summary)),
        ("environment", summary.env or "-"), ("base model", summary.base_model or "-"),
        ("learner steps", _steps(summary)),
        ("value-network versions" if summary.kind == "value-network" else "adapter versions", str(summary.versions)),
        ("last reward", _reward(summary)), ("last activity (UTC)", _when(summary.last_activity)),
        ("store", store.url(f"runs/{name}")),
    ):  # fmt: skip
        table.add_row(label, value)
    console.print(table)
    for line in summary.notes:
        console.print(f"note: {line}", style="yellow", markup=False)


@app.command("delete", epilog="Example: rlpipe runs delete --run cartpole-20260101-120000 --yes")
@handle_user_errors
def delete_command(
    run: RunOpt = None,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Delete without asking.")] = False,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    no_bus: NoBusOpt = False,
    bus_timeout: TimeoutOpt = 3.0,
) -> None:
    """Delete one run: its objects in the store (trajectories, adapters, checkpoints, evaluations) and its
    cached adapters and launcher folder on this machine.  Its events stay on the shared topics.
    A run the log shows running is refused: stop it first.  Without the event log (--no-bus, no broker) that
    check is skipped, and the command says so.  A Tinker API training client's weights are refused until its
    session has ended (a lapsed one is only unloaded until its next call), from the store alone (they have no
    events)."""
    name = chosen_run(run, None, "runs delete")
    store = _store(root, gcs_endpoint)
    _known_run(store, name)
    _refuse_running(store, name, None if no_bus else bus_config_from_cli(bootstrap, namespace), bus_timeout)
    plan = plan_delete(store, name, rlpipe_home())
    what = f"run {name}: {len(plan.store_keys)} objects under {store.url(plan.store_prefix)}" + (
        f" and {len(plan.local_paths)} local folders ({', '.join(str(p) for p in plan.local_paths)})"
        if plan.local_paths else "")
    if not yes and not typer.confirm(f"delete {what}?", default=False):
        console.print("nothing deleted")  # the answer asked for, not a failure: exit 0
        return
    delete_run(store, plan)
    console.print(f"deleted {what}", markup=False)


def _refuse_running(store: ObjectStore, name: str, bus: BusConfig | None, bus_timeout: float) -> None:
    """Fail when ``name`` is running: a training client until its session ended (the store says), any other run
    while the log shows events in the last ``ACTIVE_WITHIN_S`` (not checked, and said so, without the log)."""
    session = training_client_session(name)
    found = stored_session_state(store, session) if session else None
    if found is not None:
        if found[0] != "ended":  # a lapsed session is unloaded only until its next call
            state = "lapsed, not ended" if found[0] == "lapsed" else found[0]
            fail(f"run {name} holds the weights of Tinker API session {session}'s training client, and the session "
                 f"is {state}; end it first (rlpipe sessions end {session}), then delete them", EXIT_USAGE)
        return
    activity, note = activity_or_note(bus, bus_timeout, name)
    if activity is None:
        err_console.print(f"not checked whether run {name} is running: {note}", markup=False)
    elif summarize(store, name, activity.get(name), True).status == "running":
        fail(f"run {name} is running (events in the last {ACTIVE_WITHIN_S:.0f} s); stop it first, then delete it",
             EXIT_USAGE)


@app.command("create", epilog="Example: rlpipe runs create --preset cartpole --run exp-1  (taken up by "
                              "rlpipe learner start --follow-runs 'exp-*' and rlpipe producer start --follow-runs 'exp-*')")
@handle_user_errors
def create_command(
    preset: PresetOpt = None,
    config: ConfigOpt = None,
    overrides: SetOpt = None,
    run: Annotated[str | None, typer.Option("--run", "-r", help="Name the new run (default: the preset's run_id "
                                                                "plus the UTC time); it must not exist yet.")] = None,
) -> None:
    """Create a run (its run.json) and announce it (RunStarted) without starting any process: a packed learner
    and producer started with --follow-runs PATTERN take it up while serving their other runs."""
    from pipeline.cli.run_cmd import explicit_run_id, new_run_id
    from pipeline.io.bus import EventPublisher
    from pipeline.membership import announce_membership, membership_key
    from pipeline.runtime import create_run, resolved_bus
    from schemas.events import RunStarted

    cfg = run_config(preset, config, overrides)
    if cfg.value is not None:
        fail("value-based runs are not packed: start the run with rlpipe run", EXIT_USAGE)
    store = reachable_store(cfg.store)
    cfg = cfg.model_copy(update={"run_id": new_run_id(store, cfg.run_id, run or explicit_run_id(config, overrides or []))})
    bus = resolved_bus(cfg.bus)
    with EventPublisher(bus) as publisher:  # the broker first: a run that cannot be announced is not created
        key, _, started = create_run(store, cfg, cfg.model.base_model)
        if not isinstance(started, RunStarted):  # another create took the name since it was checked
            fail(f"run {cfg.run_id} already exists in {store.root}; name a new one with --run", EXIT_USAGE)
        try:
            announce_membership(store, publisher, cfg.run_id, started)
        except BaseException:  # this create's own run.json and record: nothing else of the run exists yet
            store.delete(membership_key(cfg.run_id), missing_ok=True)
            store.delete(key, missing_ok=True)
            raise
    console.print(f"created run {cfg.run_id}: processes started with --follow-runs matching it take it up; "
                  f"stop it with rlpipe runs stop --run {cfg.run_id}", markup=False, soft_wrap=True)


@app.command("stop", epilog="Example: rlpipe runs stop --run exp-1")
@handle_user_errors
def stop_command(
    run: RunOpt = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
) -> None:
    """Announce that a run ends (RunStopped): the processes serving it let it go (its learner trains what waits
    and checkpoints, its sampling flushes finished groups): packed ones following it, and a learner or producer of
    that one run started before the stop, which then exits 0 as on SIGTERM; the run stays in the store, and stays stopped
    when a packed process naming it starts again, until rlpipe runs resume.  A run whose stop is recorded and on
    the control topic is already stopped, and nothing is announced; one whose recorded stop the topic never
    carried (its publish failed) is announced.  The run id is matched exactly: one differing only in case from the
    stored run is refused, naming it."""
    from pipeline.analysis.runs import learner_step
    from pipeline.io.bus import EventPublisher
    from pipeline.membership import announce_membership, recorded_membership
    from pipeline.runtime import resolved_bus
    from schemas.events import RunStopped

    name = chosen_run(run, None, "runs stop")
    store = _store(root, gcs_endpoint)
    _known_run(store, name)
    bus = resolved_bus(bus_config_from_cli(bootstrap, namespace))
    activity, _ = activity_or_note(bus, 3.0, name)
    if activity is not None:
        summary = summarize(store, name, activity.get(name), log_read=True)
        try:
            recorded = recorded_membership(store, name)
        except ValueError:  # a damaged record: this stop writes it again
            recorded = None
        # nothing live since its last RunStopped, which the store keeps and the topic carried: announcing again
        # changes nothing.  A stop the store keeps but the topic lacks is announced: the store is written first, and
        # the publish after it may have failed, leaving a process that serves the run unaware of the stop
        if (summary.status == "stopped" and recorded is not None and isinstance(recorded.payload, RunStopped)
                and _topic_carried_stop(activity.get(name), recorded.time.timestamp())):
            console.print(f"run {name} is already stopped ({summary.stop_reason}); continue it with "
                          f"rlpipe runs resume --run {name} (packed) or rlpipe run --resume {name}", markup=False,
                          soft_wrap=True)
            return
    with EventPublisher(bus) as publisher:
        announce_membership(store, publisher, name, RunStopped(reason="stopped by rlpipe runs stop",
                                                               final_step=learner_step(store, name)))
    console.print(f"announced the end of run {name}: the learner and producers serving it (single-run or packed) "
                  "finish the step or groups in hand and let it go, as on SIGTERM; packed processes starting again "
                  f"do not serve it; resume it with rlpipe runs resume --run {name}", markup=False, soft_wrap=True)


@app.command("resume", epilog="Example: rlpipe runs resume --run exp-1")
@handle_user_errors
def resume_command(
    run: RunOpt = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    bootstrap: BootstrapOpt = None,
    namespace: NamespaceOpt = None,
    force: Annotated[bool, typer.Option("--force", help="Announce the run even when its newest start is on the "
                                                        "control topic already.")] = False,
) -> None:
    """Announce a stopped run again (RunStarted): packed processes naming it (--run) or following it
    (--follow-runs) take it up from its newest checkpoint, now and when they start again.  A run whose newest
    start is recorded and on the control topic is not stopped, and nothing is announced unless --force; one whose
    recorded start the topic never carried (its publish failed) is announced.  The run id is matched exactly: one
    differing only in case from the stored run is refused, naming it."""
    from pipeline.io.bus import EventPublisher
    from pipeline.membership import announce_membership, recorded_membership
    from pipeline.runtime import resolved_bus, started_again
    from schemas.events import RunStarted

    name = chosen_run(run, None, "runs resume")
    store = _store(root, gcs_endpoint)
    _known_run(store, name)
    bus = resolved_bus(bus_config_from_cli(bootstrap, namespace))
    try:
        recorded = recorded_membership(store, name)
    except ValueError:  # a damaged record: this resume writes it again
        recorded = None
    # its newest announcement already started it, and a process serves a run once: announcing again changes nothing.
    # Unless the topic shows that start it is announced: the store is written first, and the publish after it may
    # have failed (an unreadable topic is announced to as well, as by stop; a broker that is down fails the publish)
    if not force and recorded is not None and isinstance(recorded.payload, RunStarted):
        activity, _ = activity_or_note(bus, 3.0, name)
        if activity is not None and _topic_carried_start(activity.get(name), recorded.time.timestamp()):
            console.print(f"run {name} is not stopped (announced {recorded.time:%Y-%m-%d %H:%M:%S} UTC); nothing "
                          f"announced; stop it with rlpipe runs stop --run {name}, or announce it anyway with "
                          f"rlpipe runs resume --run {name} --force", markup=False, soft_wrap=True)
            return
    try:
        started = started_again(store, name)
    except FileNotFoundError:
        fail(f"run {name} has no run.json in {store.root}: only a created run can be resumed", EXIT_USAGE)
    with EventPublisher(bus) as publisher:
        announce_membership(store, publisher, name, started)
    console.print(f"announced run {name} again; packed processes naming or following it take it up", markup=False,
                  soft_wrap=True)


def _status(summary: RunSummary) -> str:
    """The status ``runs show`` prints, with the reason beside ``stopped``, ``finished`` or ``ended``: a run that went
    on after its stop (``running``, then ``idle``) shows its status alone."""
    ended = summary.stop_reason and summary.status in ("stopped", "finished", "ended")
    return f"{summary.status} ({summary.stop_reason})" if ended else summary.status


def _topic_carried_stop(activity: RunActivity | None, recorded_s: float) -> bool:
    """Whether the control topic's newest start or stop of the run is a stop no older than the recorded one
    (``recorded_s``, epoch seconds): the same event when its publish went through."""
    return (activity is not None and activity.membership_s is not None and activity.membership_s >= recorded_s
            and activity.stopped_s is not None)


def _topic_carried_start(activity: RunActivity | None, recorded_s: float) -> bool:
    """Whether the control topic's newest start or stop of the run is a start no older than the recorded one
    (``recorded_s``, epoch seconds): the same event when its publish went through."""
    return (activity is not None and activity.membership_s is not None and activity.membership_s >= recorded_s
            and activity.stopped_s is None)
