"""The sampler role of the Tinker-compatible API: executes the ``sample`` calls on ``<ns>.requests`` for one base model.

Set up: the object store, a ``SamplingEngine`` for the base model (transformers
or vLLM), the base model's tokenizer (for stop strings), a group consumer of
``<ns>.requests`` (its own group: trainers skip sampling calls and this role
skips every other call) and a publisher for ``<ns>.results``.  Then one asyncio
loop: read (each ``sample`` call becomes its own task at once: no fixed batch,
the engine batches what runs concurrently), and commit offsets below the oldest
call still running, so a sampler that dies re-runs only unfinished calls.

One call: the tenant is checked against the sampling session's record
(``pipeline.api.samplers``), its weights resolved (base model, or the adapter
registry version a ``sampler_weights`` path or ``save_weights_and_get_sampling_client``
names, or for an inflight session its training client's latest inflight save, pulled
into a local cache), the SDK's ``SamplingParams`` translated
(``sampling_params``), the engine sampled, and the SDK's protobuf
``SampleResponse`` written create-only, then announced with ``ApiResultReady``.

A researcher's RL loop makes a new version every step, so the worker keeps at most
``max_adapters`` versions (least recently sampled first out): a version no call is
sampling is unloaded from the engine and its pulled folder deleted once more are
held; a later call for it pulls and loads it again.

Logprobs of sampled tokens are those of the distribution they were drawn from
(after temperature, top-k and top-p: the engine's ``processed_logprobs``), the ``q`` of
rlpipe's importance sampling.  Prompt logprobs are the model's own (temperature
1), NaN at position 0.  Top-k logprobs (``topk_prompt_logprobs``, ``topk_sample_logprobs``,
at most ``MAX_TOPK_LOGPROBS``) are of the same two distributions, encoded as the SDK's
``TopkLogprobs`` (``producers.api_encoding``).

A call whose client is gone is not sampled on: before a call starts and before each of its rounds the sampler
looks at its session (``pipeline.api.liveness.ClientPresence``: ended, or its heartbeat record unchanged for
``SESSION_TIMEOUT_S``, or older than that by far on first sight; read from the store at most every
``--session-check-s``, default ``SESSION_CHECK_S``, per session), and a call of a session gone fails as the user's,
its samples drawn so far dropped.  A script killed mid-loop would otherwise hold the engine for every round it asked
for, and a restarted sampler, reading the unanswered calls from the log, would draw those of a gone client again.

With ``--direct-port`` the sampler also takes calls straight from the gateway
(``pipeline.api.direct``: answered once the result is stored, so the gateway wakes
the poll without waiting for two broker hops); a call that arrives both ways runs
once, as one task per request id.

Every ``sample`` call that ran a round is noted with its session, wall-clock span
(from its first engine call to its return, so the time a call waits for a batch
counts) and sampled tokens in the engine's activity (``pipeline.api.activity``),
which ``rlpipe report --server`` draws as the sampler's duty cycle: a call stopped
because its client went, or failed in the engine, too, up to its stop, with the
tokens its rounds drew.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import shutil
import tempfile
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from tinker import types

from pipeline.api.activity import ActivityRecorder
from pipeline.api.direct import direct_app, serve_direct
from pipeline.api.engines import (
    announce_result,
    engine_arguments,
    engine_health,
    engine_reader,
    engine_setup,
    store_result,
)
from pipeline.api.lifecycle import files_deleted
from pipeline.api.liveness import ClientPresence
from pipeline.api.samplers import (
    check_sample_request,
    check_topk_sample_cells,
    inflight_version,
    read_sampler,
    sampled_version,
)
from pipeline.api.wire import parse_body
from pipeline.io.bus import ConsumedEvent, EventPublisher, TopicPartitionKey, ensure_topics
from pipeline.io.registry import AdapterRegistry, RetiredAdapterError
from pipeline.io.store import ObjectStore
from pipeline.topics import API_TOPIC_KINDS
from producers.api_encoding import cut_at_stop_strings, encode_sample_response, only_last
from producers.samplers.base import AdapterHandle, SampleOutput
from producers.samplers.engine import SampleParams, SampleResult, SamplingEngine
from schemas.api import ApiError, ApiRequestAccepted, result_path
from schemas.config import MAX_BATCH_SEQUENCES, BusConfig, SamplerConfig

log = logging.getLogger("rlpipe.api.sampler")
SAMPLING_OPS = ("sample",)
DEFAULT_MAX_ADAPTERS = 8
INFLIGHT_CHECK_S = 0.5  # how long the latest inflight save a run's pointer names is taken as known
MAX_RECORDS_KEPT = 4096  # sampling session records kept in memory (a loop makes one per saved version)
CALL_ROUND_SAMPLES = 16  # samples of one call in the engine at a time: a call of many takes turns with the others
SESSION_CHECK_S = 5.0  # how long what the store says of a session (ended, heartbeats lapsed) is taken as known
MAX_SESSION_CHECK_S = 60.0  # a lapse is noticed up to one check after SESSION_TIMEOUT_S: at most a minute late


# ---- translation: the SDK's request -> the engine, the engine's result -> the SDK's protobuf ---------------------


def sampling_params(request: types.SampleRequest, max_model_len: int) -> tuple[SampleParams, list[str]]:
    """The engine's ``SampleParams`` and the stop strings (cut after sampling) of one ``SampleRequest``."""
    check_sample_request(request)
    given = request.sampling_params
    if request.prompt.length >= max_model_len:
        raise ApiError(f"prompt of {request.prompt.length} tokens does not fit this server's context of "
                       f"{max_model_len} tokens (max_context_length in get_server_capabilities); shorten it")
    stop = given.stop
    strings: list[str] = []
    stop_ids: tuple[int, ...] | None = None
    if isinstance(stop, str):
        strings = [stop]
    elif stop is not None:
        items = list(stop)
        if all(isinstance(item, str) for item in items) and items:
            strings = [str(item) for item in items]
        elif all(isinstance(item, int) for item in items):
            stop_ids = tuple(int(item) for item in items)  # [] = never stop before max_tokens
        else:
            raise ApiError("sampling_params.stop mixes strings and token ids; send one kind")
    max_tokens = max_model_len if given.max_tokens is None else given.max_tokens
    check_topk_sample_cells(request, max_tokens)
    params = SampleParams(max_tokens=max_tokens, num_samples=request.num_samples,
                          temperature=given.temperature, top_p=given.top_p, top_k=max(0, given.top_k),
                          seed=given.seed,
                          stop_token_ids=stop_ids, prompt_logprobs=bool(request.prompt_logprobs),
                          topk_prompt_logprobs=request.topk_prompt_logprobs,
                          topk_sample_logprobs=request.topk_sample_logprobs)
    return params, strings


