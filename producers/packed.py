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

With ``follow_runs`` (``rlpipe producer start --follow-runs PATTERN``) runs
announced later join (a new thread on the same engine) and served runs stopped
later leave (their thread stops as on SIGTERM: finished groups flushed; their
adapter versions are unloaded from the engine), while
the others sample on (``pipeline.membership``); the engine then keeps room for
``FOLLOW_RESERVE_RUNS`` more runs' adapters in one batch.

A run whose rollout loop raises (its environment, its store, its broker) is
released and comes back after a pause (``pipeline.membership.Comebacks``: 30 s,
doubled for each failure in a row, at most 10 minutes); the others sample on.
Every opening of a run (its first, a comeback, a resume after a stop) draws a
sampling incarnation of its own (``producers.rollout.SamplingStreams``), as a
restarted single-run producer does, so it never replays the draws of an earlier one.

Health: ``/metrics`` carries each run's heartbeat series, labelled ``run="<id>"``,
and ``rlpipe_producer_run_serving{run}``; ``/readyz`` names each run; a run that
leaves is no longer reported (``pipeline.health.PackedRunsHealth``).
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

from transformers import AutoTokenizer

from pipeline.config import check_env
from pipeline.health import HealthServer, PackedRunsHealth
from pipeline.membership import Comebacks, Left, RunMembership, control_start, engine_config, runs_not_stopped
from pipeline.models import check_same_tiny_build as same_tiny_build
from pipeline.runtime import StopFlag, open_store
from producers.rollout import RolloutWorker, SamplingStreams
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from producers.samplers.engine import engine_for_run
from producers.samplers.sync import SyncSampler
from producers.service import (
    RunConnection,
    RunProducer,
    check_run_lora_rank,
    connect_run,
    default_producer_id,
    open_run_producer,
)
from producers.tiny_model import default_tiny_dir, resolve_model
from schemas.config import RunConfig, check_sampler_holds_rank
from schemas.config import check_packable as packable

log = logging.getLogger("rlpipe.producer")


def adapter_name_part(run_id: str) -> str:
    """``run_id`` as part of an adapter name, which peft refuses with a ``.`` in it: ``_`` written ``__`` and ``.``
    written ``_d``, so two run ids never give one name ("exp.1" -> "exp_d1", "exp_1" -> "exp__1")."""
    return run_id.replace("_", "__").replace(".", "_d")


class RunSampler(Sampler):
    """One run's view of a shared engine: its adapter handles carry the run, its requests go to the engine as the
    run's (their ``owner``)."""

    def __init__(self, shared: SyncSampler, run_id: str) -> None:
        self.shared, self.run_id = shared, run_id
        self.eos_token_id, self.max_model_len = shared.eos_token_id, shared.max_model_len

    def tagged(self, handle: AdapterHandle | None) -> AdapterHandle | None:
        """``handle`` as the run's own: the run named, and a name no other run's version has."""
        if handle is None:
            return None
        return replace(handle, run=self.run_id, name=f"{adapter_name_part(self.run_id)}-{handle.name}")

    # every request names the run as its owner: runs sampling the same weights alike (the base model) share a
    # group of the transformers engine's calls, in which owners take turns, so one run's burst does not hold another
    def generate(self, requests: list[SampleRequest], adapter: AdapterHandle | None = None, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None) -> list[SampleOutput]:
        return self.shared.generate(requests, self.tagged(adapter), temperature, top_p, seed, owner=self.run_id)

    concurrent_requests = True

    def submit(self, request: SampleRequest, adapter: AdapterHandle | None = None, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None) -> Future[SampleOutput]:
        return self.shared.submit(request, self.tagged(adapter), temperature, top_p, seed, owner=self.run_id)

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.shared.load_adapter(self.tagged(handle))  # type: ignore[arg-type]  # a handle stays a handle

    def unload_adapter(self, handle: AdapterHandle) -> None:
        self.shared.unload_adapter(self.tagged(handle))  # type: ignore[arg-type]

    def close(self) -> None:
        """Nothing: the shared engine is closed once, by the process that made it."""


