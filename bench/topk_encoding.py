"""Top-k logprobs from vLLM's outputs to the wire: the steps a sample call's top-k rows take after the model.

- **vLLM builds**: vLLM's output processor turns each step's logprob lists into the request's positions, in the
  engine's process on its event loop: a dict token -> ``Logprob`` per position (the chosen token and the top K),
  or with ``flat_logprobs=True`` one ``FlatLogprobs`` of a few flat lists (timed with vLLM's own
  ``append_logprobs_for_next_position`` on the lists its engine core hands over);
- **convert**: the ``RequestOutput``s (one per sample) -> the call's samples and prompt top-k rows
  (``producers.samplers.vllm_outputs.sample_parts``, in a worker thread);
- **encode**: those -> the protobuf ``SampleResponse`` the SDK decodes (``producers.api_encoding``).

Three paths on the same synthetic outputs, alternating repeat by repeat (the order rotating), so a shared
machine's load falls on all alike:

- **tuples**: vLLM's dicts, the rows as lists of (token, logprob) tuples, as rlpipe had them before ``TopKRows``:
  ``tuple_rows_*`` below are a copy of that code (vllm_outputs.py's ``top_rows`` and api_encoding.py's
  ``encode_topk`` as they were), kept here only to be timed against;
- **arrays (dicts)**: vLLM's dicts, the rows as ``TopKRows`` matrices from the conversion to the encoder;
- **arrays (flat)**: the same from ``FlatLogprobs``, as ``VLLMEngine`` asks vLLM for them.

All three must put the same bytes on the wire; the bench checks that before it times anything.

    python bench/topk_encoding.py                       # 1 x 4096 prompt, 64 x 256 samples, 1024 x 64 (the cap)
    python bench/topk_encoding.py --repeats 3 --json-out topk.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int

# (name, samples, tokens per sample, prompt tokens, K of the samples, K of the prompt)
CASES = [
    ("prompt 1 x 4096, K=20", 1, 1, 4096, 0, 20),
    ("samples 64 x 256, K=20", 64, 256, 16, 20, 0),
    ("samples 1024 x 64, K=16 (the cap)", 1024, 64, 16, 16, 0),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats of each path per case")
    parser.add_argument("--json-out", default=None, help="also write the figures here as JSON")
    return parser.parse_args(argv)


def engine_rows(n: int, k: int, rng: np.random.Generator) -> list[tuple[list[int], list[float], int]]:
    """``n`` positions as vLLM's engine core hands them over: the chosen token and its logprob first, then the top
    ``k`` in rank order, and the chosen token's rank; distinct ids below 150,000, float32 logprobs; the chosen token
    is among the top k at about half the positions (then vLLM's dict holds k entries, else k + 1)."""
    ids_NJ = rng.integers(0, 7_000, (n, 1)) + 7_001 * rng.permuted(np.tile(np.arange(k + 1), (n, 1)), axis=1)
    values_NJ = -np.sort(rng.exponential(2.0, (n, k + 1)).astype(np.float32), axis=1)
    chosen_N = np.where(rng.random(n) < 0.5, rng.integers(0, max(k, 1), n), k)
    return [([ids[chosen], *ids[:k]], [values[chosen], *values[:k]], chosen + 1)
            for ids, values, chosen in zip(ids_NJ.tolist(), values_NJ.tolist(), chosen_N.tolist(), strict=True)]


def positions_of(rows: list[tuple[list[int], list[float], int]], k: int, flat: bool, prompt: bool = False) -> Any:
    """What vLLM's output processor makes of ``rows`` (a prompt's start with position 0, which has none)."""
    from vllm.logprobs import append_logprobs_for_next_position, create_prompt_logprobs, create_sample_logprobs

    positions = (create_prompt_logprobs if prompt else create_sample_logprobs)(flat)
    for ids, values, rank in rows:
        append_logprobs_for_next_position(positions, ids, values, itertools.repeat(None), rank, k)
    return positions


def request_outputs(case: Case, flat: bool) -> list[Any]:
    """One ``RequestOutput``-shaped object per sample; the first scored the prompt when ``case.k_prompt`` >= 1."""
    outputs = []
    for j, rows in enumerate(case.sample_rows):
        completion = SimpleNamespace(token_ids=[ids[0] for ids, _, _ in rows], finish_reason="length",
                                     logprobs=positions_of(rows, case.k_sample, flat))
        prompt = (positions_of(case.prompt_rows, case.k_prompt, flat, prompt=True)
                  if j == 0 and case.k_prompt else None)
        outputs.append(SimpleNamespace(outputs=[completion], prompt_logprobs=prompt))
    return outputs


@dataclass
class Case:
    """One call's engine rows: ``samples`` x ``tokens`` sampled positions, ``prompt`` prompt tokens."""

    name: str
    samples: int
    tokens: int
    prompt: int
    k_sample: int
    k_prompt: int

    def __post_init__(self) -> None:
        rng = np.random.default_rng(0)
        self.sample_rows = [engine_rows(self.tokens, self.k_sample, rng) for _ in range(self.samples)]
        self.prompt_rows = engine_rows(self.prompt - 1, self.k_prompt, rng)
        self.prompt_ids = [0] + [ids[0] for ids, _, _ in self.prompt_rows]


# ---- the tuples path, as it was before TopKRows (copied here to be timed against; not rlpipe's code) ----

def tuple_rows_top(positions: list[dict[int, Any]], k: int) -> list[list[tuple[int, float]]]:
    return [[(token, entry.logprob) for token, entry in sorted(position.items(), key=_likeliest_first)[:k]
             if entry.logprob > -math.inf] for position in positions]


def _likeliest_first(item: tuple[int, Any]) -> tuple[float, int]:
    return -item[1].logprob, item[1].rank or 0


def tuple_rows_convert(outputs: list[Any], k_sample: int, k_prompt: int) -> tuple[list[Any], list[Any] | None]:
    """(token ids, logprobs, rows) of every sample, and the prompt's rows (None at position 0)."""
    samples = []
    for output in outputs:
        completion = output.outputs[0]
        token_ids = [int(t) for t in completion.token_ids]
        logprobs = [float(p[t].logprob) for t, p in zip(token_ids, completion.logprobs, strict=True)]
        samples.append((token_ids, logprobs, tuple_rows_top(completion.logprobs, k_sample) if k_sample else None))
    prompt_rows = [None, *tuple_rows_top(outputs[0].prompt_logprobs[1:], k_prompt)] if k_prompt else None
    return samples, prompt_rows


def tuple_rows_encode_topk(rows: list[Any], k: int, into: Any) -> None:
    from tinker.types.topk_logprobs import MASK_LOGPROB

    lengths_N = np.fromiter((0 if row is None else len(row) for row in rows), np.int64, len(rows))
    pairs = np.fromiter(itertools.chain.from_iterable(itertools.chain.from_iterable(row for row in rows if row)),
                        np.float64, 2 * int(lengths_N.sum()))
    row_M = np.repeat(np.arange(len(rows)), lengths_N)
    column_M = np.arange(row_M.size) - np.repeat(np.cumsum(lengths_N) - lengths_N, lengths_N)
    ids_NK = np.zeros((len(rows), k), np.int32)
    logprobs_NK = np.full((len(rows), k), MASK_LOGPROB, np.float32)
    ids_NK[row_M, column_M] = pairs[0::2]
    logprobs_NK[row_M, column_M] = pairs[1::2]
    into.token_ids, into.logprobs, into.k, into.length = ids_NK.tobytes(), logprobs_NK.tobytes(), k, len(rows)


def tuple_rows_encode(samples: list[Any], prompt_rows: list[Any] | None, k_sample: int, k_prompt: int) -> bytes:
    from tinker.proto import tinker_public_pb2 as public_pb

    msg = public_pb.SampleResponse()
    for token_ids, logprobs, rows in samples:
        sequence = msg.sequences.add(stop_reason=public_pb.STOP_REASON_LENGTH,
                                     tokens=np.asarray(token_ids, np.int32).tobytes(),
                                     logprobs=np.asarray(logprobs, np.float32).tobytes())
        if k_sample and rows is not None:
            tuple_rows_encode_topk(rows, k_sample, sequence.topk_sampled_logprobs)
    if k_prompt and prompt_rows is not None:
        tuple_rows_encode_topk(prompt_rows, k_prompt, msg.topk_prompt_logprobs)
    return msg.SerializeToString()


# ---- the paths, timed ----

ARMS = ("tuples", "arrays (dicts)", "arrays (flat)")
STEPS = ("vLLM builds", "convert", "encode")


def steps(case: Case) -> dict[str, tuple[Callable[[], Any], ...]]:
    """Each path's three steps as thunks; each step reads what the step before it made last."""
    from producers.api_encoding import encode_sample_response
    from producers.samplers.engine import SampleParams, SampleResult
    from producers.samplers.vllm_outputs import sample_parts

    params = SampleParams(1, topk_sample_logprobs=case.k_sample, topk_prompt_logprobs=case.k_prompt)
    made: dict[str, Any] = {}

    def build(arm: str, flat: bool) -> Callable[[], None]:
        return lambda: made.__setitem__((arm, "outputs"), request_outputs(case, flat))

    def tuples_convert() -> None:
        made["tuples", "rows"] = tuple_rows_convert(made["tuples", "outputs"], case.k_sample, case.k_prompt)

    def arrays_convert(arm: str) -> Callable[[], None]:
        return lambda: made.__setitem__((arm, "rows"), SampleResult(*sample_parts(
            made[arm, "outputs"], case.prompt_ids, params, stops=())))

    def arrays_encode(arm: str) -> Callable[[], bytes]:
        return lambda: encode_sample_response(made[arm, "rows"], case.k_prompt, case.k_sample)

    return {
        "tuples": (build("tuples", False), tuples_convert,
                   lambda: tuple_rows_encode(*made["tuples", "rows"], case.k_sample, case.k_prompt)),
        "arrays (dicts)": (build("arrays (dicts)", False), arrays_convert("arrays (dicts)"),
                           arrays_encode("arrays (dicts)")),
        "arrays (flat)": (build("arrays (flat)", True), arrays_convert("arrays (flat)"),
                          arrays_encode("arrays (flat)")),
    }


def run_case(case: Case, repeats: int) -> dict[str, Any]:
    arms = steps(case)
    wire = {}
    for arm, thunks in arms.items():  # once untimed: warm, and all must agree byte for byte
        wire[arm] = [thunk() for thunk in thunks][-1]
    if len(set(wire.values())) != 1:
        raise SystemExit(f"{case.name}: the paths put different bytes on the wire; an arrays path is wrong")
    times: dict[str, dict[str, list[float]]] = {arm: {step: [] for step in STEPS} for arm in arms}
    for repeat in range(repeats):
        for arm in ARMS[repeat % 3:] + ARMS[:repeat % 3]:
            for step, thunk in zip(STEPS, arms[arm], strict=True):
                started = time.perf_counter()
                thunk()
                times[arm][step].append(time.perf_counter() - started)
    cells = case.samples * case.tokens * case.k_sample + (case.prompt - 1) * case.k_prompt
    return {"case": case.name, "cells": cells, "wire_bytes": len(wire["tuples"]),
            "median_s": {arm: {step: statistics.median(t) for step, t in by_step.items()}
                         for arm, by_step in times.items()},
            "times_s": times}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    results = []
    with LoadAverage() as load:
        for case in CASES:
            results.append(run_case(Case(*case), repeats=args.repeats))
    print(f"seconds, median of {args.repeats} repeats, {load}")
    print("| case | cells | path | vLLM builds | convert | encode | convert + encode |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
    for r in results:
        for arm in ARMS:
            t = r["median_s"][arm]
            print(f"| {r['case']} | {r['cells']:,} | {arm} | {t['vLLM builds']:.3f} | {t['convert']:.3f} "
                  f"| {t['encode']:.3f} | {t['convert'] + t['encode']:.3f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"load": str(load), "results": results}, indent=1))


if __name__ == "__main__":
    main()