# ---- the worker --------------------------------------------------------------------------------------------------


class SamplerWorker:
    """Executes one base model's ``sample`` calls from the log, each its own task; see the module docstring."""

    def __init__(self, store: ObjectStore, bus: BusConfig, base_model: str, engine: SamplingEngine,
                 decode: Callable[[list[int]], str], cache_dir: str | None = None,
                 consumer_options: dict[str, Any] | None = None, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 activity: ActivityRecorder | None = None, session_check_s: float = SESSION_CHECK_S) -> None:
        if max_adapters < 1:
            raise ValueError(f"max_adapters must be at least 1, got {max_adapters}")
        if not 0 <= session_check_s <= MAX_SESSION_CHECK_S:
            raise ValueError(f"session_check_s must be from 0 to {MAX_SESSION_CHECK_S:g} (a lapse is noticed up to "
                             f"that late), got {session_check_s}")
        self.store, self.bus, self.base_model, self.engine, self.decode = store, bus, base_model, engine, decode
        self.activity = activity
        self.max_adapters = max_adapters
        self.cache_dir = cache_dir or tempfile.mkdtemp(prefix="rlpipe-api-sampler-")
        self._own_cache = cache_dir is None  # removed on close
        ensure_topics(bus, API_TOPIC_KINDS)
        self.consumer = engine_reader(bus, "sampler", base_model, consumer_options)
        self.publisher = EventPublisher(bus)
        self.running: dict[asyncio.Task[None], tuple[TopicPartitionKey, int]] = {}
        self._adapters: OrderedDict[tuple[str, int], AdapterHandle] = OrderedDict()  # least recently used first
        self._in_use: Counter[tuple[str, int]] = Counter()  # calls sampling each version now
        self._pulling: dict[tuple[str, int], asyncio.Lock] = {}
        self._lora_ids = itertools.count(1)
        self._committed: dict[TopicPartitionKey, int] = {}
        self._calls: dict[str, asyncio.Task[None]] = {}  # request id -> the task running it (from either path)
        self._announcing: set[asyncio.Task[None]] = set()
        self._records: OrderedDict[str, dict[str, Any]] = OrderedDict()  # sampling session id -> its record
        self._records_lock = threading.Lock()
        self.inflight_check_s = INFLIGHT_CHECK_S
        self._inflight: dict[str, tuple[float, int | None]] = {}  # run -> (monotonic time read, latest inflight save)
        self.presence = ClientPresence(store, session_check_s, MAX_RECORDS_KEPT)

    # ---- the loop -------------------------------------------------------------------------------------------
    async def run(self, stop: Callable[[], bool], direct_port: int | None = None) -> None:
        """Read and execute calls until ``stop()``; with ``direct_port``, also take them from the gateway."""
        log.info("sampler for %s reading %s.requests", self.base_model, self.bus.namespace)
        server = None
        if direct_port:
            server, serving = await serve_direct(direct_app(self.run_direct), direct_port)
            log.info("sampler for %s taking calls directly on 127.0.0.1:%d", self.base_model, direct_port)
        while not stop():
            await self.step()
        if server is not None:
            server.should_exit = True
            with contextlib.suppress(Exception):  # one that never listened said so when it started
                await serving
        if self._calls:
            await asyncio.wait(list(self._calls.values()))
        if self._announcing:
            await asyncio.wait(list(self._announcing))
        await asyncio.to_thread(self._commit)
        self.close()

    async def step(self, poll_timeout_s: float = 0.2) -> int:
        """Read once, start a task per sampling call, commit; the number of tasks started."""
        events = await asyncio.to_thread(self.consumer.poll, poll_timeout_s)
        started = 0
        for consumed in events:
            if self.accept(consumed):
                task = self.start(consumed.event.payload)
                self.running[task] = ((consumed.topic, consumed.partition), consumed.offset)
                task.add_done_callback(self._finished)
                started += 1
        await asyncio.to_thread(self._commit)
        return started

    def accept(self, consumed: ConsumedEvent) -> bool:
        """Whether the event is a sampling call of this base model."""
        call = consumed.event.payload
        return isinstance(call, ApiRequestAccepted) and call.op in SAMPLING_OPS and call.base_model == self.base_model

    def start(self, call: ApiRequestAccepted) -> asyncio.Task[None]:
        """The task executing ``call``: the one already running for its request id, else a new one."""
        task = self._calls.get(call.request_id)
        if task is None or task.done():
            task = asyncio.create_task(self.execute(call))
            self._calls[call.request_id] = task
            task.add_done_callback(lambda done: self._calls.pop(call.request_id, None)
                                   if self._calls.get(call.request_id) is done else None)
        return task

    async def run_direct(self, call: ApiRequestAccepted) -> None:
        """Execute a call the gateway handed over directly; returns once its result is stored."""
        if call.op not in SAMPLING_OPS or call.base_model != self.base_model:
            raise ValueError(f"this sampler serves sample calls of {self.base_model}, not {call.op} of "
                             f"{call.base_model}")
        await asyncio.shield(self.start(call))  # a gateway that goes away does not cancel the call

    def _finished(self, task: asyncio.Task[None]) -> None:
        self.running.pop(task, None)

    def _commit(self) -> None:
        """Commit each partition below its oldest running call (everything polled when none runs)."""
        held: dict[TopicPartitionKey, int] = {}
        for tp, offset in list(self.running.values()):
            held[tp] = min(offset, held.get(tp, offset))
        positions = self.consumer.positions()
        offsets = {tp: held.get(tp, position) for tp, position in positions.items()}
        if offsets and offsets != self._committed:
            self._committed = self.consumer.commit(offsets)

    def close(self) -> None:
        self.consumer.close()
        self.publisher.close()
        if self.activity is not None:
            self.activity.close()
        if self._own_cache:  # the pulled versions in a folder of its own making
            shutil.rmtree(self.cache_dir, ignore_errors=True)

    # ---- one call -------------------------------------------------------------------------------------------
    async def execute(self, call: ApiRequestAccepted) -> None:
        """Sample one call and write its result (or its error); a call with a stored result is not re-run."""
        for kind in ("pb", "json"):  # a failure told to the client stands too: it never turns into a success
            if await asyncio.to_thread(self.store.exists, result_path(call.session_id, call.request_id, kind)):
                return
        try:
            data, fmt, error, category = await self._sample(call), "pb", None, None
        except ApiError as exc:
            error, category = str(exc), exc.category
        except RetiredAdapterError as exc:  # weights retired since the call was accepted (its session ended)
            error, category = str(exc), "user"
        except ValueError as exc:  # the engine's refusals (a prompt that does not fit): the request's fault
            error, category = f"{exc}", "user"
        except FileNotFoundError as exc:
            if await asyncio.to_thread(files_deleted, self.store, call.session_id) is not None:
                log.warning("sample %s dropped: its session ended and its calls were deleted", call.request_id)
                return  # read a day after its session's end (a sampler that far behind): nobody waits for it
            log.exception("sample %s failed", call.request_id)
            error, category = f"sample failed on the sampler (FileNotFoundError: {exc}); retry, or report it", "server"
        except Exception as exc:
            log.exception("sample %s failed", call.request_id)
            error, category = f"sample failed on the sampler ({type(exc).__name__}: {exc}); retry, or report it", "server"
        if error is not None:
            data, fmt = json.dumps({"error": error, "category": category}).encode(), "json"
        digest = await asyncio.to_thread(store_result, self.store, call, data, fmt)  # type: ignore[arg-type]
        if digest is not None:  # announced after the call ends: the direct path has answered by then
            announcing = asyncio.create_task(asyncio.to_thread(
                announce_result, self.publisher, call, fmt, digest, error, category))  # type: ignore[arg-type]
            self._announcing.add(announcing)
            announcing.add_done_callback(self._announcing.discard)

    async def _sample(self, call: ApiRequestAccepted) -> bytes:
        record, body = await asyncio.to_thread(self._read_call, call)  # a session whose files are gone: dropped
        # off the loop every session's samples share, and JSON first: four times faster over a prompt's token list
        request = await asyncio.to_thread(parse_body, types.SampleRequest, body, json_first=True)
        params, strings = sampling_params(request, self.engine.max_model_len)
        await self._check_client(call, 0, request.num_samples)  # (a call read again after a restart) before a pull
        key = None
        if record.get("run") is not None:  # an inflight session reads its training client's latest inflight save
            latest = await self._latest_inflight(str(record["run"])) if record.get("kind") == "inflight" else None
            key = (str(record["run"]), sampled_version(record, latest))
        adapter = None if key is None else await self._acquire(key)
        try:
            result = await self._sample_in_rounds(request.prompt.to_ints(), adapter, params, call)
        finally:
            if key is not None:
                self._in_use[key] -= 1
                await self._evict()
        sequences = [cut_at_stop_strings(sample, strings, self.decode) for sample in result.sequences]
        last_n = request.prompt_logprobs_last_n  # only the last N are asked for (the top-k rows' too)
        answer = SampleResult(sequences, only_last(result.prompt_logprobs, last_n),
                              only_last(result.topk_prompt_logprobs, last_n))
        # off the loop too: a call's top-k rows are up to MAX_TOPK_SAMPLE_CELLS entries to flatten and place
        return await asyncio.to_thread(encode_sample_response, answer, params.topk_prompt_logprobs,
                                       params.topk_sample_logprobs)

    async def _sample_in_rounds(self, prompt: list[int], adapter: AdapterHandle | None,
                                params: SampleParams, call: ApiRequestAccepted) -> SampleResult:
        """``params.num_samples`` samples, at most ``CALL_ROUND_SAMPLES`` in the engine at a time: a call of many
        samples takes turns with the calls that arrive meanwhile instead of holding the engine until it ends.
        Round k draws streams k * CALL_ROUND_SAMPLES on, so a seeded call draws what it would in one piece.
        Each round is the call's tenant's (the engine's ``owner``): a tenant's many calls take turns with
        another's.  Before each round the call's client is looked for (``_check_client``).

        A call that ran a round is noted in the engine's activity whatever its outcome, from its first round's start
        to its return, its stop or its failure, with the tokens its rounds drew: a call stopped because its client
        went kept the engine busy for the rounds it ran, though its samples are dropped."""
        sequences: list[SampleOutput] = []
        scored = SampleResult([])
        began: tuple[float, float] | None = None  # (time.time(), time.perf_counter()) at the first round's start
        try:
            for first in range(0, params.num_samples, CALL_ROUND_SAMPLES):  # the prompt is scored in the first round
                await self._check_client(call, first, params.num_samples)
                log.debug("sample %s of session %s: round %d of %d", call.request_id, call.session_id,
                          first // CALL_ROUND_SAMPLES + 1, math.ceil(params.num_samples / CALL_ROUND_SAMPLES))
                part = dataclasses.replace(params, num_samples=min(CALL_ROUND_SAMPLES, params.num_samples - first),
                                           first_stream=params.first_stream + first,
                                           prompt_logprobs=params.prompt_logprobs and first == 0,
                                           topk_prompt_logprobs=params.topk_prompt_logprobs if first == 0 else 0)
                began = began or (time.time(), time.perf_counter())
                result = await self.engine.sample(prompt, adapter, part, owner=call.tenant)
                sequences += result.sequences
                scored = result if first == 0 else scored
        finally:
            if began is not None:
                self._note_activity(call, began, sequences)
        return SampleResult(sequences, scored.prompt_logprobs, scored.topk_prompt_logprobs)

    def _note_activity(self, call: ApiRequestAccepted, began: tuple[float, float],
                       sequences: list[SampleOutput]) -> None:
        """Note a call's busy span (from ``began``, a (wall, perf_counter) pair, to now) and drawn tokens."""
        if self.activity is not None:
            wall, started = began
            self.activity.record(call.session_id, call.tenant, call.op, wall, wall + time.perf_counter() - started,
                                 sum(len(sample.token_ids) for sample in sequences))

    async def _check_client(self, call: ApiRequestAccepted, drawn: int, wanted: int) -> None:
        """Raise a user ``ApiError`` when nobody waits for the call's samples any more: its session ended or its
        heartbeats lapsed (``ClientPresence``, read at most every ``session_check_s``).  The samples drawn are not
        returned: the call fails as a whole."""
        why = await asyncio.to_thread(self.presence.gone, call.session_id)
        if why is None:
            return
        log.info("sample %s stopped after %d of %d samples: session %s %s", call.request_id, drawn, wanted,
                 call.session_id, why)
        fix = ("sample again from a live ServiceClient" if why.startswith("ended")
               else "retry the call: a ServiceClient whose process runs beats every 10 s and takes its session back")
        raise ApiError(f"session {call.session_id} {why}; sample call not completed ({drawn} of {wanted} samples "
                       f"drawn, none returned); {fix}")

    async def _latest_inflight(self, run: str) -> int | None:
        """The run's latest inflight save, read at most every ``inflight_check_s`` (inflight weights propagate
        asynchronously; a session never samples older weights than its own whatever this says)."""
        checked, latest = self._inflight.get(run, (-math.inf, None))
        if time.monotonic() - checked >= self.inflight_check_s:
            latest = await asyncio.to_thread(inflight_version, self.store, run)
            self._inflight[run] = (time.monotonic(), latest)
            while len(self._inflight) > MAX_RECORDS_KEPT:
                self._inflight.pop(next(iter(self._inflight)))
        return latest

    def _read_call(self, call: ApiRequestAccepted) -> tuple[dict[str, Any], bytes]:
        """The sampling session's record (kept: records are create-only) and the call's body, tenant checked."""
        sampler_id = call.model_id or ""
        with self._records_lock:  # read in worker threads
            record = self._records.get(sampler_id)
        if record is None:
            record = read_sampler(self.store, call.tenant, sampler_id)
            with self._records_lock:
                self._records[sampler_id] = record
                while len(self._records) > MAX_RECORDS_KEPT:
                    self._records.popitem(last=False)
        elif record["tenant"] != call.tenant:
            read_sampler(self.store, call.tenant, sampler_id)  # raises the one "not found" every tenant gets
        return record, self.store.get(call.body_path, call.body_sha256)

    async def _acquire(self, key: tuple[str, int]) -> AdapterHandle:
        """The handle of registry version ``key`` (pulled when not held), marked in use and most recent."""
        async with self._pulling.setdefault(key, asyncio.Lock()):  # concurrent first calls share one pull
            if key not in self._adapters:
                self._adapters[key] = await asyncio.to_thread(self._pull, key)
            self._in_use[key] += 1
        self._adapters.move_to_end(key)
        return self._adapters[key]

    def _pull(self, key: tuple[str, int]) -> AdapterHandle:
        run, version = key
        registry = AdapterRegistry(self.store, run)
        lora_id = next(self._lora_ids)  # a fresh id each time: an engine never reuses one for other weights
        folder = registry.pull(version, f"{self.cache_dir}/{lora_id}")
        return AdapterHandle(version=version, lora_int_id=lora_id, name=f"v{version}-id{lora_id}", path=str(folder),
                             sha256=registry.adapter_sha256(version), run=run)

    async def _evict(self) -> None:
        """Unload the least recently sampled idle versions while more than ``max_adapters`` are held."""
        while len(self._adapters) > self.max_adapters:
            idle = next((key for key in self._adapters if not self._in_use[key]), None)
            if idle is None:
                return  # every held version is being sampled: evicted when a call ends
            handle = self._adapters.pop(idle)
            del self._in_use[idle]
            self._pulling.pop(idle, None)
            await self.engine.unload_adapter(handle)
            await asyncio.to_thread(shutil.rmtree, f"{self.cache_dir}/{handle.lora_int_id}", True)
            log.info("unloaded %s version %d (%d versions held at most)", handle.run, handle.version,
                     self.max_adapters)

    def adapters_held(self) -> list[tuple[str, int]]:
        """The registry versions held now, least recently sampled first."""
        return list(self._adapters)



# ---- entry point -------------------------------------------------------------------------------------------------


def engine_options(backend: str, max_adapters: int) -> dict[str, Any]:
    """``make_engine``'s settings for a sampler holding ``max_adapters`` versions: vLLM keeps them all loaded
    (``max_cpu_loras``) rather than evicting all but ``max_loras`` and reading them from disk at every turn."""
    return {"max_cpu_loras": max_adapters} if backend == "vllm" else {}


def sampler_config(backend: str, max_lora_rank: int | None = None,
                   max_batch_sequences: int | None = None) -> SamplerConfig:
    """The engine's ``SamplerConfig`` from the sampler's options (None: the config's default)."""
    config = SamplerConfig(backend=backend)
    if max_lora_rank:
        config = config.model_copy(update={"max_lora_rank": max_lora_rank})
    if max_batch_sequences is not None:
        config = config.model_copy(update={"max_batch_sequences": max_batch_sequences})
    return config


def main(argv: list[str] | None = None) -> int:
    """``python -m producers.api_sampler --base-model PATH --store URL --bootstrap HOST:PORT [--backend B]``."""
    from transformers import AutoTokenizer

    from pipeline.io.bus import group_timings_from_env
    from pipeline.runtime import StopFlag
    from producers.samplers.engine import make_engine
    from schemas.config import LORA_RANK_SLOTS

    parser = engine_arguments("rlpipe-api-sampler", main.__doc__)
    parser.add_argument("--backend", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--max-lora-rank", type=int, default=None, choices=LORA_RANK_SLOTS,
                        help="--backend vllm: the largest adapter rank it loads (default: the sampler config's)")
    parser.add_argument("--max-batch-sequences", type=int, default=None,
                        help="--backend transformers: the most sequences decoded together, as one batch of calls "
                             "sharing weights and settings (default 16; sampler.max_batch_sequences)")
    parser.add_argument("--max-adapters", type=int, default=DEFAULT_MAX_ADAPTERS,
                        help="adapter versions kept loaded (least recently sampled out first)")
    parser.add_argument("--direct-port", type=int, default=None,
                        help="also take calls straight from the gateway on 127.0.0.1:PORT (pipeline.api.direct)")
    parser.add_argument("--session-check-s", type=float, default=SESSION_CHECK_S,
                        help="how long what the store says of a session (ended, heartbeats lapsed) is taken as "
                             f"known before a call's next round reads it again (default {SESSION_CHECK_S:g}, at most "
                             f"{MAX_SESSION_CHECK_S:g}; 0: every round)")
    args = parser.parse_args(argv)
    if args.max_batch_sequences is not None and args.backend != "transformers":
        parser.error("--max-batch-sequences is the transformers backend's (vLLM batches continuously); drop it")
    if args.max_batch_sequences is not None and not 1 <= args.max_batch_sequences <= MAX_BATCH_SEQUENCES:
        parser.error(f"--max-batch-sequences must be from 1 to {MAX_BATCH_SEQUENCES}, got {args.max_batch_sequences}")
    if not 0 <= args.session_check_s <= MAX_SESSION_CHECK_S:
        parser.error(f"--session-check-s must be from 0 to {MAX_SESSION_CHECK_S:g} (a lapse is noticed up to that "
                     f"late), got {args.session_check_s:g}")
    bus = engine_setup(args, log)
    ready = engine_health(args)
    log.info("initialising the %s sampling engine for %s", args.backend, args.base_model)
    config = sampler_config(args.backend, args.max_lora_rank, args.max_batch_sequences)
    engine = make_engine(args.backend, args.base_model, config, **engine_options(args.backend, args.max_adapters))
    tokenizer = AutoTokenizer.from_pretrained(args.base_model)
    ready.add("engine loaded")
    store = ObjectStore(args.store)
    worker = SamplerWorker(store, bus, args.base_model, engine,
                           lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
                           consumer_options=group_timings_from_env(), max_adapters=args.max_adapters,
                           activity=ActivityRecorder(store, "sampler", args.engine_id),
                           session_check_s=args.session_check_s)
    ready.add("reading calls")
    try:
        asyncio.run(worker.run(StopFlag().install(), args.direct_port))
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
