"""vLLM's request outputs as the parts of rlpipe's ``SampleResult``: sampled tokens, their logprobs, prompt logprobs and top-k rows.

vLLM gives, at each position, the top K (``logprobs``/``prompt_logprobs`` = K) and the chosen token (the prompt's or
the sampled one) besides: as a dict token -> ``Logprob`` per position (at most K + 1 entries), or, as
``VLLMEngine`` asks for them (``flat_logprobs=True``), as one ``FlatLogprobs`` of flat lists (the chosen token
first, then the top K, K + 1 entries) that its output processor builds without an object per entry.  Both are
read here, one layout per call (a mix is refused).  A call's top-k rows are up to ``MAX_TOPK_SAMPLE_CELLS``
entries, so ``VLLMEngine.sample`` runs ``sample_parts`` in a worker thread: on the event loop, every other call on
the engine would stand still meanwhile.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from producers.samplers.base import SampleOutput
from producers.samplers.topk import TopKRows, cells

if TYPE_CHECKING:  # engine.py imports this module
    from producers.samplers.engine import SampleParams


def sample_parts(outputs: Sequence[Any], prompt_token_ids: list[int], params: SampleParams, stops: tuple[int, ...]
                 ) -> tuple[list[SampleOutput], list[float | None] | None, TopKRows | None]:
    """One ``RequestOutput`` per sample (the first scored the prompt, when asked) -> the call's samples, prompt
    logprobs and prompt top-k rows (``SampleResult``'s fields, in its order).  The samples' top-k rows are ranked
    together, in one ``top_rows``."""
    prompt_logprobs = _prompt_logprobs(outputs[0], prompt_token_ids) if params.prompt_logprobs else None
    topk_prompt = (_topk_prompt_logprobs(outputs[0], params.topk_prompt_logprobs)
                   if params.topk_prompt_logprobs else None)
    completions = [out.outputs[0] for out in outputs]
    rows: list[TopKRows | None] = [None] * len(completions)
    if params.topk_sample_logprobs:
        rows = list(top_rows([c.logprobs for c in completions], params.topk_sample_logprobs))
    return ([_to_sample_output(c, stops, r) for c, r in zip(completions, rows, strict=True)], prompt_logprobs,
            topk_prompt)


def top_rows(parts: Sequence[Sequence[Any]], k: int) -> list[TopKRows]:
    """The ``k`` most likely tokens at each position of each of ``parts`` (a sample's positions or a prompt's, as
    vLLM gives them), most likely first (ties in vLLM's rank order), one ``TopKRows`` per part.

    Tokens a top-k or top-p cut removed (logprob -inf) are left out, as they cannot be drawn.  Every entry is read
    once into flat arrays (entry m of M, position after position), placed in a positions x (at most k + 1) matrix,
    and each row ranked by one sort of that matrix.  From dicts the time is in reading the ``Logprob`` objects
    (a million at the cell cap); from ``FlatLogprobs`` it is a few copies of its lists."""
    counts_N, ids_M, ranks_M, logprobs_M = _entries(parts)
    row_M, column_M = cells(counts_N)  # each entry's place: its position, then its column there
    shape = (counts_N.size, max(int(counts_N.max(initial=0)), k))
    ids_NJ, ranks_NJ, logprobs_NJ = np.zeros(shape, np.int64), np.zeros(shape, np.int64), np.full(shape, -np.inf)
    ids_NJ[row_M, column_M], ranks_NJ[row_M, column_M], logprobs_NJ[row_M, column_M] = ids_M, ranks_M, logprobs_M
    order_NK = np.lexsort((ranks_NJ, -logprobs_NJ))[:, :k]  # the empty cells (-inf) sort last, as cut tokens do
    every = TopKRows.from_ranked(np.take_along_axis(ids_NJ, order_NK, 1), np.take_along_axis(logprobs_NJ, order_NK, 1))
    ends = np.cumsum([len(part) for part in parts]).tolist()
    return [every[start:end] for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def _entries(parts: Sequence[Sequence[Any]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The entries to rank at each position of ``parts``, position after position: each position's count, then
    every entry's token, rank and logprob."""
    flat = [_is_flat(part) for part in parts]
    if all(flat):
        return _flat_entries(parts)
    if not any(flat):  # lists of dicts: read as one run of positions
        return _dict_entries(list(itertools.chain.from_iterable(parts)))
    raise ValueError(f"{sum(flat)} of {len(parts)} parts are vLLM's FlatLogprobs and the rest lists of dicts; "
                     "give one engine's outputs, all read with the same flat_logprobs setting")


def _dict_entries(positions: Sequence[dict[int, Any] | None]) -> tuple[np.ndarray, np.ndarray, np.ndarray,
                                                                        np.ndarray]:
    """Positions as dicts token -> ``Logprob`` (None: no entry), every entry read once."""
    counts_N = np.fromiter((0 if position is None else len(position) for position in positions), np.int64,
                           len(positions))
    total = int(counts_N.sum())
    entries = list(itertools.chain.from_iterable(position.values() for position in positions if position))
    ids_M = np.fromiter(itertools.chain.from_iterable(position for position in positions if position), np.int64,
                        total)
    ranks_M = np.fromiter((entry.rank or 0 for entry in entries), np.int64, total)
    return counts_N, ids_M, ranks_M, np.fromiter(map(_LOGPROB, entries), np.float64, total)


def _flat_entries(parts: Sequence[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """vLLM's ``FlatLogprobs``, one per part, their lists read whole.  Each position's entries are the chosen token
    (its ``ranks`` entry: its rank in the vocabulary), then the top K (ranks 1..K), no duplicate removed: the chosen
    entry (twice where it is among the top K) is left out, and the top K alone are ranked, by vLLM's ranks."""
    sizes = [len(part.token_ids) for part in parts]  # entries; each part's indices count from 0
    offsets_N = np.repeat(np.cumsum(sizes) - sizes, [len(part) for part in parts])
    starts_N = np.fromiter(itertools.chain.from_iterable(part.start_indices for part in parts), np.int64,
                           offsets_N.size) + offsets_N
    ends_N = np.fromiter(itertools.chain.from_iterable(part.end_indices for part in parts), np.int64,
                         offsets_N.size) + offsets_N
    keep_M = np.ones(sum(sizes), bool)
    keep_M[starts_N[ends_N > starts_N]] = False
    ids_M = np.fromiter(itertools.chain.from_iterable(part.token_ids for part in parts), np.int64, keep_M.size)
    ranks_M = np.fromiter(itertools.chain.from_iterable(part.ranks for part in parts), np.int64, keep_M.size)
    logprobs_M = np.fromiter(itertools.chain.from_iterable(part.logprobs for part in parts), np.float64, keep_M.size)
    counts_N = np.maximum(ends_N - starts_N - 1, 0)
    return counts_N, ids_M[keep_M], ranks_M[keep_M], logprobs_M[keep_M]


def _is_flat(positions: Any) -> bool:
    """Whether ``positions`` are vLLM's ``FlatLogprobs`` (``flat_logprobs=True``) rather than a list of dicts."""
    return hasattr(positions, "start_indices")


def _chosen_logprobs(positions: Any, tokens: list[int]) -> list[float]:
    """The logprob of each position's chosen token (``tokens``: the sampled or the prompt's)."""
    if not _is_flat(positions):
        return [float(position[token].logprob) for token, position in zip(tokens, positions, strict=True)]
    if len(positions) != len(tokens):
        raise ValueError(f"{len(tokens)} tokens but {len(positions)} positions of logprobs")
    chosen = positions.start_indices  # each position's first entry (a FlatLogprobs slice counts from 0 again)
    if [positions.token_ids[m] for m in chosen] != tokens:
        raise RuntimeError("vLLM's flat logprobs do not start each position with its chosen token; rlpipe reads "
                           "them as vLLM 0.32 lays them out (pin that vLLM, or update vllm_outputs.py)")
    return [float(positions.logprobs[m]) for m in chosen]


_LOGPROB = operator.attrgetter("logprob")


def _to_sample_output(completion: Any, stops: tuple[int, ...], rows: TopKRows | None) -> SampleOutput:
    """vLLM's CompletionOutput -> SampleOutput: the sampled ids (stop token kept), each one's logprob, and the top-k
    ``rows`` of its positions (None: not asked for)."""
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = _chosen_logprobs(completion.logprobs, token_ids)
    reason = "stop" if token_ids and token_ids[-1] in stops else (completion.finish_reason or "length")
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, topk_logprobs=rows)


def _topk_prompt_logprobs(request_output: Any, k: int) -> TopKRows:
    """The ``k`` most likely tokens at each prompt position (None at position 0, which nothing predicts)."""
    rows = top_rows([request_output.prompt_logprobs or [None]], k)[0]
    return rows.only_last(len(rows) - 1)


def _prompt_logprobs(request_output: Any, prompt_token_ids: list[int]) -> list[float | None]:
    """One logprob per prompt token (None at position 0, which nothing predicts)."""
    positions = request_output.prompt_logprobs or [None]
    return [None, *_chosen_logprobs(positions[1:], prompt_token_ids[1:])]
