"""``TransformersEngine``: the plain transformers sampler behind the sampling engine's coroutine.

Calls that wait together and share the adapter and the sampling settings are decoded
as one batch in a worker thread, up to ``max_batch_sequences`` sequences a batch, the groups
of such calls taking turns and, within a group, the owners of its calls (the API's tenants);
the conventions are the engine's (``producers.samplers.engine``).
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, replace
from typing import Any

from producers.samplers.base import AdapterHandle
from producers.samplers.engine import SampleParams, SampleResult, SamplingEngine
from schemas.config import SamplerConfig


@dataclass
class _Waiting:
    """A ``sample`` call of the transformers engine waiting for its batch."""

    prompt: list[int]
    adapter: AdapterHandle | None
    params: SampleParams
    budget: int
    result: asyncio.Future[SampleResult]
    key: tuple[Any, ...]  # ``batch_key``: calls with equal keys can share a batch
    arrival: int  # the engine's round when it was submitted (one counter with the rounds batches are served in)
    owner: str | None = None  # who it is for (the API's tenant): owners take turns within a group


def batch_key(adapter: AdapterHandle | None, params: SampleParams, engine: SamplingEngine) -> tuple[Any, ...]:
    """Calls with equal keys can share a batch: the same weights and sampling settings."""
    weights = None if adapter is None else (adapter.name, adapter.lora_int_id, adapter.path)
    return weights, params.temperature, params.top_p, params.top_k, engine.stop_ids(params)


def _settle(waiting: _Waiting, result: SampleResult | None = None, exception: BaseException | None = None) -> None:
    if waiting.result.done():  # its caller went away (cancelled)
        return
    if exception is not None:
        waiting.result.set_exception(exception)
    else:
        waiting.result.set_result(result)  # type: ignore[arg-type]


class TransformersEngine(SamplingEngine):
    """The transformers sampler behind the engine's coroutine, calls batched in a worker thread.

    Calls that wait together and share the adapter and the sampling settings (temperature,
    top-p, top-k, stop ids) are decoded as one batch of at most ``max_batch_sequences`` sequences
    (the argument, else ``SamplerConfig.max_batch_sequences``, which also sets the sampler's decode
    batch; default: the sampler's decode batch, ``max_batch``; a call of more runs whole, alone); the
    rest wait for the next.  Each batch goes to the group that has waited longest (since it was
    last served, or since its oldest call arrived), so one caller's many waiting calls take
    turns with another's calls of other weights or settings instead of holding them, and a
    stream of new groups (a new adapter version each step) does not starve an older one.  Inside
    a group the calls' owners (``sample``'s ``owner``: the API sampler passes the tenant) take
    turns by the same rule, each owner's calls oldest first, so two tenants sampling the same
    weights alike do not share one queue in which the first one's burst holds the other.  Every
    sample draws from its own seed, so a call's tokens do not depend on what else runs;
    its logprobs agree with the call alone within float rounding.  It is the readable
    reference and the backend for machines without vLLM, not a continuous-batching engine.

    An adapter is (``run``, ``version``) of its handle, as on vLLM: each gets a peft adapter
    name of its own in this engine (never another's while it is loaded), so runs with
    overlapping version numbers share the engine, and a known (run, version) with other
    weights is refused.
    """

    def __init__(self, model_path: str, config: SamplerConfig | None = None, max_batch_sequences: int | None = None,
                 **kwargs: Any) -> None:
        from producers.samplers.hf_sampler import TransformersSampler

        if max_batch_sequences is not None and max_batch_sequences < 1:
            raise ValueError(f"max_batch_sequences must be at least 1 (or None: the sampler's max_batch), "
                             f"got {max_batch_sequences}")
        cap = max_batch_sequences or (config.max_batch_sequences if config is not None else None)
        if cap is not None:
            kwargs.setdefault("max_batch", cap)  # the sequences of a batch decode together, not in pieces of 16
        self.sampler = TransformersSampler(model_path, config, **kwargs)
        self.max_batch_sequences = cap or self.sampler.max_batch
        self.eos_token_id = self.sampler.eos_token_id
        self.vocab_size = self.sampler.vocab_size
        self.max_model_len = self.sampler.max_model_len
        self._waiting: list[_Waiting] = []
        self._worker: asyncio.Task[None] | None = None
        self._serving: dict[tuple[str, int], AdapterHandle] = {}  # (run, version) -> the sampler's handle of it
        self._names = itertools.count(1)  # its peft adapter names: never reused in this engine
        self._served: dict[tuple[Any, ...], int] = {}  # batch key of a waiting group -> the round it was last served
        # (batch key, owner) of calls waiting -> the round that owner's last call of that group was taken
        self._owner_served: dict[tuple[tuple[Any, ...], str | None], int] = {}
        self._rounds = itertools.count()  # one clock for calls arriving, groups served and owners' calls taken

    async def sample(
        self, prompt_token_ids: list[int], adapter: AdapterHandle | None, params: SampleParams,
        *, owner: str | None = None,
    ) -> SampleResult:
        budget = self.token_budget(prompt_token_ids, params)
        arrival = next(self._rounds)  # its place in the turns: a load of its adapter first does not lose it
        if adapter is not None:
            adapter.check_folder()
            if (adapter.run, adapter.version) not in self._serving:
                await self.load_adapter(adapter)  # a refused adapter fails here, and its (run, version) stays free
            adapter = self._own(adapter)
        waiting = _Waiting(list(prompt_token_ids), adapter, params, budget, asyncio.get_running_loop().create_future(),
                           batch_key(adapter, params, self), arrival, owner)
        bisect.insort(self._waiting, waiting, key=lambda one: one.arrival)  # kept in arrival order
        if self._worker is None or self._worker.done():
            self._worker = asyncio.create_task(self._drain())
        return await waiting.result

    def stop_ids(self, params: SampleParams) -> tuple[int, ...]:
        """Unless told otherwise, the sampler's stop ids (eos and the generation config's eos ids, as vLLM's) and
        the extra ones."""
        if params.stop_token_ids is None:
            return tuple(sorted(self.sampler.stop_token_ids | set(params.extra_stop_token_ids)))
        return tuple(params.stop_token_ids)

    async def _drain(self) -> None:
        """Run what waits, one batch of compatible calls at a time, until nothing waits."""
        while self._waiting:
            batch = self._next_batch()
            try:
                results = await asyncio.to_thread(self._sample_blocking, batch)
            except Exception as exc:
                if len(batch) == 1:
                    _settle(batch[0], exception=exc)
                    continue
                for one in batch:  # one call's failure must not fail the others: each runs alone
                    try:
                        _settle(one, result=(await asyncio.to_thread(self._sample_blocking, [one]))[0])
                    except Exception as alone:
                        _settle(one, exception=alone)
                continue
            for one, result in zip(batch, results, strict=True):
                _settle(one, result=result)

    def _next_batch(self) -> list[_Waiting]:
        """Take the next batch out of the waiting calls: calls of the group that has waited longest, up to
        ``max_batch_sequences`` sequences and at least one call, its owners taking turns (``_take_turns``).

        A group has waited since the round it was last served, or, when not served since it last had calls
        waiting, since its oldest waiting call arrived; arrivals and serves count on one clock, so the groups take
        turns and a stream of new groups cannot hold back one that was served before they arrived."""
        groups: dict[tuple[Any, ...], list[_Waiting]] = {}
        for waiting in self._waiting:  # in arrival order: each group's first call is its oldest
            groups.setdefault(waiting.key, []).append(waiting)
        key = min(groups, key=lambda k: self._served.get(k, groups[k][0].arrival))  # every round is a new number
        self._served = {k: served for k, served in self._served.items() if k in groups}
        self._served[key] = next(self._rounds)
        waiting_owners = {(waiting.key, waiting.owner) for waiting in self._waiting}
        self._owner_served = {k: served for k, served in self._owner_served.items() if k in waiting_owners}
        batch = self._take_turns(key, groups[key])
        taken = {id(waiting) for waiting in batch}
        self._waiting = [waiting for waiting in self._waiting if id(waiting) not in taken]
        return batch

    def _take_turns(self, key: tuple[Any, ...], group: list[_Waiting]) -> list[_Waiting]:
        """The batch of ``group`` (its calls in arrival order): one call at a time from the owner that has waited
        longest in it, by the groups' rule (since that owner's last call was taken, or since its oldest waiting
        call arrived), each owner's calls oldest first, until the next call would pass ``max_batch_sequences``.

        So owners sharing weights and settings (two tenants sampling the base model alike) take turns call by
        call, and one owner's many waiting calls hold another's for at most one call of each; calls without an
        owner are one owner's, oldest first."""
        queues: dict[str | None, list[_Waiting]] = {}
        for waiting in group:
            queues.setdefault(waiting.owner, []).append(waiting)
        turns = {owner: self._owner_served.get((key, owner), queue[0].arrival) for owner, queue in queues.items()}
        batch: list[_Waiting] = []
        sequences = 0
        while turns:
            owner = min(turns, key=turns.__getitem__)  # every round is a new number: no ties
            waiting = queues[owner][0]
            if batch and sequences + waiting.params.num_samples > self.max_batch_sequences:
                break
            batch.append(waiting)
            sequences += waiting.params.num_samples
            del queues[owner][0]
            turns[owner] = self._owner_served[(key, owner)] = next(self._rounds)
            if not queues[owner]:
                del turns[owner]
        return batch

    def _sample_blocking(self, batch: list[_Waiting]) -> list[SampleResult]:
        from producers.samplers.hf_sampler import Continuation

        first, adapter = batch[0], batch[0].adapter
        try:
            done = self.sampler.continue_prompts(
                [Continuation(w.prompt, w.budget, w.params.seeds(), w.params.prompt_logprobs,
                              w.params.topk_prompt_logprobs, w.params.topk_sample_logprobs) for w in batch],
                adapter, first.params.temperature, first.params.top_p,
                stop_ids=frozenset(self.stop_ids(first.params)), top_k=first.params.top_k,
            )
        finally:
            if adapter is not None and self._serving.get((adapter.run, adapter.version)) is not adapter:
                self.sampler.unload_adapter(adapter)  # unloaded while these calls waited: they loaded it again
        return [SampleResult(one.samples, one.prompt_logprobs, one.topk_prompt_logprobs) for one in done]

    def _own(self, handle: AdapterHandle) -> AdapterHandle:
        """The sampler's handle of ``handle``'s (run, version): named by this engine; refused with other weights."""
        key = (handle.run, handle.version)
        known = self._serving.get(key)
        self.refuse_other_weights(known, handle)
        if known is None:
            number = next(self._names)
            known = self._serving[key] = replace(handle, lora_int_id=number, name=f"lora{number}")
        return known

    async def load_adapter(self, handle: AdapterHandle) -> None:
        """Load ``handle`` under its own name; when the sampler refuses it, its (run, version) stays free for other
        weights (concurrent loads of it share the entry, and fail alike)."""
        handle.check_folder()
        key = (handle.run, handle.version)
        new = key not in self._serving
        own = self._own(handle)
        try:
            await asyncio.to_thread(self.sampler.load_adapter, own)
        except Exception:  # not on cancellation: the load goes on in its thread, and the entry names it
            if new and self._serving.get(key) is own:
                del self._serving[key]
            raise

    async def unload_adapter(self, handle: AdapterHandle) -> None:
        """Free ``handle``'s (run, version) (a no-op when it is not loaded); a request still running with it loads
        it again under its own name, and the (run, version) may take other weights from now on."""
        own = self._serving.pop((handle.run, handle.version), None)
        if own is not None:
            await asyncio.to_thread(self.sampler.unload_adapter, own)

    def close(self) -> None:
        """Stop the batching task (a batch already decoding in its thread is dropped) and release the model."""
        if self._worker is not None and not self._worker.done():
            self._worker.cancel()
        self.sampler.close()
