"""``rlpipe sessions list|show`` over a store the gateway wrote, and ``rlpipe serve``'s set-up pieces."""

from __future__ import annotations

import json
import os
import time

import pytest
from typer.testing import CliRunner

from consumers.api.worker import main
from pipeline.api.gateway import Gateway, ServedModel, SessionEndedError
from pipeline.cli.main import app
from pipeline.cli.serve_cmd import sampler_command, sdk_example, trainer_command
from pipeline.io.store import ObjectStore

runner = CliRunner()


def test_sessions_list_and_show(tmp_path):
    root = f"file://{tmp_path}/store"
    gateway = Gateway(ObjectStore(root), lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")])
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, "/m/a/tiny", 8, {}, None)
    gateway.submit("t-alice", "create_model", model_id, None, b"{}")
    listed = runner.invoke(app, ["sessions", "list", "--json", "--set", f"store.root={root}"])
    assert listed.exit_code == 0, listed.output
    (summary,) = json.loads(listed.output)
    assert summary["tenant"] == "t-alice" and summary["requests"] == 1
    assert summary["pending"] == [f"{session}.train.0.create"]
    assert summary["models"] == [{"model_id": model_id, "base_model": "/m/a/tiny", "lora_rank": 8}]
    shown = runner.invoke(app, ["sessions", "show", session, "--set", f"store.root={root}"])
    assert shown.exit_code == 0 and model_id in shown.output
    missing = runner.invoke(app, ["sessions", "show", "sess-nope", "--set", f"store.root={root}"])
    assert missing.exit_code == 2 and "rlpipe sessions list" in missing.output


def test_the_listing_tells_live_lapsed_and_ended_sessions_apart(tmp_path):
    """Engines unload a session silent for SESSION_TIMEOUT_S (lapsed: its next call brings it back); one that was
    finished, or silent for a day, has ended and takes no calls."""
    import time

    from schemas.api import SESSION_TIMEOUT_S, session_path

    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")])
    live, silent, gone, done = (gateway.create_session("t-alice", [], {}) for _ in range(4))
    for session, ago in ((silent, SESSION_TIMEOUT_S + 5), (gone, 86400 + 5)):
        store.put(f"{session_path(session)}/heartbeat.json", json.dumps({"time": time.time() - ago}).encode())
    gateway.finish("t-alice", done, "interrupted")
    listed = runner.invoke(app, ["sessions", "list", "--json", "--set", f"store.root={root}"])
    states = {s["session_id"]: (s["state"], s["ended"], s["end"]) for s in json.loads(listed.output)}
    assert states[live] == ("live", False, None) and states[silent] == ("lapsed", False, None)
    assert states[done] == ("ended", True, "finished: interrupted")
    assert states[gone][:2] == ("ended", True) and states[gone][2].startswith("expired: no heartbeat since")
    table = runner.invoke(app, ["sessions", "list", "--set", f"store.root={root}"], env={"COLUMNS": "200"})
    assert "lapsed" in table.output and "finished: interrupted" in table.output and "t-alice" in table.output


def test_an_operator_ends_a_session_and_the_first_end_stands(tmp_path):
    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")], live_check_s=0.0)
    session, closed = gateway.create_session("t-alice", [], {}), gateway.create_session("t-alice", [], {})
    gateway.finish("t-alice", closed, "success")
    ended = runner.invoke(app, ["sessions", "end", session, "--reason", "crashed loop", "--set", f"store.root={root}"])
    assert ended.exit_code == 0 and "ended by an operator: crashed loop" in ended.output
    with pytest.raises(SessionEndedError, match="ended by an operator: crashed loop"):
        gateway.heartbeat("t-alice", session)
    again = runner.invoke(app, ["sessions", "end", closed, "--set", f"store.root={root}"])
    assert again.exit_code == 0 and "already ended (finished: success)" in again.output
    as_json = json.loads(runner.invoke(app, ["sessions", "end", closed, "--json", "--set", f"store.root={root}"]).output)
    assert as_json["already_ended"] and as_json["end"] == "finished: success"
    missing = runner.invoke(app, ["sessions", "end", "sess-nope", "--set", f"store.root={root}"])
    assert missing.exit_code == 2 and "rlpipe sessions list" in missing.output


