"""The Tansu broker subprocess: it starts, answers Kafka requests, and goes away when stopped."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

from pipeline.devstack.broker import BrokerStartError, TansuBroker, answers_kafka_metadata
from pipeline.devstack.gcs_emulator import free_port


def _host_port(bootstrap: str) -> tuple[str, int]:
    host, _, port = bootstrap.rpartition(":")
    return host, int(port)


def test_session_broker_answers_kafka_metadata(kafka_broker: TansuBroker) -> None:
    host, port = _host_port(kafka_broker.bootstrap_servers)
    assert host == "127.0.0.1"
    assert port == kafka_broker.port
    assert kafka_broker.running
    assert answers_kafka_metadata(host, port)


def test_probe_refuses_closed_ports_and_non_kafka_listeners() -> None:
    assert not answers_kafka_metadata("127.0.0.1", free_port(), timeout_s=0.5)
    # A listener that accepts and answers with something that is not a Kafka response.
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()

        def answer_garbage() -> None:
            conn, _ = server.accept()
            with conn:
                conn.recv(1024)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer_garbage, daemon=True)
        thread.start()
        assert not answers_kafka_metadata("127.0.0.1", server.getsockname()[1], timeout_s=1.0)
        thread.join(timeout=2)


def test_start_stop_and_context_manager(tmp_path: Path) -> None:
    log_path = tmp_path / "broker.log"
    with TansuBroker(log_path=log_path) as broker:
        host, port = _host_port(broker.bootstrap_servers)
        pid = broker.pid
        assert pid is not None
        assert answers_kafka_metadata(host, port)
    assert not broker.running
    assert broker.pid is None
    assert not answers_kafka_metadata(host, port, timeout_s=0.5)
    assert log_path.read_text(errors="replace").strip(), "the broker's output goes to its log file"
    broker.stop()  # a second stop is harmless


def test_temporary_log_is_removed_on_stop() -> None:
    broker = TansuBroker().start()
    log_path = broker.log_path
    assert log_path is not None and log_path.exists()
    broker.stop()
    assert not log_path.exists()


def test_a_taken_port_is_refused_quickly(kafka_broker: TansuBroker) -> None:
    started = time.monotonic()
    with pytest.raises(BrokerStartError, match="already in use"):
        TansuBroker(port=kafka_broker.port).start()
    assert time.monotonic() - started < 2.0
    assert kafka_broker.running, "the session broker is untouched"


def test_invalid_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="out of range"):
        TansuBroker(port=70_000)
    with pytest.raises(ValueError, match="positive"):
        TansuBroker(start_timeout_s=0)
    with pytest.raises(BrokerStartError, match="not started"):
        _ = TansuBroker().bootstrap_servers
