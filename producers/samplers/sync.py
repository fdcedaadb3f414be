"""The sampling engine behind the ``Sampler`` interface, for callers that run in threads.

``SyncSampler`` owns an event loop in a thread of its own and builds the engine
on it (vLLM's async engine belongs to the loop that first awaits it).  Any
thread may then call ``sample`` or ``generate``; every request of every call is
its own engine request, so the calls of several threads share the running
batch, and a thread-based producer uses the engine without being rewritten.
``submit`` starts one request and returns a future at once, so a rollout worker
sends each episode's turn the moment its environment step returns.

``close`` ends the requests still running first (their callers get a
``RuntimeError`` saying the sampler closed, rather than waiting on a loop that
no longer runs), then the engine, then the loop; a request that had finished
keeps its result.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, SampleRequest
from producers.samplers.engine import SampleParams, SampleResult, SamplingEngine

T = TypeVar("T")


class SyncSampler(Sampler):
    """An engine on its own event loop thread, usable from any thread as a ``Sampler``.

    ``generate`` submits every request of the call as its own engine request, so
    calls from several threads (and their requests) share the running batch.
    Request ``i`` of a call seeded ``s`` draws from ``request_seed(s, i)``, as
    ``Sampler.generate`` promises.  ``call`` runs any coroutine on the engine's loop.
    """

    def __init__(self, make: Callable[[], SamplingEngine]) -> None:
        """Build the engine with ``make`` on the loop thread, which owns it from then on."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="sampling-engine", daemon=True)
        self._thread.start()
        self._closing = False
        self._running: set[asyncio.Task[Any]] = set()  # the tasks of the calls started and not finished
        try:
            self.engine: SamplingEngine = self.call(_build(make))
        except BaseException:
            self._stop_loop()
            raise
        self.eos_token_id = self.engine.eos_token_id
        self.max_model_len = self.engine.max_model_len

    def start(self, coroutine: Coroutine[Any, Any, T]) -> Future[T]:
        """Run ``coroutine`` on the engine's loop; its result (or error) arrives in the future."""
        if self._closing or not self._thread.is_alive():
            coroutine.close()
            raise RuntimeError("this SyncSampler is closed; build a new one")
        return asyncio.run_coroutine_threadsafe(self._tracked(coroutine), self._loop)

    async def _tracked(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """``coroutine``, ended by ``close`` with an error naming it when it is still running then."""
        task = asyncio.current_task()
        assert task is not None  # run_coroutine_threadsafe runs it as a task
        if self._closing:  # started while ``close`` began
            coroutine.close()
            raise RuntimeError("this SyncSampler is closed; build a new one")
        self._running.add(task)
        try:
            return await coroutine
        except asyncio.CancelledError:
            if self._closing:
                raise RuntimeError("the SyncSampler closed before this request finished; sample before closing "
                                   "it, or build a new one") from None
            raise
        finally:
            self._running.discard(task)

    def call(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run ``coroutine`` on the engine's loop and wait for its result (from any thread but the loop's)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("SyncSampler.call from the engine's own loop would deadlock; await the engine instead")
        return self.start(coroutine).result()

    def sample(self, prompt_token_ids: list[int], adapter: AdapterHandle | None, params: SampleParams,
               owner: str | None = None) -> SampleResult:
        """``SamplingEngine.sample``, blocking; ``owner`` names who the call is for (a packed producer's run, the
        API's tenant): the transformers engine lets owners take turns in a batch, vLLM's ignores it."""
        return self.call(self.engine.sample(prompt_token_ids, adapter, params, owner=owner))

    def generate(
        self,
        requests: list[SampleRequest],
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        owner: str | None = None,
    ) -> list[SampleOutput]:
        """See ``Sampler.generate``; each request is its own engine request, for ``owner`` (``sample``)."""
        self.check_requests(requests)

        async def every() -> list[SampleOutput]:
            return await asyncio.gather(*(self.sample_one(r, adapter, temperature, top_p, seed, stream, owner)
                                          for stream, r in enumerate(requests)))

        return self.call(every()) if requests else []

    async def sample_one(self, request: SampleRequest, adapter: AdapterHandle | None, temperature: float = 1.0,
                         top_p: float = 1.0, seed: int | None = None, stream: int = 0,
                         owner: str | None = None) -> SampleOutput:
        """Request ``stream`` of a call seeded ``seed``, as one engine request for ``owner`` (``sample``); awaited
        on the engine's loop."""
        params = SampleParams(self.new_token_budget(request), temperature=temperature, top_p=top_p, seed=seed,
                              first_stream=stream, extra_stop_token_ids=request.extra_stop_ids)
        return (await self.engine.sample(request.prompt_token_ids, adapter, params, owner=owner)).sequences[0]

    concurrent_requests = True

    def submit(
        self,
        request: SampleRequest,
        adapter: AdapterHandle | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        seed: int | None = None,
        owner: str | None = None,
    ) -> Future[SampleOutput]:
        """One engine request for ``owner`` (``sample``), started now on the engine's loop: it joins the running
        batch."""
        self.check_requests([request])
        return self.start(self.sample_one(request, adapter, temperature, top_p, seed, owner=owner))

    def load_adapter(self, handle: AdapterHandle) -> None:
        self.call(self.engine.load_adapter(handle))

    def unload_adapter(self, handle: AdapterHandle) -> None:
        self.call(self.engine.unload_adapter(handle))

    def close(self) -> None:
        """End the requests still running, close the engine, then stop its loop thread."""
        if self._closing or not self._thread.is_alive():
            return
        try:
            self.call(self._shutdown())
        finally:
            self._closing = True
            self._stop_loop()

    async def _shutdown(self) -> None:
        """On the loop: cancel the running calls (each caller gets ``_tracked``'s error), then close the engine."""
        self._closing = True  # from here no call starts, and a cancelled one says why
        running = [task for task in self._running if task is not asyncio.current_task()]
        for task in running:
            task.cancel()
        await asyncio.gather(*running, return_exceptions=True)
        self.engine.close()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self._loop.close()


async def _build(make: Callable[[], SamplingEngine]) -> SamplingEngine:
    return make()