def test_the_listing_reads_each_sessions_heartbeat_once(tmp_path, monkeypatch):
    """A session's state and its heartbeat's age come from one read of its heartbeat record: a store with many
    sessions (or a remote one) is not read for each twice or more."""
    from collections import Counter

    from schemas.api import session_path

    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")])
    sessions = [gateway.create_session("t-alice", [], {}) for _ in range(3)]
    for session in sessions:
        store.put(f"{session_path(session)}/heartbeat.json", json.dumps({"time": time.time() - 5}).encode())
    reads: Counter[str] = Counter()
    real_get = ObjectStore.get

    def counted(self, key, *args, **kwargs):
        reads[key] += 1
        return real_get(self, key, *args, **kwargs)

    monkeypatch.setattr(ObjectStore, "get", counted)
    listed = runner.invoke(app, ["sessions", "list", "--json", "--set", f"store.root={root}"])
    assert [s["state"] for s in json.loads(listed.output)] == ["live"] * 3, listed.output
    beats = {key: n for key, n in reads.items() if key.endswith("/heartbeat.json")}
    assert beats == {f"{session_path(session)}/heartbeat.json": 1 for session in sessions}, reads


def test_the_listing_fits_80_columns_with_each_session_id_and_heartbeat_on_one_line(tmp_path):
    """Session ids are copied into commands: the counts are left out, with a note, before an id or a heartbeat
    would be split over lines."""
    from schemas.api import SESSION_TIMEOUT_S, session_path

    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")])
    live, silent, done = (gateway.create_session("t-alice", [], {}) for _ in range(3))
    store.put(f"{session_path(silent)}/heartbeat.json",
              json.dumps({"time": time.time() - SESSION_TIMEOUT_S - 5}).encode())
    gateway.finish("t-alice", done, "interrupted")
    table = runner.invoke(app, ["sessions", "list", "--set", f"store.root={root}"], env={"COLUMNS": "80"})
    assert table.exit_code == 0, table.output
    lines = [line for line in table.output.splitlines() if line[:1] in "┏┃┡│└"]
    assert max(len(line) for line in lines) <= 80, table.output
    rows = {session: next((line for line in lines if session in line), "") for session in (live, silent, done)}
    assert " s ago " in rows[live] and "lapsed (" in rows[silent] and " s ago)" in rows[silent], table.output
    assert "finished: interrupted (" in rows[done] and " s ago)" in rows[done], table.output
    assert "left out to fit 80 columns" in table.output


