"""Connecting to Kafka: client settings from ``BusConfig`` and a bounded connect.

``kafka_client_settings`` turns the bus configuration into kafka-python settings
(the SASL password only ever lives there, and prints as ``***``).  ``_connect``
probes the brokers itself first (TCP, then TLS with our own deadline: kafka-python's
TLS handshake has none) and then builds the client, so an unreachable broker, a
plaintext listener behind a TLS setting or refused credentials raise one
``BusUnavailableError`` line within about ``bus.connect_timeout_s``.  ``_bus_errors``
does the same for timeouts and lost connections during a request.  The
underscored names are shared by the other modules of ``pipeline.io.bus`` only.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

from kafka.errors import KafkaConnectionError, KafkaError, KafkaTimeoutError, NodeNotReadyError

from pipeline.io.bus.errors import BusConfigError, BusError, BusUnavailableError
from schemas.config import BusConfig

_CLIENT_ID = "rlpipe"


class _Redacted(str):
    """A string that prints as ``***``: kafka-python logs its whole configuration at debug level."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'***'"


def parse_bootstrap_servers(servers: str) -> list[str]:
    """``"a:9092, b:9092"`` -> ``["a:9092", "b:9092"]``; a clear error for anything that is not host:port."""
    parsed = [item.strip() for item in servers.split(",") if item.strip()]
    if not parsed:
        raise BusConfigError("bus.bootstrap_servers is empty; set it to host:port or start a broker with `rlpipe up`")
    for item in parsed:
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise BusConfigError(f"bus.bootstrap_servers entry {item!r} is not host:port (e.g. localhost:9092)")
    return parsed


def _sasl_password(bus_config: BusConfig) -> str:
    if bus_config.sasl_password is not None and bus_config.sasl_password_file:
        raise BusConfigError("set only one of bus.sasl_password and bus.sasl_password_file")
    if bus_config.sasl_password is not None:
        return bus_config.sasl_password.get_secret_value()
    if not bus_config.sasl_password_file:
        raise BusConfigError(
            f"bus.sasl_mechanism {bus_config.sasl_mechanism} needs a password: set bus.sasl_password "
            "or bus.sasl_password_file"
        )
    path = Path(bus_config.sasl_password_file).expanduser()
    try:
        return path.read_text().strip("\r\n")
    except OSError as exc:
        raise BusConfigError(f"cannot read bus.sasl_password_file {str(path)!r}: {exc.strerror}") from None


def kafka_client_settings(bus_config: BusConfig, bootstrap_servers: str | None = None) -> dict[str, Any]:
    """Connection settings shared by every kafka-python client, from ``bus_config``.

    ``bootstrap_servers`` overrides the config; when both are empty the embedded
    stack's broker (``rlpipe up``) is used.  The SASL password comes from
    ``sasl_password`` or ``sasl_password_file`` and prints as ``***``.
    """
    if bootstrap_servers is None:
        from pipeline.devstack.stack import resolve_bootstrap_servers  # the stack imports nothing from here

        bootstrap_servers = resolve_bootstrap_servers(bus_config)
    settings: dict[str, Any] = {
        "bootstrap_servers": parse_bootstrap_servers(bootstrap_servers),
        "security_protocol": bus_config.security_protocol,
        "bootstrap_timeout_ms": int(bus_config.connect_timeout_s * 1000),
        "reconnect_backoff_max_ms": 5000,  # kafka-python's 30 s would keep a restarted broker waiting
    }
    if bus_config.security_protocol.startswith("SASL"):
        settings["sasl_mechanism"] = bus_config.sasl_mechanism
        settings["sasl_plain_username"] = bus_config.sasl_username
        settings["sasl_plain_password"] = _Redacted(_sasl_password(bus_config))
    if bus_config.ssl_cafile:
        cafile = Path(bus_config.ssl_cafile).expanduser()
        if not cafile.is_file():
            raise BusConfigError(f"bus.ssl_cafile {str(cafile)!r} does not exist")
        settings["ssl_cafile"] = str(cafile)
    return settings


