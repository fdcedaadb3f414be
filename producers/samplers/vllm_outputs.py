"""vLLM's request outputs as the parts of rlpipe's ``SampleResult``: sampled tokens, their logprobs, prompt logprobs and top-k rows.

vLLM gives, at each position, a dict token -> ``Logprob``: the top K (``logprobs``/``prompt_logprobs`` = K) and the
chosen token (the prompt's or the sampled one) besides, so at most K + 1 entries.  A call's top-k rows are up to
``MAX_TOPK_SAMPLE_CELLS`` entries, so ``VLLMEngine.sample`` runs ``sample_parts`` in a worker thread: on the event
loop, every other call on the engine would stand still meanwhile.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from producers.samplers.base import SampleOutput
from producers.samplers.topk import TopKRows

if TYPE_CHECKING:  # engine.py imports this module
    from producers.samplers.engine import SampleParams


def sample_parts(outputs: Sequence[Any], prompt_token_ids: list[int], params: SampleParams, stops: tuple[int, ...]
                 ) -> tuple[list[SampleOutput], list[float | None] | None, TopKRows | None]:
    """One ``RequestOutput`` per sample (the first scored the prompt, when asked) -> the call's samples, prompt
    logprobs and prompt top-k rows (``SampleResult``'s fields, in its order).  The samples' top-k rows are ranked
    together, in one ``top_rows``, and each sample gets its slice of them."""
    prompt_logprobs = _prompt_logprobs(outputs[0], prompt_token_ids) if params.prompt_logprobs else None
    topk_prompt = (_topk_prompt_logprobs(outputs[0], params.topk_prompt_logprobs)
                   if params.topk_prompt_logprobs else None)
    completions = [out.outputs[0] for out in outputs]
    rows: list[TopKRows | None] = [None] * len(completions)
    if params.topk_sample_logprobs:
        every = top_rows(list(itertools.chain.from_iterable(c.logprobs for c in completions)),
                         params.topk_sample_logprobs)
        ends = np.cumsum([len(c.logprobs) for c in completions]).tolist()
        rows = [every[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]
    return ([_to_sample_output(c, stops, r) for c, r in zip(completions, rows, strict=True)], prompt_logprobs,
            topk_prompt)


def top_rows(positions: Sequence[dict[int, Any]], k: int) -> TopKRows:
    """The ``k`` most likely tokens of each of vLLM's ``positions``, most likely first (ties in vLLM's rank order).

    Tokens a top-k or top-p cut removed (logprob -inf) are left out, as they cannot be drawn.  Every entry is read
    once into flat arrays (entry m of M, position after position), placed in a positions x (at most k + 1) matrix,
    and each row ranked by one sort of the matrix; the time is in reading the ``Logprob`` objects (a million at
    the cell cap)."""
    counts_N = np.fromiter(map(len, positions), np.int64, len(positions))
    total = int(counts_N.sum())
    entries = list(itertools.chain.from_iterable(position.values() for position in positions))
    row_M = np.repeat(np.arange(len(positions)), counts_N)
    column_M = np.arange(total) - np.repeat(np.cumsum(counts_N) - counts_N, counts_N)  # place within its position
    shape = (len(positions), max(int(counts_N.max(initial=0)), k))
    ids_NJ, ranks_NJ, logprobs_NJ = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.full(shape, -np.inf)
    ids_NJ[row_M, column_M] = np.fromiter(itertools.chain.from_iterable(positions), np.int64, total)
    ranks_NJ[row_M, column_M] = np.fromiter((entry.rank or 0 for entry in entries), np.int64, total)
    logprobs_NJ[row_M, column_M] = np.fromiter(map(_LOGPROB, entries), np.float64, total)
    order_NK = np.lexsort((ranks_NJ, -logprobs_NJ))[:, :k]  # the empty cells (-inf) sort last, as cut tokens do
    return TopKRows.from_ranked(np.take_along_axis(ids_NJ, order_NK, 1), np.take_along_axis(logprobs_NJ, order_NK, 1))


_LOGPROB = operator.attrgetter("logprob")


def _to_sample_output(completion: Any, stops: tuple[int, ...], rows: TopKRows | None) -> SampleOutput:
    """vLLM's CompletionOutput -> SampleOutput: the sampled ids (stop token kept), each one's logprob, and the top-k
    ``rows`` of its positions (None: not asked for)."""
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = [float(position[token].logprob) for token, position in zip(token_ids, completion.logprobs, strict=True)]
    reason = "stop" if token_ids and token_ids[-1] in stops else (completion.finish_reason or "length")
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, topk_logprobs=rows)


def _topk_prompt_logprobs(request_output: Any, k: int) -> TopKRows:
    """The ``k`` most likely tokens at each prompt position (None at position 0, which nothing predicts)."""
    positions = request_output.prompt_logprobs or []
    return top_rows([{}, *positions[1:]], k)


def _prompt_logprobs(request_output: Any, prompt_token_ids: list[int]) -> list[float | None]:
    """One logprob per prompt token (None at position 0, which nothing predicts)."""
    positions = request_output.prompt_logprobs or []
    out: list[float | None] = [None]
    for token, position in zip(prompt_token_ids[1:], positions[1:], strict=True):
        out.append(float(position[token].logprob))
    return out
