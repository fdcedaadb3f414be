"""The sampler's answers on the wire: a sample call's result as the protobuf ``SampleResponse`` the Tinker SDK decodes.

Pure transforms of a ``SampleResult``: samples cut at the first stop string (``cut_at_stop_strings``), prompt
logprobs blanked before the last N (``only_last``), and the response with its top-k rows as the SDK's dense
``TopkLogprobs`` matrices (``encode_topk``, ``encode_sample_response``: the engines' ``TopKRows`` already hold
them).  Encoding a call's answer copies up to ``MAX_TOPK_SAMPLE_CELLS`` top-k entries, so the sampler runs it off
the event loop its calls share.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import numpy as np
from tinker.proto import tinker_public_pb2 as public_pb
from tinker.types.topk_logprobs import MASK_LOGPROB

from producers.samplers.base import SampleOutput
from producers.samplers.engine import SampleResult
from producers.samplers.topk import TopKRows


def cut_at_stop_strings(sample: SampleOutput, strings: list[str], decode: Callable[[list[int]], str]) -> SampleOutput:
    """``sample`` ended with the first token that completes a stop string (kept, logprobs aligned), if any.

    A prefix that holds a stop string is held by every longer prefix, so the first such prefix is found by
    bisection: about log2(n) decodes of a sample of n tokens (this runs on the event loop every call shares, hence
    the limits on stop strings of ``check_sample_request``), and one decode when no stop string occurs."""
    if not strings:
        return sample

    def stops(end: int) -> bool:
        text = decode(sample.token_ids[:end])
        return any(stop in text for stop in strings)

    n = len(sample.token_ids)
    if not n or not stops(n):
        return sample
    end = 1 + bisect.bisect_left(range(1, n + 1), True, key=stops)  # the shortest prefix that holds one
    rows = None if sample.topk_logprobs is None else sample.topk_logprobs[:end]
    return SampleOutput(token_ids=sample.token_ids[:end], logprobs=sample.logprobs[:end], finish_reason="stop",
                        topk_logprobs=rows)


def only_last(values: list[Any] | TopKRows | None, last_n: int | None) -> list[Any] | TopKRows | None:
    """``values`` (one per prompt token) with all but the last ``last_n`` None (``prompt_logprobs_last_n``)."""
    if values is None or last_n is None:
        return values
    if isinstance(values, TopKRows):
        return values.only_last(last_n)
    return [None] * (len(values) - last_n) + list(values[-last_n:])


def encode_topk(rows: TopKRows, k: int, into: Any) -> None:
    """Top-k rows as the SDK's ``TopkLogprobs``: N x ``k`` int32 ids and float32 logprobs, row-major, most likely
    first; the cells a row leaves (None: all of them) hold 0 / ``MASK_LOGPROB``, which the SDK's decoder drops.

    ``TopKRows`` already is that layout (topk.py), so this is two copies of a call's up to
    ``MAX_TOPK_SAMPLE_CELLS`` cells; rows narrower than ``k`` are widened with missing cells."""
    if rows.k > k:
        lengths_N = rows.lengths()
        too_long = np.flatnonzero(lengths_N > k)
        if too_long.size:
            raise ValueError(f"a top-k row of {lengths_N[too_long[0]]} entries for k={k}; an engine gives at most k")
    ids_NK, logprobs_NK = rows.ids_NK[:, :k], rows.logprobs_NK[:, :k]
    if rows.k < k:
        ids_NK = np.pad(ids_NK, ((0, 0), (0, k - rows.k)))
        logprobs_NK = np.pad(logprobs_NK, ((0, 0), (0, k - rows.k)), constant_values=MASK_LOGPROB)
    into.token_ids, into.logprobs, into.k, into.length = ids_NK.tobytes(), logprobs_NK.tobytes(), k, len(rows)


def encode_sample_response(result: SampleResult, topk_prompt: int = 0, topk_sample: int = 0) -> bytes:
    """The protobuf ``SampleResponse`` the SDK decodes (int32 tokens, float32 logprobs, NaN prompt position 0), with
    the top-k logprobs of the prompt (``topk_prompt`` >= 1) and of each sample (``topk_sample`` >= 1) the call
    asked for, ``k`` columns wide."""
    msg = public_pb.SampleResponse()
    for sample in result.sequences:
        sequence = msg.sequences.add(
            stop_reason=public_pb.STOP_REASON_STOP if sample.finish_reason == "stop" else public_pb.STOP_REASON_LENGTH,
            tokens=np.asarray(sample.token_ids, np.int32).tobytes(),
            logprobs=np.asarray(sample.logprobs, np.float32).tobytes(),
        )
        if topk_sample and sample.topk_logprobs is not None:
            encode_topk(sample.topk_logprobs, topk_sample, sequence.topk_sampled_logprobs)
    if result.prompt_logprobs is not None:
        values = [np.nan if value is None else value for value in result.prompt_logprobs]
        msg.prompt_logprobs = np.asarray(values, np.float32).tobytes()
    if topk_prompt and result.topk_prompt_logprobs is not None:
        encode_topk(result.topk_prompt_logprobs, topk_prompt, msg.topk_prompt_logprobs)
    return msg.SerializeToString()
