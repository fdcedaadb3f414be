"""vLLM's request outputs as the parts of rlpipe's ``SampleResult``: sampled tokens, their logprobs, prompt logprobs and top-k rows.

vLLM gives, at each position, a dict token -> ``Logprob``: the top K (``logprobs``/``prompt_logprobs`` = K) and the
chosen token (the prompt's or the sampled one) besides, so at most K + 1 entries.  A call's top-k rows are up to
``MAX_TOPK_SAMPLE_CELLS`` entries, so ``VLLMEngine.sample`` runs ``sample_parts`` in a worker thread: on the event
loop, every other call on the engine would stand still meanwhile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from producers.samplers.base import SampleOutput, TopK

if TYPE_CHECKING:  # engine.py imports this module
    from producers.samplers.engine import SampleParams


def sample_parts(outputs: Sequence[Any], prompt_token_ids: list[int], params: SampleParams, stops: tuple[int, ...]
                 ) -> tuple[list[SampleOutput], list[float | None] | None, list[TopK | None] | None]:
    """One ``RequestOutput`` per sample (the first scored the prompt, when asked) -> the call's samples, prompt
    logprobs and prompt top-k rows (``SampleResult``'s fields, in its order)."""
    prompt_logprobs = _prompt_logprobs(outputs[0], prompt_token_ids) if params.prompt_logprobs else None
    topk_prompt = (_topk_prompt_logprobs(outputs[0], params.topk_prompt_logprobs)
                   if params.topk_prompt_logprobs else None)
    return [_to_sample_output(out, stops, params.topk_sample_logprobs) for out in outputs], prompt_logprobs, topk_prompt


def top_rows(positions: Sequence[dict[int, Any]], k: int) -> list[TopK]:
    """The ``k`` most likely tokens of each of vLLM's ``positions``, most likely first (ties in vLLM's rank order).

    Tokens a top-k or top-p cut removed (logprob -inf) are left out, as they cannot be drawn.  A position holds at
    most k + 1 entries, so one sort of each is cheap; the time is in reading a million Python objects at the cell
    cap (about 0.5 s), whichever way they are ranked (a heap or one array sort of all entries is no faster)."""
    return [[(token, entry.logprob) for token, entry in sorted(position.items(), key=_likeliest_first)[:k]
             if entry.logprob > -math.inf] for position in positions]


def _likeliest_first(item: tuple[int, Any]) -> tuple[float, int]:
    return -item[1].logprob, item[1].rank or 0


def _to_sample_output(request_output: Any, stops: tuple[int, ...], topk: int = 0) -> SampleOutput:
    """vLLM's RequestOutput -> SampleOutput: the sampled ids (stop token kept), each one's logprob, and with ``topk``
    the ``topk`` most likely tokens at each position."""
    completion = request_output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    logprobs = [float(position[token].logprob) for token, position in zip(token_ids, completion.logprobs, strict=True)]
    reason = "stop" if token_ids and token_ids[-1] in stops else (completion.finish_reason or "length")
    rows = top_rows(completion.logprobs, topk) if topk else None
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, finish_reason=reason, topk_logprobs=rows)


def _topk_prompt_logprobs(request_output: Any, k: int) -> list[TopK | None]:
    """The ``k`` most likely tokens at each prompt position (None at position 0, which nothing predicts)."""
    positions = request_output.prompt_logprobs or []
    return [None, *top_rows(positions[1:], k)]


def _prompt_logprobs(request_output: Any, prompt_token_ids: list[int]) -> list[float | None]:
    """One logprob per prompt token (None at position 0, which nothing predicts)."""
    positions = request_output.prompt_logprobs or []
    out: list[float | None] = [None]
    for token, position in zip(prompt_token_ids[1:], positions[1:], strict=True):
        out.append(float(position[token].logprob))
    return out