def test_a_session_with_no_heartbeat_yet_says_so_instead_of_an_age(tmp_path):
    """A session just created, or one ended before its first heartbeat, has no heartbeat to count from."""
    from pipeline.api.lifecycle import record_end

    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    fresh, closed = "sess-00000011", "sess-00000012"
    for session in (fresh, closed):
        store.put(f"sessions/{session}/session.json", json.dumps({"tenant": "t", "created_at": time.time()}).encode())
    record_end(store, closed, "finished: success")
    table = runner.invoke(app, ["sessions", "list", "--set", f"store.root={root}"], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    rows = {session: next(line for line in table.output.splitlines() if session in line) for session in (fresh, closed)}
    assert "None" not in table.output, table.output
    assert "none yet" in rows[fresh] and "finished: success (no heartbeat)" in rows[closed], table.output


def test_freeing_every_ended_session_says_which_it_skipped_and_from_when_they_can_be_freed(tmp_path):
    """Sessions that ended within the grace are listed as ended but not freed: the command says how many it
    skipped and from when each can be freed, instead of a bare "freed 0"."""
    from datetime import UTC, datetime

    from pipeline.api.lifecycle import END_GRACE_S

    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")])
    first, second = gateway.create_session("t-alice", [], {}), gateway.create_session("t-alice", [], {})
    for session in (first, second):
        runner.invoke(app, ["sessions", "end", session, "--set", f"store.root={root}"])
    ended = json.loads(store.get(f"sessions/{second}/ended.json"))
    store.put(f"sessions/{second}/ended.json", json.dumps({**ended, "time": ended["time"] + 120}).encode())
    free_from = {session: json.loads(store.get(f"sessions/{session}/ended.json"))["time"] + END_GRACE_S
                 for session in (first, second)}  # the later one two minutes after the first
    shown = {session: datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
             for session, at in free_from.items()}
    line = runner.invoke(app, ["sessions", "free", "--all-ended", "--set", f"store.root={root}"],
                         env={"COLUMNS": "250"}).output
    assert "freed 0 ended sessions" in line and "skipped 2 that ended less than 10 minutes ago" in line, line
    assert f"from {shown[first]}" in line and f"the last from {shown[second]}" in line, line
    every = json.loads(runner.invoke(app, ["sessions", "free", "--all-ended", "--json",
                                           "--set", f"store.root={root}"]).output)
    assert every["freed"] == {} and every["skipped"] == {s: datetime.fromtimestamp(at, UTC).isoformat()
                                                         for s, at in free_from.items()}
    assert store.exists(f"sessions/{first}/session.json")


def test_an_operator_frees_an_ended_sessions_files_and_a_live_one_is_refused(tmp_path):
    root = f"file://{tmp_path}/store"
    store = ObjectStore(root)
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/m/a/tiny", "/m/a/tiny")], live_check_s=0.0)
    session = gateway.create_session("t-alice", [], {})
    model_id = gateway.register_model("t-alice", session, 0, "/m/a/tiny", 8, {}, None)
    gateway.submit("t-alice", "create_model", model_id, None, b"{}")
    live = runner.invoke(app, ["sessions", "free", session, "--set", f"store.root={root}"])
    assert live.exit_code == 1 and f"rlpipe sessions end {session}" in live.output
    assert store.list(f"sessions/{session}/requests") != []
    runner.invoke(app, ["sessions", "end", session, "--set", f"store.root={root}"])
    early = runner.invoke(app, ["sessions", "free", session, "--set", f"store.root={root}"])
    assert early.exit_code == 1 and "ended less than 10 minutes ago" in early.output  # calls may be in flight
    ended = json.loads(store.get(f"sessions/{session}/ended.json"))
    store.put(f"sessions/{session}/ended.json", json.dumps({**ended, "time": ended["time"] - 601}).encode())
    freed = runner.invoke(app, ["sessions", "free", session, "--json", "--set", f"store.root={root}"])
    assert freed.exit_code == 0 and json.loads(freed.output) == {"session_id": session, "deleted": 1}
    shown = json.loads(runner.invoke(app, ["sessions", "show", session, "--json", "--set", f"store.root={root}"]).output)
    assert shown["requests"] == 0 and shown["files_deleted"]["reason"] == "freed by an operator"
    assert shown["models"] == [{"model_id": model_id, "base_model": "/m/a/tiny", "lora_rank": 8}]
    table = runner.invoke(app, ["sessions", "list", "--set", f"store.root={root}"], env={"COLUMNS": "250"})
    assert "calls' files deleted" in " ".join(table.output.split())
    # every ended session at once: a day-silent one (expired), not a live one nor the one already freed
    silent, live = gateway.create_session("t-alice", [], {}), gateway.create_session("t-alice", [], {})
    for sid in (silent, live):
        gateway.submit("t-alice", "create_model", gateway.register_model("t-alice", sid, 0, "/m/a/tiny", 8, {}, None),
                       None, b"{}")
    store.put(f"sessions/{silent}/heartbeat.json", json.dumps({"time": time.time() - 2 * 86400}).encode())
    every = runner.invoke(app, ["sessions", "free", "--all-ended", "--json", "--set", f"store.root={root}"])
    assert every.exit_code == 0 and json.loads(every.output) == {"freed": {silent: 1}, "deleted": 1, "skipped": {}}
    assert store.list(f"sessions/{live}/requests") != []
    neither = runner.invoke(app, ["sessions", "free", "--set", f"store.root={root}"])
    assert neither.exit_code == 2 and "--all-ended" in neither.output
    both = runner.invoke(app, ["sessions", "free", live, "--all-ended", "--set", f"store.root={root}"])
    assert both.exit_code == 2 and "not both" in both.output  # it said to name one session, which it did


def test_serve_refuses_unknown_roles_and_prints_a_working_example():
    assert runner.invoke(app, ["serve", "--role", "sampler", "--sampler", "chef"]).exit_code == 2
    assert runner.invoke(app, ["serve", "--role", "chef"]).exit_code == 2
    example = sdk_example("http://127.0.0.1:8000", "/m/a/tiny")
    assert len(example.splitlines()) == 3 and "base_url='http://127.0.0.1:8000'" in example
    assert "tml-anything" in example and "tml-anything" not in sdk_example("http://h:1", "/m", open_keys=False)
    assert trainer_command("/m/a/tiny", "file:///s", "h:1", "ns")[1:3] == ["-m", "consumers.api.worker"]
    sampler = sampler_command("/m/a/tiny", "file:///s", "h:1", "ns", "vllm")
    assert sampler[1:3] == ["-m", "producers.api_sampler"] and sampler[-4:] == ["--backend", "vllm",
                                                                               "--max-lora-rank", "32"]
    assert sampler_command("/m", "file:///s", "h:1", "ns", "vllm", max_lora_rank=64)[-1] == "64"
    assert "--max-lora-rank" not in sampler_command("/m", "file:///s", "h:1", "ns", "transformers")


def test_serve_refuses_a_public_url_that_is_not_one():
    result = runner.invoke(app, ["serve", "--public-url", "rl.example.org"])
    assert result.exit_code == 2 and "--public-url 'rl.example.org' is not a URL" in " ".join(result.output.split())


def test_serve_refuses_gateway_thread_settings_that_cannot_be_used_before_anything_starts():
    from pipeline.devstack.process import free_port

    result = runner.invoke(app, ["serve", "--port", str(free_port())],
                           env={"RLPIPE_API_THREADS": "16", "RLPIPE_API_THREADS_RESERVED": "16"})
    assert result.exit_code == 2, result.output
    assert "RLPIPE_API_THREADS_RESERVED=16 leaves no thread" in " ".join(result.output.split())


def test_the_trainers_adapter_limits_reach_its_command_and_only_a_trainer_takes_them():
    command = trainer_command("/m", "file:///s", "h:1", "ns", max_adapters=4, idle_unload_s=120)
    assert command[-4:] == ["--max-adapters", "4", "--idle-unload-s", "120"]
    assert "--max-adapters" not in trainer_command("/m", "file:///s", "h:1", "ns")
    with pytest.raises(SystemExit):  # the trainer refuses a limit of 0, naming the fix
        main(["--base-model", "/m", "--store", "file:///s", "--bootstrap", "h:1", "--max-adapters", "0"])
    result = runner.invoke(app, ["serve", "--role", "sampler", "--max-adapters", "2"])
    assert result.exit_code == 2 and "--max-adapters and --idle-unload-s are the trainer's" in " ".join(
        result.output.split())
    assert runner.invoke(app, ["serve", "--max-adapters", "0"]).exit_code == 2


def test_serve_refuses_a_max_lora_rank_vllm_has_no_slot_for():
    result = runner.invoke(app, ["serve", "--sampler", "vllm", "--max-lora-rank", "24"])
    assert result.exit_code == 2
    assert "--max-lora-rank 24 is not a vLLM rank slot; use one of 1, 8, 16, 32" in " ".join(result.output.split())


def test_the_samplers_batch_cap_reaches_a_transformers_sampler_and_is_refused_elsewhere():
    command = sampler_command("/m", "file:///s", "h:1", "ns", "transformers", max_batch_sequences=8)
    assert command[-2:] == ["--max-batch-sequences", "8"]
    assert "--max-batch-sequences" not in sampler_command("/m", "file:///s", "h:1", "ns", "transformers")
    for args in (["--sampler", "vllm"], ["--role", "trainer"], ["--role", "gateway"]):
        result = runner.invoke(app, ["serve", *args, "--max-batch-sequences", "8"])
        assert result.exit_code == 2, args
        assert "--max-batch-sequences is the transformers sampler's" in " ".join(result.output.split()), args
    assert runner.invoke(app, ["serve", "--max-batch-sequences", "0"]).exit_code == 2


def test_serve_stops_its_engines_and_kills_one_that_ignores_the_request():
    """An engine whose broker went away first can hang in its shutdown; serve must not leave it running."""
    import subprocess
    import sys
    import time

    from pipeline.cli.serve_cmd import stop_workers

    polite = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stuck = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    assert stuck.stdout is not None and stuck.stdout.readline().strip() == "ready"
    started = time.monotonic()
    stop_workers([polite, stuck], timeout_s=1.0)
    assert polite.poll() is not None and stuck.poll() is not None
    assert time.monotonic() - started < 10


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGHUP"])
def test_sigterm_lets_serve_stop_its_engines_after_uvicorn_shuts_down(tmp_path, signal_name):
    """uvicorn raises SIGTERM again after its graceful shutdown; serve's clean-up must still run.  A closed
    terminal's SIGHUP too: it reaches serve alone, its engines being in process groups of their own."""
    import signal
    import subprocess
    import sys
    import time

    from pipeline.devstack.process import free_port, port_is_free

    port = free_port()
    script = tmp_path / "serve_like.py"
    script.write_text(
        "import uvicorn\n"
        "from pipeline.cli.serve_cmd import stop_on_sigterm\n"
        "async def app(scope, receive, send):\n"
        "    pass\n"
        "stop_on_sigterm()\n"
        "try:\n"
        f"    uvicorn.run(app, host='127.0.0.1', port={port}, log_level='warning', lifespan='off')\n"
        "finally:\n"
        "    print('engines stopped', flush=True)\n")
    process = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    deadline = time.monotonic() + 60
    while port_is_free(port) and time.monotonic() < deadline:  # uvicorn listening, its signal handlers in place
        time.sleep(0.1)
    time.sleep(0.5)
    sent = getattr(signal, signal_name)
    process.send_signal(sent)
    out, _ = process.communicate(timeout=30)
    assert "engines stopped" in out and process.returncode == 128 + sent, out


def test_an_engine_that_dies_is_started_again_and_one_that_keeps_dying_is_given_up(tmp_path, caplog):
    """A trainer resumes from its folds and its request log, so serve starts a dead engine again
    (it once stopped on a broker error and every session waited for ever); a crash loop is not retried for ever."""
    import logging
    import sys
    import time

    from pipeline.cli.serve_cmd import EngineSupervisor

    starts = tmp_path / "starts"
    steady = [sys.executable, "-c", f"open({str(starts)!r}, 'a').write('s'); import time; time.sleep(60)"]
    crashing = [sys.executable, "-c", "raise SystemExit(3)"]
    with caplog.at_level(logging.WARNING, logger="rlpipe.serve"):
        supervisor = EngineSupervisor([("trainer for a", steady), ("sampler for a", crashing)], env=None,
                                      max_restarts=2, window_s=60.0, poll_s=0.1).start()
        try:
            deadline = time.monotonic() + 30
            while not starts.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
            supervisor.processes[0].kill()  # the trainer dies
            while starts.read_text() != "ss" and time.monotonic() < deadline:
                time.sleep(0.1)
            assert starts.read_text() == "ss"
            assert supervisor.processes[0].poll() is None
            # a process group of its own, restarted ones too: a Ctrl-C at serve's terminal reaches serve alone,
            # which then stops each engine once (a second signal would abort its shutdown)
            engine = supervisor.processes[0].pid
            assert os.getpgid(engine) == engine != os.getpgid(0)
            while "giving up" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.1)
        finally:
            supervisor.stop(timeout_s=5.0)
    assert all(p.poll() is not None for p in supervisor.processes)
    assert "trainer for a exited with code -9; starting it again" in caplog.text
    assert caplog.text.count("sampler for a exited with code 3; starting it again") == 2
    assert "sampler for a exited with code 3 after 2 restarts in 60 s; giving up" in caplog.text
    time.sleep(0.5)
    assert starts.read_text() == "ss"  # stopped for good: nothing started after stop()