def check_packable(configs: list[RunConfig]) -> None:
    """Refuse, in one line, runs that cannot share one sampling engine and one event log: the engine takes the
    first run's sampler settings, so every run's adapters must fit its LoRA rank slot too; and a run whose
    environment this producer cannot build (a run joining from its stored configuration), which would otherwise
    fail at its first episode and come back after every pause."""
    packable(configs, ("model.base_model", "model.dtype", "sampler.backend", "sampler.max_model_len",
                       "bus.bootstrap_servers", "bus.namespace"), "one sampling engine and event log")
    first = configs[0]
    for cfg in configs[1:]:
        check_same_tiny_build(first, cfg)
        check_sampler_holds_rank(first.sampler, cfg.learner.lora_rank, cfg.run_id,
                                 f"the shared engine's (run {first.run_id}'s)")
    for cfg in configs:
        check_env(cfg)


def check_same_tiny_build(first: RunConfig, cfg: RunConfig) -> None:
    """Refuse, in one line, run ``cfg`` on another tiny model build than the engine's, ``first``'s
    (``pipeline.models.check_same_tiny_build``; a run naming no model.tiny_dir has the default build's folder, as
    ``resolve_model`` builds it)."""
    same_tiny_build(first, cfg, str(default_tiny_dir()),
                    "a packed producer samples every run on one base model: start a producer per base model")


def release_run(run: RunProducer) -> None:
    """Let go of a run that left the shared engine (stopped, failed, deleted): its connections closed, its versions
    unloaded from the engine, which samples on for the other runs (a run created again under its id then loads
    its own weights), and their cached folders deleted."""
    run.close()
    run.watcher.unload_all()
    run.watcher.close()


FOLLOW_RESERVE_RUNS = 3  # a following producer's engine keeps LoRA slots for this many runs joining later


def shared_engine(configs: list[RunConfig], model_path: str, seed: int, reserve_runs: int = 0) -> SyncSampler:
    """One engine for every run: the first run's sampler settings, room for every run's adapter versions (and
    ``reserve_runs`` more runs like the first)."""
    first = configs[0]
    config = first.model_copy(update={"sampler": first.sampler.model_copy(update={"seed": seed})})
    slots = sum(c.sampler.max_loras for c in configs) + reserve_runs * first.sampler.max_loras
    extra = {"max_loras": slots} if first.sampler.backend == "vllm" else {}
    return SyncSampler(lambda: engine_for_run(config, model_path, **extra))


