"""Health server: real HTTP requests to 127.0.0.1 on a free port."""

from __future__ import annotations

import socket
import threading
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.health import HealthServer, PackedRunsHealth


def _get(server: HealthServer, path: str) -> tuple[int, str, str]:
    """(status, content type, body) of GET ``path``; HTTP errors are answers too."""
    url = f"http://127.0.0.1:{server.port}{path}"
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def _samples(body: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Parse the exposition with prometheus' own parser: {(sample name, sorted labels): value}."""
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


@pytest.fixture
def server():
    with HealthServer(0, host="127.0.0.1") as srv:
        yield srv


def test_port_zero_binds_a_real_free_port(server):
    assert server.running
    assert isinstance(server.port, int) and server.port > 0
    with socket.create_connection(("127.0.0.1", server.port), timeout=2):
        pass


def test_healthz_is_ok_while_alive(server):
    status, _, body = _get(server, "/healthz")
    assert (status, body) == (200, "ok\n")


def test_readyz_without_checks_is_ready(server):
    assert _get(server, "/readyz")[0] == 200


def test_readyz_reports_each_failing_check_by_name(server):
    state = {"broker": False, "store": True}
    server.add_readiness_check("broker", lambda: state["broker"])
    server.add_readiness_check("store", lambda: state["store"])
    status, _, body = _get(server, "/readyz")
    assert status == 503
    assert "broker" in body and "store" not in body

    state["broker"] = True  # checks run per request: the answer follows the process's state
    assert _get(server, "/readyz")[0] == 200

    state["store"] = False
    status, _, body = _get(server, "/readyz")
    assert status == 503 and "store" in body and "broker" not in body


def test_a_raising_check_is_not_ready_and_names_the_error(server):
    def model_loaded() -> bool:
        raise RuntimeError("weights missing")

    server.add_readiness_check("model", model_loaded)
    status, _, body = _get(server, "/readyz")
    assert status == 503
    assert "model: RuntimeError: weights missing" in body
    assert _get(server, "/healthz")[0] == 200  # liveness is independent of readiness


def test_unknown_path_is_404(server):
    assert _get(server, "/nope")[0] == 404


def test_metrics_gauges_and_counters_in_prometheus_text_format(server):
    server.set_gauge("rlpipe_adapter_version", 3, "newest adapter loaded")
    server.set_gauge("rlpipe_adapter_version", 4, "newest adapter loaded")  # a gauge is replaced
    server.inc_counter("rlpipe_groups", help="groups sampled", labels={"env": "sokoban"})
    server.inc_counter("rlpipe_groups", 2, help="groups sampled", labels={"env": "sokoban"})
    server.inc_counter("rlpipe_groups_total", help="groups sampled", labels={"env": "tetris"})

    status, content_type, body = _get(server, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain") and "version=0.0.4" in content_type
    assert "# HELP rlpipe_adapter_version newest adapter loaded" in body
    assert "# TYPE rlpipe_adapter_version gauge" in body
    assert "# TYPE rlpipe_groups_total counter" in body  # text format 0.0.4 names the counter with its suffix
    samples = _samples(body)
    assert samples[("rlpipe_adapter_version", ())] == 4.0
    assert samples[("rlpipe_groups_total", (("env", "sokoban"),))] == 3.0  # 1 + 2
    assert samples[("rlpipe_groups_total", (("env", "tetris"),))] == 1.0
    assert server.metric_value("rlpipe_groups_total", {"env": "sokoban"}) == 3.0


def test_label_values_and_help_are_escaped(server):
    nasty = 'a "quoted" \\ back\nslash'
    server.set_gauge("rlpipe_weird", 1.5, help="line one\nline two \\", labels={"path": nasty})
    body = _get(server, "/metrics")[2]
    # The raw newline must not break the line-based format: every line is a comment or a sample.
    for line in body.strip().splitlines():
        assert line.startswith("#") or line.startswith("rlpipe_weird{")
    assert 'path="a \\"quoted\\" \\\\ back\\nslash"' in body
    assert _samples(body)[("rlpipe_weird", (("path", nasty),))] == 1.5  # round-trips through the parser


def test_label_order_does_not_make_a_new_series(server):
    server.set_gauge("rlpipe_lag", 1, labels={"topic": "t", "group": "g"})
    server.set_gauge("rlpipe_lag", 7, labels={"group": "g", "topic": "t"})
    samples = _samples(_get(server, "/metrics")[2])
    assert [v for (name, _), v in samples.items() if name == "rlpipe_lag"] == [7.0]


def test_misuse_is_refused_with_a_clear_error():
    srv = HealthServer(None)
    with pytest.raises(ValueError, match="invalid"):
        srv.set_gauge("bad-name", 1)
    with pytest.raises(ValueError, match="label name"):
        srv.set_gauge("ok_name", 1, labels={"bad-label": "x"})
    srv.set_gauge("rlpipe_x", 1)
    with pytest.raises(ValueError, match="is a gauge"):
        srv.inc_counter("rlpipe_x")
    with pytest.raises(ValueError, match="same label names"):
        srv.set_gauge("rlpipe_x", 1, labels={"env": "a"})
    with pytest.raises(ValueError, match="only go up"):
        srv.inc_counter("rlpipe_y", -1)
    with pytest.raises(ValueError, match="out of range"):
        HealthServer(70000)


def test_disabled_server_keeps_metrics_and_listens_nowhere():
    srv = HealthServer(None).start()
    srv.inc_counter("rlpipe_steps", 5)
    assert not srv.running and srv.port is None
    assert srv.metric_value("rlpipe_steps_total") == 5.0
    assert b"rlpipe_steps_total 5.0" in srv.render_metrics()
    srv.stop()


def test_stop_frees_the_port_and_is_idempotent():
    srv = HealthServer(0, host="127.0.0.1").start()
    port = srv.port
    srv.stop()
    srv.stop()
    assert not srv.running
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    # The port is free again: a new server can bind exactly it.
    with HealthServer(port, host="127.0.0.1") as again:
        assert _get(again, "/healthz")[0] == 200


def test_busy_port_is_a_one_line_error():
    with HealthServer(0, host="127.0.0.1") as first, pytest.raises(OSError, match="choose another health_port"):
        HealthServer(first.port, host="127.0.0.1").start()


@pytest.mark.parametrize("part", ["learner", "producer"])
def test_a_busy_health_port_ends_the_command_in_one_line(part, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from pipeline.cli.main import app
    from pipeline.devstack.process import free_port

    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = CliRunner().invoke(app, [part, "start", "--preset", "cartpole", "--set", f"{part}.health_port={port}",
                                          "--set", f"bus.bootstrap_servers=127.0.0.1:{free_port()}",
                                          "--set", f"store.root={(tmp_path / 'store').as_uri()}"])
    assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.exception
    assert f"error: cannot serve health endpoints on 0.0.0.0:{port}" in result.output and "health_port" in result.output
    assert "Traceback" not in result.output


def test_serves_concurrent_requests_while_a_check_blocks(server):
    # A slow readiness check must not stall liveness: ThreadingHTTPServer answers each request in its own thread.
    release = threading.Event()
    server.add_readiness_check("slow", lambda: release.wait(5))
    slow = threading.Thread(target=_get, args=(server, "/readyz"))
    slow.start()
    try:
        assert _get(server, "/healthz")[0] == 200
    finally:
        release.set()
        slow.join()


def test_a_raising_check_is_logged_as_a_warning(server, caplog):
    def model_loaded() -> bool:
        raise RuntimeError("weights missing")

    server.add_readiness_check("model", model_loaded)
    with caplog.at_level("WARNING", logger="pipeline.health"):
        assert server.failing_checks() == ["model: RuntimeError: weights missing"]
    assert [r.levelname for r in caplog.records] == ["WARNING"]
    assert "model" in caplog.text and "weights missing" in caplog.text


def test_remove_series_drops_every_sample_carrying_the_labels_and_keeps_the_rest(server):
    server.set_gauge("rlpipe_learner_step", 3, labels={"run": "a"})
    server.set_gauge("rlpipe_learner_step", 5, labels={"run": "b"})
    server.inc_counter("rlpipe_lag", 2, labels={"run": "b", "topic": "t"})
    server.set_gauge("rlpipe_learner_up", 1)

    assert server.remove_series({"run": "b"}) == 2
    samples = _samples(_get(server, "/metrics")[2])
    assert samples == {("rlpipe_learner_step", (("run", "a"),)): 3.0, ("rlpipe_learner_up", ()): 1.0}
    assert "rlpipe_lag" not in _get(server, "/metrics")[2]  # a family left with no sample is not rendered
    assert server.remove_series({"run": "b"}) == 0
    with pytest.raises(ValueError, match="at least one label"):
        server.remove_series({})  # would remove everything: never what a caller means


def test_readiness_details_are_listed_on_readyz_whether_ready_or_not(server):
    ready = {"runs": True}
    server.add_readiness_check("runs", lambda: ready["runs"])
    server.add_readiness_detail(lambda: ["run a: serving", "run b: waiting to come back (OSError: gone)"])
    status, _, body = _get(server, "/readyz")
    assert (status, body) == (200, "ready\nrun a: serving\nrun b: waiting to come back (OSError: gone)\n")
    ready["runs"] = False
    status, _, body = _get(server, "/readyz")
    assert (status, body.splitlines()) == (503, ["not ready: runs", "run a: serving",
                                                 "run b: waiting to come back (OSError: gone)"])


def test_packed_runs_are_labelled_marked_serving_or_waiting_and_forgotten_once_gone(server):
    runs = PackedRunsHealth(server, "rlpipe_learner")
    runs.sync(serving=["a", "b"], waiting={})
    server.set_gauge("rlpipe_learner_step", 4, labels=runs.labels("a"))
    server.set_gauge("rlpipe_learner_step", 7, labels=runs.labels("b"))
    server.set_gauge("rlpipe_learner_up", 1)
    samples = _samples(_get(server, "/metrics")[2])
    assert samples[("rlpipe_learner_run_serving", (("run", "a"),))] == 1.0
    assert samples[("rlpipe_learner_run_serving", (("run", "b"),))] == 1.0
    assert _get(server, "/readyz")[2] == "ready\nrun a: serving\nrun b: serving\n"

    # b stopped on an error: still reported, as not served, its last numbers kept until it comes back
    runs.sync(serving=["a"], waiting={"b": "OSError: store gone"})
    samples = _samples(_get(server, "/metrics")[2])
    assert samples[("rlpipe_learner_run_serving", (("run", "b"),))] == 0.0
    assert samples[("rlpipe_learner_step", (("run", "b"),))] == 7.0
    assert "run b: waiting to come back (OSError: store gone)" in _get(server, "/readyz")[2]

    runs.sync(serving=["a"], waiting={})  # b left: every series of it goes, a's and the process's stay
    samples = _samples(_get(server, "/metrics")[2])
    assert {labels for _, labels in samples} == {(("run", "a"),), ()}
    assert samples[("rlpipe_learner_up", ())] == 1.0
    assert _get(server, "/readyz")[2] == "ready\nrun a: serving\n"
