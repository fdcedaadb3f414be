"""What the API's engine processes (the trainer and the sampler roles) share: reading the calls, writing a
call's result, their command line and their health endpoints.

Each role of each base model reads ``<ns>.requests`` in a consumer group of its own
per namespace, ``api-<role>-<namespace>-<digest of the base model>``: a group is the
broker's, not a namespace's, and one shared by two namespaces would make an engine
starting or stopping in one stall the other's in a rebalance.  Releases before the
namespace was part of the name used ``api-<role>-<digest>``; a group that has no
committed offset on ``<ns>.requests`` yet starts where that name had committed, so an
upgrade neither replays the log nor skips calls.  That adoption is a one-off migration: where
the broker refuses it (an ACL granting only ``api-<role>-<namespace>-``, no admin
offset commits) the engine logs a warning naming the former group and starts anyway.

A result is written create-only under the call's session and announced with
``ApiResultReady`` on ``<ns>.results`` (keyed by model, so one model's results
keep their order); a call executed again after a restart finds its result
already there and announces nothing new.  The announcement only wakes waiting
polls early: one that cannot be published is logged and the engine goes on.

An engine takes no HTTP traffic, so with ``--health-port`` it serves only
``pipeline.health``'s ``/healthz`` (from its start, while the model loads) and
``/readyz`` (once ``ENGINE_SETUP_STEPS`` are done) for Kubernetes' probes.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
from typing import Any, Literal

from pipeline.health import HealthServer
from pipeline.io.bus import BusError, EventConsumer, EventPublisher, PublishError, adopt_group_offsets
from pipeline.io.store import ObjectStore
from schemas.api import ApiRequestAccepted, ApiResultReady, BodyFormat, ErrorCategory, result_path
from schemas.config import BusConfig
from schemas.events import make_event
from schemas.names import validate_name

log = logging.getLogger(__name__)
ENGINE_SETUP_STEPS = ("engine loaded", "reading calls")  # what /readyz waits for, in order
EngineRole = Literal["trainer", "sampler"]


def engine_group(role: EngineRole, namespace: str, base_model: str) -> str:
    """The consumer group of ``role``'s engines of ``base_model`` in ``namespace``.

    The ``api-<role>-`` prefix is what the deployment's Kafka ACLs grant; the digest keeps a long model path short.
    """
    return f"api-{role}-{validate_name(namespace, 'namespace')}-{_digest(base_model)}"


def _unnamespaced_group(role: EngineRole, base_model: str) -> str:
    """The group name of earlier releases, shared by every namespace (read only to adopt its offsets)."""
    return f"api-{role}-{_digest(base_model)}"


def _digest(base_model: str) -> str:
    return hashlib.sha256(base_model.encode()).hexdigest()[:16]


def engine_reader(bus: BusConfig, role: EngineRole, base_model: str,
                  options: dict[str, Any] | None = None) -> EventConsumer:
    """``request_reader`` in ``engine_group``, which first adopts the offsets of the un-namespaced group."""
    group_id = engine_group(role, bus.namespace, base_model)
    former = _unnamespaced_group(role, base_model)
    try:
        adopted = adopt_group_offsets(bus, "requests", group_id, former)
    except BusError as exc:  # a migration step never blocks the start
        log.warning("group %s did not adopt the offsets of the former group %s: %s", group_id, former, exc)
        adopted = {}
    if adopted:
        log.info("group %s starts where %s had got to: %s", group_id, former,
                 ", ".join(f"{topic}:{partition}@{offset}" for (topic, partition), offset in sorted(adopted.items())))
    return request_reader(bus, group_id, options)


def request_reader(bus: BusConfig, group_id: str, options: dict[str, Any] | None = None) -> EventConsumer:
    """The group consumer of ``<ns>.requests`` an engine reads its calls with (``options``: ``EventConsumer``'s).

    It keeps the default fetch wait (0.5 s): a fetch that finds a call returns at once whatever the
    wait, while on Tansu with object storage the wait also bounds the listing of the partition that
    each fetch makes; a shorter wait than a listing reads nothing at all.
    """
    return EventConsumer(bus, "requests", group_id, **(options or {}))


def write_result(store: ObjectStore, publisher: EventPublisher, call: ApiRequestAccepted, data: bytes,
                 fmt: BodyFormat, error: str | None = None, category: ErrorCategory | None = None) -> None:
    """Store ``data`` as ``call``'s result (create-only) and announce it; nothing if it is already stored."""
    digest = store_result(store, call, data, fmt)
    if digest is not None:
        announce_result(publisher, call, fmt, digest, error, category)


def store_result(store: ObjectStore, call: ApiRequestAccepted, data: bytes, fmt: BodyFormat) -> str | None:
    """Store ``data`` as ``call``'s result (create-only): its sha256, or None if a result was already stored."""
    try:
        return store.put_create(result_path(call.session_id, call.request_id, fmt), data)
    except FileExistsError:
        return None


def announce_result(publisher: EventPublisher, call: ApiRequestAccepted, fmt: BodyFormat, digest: str,
                    error: str | None = None, category: ErrorCategory | None = None) -> None:
    """Announce ``call``'s stored result with ``ApiResultReady`` (a failure is logged: polls re-check the store)."""
    key = result_path(call.session_id, call.request_id, fmt)
    ready = ApiResultReady(request_id=call.request_id, session_id=call.session_id, op=call.op,
                           model_id=call.model_id, seq_id=call.seq_id, ok=error is None,
                           result_path=key if error is None else None, result_format=fmt,
                           result_sha256=digest if error is None else None, error=error, category=category)
    try:
        publisher.publish("results", make_event(call.session_id, ready), key=call.model_id)
    except PublishError as exc:  # the result is stored: a poll finds it at its next re-check of the store
        log.warning("result of %s stored but not announced (%s); polls find it in the store", call.request_id, exc)


def engine_arguments(prog: str, description: str | None) -> argparse.ArgumentParser:
    """The options every API engine process takes: the base model, the store, the broker, the log level."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--base-model", required=True, help="the served base model (a local folder)")
    parser.add_argument("--store", required=True, help="store root URL, e.g. file:///data/rlpipe")
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    parser.add_argument("--namespace", default="rlpipe", help="topic namespace")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING"])
    parser.add_argument("--engine-id", default=None,
                        help="this engine's name in its activity (engines/<kind>-<id>/); default <host>-<pid>")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /healthz and /readyz (engine loaded, reading calls) on 0.0.0.0:PORT for "
                             "Kubernetes probes; default: none")
    return parser


def engine_health(args: argparse.Namespace) -> set[str]:
    """Serve ``--health-port``'s endpoints from now on (nothing without it), before the slow engine load, so
    ``/healthz`` answers while it loads.  Add each of ``ENGINE_SETUP_STEPS`` to the returned set once done:
    ``/readyz`` is 200 when all are, else 503 naming those missing."""
    return HealthServer(args.health_port).start().add_setup_steps(ENGINE_SETUP_STEPS)


def engine_setup(args: argparse.Namespace, log: logging.Logger) -> BusConfig:
    """Logging as the engine processes print it, and the bus configuration: ``--bootstrap`` and ``--namespace``
    over the ``RLPIPE_BUS__`` environment (TLS, SASL, timeouts; ``rlpipe serve`` passes its own on)."""
    from pipeline.config import env_layer

    log.setLevel(args.log_level)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("kafka").setLevel(logging.WARNING)  # connection chatter; rlpipe's own lines stay
    return BusConfig.model_validate({**(env_layer().get("bus") or {}), "bootstrap_servers": args.bootstrap,
                                     "namespace": args.namespace})