def run_packed_producer(configs: list[RunConfig], stop: StopFlag | None = None,
                        follow_runs: str | None = None, template: RunConfig | None = None) -> list[RolloutWorker]:
    """Serve several runs from one process and one engine until stopped or each wrote its ``max_groups``.

    Each run's producer id is the process's with the run appended, so its
    training seeds and episode ids are its own.  With ``follow_runs`` (a glob of
    run ids) runs announced later join and served runs stopped later leave, and
    the process serves until stopped; it may then start with no run, its engine set up from ``template``.
    A named run whose newest recorded event is a ``RunStopped`` is not served until ``rlpipe runs resume`` (a
    restart does not undo a stop).  The control topic is followed from where it ended as this starts, before the
    runs' records are read (``pipeline.membership.control_start``): a run stopped since is let go even if its
    ``RunStopped`` came while the process was still connecting, and a stop sent before is not read as new.
    """
    control_from_P = control_start(configs, template)
    named_configs, configs = configs, runs_not_stopped(configs, follow_runs)
    named = [cfg.run_id for cfg in named_configs]
    first = engine_config(configs, follow_runs, template, check_packable)
    stop = stop or StopFlag()
    process_id = first.producer.producer_id or default_producer_id()
    health = HealthServer(first.producer.health_port).start()
    done = health.add_setup_steps(("broker", "store", "sampler", "adapters"))
    health.add_readiness_check("stopping", lambda: not stop())
    runs: list[RunProducer] = []
    configs_of: dict[str, RunConfig] = {}
    comebacks = Comebacks()
    runs_health = PackedRunsHealth(health, "rlpipe_producer")
    sampler: SyncSampler | None = None
    membership: RunMembership | None = None
    try:
        connections = [connect_run(cfg, done) for cfg in configs]
        # each run's stored LoRA rank against the engine's slot (the first run's sampler settings), before the
        # engine starts; a run joining later is checked by check_packable on its stored configuration
        for cfg, connection in zip(configs, connections, strict=True):
            check_run_lora_rank(cfg.model_copy(update={"sampler": first.sampler}), connection.archive.store)
        # every packed producer lets a run go on its RunStopped; with --follow-runs it also takes new runs up.  It
        # follows the control topic from the process's start, so a run stopped while it set up is let go too.
        membership = RunMembership(follow_runs, first, open_store(first.store), check_packable,
                                   control_from_P=control_from_P, named=named)
        model_path = resolve_model(first.model)
        streams = SamplingStreams(first.sampler.seed, process_id)
        log.info("initialising one %s engine on %s for runs %s", first.sampler.backend, model_path,
                 ", ".join(c.run_id for c in configs) or f"matching {follow_runs}")
        # room for every named run's adapters, each once: one stopped now joins when resumed (``first`` is one
        # of them when every named run is stopped)
        stopped = [cfg for cfg in named_configs if cfg.run_id not in {c.run_id for c in [first, *configs]}]
        sampler = shared_engine([first, *configs[1:], *stopped], model_path, streams.engine_seed(),
                                FOLLOW_RESERVE_RUNS if follow_runs is not None else 0)
        shared = sampler

        def open_run(cfg: RunConfig, connection: RunConnection | None = None) -> RunProducer:
            configs_of[cfg.run_id] = cfg
            producer_id = f"{process_id}-{cfg.run_id}" if cfg.producer.producer_id is None else cfg.producer.producer_id
            tokenizer = AutoTokenizer.from_pretrained(model_path)  # one per thread: tokenizers are not shared
            # each opening its own sampling incarnation (a random nonce, as SamplingStreams draws): a run opened again
            # under its producer id (back from an error, or stopped and resumed) must not replay the streams, and so
            # the samples, it drew before
            incarnation = secrets.randbits(64)
            run = open_run_producer(cfg, connection or connect_run(cfg), producer_id, RunSampler(shared, cfg.run_id),
                                    tokenizer, incarnation, health, runs_health.labels(cfg.run_id))
            runs.append(run)
            return run

        done.add("sampler")
        for cfg, connection in zip(configs, connections, strict=True):
            open_run(cfg, connection)
        done.add("adapters")
        health.set_gauge("rlpipe_producer_up", 1.0, "1 once the producer is set up and sampling")
        changes = following(membership, open_run, comebacks)

        def note_runs() -> None:
            """Who is served and who waits, on ``/metrics`` and ``/readyz``; the series of a run gone removed."""
            health.set_gauge("rlpipe_producer_runs_waiting", float(len(comebacks.waiting)),
                             "runs stopped on an error, waiting to come back")
            runs_health.sync([run.worker.run_id for run in runs],
                             {run_id: comebacks.errors.get(run_id, "") for run_id in comebacks.waiting})

        def follow(serving: set[str]) -> tuple[list[RunProducer], list[str]]:  # (the runs released since noted)
            note_runs()
            return changes(serving)

        note_runs()

        def release(run: RunProducer) -> None:  # a run that left: its connections, adapters and cache go
            runs.remove(run)
            release_run(run)
            log.info("run %s left: %d batches, %d samples", run.worker.run_id, run.worker.stats.batches,
                     run.worker.stats.samples)

        def failed(run: RunProducer, error: Exception) -> None:  # (released already) it comes back after a pause
            if run.worker.stats.batches:  # it wrote since it last (re)started: a first failure again
                comebacks.progressed(run.worker.run_id)
            comebacks.failed(configs_of[run.worker.run_id], error)

        health.add_readiness_check("runs", lambda: bool(runs) or not comebacks.waiting)  # not every run failing
        serve(list(runs), stop, follow, release, until_stopped=lambda: follow_runs is not None or bool(
            comebacks.waiting), on_failure=failed)
    finally:
        if membership is not None:
            membership.close()
        for run in runs:
            run.close()
        if sampler is not None:
            sampler.close()
        for run in runs:
            run.watcher.close()
        health.stop()
    for run in runs:
        log.info("run %s: %d batches, %d samples", run.worker.run_id, run.worker.stats.batches,
                 run.worker.stats.samples)
    comebacks.check_settled()  # a run still failing: the exit says so, as a single-run producer's does
    return [run.worker for run in runs]


Follow = Callable[[set[str]], tuple[list[RunProducer], list[str]]]


