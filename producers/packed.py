"""Packed sampling: one producer process and one sampling engine serve several runs.

The engine (``producers.samplers.engine``: vLLM's async engine, or the
transformers one) runs on its own event loop (``SyncSampler``); each run has a
whole producer of its own (``producers.service.open_run_producer``: rollout
worker, environment, adapter watcher, sink, heartbeat, backlog bound) in a
thread of its own, so every run writes its own batches and events and follows
its own adapter versions.  Every request of every run is its own engine
request: the runs' turns join one running batch, and a run whose environment
steps are slow holds up nobody else's requests.

A run's sampler is a ``RunSampler``, a view of the shared engine that names the
run in every adapter handle, so version 3 of run A and version 3 of run B are
two adapters with two LoRA ids.  The engine holds up to the sum of the runs'
``sampler.max_loras`` adapters.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import replace

from transformers import AutoTokenizer

from pipeline.health import HealthServer
from pipeline.runtime import StopFlag
from producers.rollout import RolloutWorker, SamplingStreams
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from producers.samplers.engine import engine_for_run
from producers.samplers.sync import SyncSampler
from producers.service import RunProducer, connect_run, default_producer_id, open_run_producer
from producers.tiny_model import resolve_model
from schemas.config import RunConfig
from schemas.config import check_packable as packable

log = logging.getLogger("rlpipe.producer")


class RunSampler(Sampler):
    """One run's view of a shared engine: its adapter handles carry the run, its requests go to the engine."""

    def __init__(self, shared: SyncSampler, run_id: str) -> None:
        self.shared, self.run_id = shared, run_id
        self.eos_token_id, self.max_model_len = shared.eos_token_id, shared.max_model_len

    def tagged(self, handle: AdapterHandle | None) -> AdapterHandle | None:
        """``handle`` as the run's own: the run named, and a name no other run's version has."""
        if handle is None:
            return None
        return replace(handle, run=self.run_id, name=f"{self.run_id.replace('.', '_')}-{handle.name}")

    def generate(self, requests: list[SampleRequest], adapter: AdapterHandle | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[SampleOutput]:
        return self.shared.generate(requests, self.tagged(adapter), temperature, top_p, seed)

    concurrent_requests = True

    def submit(self, request: SampleRequest, adapter: AdapterHandle | None = None, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None) -> Future[SampleOutput]:
        return self.shared.submit(request, self.tagged(adapter), temperature, top_p, seed)

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.shared.load_adapter(self.tagged(handle))  # type: ignore[arg-type]  # a handle stays a handle

    def unload_adapter(self, handle: AdapterHandle) -> None:
        self.shared.unload_adapter(self.tagged(handle))  # type: ignore[arg-type]

    def close(self) -> None:
        """Nothing: the shared engine is closed once, by the process that made it."""


def check_packable(configs: list[RunConfig]) -> None:
    """Refuse, in one line, runs that cannot share one sampling engine and one event log."""
    packable(configs, ("model.base_model", "model.dtype", "sampler.backend", "sampler.max_model_len",
                       "bus.bootstrap_servers", "bus.namespace"), "one sampling engine and event log")


def shared_engine(configs: list[RunConfig], model_path: str, seed: int) -> SyncSampler:
    """One engine for every run: the first run's sampler settings, room for every run's adapter versions."""
    first = configs[0]
    config = first.model_copy(update={"sampler": first.sampler.model_copy(update={"seed": seed})})
    extra = {"max_loras": sum(c.sampler.max_loras for c in configs)} if first.sampler.backend == "vllm" else {}
    return SyncSampler(lambda: engine_for_run(config, model_path, **extra))


def run_packed_producer(configs: list[RunConfig], stop: StopFlag | None = None) -> list[RolloutWorker]:
    """Serve several runs from one process and one engine until stopped or each wrote its ``max_groups``.

    Each run's producer id is the process's with the run appended, so its
    training seeds and episode ids are its own.
    """
    check_packable(configs)
    stop = stop or StopFlag()
    process_id = configs[0].producer.producer_id or default_producer_id()
    health = HealthServer(configs[0].producer.health_port).start()
    done = health.add_setup_steps(("broker", "store", "sampler", "adapters"))
    health.add_readiness_check("stopping", lambda: not stop())
    runs: list[RunProducer] = []
    sampler: SyncSampler | None = None
    try:
        connections = [connect_run(cfg, done) for cfg in configs]
        model_path = resolve_model(configs[0].model)
        streams = SamplingStreams(configs[0].sampler.seed, process_id)
        log.info("initialising one %s engine on %s for runs %s", configs[0].sampler.backend, model_path,
                 ", ".join(c.run_id for c in configs))
        sampler = shared_engine(configs, model_path, streams.engine_seed())
        done.add("sampler")
        for cfg, connection in zip(configs, connections, strict=True):
            producer_id = f"{process_id}-{cfg.run_id}" if cfg.producer.producer_id is None else cfg.producer.producer_id
            tokenizer = AutoTokenizer.from_pretrained(model_path)  # one per thread: tokenizers are not shared
            runs.append(open_run_producer(cfg, connection, producer_id, RunSampler(sampler, cfg.run_id), tokenizer,
                                          streams.incarnation, None))
        done.add("adapters")
        health.set_gauge("rlpipe_producer_up", 1.0, "1 once the producer is set up and sampling")
        serve(runs, stop)
    finally:
        for run in runs:
            run.close()
        if sampler is not None:
            sampler.close()
        for run in runs:
            run.watcher.close()
        health.stop()
    for cfg, run in zip(configs, runs, strict=True):
        log.info("run %s: %d batches, %d samples", cfg.run_id, run.worker.stats.batches, run.worker.stats.samples)
    return [run.worker for run in runs]


def serve(runs: list[RunProducer], stop: StopFlag) -> None:
    """Each run's rollout loop in its own thread; the first error stops them all and is raised here."""
    errors: list[BaseException] = []

    def stopping() -> bool:
        return stop() or bool(errors)

    def one(run: RunProducer) -> None:
        try:
            run.run(stopping)
        except BaseException as exc:  # raised again below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(run,), name=f"run-{run.worker.run_id}") for run in runs]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
