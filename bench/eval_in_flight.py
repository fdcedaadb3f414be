"""Held-out evaluation with 8 episodes in flight against all of them at once, side by side.

``rlpipe eval`` plays its held-out episodes through the producer's rollout worker:
one batched generate call per turn for every episode in flight.  This bench plays
the same held-out seeds with one adapter version twice per round on one sampler
(the engine starts once): ``--in-flight 8`` (how evaluation ran before) and
``--in-flight 32`` (the default now), alternating the order between rounds, and
prints each wall time and the ratio.  Returns differ only by the sampling draws.

    python bench/eval_in_flight.py --run demo-20261202-091512 --version latest
"""

from __future__ import annotations

import argparse
import os
import time

from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import open_store
from producers.eval_cli import resolve_version, stored_run_config
from producers.evaluation import evaluate_version
from producers.samplers import sampler_for_run
from producers.tiny_model import resolve_model
from schemas.config import StoreConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run with published adapters (e.g. a demo run)")
    parser.add_argument("--version", default="latest")
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--compare", type=int, nargs=2, default=[8, 32], metavar=("LOW", "HIGH"))
    args = parser.parse_args()
    config = stored_run_config(args.run, StoreConfig(), [])
    store = open_store(config.store)
    version = resolve_version(AdapterRegistry(store, args.run), args.version)
    model_path = resolve_model(config.model)
    sampler = sampler_for_run(config, model_path)
    seconds: dict[int, list[float]] = {n: [] for n in args.compare}
    try:
        for r in range(args.rounds):
            for n in args.compare if r % 2 == 0 else reversed(args.compare):
                started = time.monotonic()
                result = evaluate_version(config, store, model_path, version, args.episodes, sampler=sampler,
                                          in_flight=n)
                seconds[n].append(time.monotonic() - started)
                print(f"round {r + 1}: {n:3d} in flight: {seconds[n][-1]:6.1f} s, "
                      f"return {result.mean_return:.1f} ± {result.ci95:.1f}", flush=True)
    finally:
        sampler.close()
    low, high = (sum(seconds[n]) / len(seconds[n]) for n in args.compare)
    print(f"{args.run} v{version}, {args.episodes} episodes ({config.sampler.backend}), load {os.getloadavg()[0]:.2f}: "
          f"{args.compare[0]} in flight {low:.1f} s, {args.compare[1]} in flight {high:.1f} s -> x{low / high:.2f}")


if __name__ == "__main__":
    main()