def following(membership: RunMembership, open_run: Callable[[RunConfig], RunProducer],
              comebacks: Comebacks | None = None) -> Follow:
    """For ``serve``: the runs that joined (opened; those of ``comebacks`` whose pause is over too) and the served
    ones that left since the last call.

    A run that cannot start (its store or the broker unreachable) is logged and skipped: the others go on (one
    coming back waits its next pause).
    """
    comebacks = comebacks or Comebacks()

    def changes(serving: set[str]) -> tuple[list[RunProducer], list[str]]:
        joined: list[RunProducer] = []
        left: list[str] = []
        # the log first: a run stopped while it waited stays stopped, and one started again meanwhile (still
        # waiting, so taken for served) comes back once, below
        for change in membership.changes(serving | set(comebacks.waiting)):
            if isinstance(change, Left):
                if comebacks.forget(change.run_id):
                    log.info("run %s stopped while waiting to come back; it stays stopped", change.run_id)
                else:
                    left.append(change.run_id)
                continue
            log.info("run %s joins", change.config.run_id)
            try:
                joined.append(open_run(change.config))
            except Exception as exc:  # one run's failure to start must not stop the runs already served
                log.error("run %s could not join: %s", change.config.run_id, exc)
        for config in comebacks.due():
            log.info("run %s comes back", config.run_id)
            try:
                joined.append(open_run(config))
            except Exception as exc:
                comebacks.failed(config, exc)
        return joined, left

    return changes


def serve(runs: list[RunProducer], stop: StopFlag, follow: Follow | None = None,
          release: Callable[[RunProducer], None] = lambda run: None, poll_s: float = 0.5,
          until_stopped: bool | Callable[[], bool] = False,
          on_failure: Callable[[RunProducer, Exception], None] | None = None) -> None:
    """Each run's rollout loop in its own thread; without ``on_failure`` the first error stops them all and is
    raised here, with it a run whose loop raised is released and handed to ``on_failure`` while the others go on.

    With ``follow``, runs join (a thread started) and leave (their thread stopped and waited for, then the run
    handed to ``release``) as it says.  This returns when every run's loop has ended or left, or, while
    ``until_stopped`` (or what it returns) is true (a process following new runs), only when stopped.
    """
    errors: list[BaseException] = []  # what stops every run
    failed: list[tuple[RunProducer, Exception]] = []  # runs whose loop raised, for on_failure
    threads: dict[str, tuple[threading.Thread, threading.Event, RunProducer]] = {}

    def stopping() -> bool:
        return stop() or bool(errors)

    def one(run: RunProducer, leave: threading.Event) -> None:
        try:
            run.run(lambda: stopping() or leave.is_set())
        except Exception as exc:
            if on_failure is None:
                errors.append(exc)  # raised again below, in the main thread
            else:
                failed.append((run, exc))
        except BaseException as exc:
            errors.append(exc)

    def start(run: RunProducer) -> None:
        leave = threading.Event()
        thread = threading.Thread(target=one, args=(run, leave), name=f"run-{run.worker.run_id}")
        threads[run.worker.run_id] = thread, leave, run
        thread.start()

    def going_on() -> bool:
        return (until_stopped() if callable(until_stopped) else until_stopped) or any(
            thread.is_alive() for thread, _, _ in threads.values())

    for run in runs:
        start(run)
    try:
        while not stopping() and (going_on() or failed):
            while failed:  # (appended by the runs' threads; popped only here)
                run, error = failed.pop(0)
                if threads.get(run.worker.run_id, (None, None, None))[2] is not run:  # failed as it was let go
                    # (released as it left, and it does not come back), or as it left before it joined again
                    log.error("run %s failed as it left (%s: %s)", run.worker.run_id, type(error).__name__, error)
                    continue
                thread, _, _ = threads.pop(run.worker.run_id)
                thread.join()
                release(run)
                assert on_failure is not None
                on_failure(run, error)
            if follow is not None:
                joined, left = follow(set(threads))
                for run_id in left:
                    thread, leave, run = threads.pop(run_id)
                    leave.set()
                    thread.join()
                    release(run)
                for run in joined:
                    start(run)
            time.sleep(poll_s)
    except BaseException as exc:  # (follow or release failed) every run stops before the process closes under it
        errors.append(exc)
    for thread, _, _ in threads.values():
        thread.join()
    if errors:
        raise errors[0]
