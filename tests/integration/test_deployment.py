"""Deployment acceptance: what a Kubernetes pod relies on, checked against the real broker and real processes.

1. A producer and a learner configured only through ``RLPIPE_*`` variables (as the pod manifests do), run
   as the real ``rlpipe producer start`` / ``rlpipe learner start`` subprocesses: ``/healthz``, ``/readyz``
   and ``/metrics`` answer, the gauges the heartbeat and the learner's step carry show up, the learner
   trains a step from the producer's batches, and SIGTERM ends both with exit code 0.
2. Readiness is honest: ``/healthz`` answers while set-up is still under way, and ``/readyz`` is 503
   naming the missing step until the sampler (producer) or the policy and its resume (learner) are done.
3. A wrong SASL setting against the plaintext broker ends ``rlpipe topics list`` and ``rlpipe producer
   start`` with one line on stderr within a bound, no traceback; the password comes from
   ``RLPIPE_BUS__SASL_PASSWORD`` or ``RLPIPE_BUS__SASL_PASSWORD_FILE``.
4. The SASL password never appears in any output, in ``rlpipe config show`` (shown as ``***``) or in the
   files the processes write.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.config import resolve_config
from pipeline.io.bus import kafka_client_settings
from pipeline.runtime import StopFlag
from schemas.config import RunConfig

pytestmark = pytest.mark.integration

SECRET = "zebra-7f3c-do-not-print"  # distinctive, so finding it anywhere means it leaked
CLI = [sys.executable, "-c", "from pipeline.cli.main import main; main()"]
READY_TIMEOUT_S = 150.0  # two processes importing torch on two busy cores; normally ~30 s
STEP_TIMEOUT_S = 120.0


# ---- helpers --------------------------------------------------------------------------------------------


def free_port() -> int:
    """A port nothing listens on right now (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rlpipe_env(**variables: str) -> dict[str, str]:
    """This process's environment without any ``RLPIPE_*`` variable, plus ``variables`` (names without prefix)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RLPIPE_")}
    env.update({f"RLPIPE_{name}": value for name, value in variables.items()})
    env["HF_HUB_OFFLINE"] = "1"  # the tiny model is a local folder; never reach for the hub
    env["COLUMNS"] = "400"  # rich wraps log lines at 80 columns off a terminal; keep each message whole
    return env


def sasl_env(bootstrap: str, home: Path, **extra: str) -> dict[str, str]:
    """A client configured for SASL/SCRAM, pointed at the plaintext broker (a wrong setting)."""
    return rlpipe_env(
        BUS__BOOTSTRAP_SERVERS=bootstrap,
        BUS__SECURITY_PROTOCOL="SASL_PLAINTEXT",
        BUS__SASL_MECHANISM="SCRAM-SHA-512",
        BUS__SASL_USERNAME="rlpipe",
        BUS__CONNECT_TIMEOUT_S="3",
        HOME=str(home),
        **extra,
    )


def run_cli(args: list[str], env: dict[str, str], timeout_s: float) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run ``rlpipe ARGS``; returns the finished process and its wall time."""
    started = time.monotonic()
    done = subprocess.run(CLI + args, env=env, capture_output=True, text=True, timeout=timeout_s)
    return done, time.monotonic() - started


def http_get(port: int, path: str) -> tuple[int, str, str]:
    """(status, body, content type) of ``GET http://127.0.0.1:PORT/PATH``; status 0 when nothing answers."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode(), response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), exc.headers.get("Content-Type", "")
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, "", ""


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` parsed by prometheus_client's own parser: sample name -> value (unlabelled samples)."""
    status, body, content_type = http_get(port, "/metrics")
    assert status == 200 and content_type.startswith("text/plain"), (status, content_type)
    return {s.name: s.value for family in text_string_to_metric_families(body) for s in family.samples if not s.labels}


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str,
               alive: Callable[[], str | None] = lambda: None) -> None:
    """Poll ``condition`` every 0.2 s; fail naming ``what`` after ``timeout_s`` or as soon as ``alive`` says why."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        dead = alive()
        if dead:
            pytest.fail(f"{what}: {dead}")
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout_s:g}s")


class Service:
    """A long-running ``rlpipe`` subprocess whose output goes to files (a pipe could fill and block it)."""

    def __init__(self, name: str, args: list[str], env: dict[str, str], folder: Path, port: int) -> None:
        self.name, self.port = name, port
        self.out_path, self.err_path = folder / f"{name}.out", folder / f"{name}.err"
        with self.out_path.open("wb") as out, self.err_path.open("wb") as err:
            self.process = subprocess.Popen(CLI + args, env=env, stdout=out, stderr=err)

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(errors="replace")

    def died(self) -> str | None:
        """Why waiting is pointless: the process exited (with its last output), else None."""
        code = self.process.poll()
        return None if code is None else f"{self.name} exited with {code}:\n{self.output()[-3000:]}"

    def terminate(self, timeout_s: float = 60.0) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout=timeout_s)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def files_containing(folder: Path, text: str) -> list[Path]:
    """Every file under ``folder`` whose bytes contain ``text``."""
    needle = text.encode()
    return [p for p in folder.rglob("*") if p.is_file() and needle in p.read_bytes()]


# ---- 1. producer and learner configured only through RLPIPE_ variables -----------------------------------


def test_env_only_producer_and_learner_serve_health_metrics_and_stop_cleanly(
    kafka_broker: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    store, home = tmp_path / "store", tmp_path / "home"
    producer_port, learner_port = free_port(), free_port()
    env = rlpipe_env(
        RUN_ID=f"deploy-{uuid.uuid4().hex[:8]}",
        BUS__BOOTSTRAP_SERVERS=kafka_broker.bootstrap_servers,
        BUS__NAMESPACE=f"t{uuid.uuid4().hex[:12]}",
        BUS__CONNECT_TIMEOUT_S="10",
        BUS__SASL_PASSWORD=SECRET,  # present as in a pod (from a Secret), unused by the PLAINTEXT bus
        STORE__ROOT=store.as_uri(),
        MODEL__BASE_MODEL=tiny_model_dir,
        SAMPLER__BACKEND="transformers",
        SAMPLER__MAX_NEW_TOKENS="8",
        ENV__NAME="cartpole",
        ENV__OVERRIDES='{"max_turns": 2}',  # JSON values are decoded: short episodes
        PRODUCER__GROUP_SIZE="2",
        PRODUCER__GROUPS_PER_BATCH="1",
        PRODUCER__CONCURRENT_GROUPS="1",
        PRODUCER__ENV_WORKERS="1",
        PRODUCER__HEARTBEAT_INTERVAL_S="1",
        PRODUCER__HEALTH_PORT=str(producer_port),
        PRODUCER__PRODUCER_ID="rlpipe-producer-3",  # a StatefulSet pod name: ordinal 3
        LEARNER__BATCH_ROWS="2",  # one producer batch = one optimizer step
        LEARNER__TORCH_THREADS="1",
        LEARNER__HEALTH_PORT=str(learner_port),
        HOME=str(home),
    )
    learner = Service("learner", ["learner", "start"], env, tmp_path, learner_port)
    producer = Service("producer", ["producer", "start"], env, tmp_path, producer_port)
    services = (producer, learner)
    try:
        for service in services:
            wait_until(lambda s=service: http_get(s.port, "/readyz")[0] == 200, READY_TIMEOUT_S,
                       f"{service.name} /readyz", service.died)
            assert http_get(service.port, "/healthz")[:2] == (200, "ok\n")
        assert scrape(producer_port)["rlpipe_producer_up"] == 1.0  # published right after set-up
        assert scrape(learner_port)["rlpipe_learner_up"] == 1.0

        def trained() -> bool:
            return scrape(learner_port).get("rlpipe_learner_step", 0.0) >= 1.0

        wait_until(trained, STEP_TIMEOUT_S, "learner step from the producer's batch",
                   lambda: producer.died() or learner.died())
        # carried by the producer's next heartbeat (every second), which a learner reading at once can beat
        wait_until(lambda: "rlpipe_producer_samples_per_s" in scrape(producer_port), 30.0,
                   "the producer's heartbeat metrics", producer.died)
        produced = scrape(producer_port)
        assert produced["rlpipe_producer_samples_total"] >= 2  # at least the group the learner trained on
        assert produced["rlpipe_producer_groups_dropped_total"] == 0.0
        learned = scrape(learner_port)
        assert learned["rlpipe_learner_step"] >= 1 and "rlpipe_learner_loss" in learned

        codes = {service.name: service.terminate() for service in services}
        assert codes == {"producer": 0, "learner": 0}, {s.name: s.output()[-3000:] for s in services}
    finally:
        for service in services:
            service.kill()
    for service in services:
        text = service.output()
        assert SECRET not in text
        assert "Traceback" not in text
    seeds = RunConfig().training_seeds("rlpipe-producer-3")  # the ordinal's range, below the evaluation seeds
    assert f"environment seeds {seeds.start}..{seeds.stop - 1}" in producer.output()
    assert files_containing(tmp_path, SECRET) == []  # run.json, checkpoints, logs: nowhere on disk


# ---- 2. readiness flips only when set-up is done (in-process, with one set-up step held back) -----------


@contextmanager
def held(module: Any, name: str) -> Iterator[threading.Event]:
    """Make ``module.name`` wait for the returned event before doing its real work."""
    release = threading.Event()
    real = getattr(module, name)

    def waiting(*args: Any, **kwargs: Any) -> Any:
        assert release.wait(timeout=120), f"{name} was never released"
        return real(*args, **kwargs)

    setattr(module, name, waiting)
    try:
        yield release
    finally:
        release.set()
        setattr(module, name, real)


def run_in_thread(target: Callable[[], Any]) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def main() -> None:
        try:
            target()
        except BaseException as exc:  # reported by the test, not lost in the thread
            errors.append(exc)

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    return thread, errors


def in_process_config(bus_config: Any, tiny_model_dir: str, tmp_path: Path, port: int) -> RunConfig:
    return RunConfig.model_validate({
        "run_id": "ready",
        "bus": bus_config.model_dump(),
        "store": {"root": (tmp_path / "store").as_uri()},
        "model": {"base_model": tiny_model_dir},
        "env": {"name": "cartpole", "overrides": {"max_turns": 1}},
        "sampler": {"backend": "transformers", "max_new_tokens": 4},
        "producer": {"group_size": 1, "groups_per_batch": 1, "concurrent_groups": 1, "env_workers": 1,
                     "health_port": port, "max_backlog_steps": None},
        "learner": {"torch_threads": 1, "health_port": port, "advantage": "raw"},  # one sample per group
    })


def failing_checks(port: int) -> set[str] | None:
    """The check names a 503 ``/readyz`` lists; None when it answers otherwise."""
    status, body, _ = http_get(port, "/readyz")
    return set(body.removeprefix("not ready: ").split()) if status == 503 else None


def assert_not_ready_while_held(port: int, missing: set[str], errors: list[BaseException]) -> None:
    """/healthz 200 while /readyz is 503 naming exactly the steps not done (the earlier ones pass)."""
    wait_until(lambda: failing_checks(port) == missing, 60, f"/readyz failing exactly {sorted(missing)}",
               lambda: repr(errors[0]) if errors else None)
    assert http_get(port, "/healthz")[:2] == (200, "ok\n")
    time.sleep(0.5)
    assert failing_checks(port) == missing  # still held back: it does not turn ready by itself


def assert_ready_then_stopping(port: int, stop: StopFlag, thread: threading.Thread, errors: list[BaseException],
                               gauge: str) -> None:
    wait_until(lambda: http_get(port, "/readyz")[0] == 200, 120, "/readyz after set-up",
               lambda: repr(errors[0]) if errors else None)
    assert scrape(port)[gauge] == 1.0
    stop.set()
    status, body, _ = http_get(port, "/readyz")  # either still draining (503 stopping) or already gone
    assert (status, body) in {(503, "not ready: stopping\n"), (0, "")}, (status, body)
    thread.join(timeout=60)
    assert not thread.is_alive() and errors == []
    assert http_get(port, "/healthz")[0] == 0  # the server stops with the work: a restart can bind the port


def test_producer_is_ready_only_after_its_sampler_is_loaded(
    bus_config: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    import producers.service as service

    port = free_port()
    config = in_process_config(bus_config, tiny_model_dir, tmp_path, port)
    stop = StopFlag()
    with held(service, "sampler_for_run") as release:
        thread, errors = run_in_thread(lambda: service.run_producer(config, stop))
        try:
            assert_not_ready_while_held(port, missing={"sampler", "adapters"}, errors=errors)
            release.set()
            assert_ready_then_stopping(port, stop, thread, errors, "rlpipe_producer_up")
        finally:
            stop.set()  # never leave a producer sampling in this process


def test_learner_is_ready_only_after_its_policy_is_loaded_and_resumed(
    bus_config: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    import consumers.service as service

    port = free_port()
    config = in_process_config(bus_config, tiny_model_dir, tmp_path, port)
    stop = StopFlag()
    with held(service, "build_learner") as release:
        thread, errors = run_in_thread(lambda: service.run_learner(config, stop))
        try:
            assert_not_ready_while_held(port, missing={"policy", "resumed"}, errors=errors)
            release.set()
            assert_ready_then_stopping(port, stop, thread, errors, "rlpipe_learner_up")
        finally:
            stop.set()  # never leave a learner polling in this process


# ---- 3. a wrong SASL setting: one line, bounded time, no secret ------------------------------------------


def secret_source(kind: str, tmp_path: Path) -> dict[str, str]:
    """The password as a variable or as a file (``sasl_password_file``), as a deployment would give it."""
    if kind == "variable":
        return {"BUS__SASL_PASSWORD": SECRET}
    password_file = tmp_path / "kafka-password"
    password_file.write_text(SECRET + "\n")
    password_file.chmod(0o600)
    return {"BUS__SASL_PASSWORD_FILE": str(password_file)}


def assert_one_line_error(done: subprocess.CompletedProcess[str], *fragments: str) -> None:
    # a start on a run the store lacks first says so in a line of its own (pipeline.runtime.new_run_note)
    lines = [line for line in done.stderr.strip().splitlines() if "it starts as a new run" not in line]
    assert done.returncode != 0
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in done.stdout + done.stderr
    assert SECRET not in done.stdout + done.stderr


@pytest.mark.parametrize("kind", ["variable", "file"])
def test_topics_list_with_wrong_sasl_fails_with_one_line_quickly(kafka_broker: Any, tmp_path: Path, kind: str) -> None:
    env = sasl_env(kafka_broker.bootstrap_servers, tmp_path / "home", **secret_source(kind, tmp_path))
    done, elapsed = run_cli(["topics", "list"], env, timeout_s=60)
    assert elapsed < 20, f"took {elapsed:.1f}s"
    assert_one_line_error(done, "cannot reach Kafka", kafka_broker.bootstrap_servers, "bus.security_protocol")


def test_producer_start_with_wrong_sasl_fails_with_one_line(
    kafka_broker: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    env = sasl_env(
        kafka_broker.bootstrap_servers, tmp_path / "home",
        BUS__SASL_PASSWORD=SECRET,
        STORE__ROOT=(tmp_path / "store").as_uri(),
        MODEL__BASE_MODEL=tiny_model_dir,
        SAMPLER__BACKEND="transformers",
        PRODUCER__HEALTH_PORT=str(free_port()),
    )
    done, elapsed = run_cli(["producer", "start"], env, timeout_s=120)
    # Python, torch and transformers imports take most of this on a busy machine; the bus gives up after 3 s.
    assert elapsed < 60, f"took {elapsed:.1f}s"
    assert_one_line_error(done, "cannot reach Kafka", "bus.sasl_mechanism")
    assert "initialising sampler" not in done.stdout  # it failed at the broker, before loading the model


def test_missing_password_file_is_one_line_naming_the_setting(kafka_broker: Any, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-password"
    env = sasl_env(kafka_broker.bootstrap_servers, tmp_path / "home", BUS__SASL_PASSWORD_FILE=str(missing))
    done, elapsed = run_cli(["topics", "list"], env, timeout_s=60)
    assert elapsed < 20
    assert_one_line_error(done, "bus.sasl_password_file", str(missing))
    assert done.returncode == 2  # a setting to fix, not an outage


def test_password_file_from_the_environment_reaches_the_kafka_client(tmp_path: Path) -> None:
    env = sasl_env("kafka-0.example:9093", tmp_path, **secret_source("file", tmp_path))
    settings = kafka_client_settings(resolve_config(environ=env).bus)
    assert settings["sasl_plain_password"] == SECRET  # the file's content, its newline stripped
    assert SECRET not in repr(settings)  # kafka-python logs its settings at debug level


# ---- 4. config show never prints the secret ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["variable", "file"])
def test_config_show_masks_the_password(tmp_path: Path, kind: str) -> None:
    env = sasl_env("kafka-0.example:9093", tmp_path / "home", **secret_source(kind, tmp_path))
    done, _ = run_cli(["config", "show"], env, timeout_s=60)
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    shown = json.loads(done.stdout)["bus"]
    assert shown["security_protocol"] == "SASL_PLAINTEXT" and shown["sasl_username"] == "rlpipe"
    if kind == "variable":
        assert shown["sasl_password"] == "***"
    else:
        assert shown["sasl_password"] is None
        assert shown["sasl_password_file"] == str(tmp_path / "kafka-password")  # where, never what
