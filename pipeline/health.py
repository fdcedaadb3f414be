"""Health and metrics endpoints for the long-running processes (producer, learner).

Kubernetes asks two different questions, and Prometheus a third:

- ``/healthz`` (liveness): is the process alive?  Answered 200 by the server
  thread itself, so a process busy training or loading a model is not killed.
- ``/readyz`` (readiness): can it do its work now?  200 only when every check
  registered with :meth:`HealthServer.add_readiness_check` passes (connected to
  the broker and the store, model loaded, ...); otherwise 503 and one line per
  failing check, so ``kubectl describe pod`` says *what* is not ready.  Lines
  added by :meth:`HealthServer.add_readiness_detail` follow, ready or not (a
  packed process names each run it serves and each waiting to come back).
- ``/metrics``: gauges and counters set by the process, in the Prometheus text
  exposition format (rendered by ``prometheus_client``, which does the HELP and
  label-value escaping).

Why a stdlib server in a daemon thread: the probes must answer while the main
thread is inside a long GPU call, must not pull a web framework into the
learner image, and must never keep a finished process alive.

``HealthServer(None)`` is a disabled server: metrics calls still work (and are
cheap), nothing listens.  Callers can then use one code path whether or not
``producer.health_port`` / ``learner.health_port`` is configured.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector, CollectorRegistry

log = logging.getLogger(__name__)

# The classic text format (0.0.4): every scraper understands it, and the names we
# accept (legacy charset, checked below) need none of the newer escaping.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_METRIC_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME_RE = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")

ReadinessCheck = Callable[[], bool]
MetricKind = Literal["gauge", "counter"]


@dataclass
class _Family:
    """One metric name: its kind, help text, label names and one value per label set."""

    kind: MetricKind
    help: str
    label_names: tuple[str, ...]
    values: dict[tuple[str, ...], float] = field(default_factory=dict)


class _Metrics(Collector):
    """The process's gauges and counters, kept in plain dicts and rendered on each scrape.

    A custom collector rather than ``prometheus_client.Gauge`` objects because
    the API here creates metrics on first use with any label set, and each
    server keeps its own registry (tests start several in one process).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._families: dict[str, _Family] = {}

    def set(self, kind: MetricKind, name: str, value: float, help_text: str, labels: Mapping[str, str] | None) -> None:
        """Set (gauge) or add to (counter) the sample of ``name`` with ``labels``."""
        label_names, label_values = _split_labels(name, labels)
        with self._lock:
            family = self._family(kind, name, help_text, label_names)
            if kind == "gauge":
                family.values[label_values] = float(value)
            else:
                family.values[label_values] = family.values.get(label_values, 0.0) + float(value)

    def value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The current value of one sample, or None if it was never set."""
        _, label_values = _split_labels(name, labels)
        with self._lock:
            family = self._families.get(name)
            return None if family is None else family.values.get(label_values)

    def remove(self, labels: Mapping[str, str]) -> int:
        """Drop every sample, of any metric, whose labels include all of ``labels``; how many were dropped."""
        wanted = set(labels.items())
        removed = 0
        with self._lock:
            for name, family in list(self._families.items()):
                matching = [v for v in family.values if wanted <= set(zip(family.label_names, v, strict=True))]
                for label_values in matching:
                    del family.values[label_values]
                removed += len(matching)
                if not family.values:  # (a family with no sample left would still render its HELP and TYPE)
                    del self._families[name]
        return removed

    def _family(self, kind: MetricKind, name: str, help_text: str, label_names: tuple[str, ...]) -> _Family:
        family = self._families.get(name)
        if family is None:
            family = self._families[name] = _Family(kind, help_text or name, label_names)
        elif family.kind != kind:
            raise ValueError(f"metric {name!r} is a {family.kind}; use another name for the {kind}")
        elif family.label_names != label_names:
            raise ValueError(
                f"metric {name!r} has labels {list(family.label_names)}, not {list(label_names)}; "
                "use the same label names for every sample of a metric"
            )
        return family

    def collect(self) -> Iterator[Metric]:
        """Called by ``generate_latest`` on every scrape; copies under the lock, renders outside it."""
        with self._lock:
            snapshot = [(name, f.kind, f.help, f.label_names, dict(f.values)) for name, f in self._families.items()]
        for name, kind, help_text, label_names, values in sorted(snapshot):
            metric_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = metric_type(name, help_text, labels=list(label_names))
            for label_values, value in sorted(values.items()):
                family.add_metric(list(label_values), value)
            yield family


def _split_labels(name: str, labels: Mapping[str, str] | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Validate the metric and label names; labels sorted by name so the order of the dict does not matter."""
    if not _METRIC_NAME_RE.fullmatch(name):
        raise ValueError(f"metric name {name!r} is invalid: use letters, digits, '_' and ':' (e.g. rlpipe_groups)")
    items = sorted((labels or {}).items())
    for key, _ in items:
        if not _LABEL_NAME_RE.fullmatch(key) or key.startswith("__"):
            raise ValueError(f"label name {key!r} of metric {name!r} is invalid: use letters, digits and '_'")
    return tuple(k for k, _ in items), tuple(str(v) for _, v in items)


