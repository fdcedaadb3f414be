"""A packed process's health endpoints against the real broker: each run told apart, a leaving run forgotten.

A packed learner and a packed producer, each serving runs ``a`` and ``b`` in this
process, on a free health port:

1. ``/metrics`` carries each run's own series labelled ``run="<id>"`` (the
   learner's step, version and dead-letter counter; the producer's heartbeat
   gauges) with ``<role>_run_serving`` 1, and the process-wide ``<role>_up`` once,
   unlabelled; ``/readyz`` names each run served.
2. After ``RunStopped`` for ``b`` (what ``rlpipe runs stop b`` announces), ``b``
   leaves: no series labelled ``run="b"`` is left, ``a``'s are, and ``/readyz`` no
   longer names ``b``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pipeline.io.bus import EventPublisher
from pipeline.runtime import Announcer, StopFlag
from schemas.config import RunConfig
from schemas.events import RunStopped
from tests.integration.test_deployment import free_port, http_get, in_process_config, run_in_thread, wait_until

pytestmark = pytest.mark.integration

READY_TIMEOUT_S = 150.0


def samples(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """``/metrics`` parsed by prometheus_client's own parser: (sample name, sorted labels) -> value."""
    status, body, _ = http_get(port, "/metrics")
    assert status == 200, status
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body) for s in family.samples}


def of_run(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float], run: str) -> dict[str, float]:
    """The samples labelled ``run=RUN`` (and nothing else), by name."""
    return {name: value for (name, labels), value in scraped.items() if labels == (("run", run),)}


def unlabelled(scraped: dict[tuple[str, tuple[tuple[str, str], ...]], float]) -> dict[str, float]:
    return {name: value for (name, labels), value in scraped.items() if not labels}


def two_runs(bus_config: Any, tiny_model_dir: str, tmp_path: Path, port: int, **producer: Any) -> list[RunConfig]:
    base = in_process_config(bus_config, tiny_model_dir, tmp_path, port)
    return [base.model_copy(update={"run_id": run, "producer": base.producer.model_copy(update=producer)})
            for run in ("a", "b")]


def stop_run(config: RunConfig, run: str) -> None:
    """Announce ``RunStopped`` for ``run``, as ``rlpipe runs stop`` does."""
    with EventPublisher(config.bus) as publisher:
        Announcer(publisher, run)(RunStopped(reason="stopped by the test", final_step=0))


def check_runs_reported_then_b_leaves(port: int, config: RunConfig, role: str, per_run: set[str],
                                      errors: list[BaseException]) -> None:
    alive = lambda: repr(errors[0]) if errors else None  # noqa: E731
    wait_until(lambda: http_get(port, "/readyz")[0] == 200 and all(
        per_run <= set(of_run(samples(port), run)) for run in ("a", "b")), READY_TIMEOUT_S,
        f"/readyz and {sorted(per_run)} of both runs", alive)
    scraped = samples(port)
    for run in ("a", "b"):
        assert of_run(scraped, run)[f"rlpipe_{role}_run_serving"] == 1.0
    assert unlabelled(scraped)[f"rlpipe_{role}_up"] == 1.0
    assert not ({name for name, labels in scraped if labels} & set(unlabelled(scraped))), \
        "a per-run series is also served unlabelled"
    body = http_get(port, "/readyz")[1]
    assert "run a: serving" in body and "run b: serving" in body, body

    stop_run(config, "b")
    wait_until(lambda: not of_run(samples(port), "b"), 60, "run b's series removed after it left", alive)
    scraped = samples(port)
    assert per_run <= set(of_run(scraped, "a")) and of_run(scraped, "a")[f"rlpipe_{role}_run_serving"] == 1.0
    assert not [labels for _, labels in scraped if ("run", "b") in labels]
    status, body, _ = http_get(port, "/readyz")
    assert status == 200 and "run a: serving" in body and "run b" not in body, (status, body)


def test_a_packed_learner_reports_each_run_and_forgets_one_that_left(
    bus_config: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    from consumers.packed_service import run_packed_learner

    port = free_port()
    configs = two_runs(bus_config, tiny_model_dir, tmp_path, port)
    stop = StopFlag()
    thread, errors = run_in_thread(lambda: run_packed_learner(configs, stop))
    try:
        check_runs_reported_then_b_leaves(port, configs[0], "learner", {
            "rlpipe_learner_step", "rlpipe_learner_version", "rlpipe_learner_dead_lettered_batches_total",
            "rlpipe_learner_run_serving"}, errors)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert errors == []


def test_a_packed_producer_reports_each_run_and_forgets_one_that_left(
    bus_config: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    from producers.packed import run_packed_producer

    port = free_port()
    configs = two_runs(bus_config, tiny_model_dir, tmp_path, port, max_groups=1)  # then each run idles
    stop = StopFlag()
    # following a pattern no run matches keeps the process serving once both runs wrote their group
    thread, errors = run_in_thread(lambda: run_packed_producer(configs, stop, follow_runs="none-*"))
    try:
        check_runs_reported_then_b_leaves(port, configs[0], "producer", {
            "rlpipe_producer_samples_total", "rlpipe_producer_batches_total", "rlpipe_producer_adapter_version",
            "rlpipe_producer_groups_dropped_total", "rlpipe_producer_run_serving"}, errors)
    finally:
        stop.set()
        thread.join(timeout=60)
    assert errors == []


def test_a_packed_learner_started_again_leaves_out_a_run_stopped_before_until_it_is_resumed(
    bus_config: Any, tiny_model_dir: str, tmp_path: Path
) -> None:
    """`rlpipe learner start --run a --run b` started again (a pod restart) after `rlpipe runs stop --run b`: b's
    stop holds, so only a is trained; `rlpipe runs resume --run b` then brings b in while a trains on."""
    from consumers.packed_service import run_packed_learner
    from pipeline.membership import announce_membership
    from pipeline.runtime import create_run, open_store, started_again

    port = free_port()
    configs = two_runs(bus_config, tiny_model_dir, tmp_path, port)
    store = open_store(configs[0].store)
    for config in configs:  # created and served before the restart
        create_run(store, config, config.model.base_model)
    with EventPublisher(bus_config) as publisher:
        announce_membership(store, publisher, "b", RunStopped(reason="stopped by rlpipe runs stop"))
    stop = StopFlag()
    thread, errors = run_in_thread(lambda: run_packed_learner(configs, stop))
    alive = lambda: repr(errors[0]) if errors else None  # noqa: E731
    try:
        wait_until(lambda: http_get(port, "/readyz")[0] == 200 and "rlpipe_learner_step" in of_run(samples(port), "a"),
                   READY_TIMEOUT_S, "/readyz and run a's series", alive)
        body = http_get(port, "/readyz")[1]
        assert "run a: serving" in body and "run b" not in body, body
        assert not of_run(samples(port), "b")
        with EventPublisher(bus_config) as publisher:
            announce_membership(store, publisher, "b", started_again(store, "b"))
        wait_until(lambda: "run b: serving" in http_get(port, "/readyz")[1], 120, "run b served once resumed", alive)
        assert of_run(samples(port), "b")["rlpipe_learner_run_serving"] == 1.0
    finally:
        stop.set()
        thread.join(timeout=60)
    assert errors == []