def test_serve_refuses_a_base_model_folder_that_is_not_there_before_starting_anything(tmp_path, monkeypatch):
    from pipeline.devstack import launcher

    def started(config, **kwargs):
        raise AssertionError("the stack was started before the base model was checked")

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(launcher, "ensure_stack", started)
    missing = tmp_path / "no-such-model"
    result = runner.invoke(app, ["serve", "--base-model", str(missing)])
    assert result.exit_code == 2, result.output
    assert f"base model {missing}: no such folder" in result.stderr and "Traceback" not in result.output


def test_a_gateway_names_base_models_it_holds_no_copy_of(tmp_path, monkeypatch):
    """The gateway only routes calls to the engines serving a model: a folder that exists only in the engines'
    pods is no reason for it to refuse to start (it restarted for ever in infra/k8s/api)."""
    from pipeline.cli import serve_cmd
    from pipeline.devstack import launcher
    from pipeline.io import bus

    served = []
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", (tmp_path / "store").as_uri())
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", "127.0.0.1:1")
    stacks = []
    monkeypatch.setattr(launcher, "ensure_stack", lambda config, **kwargs: stacks.append(kwargs))
    monkeypatch.setattr(bus, "ensure_topics", lambda *args, **kwargs: None)
    monkeypatch.setattr(serve_cmd, "run_gateway", lambda store, bus, models, *rest: served.append(models))
    elsewhere = "/cache/models/base"
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["serve", "--role", "gateway", "--base-model", elsewhere, "--base-model", "./here"])
    assert result.exit_code == 0, result.output
    assert served == [[elsewhere, str(tmp_path / "here")]]  # a folder it has is named as its engines name it
    assert stacks == [{"outlives": "the server"}]  # a stack it starts is said to outlive the server, not a run