class HealthPortError(OSError):
    """The health endpoints cannot listen on the configured port (taken, or not this machine's)."""


class HealthServer:
    """``/healthz``, ``/readyz`` and ``/metrics`` on one port, served from a daemon thread.

    ``port=0`` binds a free port (read it from :attr:`port` after :meth:`start`);
    ``port=None`` disables serving but keeps the metric calls working.
    """

    def __init__(self, port: int | None, host: str = "0.0.0.0") -> None:
        if port is not None and not 0 <= port <= 65535:
            raise ValueError(f"health port {port} is out of range; use 0-65535 (0 = any free port)")
        self._requested_port = port
        self._host = host
        self._checks: dict[str, ReadinessCheck] = {}
        self._details: list[Callable[[], list[str]]] = []
        self._checks_lock = threading.Lock()
        self._metrics = _Metrics()
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._metrics)
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int | None:
        """The bound port once started (the real one when 0 was asked); before that, the configured one."""
        if self._httpd is not None:
            return self._httpd.server_address[1]
        return self._requested_port

    @property
    def running(self) -> bool:
        """Whether the server thread is serving."""
        return self._thread is not None and self._thread.is_alive()

    # readiness -------------------------------------------------------------

    def add_readiness_check(self, name: str, fn: ReadinessCheck) -> None:
        """Register ``fn`` (cheap, thread-safe, returns truthy when ready) under ``name``.

        It runs on every ``/readyz`` request, in the server thread: read a flag
        or an attribute the main thread maintains, never block on the network.
        A check that raises counts as failing. Re-registering a name replaces it.
        """
        if not name or "\n" in name:
            raise ValueError("readiness check name must be a non-empty single line (e.g. 'broker')")
        with self._checks_lock:
            self._checks[name] = fn

    def add_setup_steps(self, steps: tuple[str, ...]) -> set[str]:
        """One readiness check per set-up step; each passes once its name is added to the returned set.

        Why flags rather than live probes: ``/readyz`` runs in the server thread and
        must never block on the network, and each step has proved its part (broker
        answered, store listed, model loaded) by finishing.
        """
        done: set[str] = set()
        for step in steps:
            self.add_readiness_check(step, lambda step=step: step in done)
        return done

    def add_readiness_detail(self, fn: Callable[[], list[str]]) -> None:
        """Register ``fn`` (cheap, thread-safe): the lines it returns follow the status line of every ``/readyz``
        answer, ready or not; they inform and never decide readiness."""
        with self._checks_lock:
            self._details.append(fn)

    def readiness_details(self) -> list[str]:
        """The lines of every ``add_readiness_detail`` function, in registration order (one raising is logged)."""
        with self._checks_lock:
            details = list(self._details)
        lines: list[str] = []
        for fn in details:
            try:
                lines += [" ".join(str(line).split()) for line in fn()]
            except Exception as exc:  # informative only: a broken one must not break the probe
                log.warning("readiness detail %r raised %s: %s", fn, type(exc).__name__, exc)
        return lines

    def failing_checks(self) -> list[str]:
        """One line per failing check (``name`` or ``name: error``), in registration order; empty when ready."""
        with self._checks_lock:
            checks = list(self._checks.items())
        failing = []
        for name, fn in checks:
            try:
                if not fn():
                    failing.append(name)
            except Exception as exc:  # a check is any callable; a broken one means "not ready", not a crashed probe
                failing.append(f"{name}: {type(exc).__name__}: {exc}".splitlines()[0])
                log.warning("readiness check %s raised %s", name, failing[-1].partition(": ")[2])
        return failing

    # metrics ---------------------------------------------------------------

    def set_gauge(self, name: str, value: float, help: str = "", labels: Mapping[str, str] | None = None) -> None:
        """Set a gauge sample (a value that goes up and down: queue depth, loaded adapter version)."""
        self._metrics.set("gauge", name, value, help, labels)

    def inc_counter(
        self, name: str, amount: float = 1.0, help: str = "", labels: Mapping[str, str] | None = None
    ) -> None:
        """Add ``amount`` (>= 0) to a counter; exposed as ``<name>_total`` (a trailing ``_total`` is not doubled)."""
        if amount < 0:
            raise ValueError(f"counter {name!r} can only go up; got {amount} (use set_gauge for values that fall)")
        self._metrics.set("counter", name.removesuffix("_total"), amount, help, labels)

    def remove_series(self, labels: Mapping[str, str]) -> int:
        """Stop serving every sample whose labels include all of ``labels`` (e.g. ``{"run": "a"}`` when run ``a``
        leaves a packed process); how many were removed."""
        if not labels:
            raise ValueError("remove_series needs at least one label (e.g. {'run': 'a'}); an empty set matches all")
        return self._metrics.remove({key: str(value) for key, value in labels.items()})

    def metric_value(self, name: str, labels: Mapping[str, str] | None = None) -> float | None:
        """The current value of a gauge or counter sample (None if never set); for tests and logs."""
        value = self._metrics.value(name, labels)
        if value is None and name.endswith("_total"):  # counters are stored without the suffix
            value = self._metrics.value(name.removesuffix("_total"), labels)
        return value

    def render_metrics(self) -> bytes:
        """The ``/metrics`` body."""
        return generate_latest(self._registry)

    # lifecycle -------------------------------------------------------------

    def start(self) -> HealthServer:
        """Bind and serve in a daemon thread (a no-op when disabled or already running)."""
        if self._requested_port is None or self._httpd is not None:
            return self
        try:
            httpd = ThreadingHTTPServer((self._host, self._requested_port), _handler_for(self))
        except OSError as exc:
            raise HealthPortError(
                f"cannot serve health endpoints on {self._host}:{self._requested_port}: {exc.strerror}; "
                "choose another health_port (0 = any free port)"
            ) from None
        httpd.daemon_threads = True
        self._httpd = httpd
        # A short poll interval so stop() returns quickly (serve_forever checks for shutdown between polls).
        self._thread = threading.Thread(
            target=httpd.serve_forever, kwargs={"poll_interval": 0.1}, name="rlpipe-health", daemon=True
        )
        self._thread.start()
        log.info("health endpoints on http://%s:%d (/healthz /readyz /metrics)", self._host, self.port)
        return self

    def stop(self) -> None:
        """Stop serving and free the port; safe to call twice."""
        httpd, thread = self._httpd, self._thread
        self._httpd, self._thread = None, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if thread is not None:
            thread.join(timeout=5)

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class PackedRunsHealth:
    """The runs of a packed process (several runs served by one learner or producer) on its health server.

    Each run's own series carry the label ``run="<id>"`` (``labels``), beside the
    process's unlabelled ones; ``<prefix>_run_serving{run}`` is 1 while the run is
    served and 0 while it waits to come back from an error (its last numbers kept
    meanwhile); ``/readyz`` adds a line per run.  ``sync`` is called with who is
    served and who waits whenever that may have changed: a run reported before and
    now in neither has left, and every series labelled with it is removed, so
    scrapes stop carrying a run the process no longer serves.
    """

    def __init__(self, health: HealthServer, prefix: str) -> None:
        self.health, self.prefix = health, prefix
        self._lock = threading.Lock()
        self._lines: list[str] = []
        self._reported: set[str] = set()
        health.add_readiness_detail(self.lines)

    @staticmethod
    def labels(run_id: str) -> dict[str, str]:
        """The labels of ``run_id``'s series."""
        return {"run": run_id}

    def sync(self, serving: Collection[str], waiting: Mapping[str, str]) -> None:
        """``serving``: the runs served now; ``waiting``: run -> the error each waits to come back from."""
        for run_id in sorted(self._reported - set(serving) - set(waiting)):
            self.health.remove_series(self.labels(run_id))
        for run_id in serving:
            self.health.set_gauge(f"{self.prefix}_run_serving", 1.0, _SERVING_HELP, self.labels(run_id))
        for run_id in waiting:
            self.health.set_gauge(f"{self.prefix}_run_serving", 0.0, _SERVING_HELP, self.labels(run_id))
        self._reported = set(serving) | set(waiting)
        lines = [f"run {run_id}: serving" for run_id in sorted(serving)]
        lines += [f"run {run_id}: waiting to come back ({error})" for run_id, error in sorted(waiting.items())]
        with self._lock:
            self._lines = lines

    def lines(self) -> list[str]:
        """One ``/readyz`` line per run, as of the last ``sync``."""
        with self._lock:
            return list(self._lines)


_SERVING_HELP = "1 while the run is served by this packed process, 0 while it waits to come back from an error"


def _handler_for(server: HealthServer) -> type[BaseHTTPRequestHandler]:
    """A request handler class bound to ``server`` (http.server builds one handler per request)."""

    class _Handler(BaseHTTPRequestHandler):
        server_version = "rlpipe-health"

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/healthz":
                self._reply(200, b"ok\n")
            elif path == "/readyz":
                failing, details = server.failing_checks(), server.readiness_details()
                if failing:
                    self._reply(503, "".join(line + "\n" for line in ["not ready: " + "\n".join(failing), *details])
                                .encode())
                else:
                    self._reply(200, "".join(line + "\n" for line in ["ready", *details]).encode())
            elif path == "/metrics":
                self._reply(200, server.render_metrics(), METRICS_CONTENT_TYPE)
            else:
                self._reply(404, b"not found: try /healthz, /readyz or /metrics\n")

        def _reply(self, status: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            # Probes hit these endpoints every few seconds: keep them out of the process's stderr.
            log.debug("health %s " + format, self.address_string(), *args)

    return _Handler