def redacted(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` safe to log or print: the password replaced by ``***``."""
    return {k: ("***" if "password" in k and v is not None else v) for k, v in settings.items()}


def _unavailable(servers: Iterable[str], timeout_s: float, reason: str) -> BusUnavailableError:
    where = ",".join(servers)
    reason = reason.splitlines()[0] if reason else "no answer"
    if re.search(r"sasl|authenticat|authoriz", reason, re.IGNORECASE):
        hint = "check bus.security_protocol, bus.sasl_mechanism, bus.sasl_username and the password"
    else:
        hint = "start one with `rlpipe up` or set bus.bootstrap_servers"
    return BusUnavailableError(f"cannot reach Kafka at {where} within {timeout_s:g}s: {reason}; {hint}")


def _describe(exc: BaseException) -> str:
    """``Name: message`` on one line (kafka-python's errors already start with their name)."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    name = type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}".rstrip(": ")


def _probe(server: str, protocol: str, cafile: str | None, timeout_s: float) -> str | None:
    """Open a TCP (and TLS) connection to ``server``; None if it works, else the reason.

    kafka-python's own TLS handshake has no deadline: a TLS client talking to a
    plaintext listener waits forever.  Probing first with our own deadline turns
    that, and a refused or silent port, into a prompt and specific reason.
    """
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    try:
        sock = socket.create_connection((host, int(port)), timeout=max(timeout_s, 0.05))
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    with sock:
        if protocol not in ("SSL", "SASL_SSL"):
            return None
        context = ssl.create_default_context(cafile=cafile)
        try:
            with context.wrap_socket(sock, server_hostname=host):
                return None
        except (OSError, ssl.SSLError) as exc:
            return f"TLS handshake failed: {exc}"


def _first_unreachable_reason(servers: list[str], protocol: str, cafile: str | None, deadline: float) -> str | None:
    """None as soon as one server accepts a connection, else why the last one did not (all within ``deadline``)."""
    reason = "no answer"
    for server in servers:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        reason = _probe(server, protocol, cafile, remaining) or ""
        if not reason:
            return None
    return reason


class _KafkaReasons(logging.Handler):
    """Collects why kafka-python's bootstrap failed; it logs the reason and raises a bare timeout.

    kafka-python retries a refused attempt (a SASL mechanism the broker lacks, say) until the deadline, so
    its last attempt may end in a timeout of its own: a timeout never replaces a reason already seen.
    """

    _FAILED = re.compile(r"(?:failed|Connection lost):\s*(.+?)(?:\s+\(backoff [^)]*\))?$")
    _TIMEOUT = re.compile(r"timed out|timeout", re.IGNORECASE)

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.last: str | None = None

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(TypeError, ValueError):  # a record whose message does not format
            match = self._FAILED.search(record.getMessage())
            if not match or "Unable to bootstrap" in match.group(1):  # the bare timeout that follows the reasons
                return
            if self.last is None or not self._TIMEOUT.search(match.group(1)):
                self.last = match.group(1)


ClientT = TypeVar("ClientT")


def _connect(factory: Callable[..., ClientT], bus_config: BusConfig, settings: dict[str, Any]) -> ClientT:
    """Build a kafka-python client, or raise ``BusUnavailableError`` within about ``connect_timeout_s``."""
    servers: list[str] = settings["bootstrap_servers"]
    timeout_s = bus_config.connect_timeout_s
    deadline = time.monotonic() + timeout_s
    reason = _first_unreachable_reason(servers, settings["security_protocol"], settings.get("ssl_cafile"), deadline)
    if reason is not None:
        raise _unavailable(servers, timeout_s, reason)
    remaining_ms = max(500, int((deadline - time.monotonic()) * 1000))
    handler = _KafkaReasons()
    kafka_logger = logging.getLogger("kafka")
    kafka_logger.addHandler(handler)
    try:
        return factory(**{**settings, "bootstrap_timeout_ms": remaining_ms})
    except KafkaError as exc:
        if not exc.retriable:
            raise
        raise _unavailable(servers, timeout_s, handler.last or _describe(exc)) from None
    finally:
        kafka_logger.removeHandler(handler)


@contextlib.contextmanager
def _bus_errors(bus_config: BusConfig, servers: Iterable[str], what: str) -> Iterator[None]:
    """Turn a timeout or lost connection during ``what`` into one ``BusUnavailableError`` line."""
    try:
        yield
    except (KafkaTimeoutError, KafkaConnectionError, NodeNotReadyError) as exc:
        raise _unavailable(servers, bus_config.connect_timeout_s, f"{what}: {type(exc).__name__}") from exc
    except KafkaError as exc:
        raise BusError(f"{what} failed: {_describe(exc)}") from exc