def test_a_base_model_path_must_be_a_model_folder_and_a_hub_id_passes(tmp_path):
    import pytest

    from pipeline.models import ModelPathError, resolve_base_model
    from schemas.config import ModelConfig

    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_text("")
    for name, says in ((str(tmp_path / "gone"), "no such folder"), (str(tmp_path / "empty"), "has no config.json"),
                       (str(tmp_path / "weights.bin"), "is a file"), ("./not-here/model", "no such folder")):
        with pytest.raises(ModelPathError, match=says):
            resolve_base_model(ModelConfig(base_model=name))
    (tmp_path / "empty" / "config.json").write_text("{}")
    assert resolve_base_model(ModelConfig(base_model=str(tmp_path / "empty"))) == str(tmp_path / "empty")
    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2"):
        assert resolve_base_model(ModelConfig(base_model=hub_id)) == hub_id


def test_each_engine_of_a_trainer_or_sampler_role_gets_its_own_health_port():
    assert trainer_command("/m", "file:///s", "h:1", "ns", health_port=8080)[-2:] == ["--health-port", "8080"]
    assert sampler_command("/m", "file:///s", "h:1", "ns", "vllm", health_port=8081)[-2:] == ["--health-port",
                                                                                             "8081"]
    assert "--health-port" not in trainer_command("/m", "file:///s", "h:1", "ns")
    result = runner.invoke(app, ["serve", "--role", "gateway", "--health-port", "8080"])
    assert result.exit_code == 2 and "--health-port is for --role trainer or sampler" in " ".join(
        result.output.split())


def test_a_gateway_port_in_use_is_refused_before_anything_starts(tmp_path, monkeypatch):
    """The port is checked first: not after the stack, the base models and the engines have started."""
    import socket

    from pipeline.devstack.process import free_port

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", (tmp_path / "store").as_uri())
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # nothing listens there
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--role", "gateway", "--port", str(port), "-m", "/models/elsewhere"])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert f"the gateway cannot listen on 127.0.0.1:{port}" in result.output and "--port" in result.output


@pytest.mark.parametrize("role", ["trainer", "sampler"])
def test_an_engines_health_port_in_use_is_refused_before_the_engine_starts(role, tmp_path, monkeypatch):
    """Not a traceback from the engine process once it has loaded: serve checks the port first."""
    import socket

    from pipeline.devstack.process import free_port

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("RLPIPE_STORE__ROOT", (tmp_path / "store").as_uri())
    monkeypatch.setenv("RLPIPE_BUS__BOOTSTRAP_SERVERS", f"127.0.0.1:{free_port()}")  # nothing listens there
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = runner.invoke(app, ["serve", "--role", role, "--health-port", str(port), "-m", str(model)])
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1, result.output
    assert f"cannot listen on 0.0.0.0:{port}" in result.output and "--health-port" in result.output
