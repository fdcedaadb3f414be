"""Held-out evaluation with 8 episodes in flight against all of them at once, side by side.

``rlpipe eval`` plays its held-out episodes through the producer's rollout worker: on the
blocking engine (``sampler.engine=blocking``) one batched generate call per turn for every
episode in flight, on the async engine (the default) every episode's turn its own request.
The run's stored configuration picks the engine; ``--set`` changes it.  This bench plays
the same held-out seeds with one adapter version twice per round on one sampler
(the engine starts once): ``--in-flight 8`` (how evaluation ran before) and
``--in-flight 32`` (the default now), alternating the order between rounds, and
prints each wall time and the ratio.  Returns differ only by the sampling draws.

    python bench/eval_in_flight.py --run demo-20261202-091512 --version latest
    python bench/eval_in_flight.py --run demo-20261202-091512 --set sampler.engine=blocking
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from pipeline.io.registry import AdapterRegistry
from pipeline.runtime import open_store
from producers.eval_cli import resolve_version, stored_run_config
from producers.evaluation import evaluate_version
from producers.samplers import sampler_for_run
from producers.tiny_model import resolve_model
from schemas.config import StoreConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", required=True, help="a run with published adapters (e.g. a demo run)")
    parser.add_argument("--root", default=None, help="the store holding the run (default: the local one)")
    parser.add_argument("--version", default="latest")
    parser.add_argument("--episodes", type=positive_int, default=32)
    parser.add_argument("--rounds", type=positive_int, default=1)
    parser.add_argument("--compare", type=positive_int, nargs=2, default=[8, 32], metavar=("LOW", "HIGH"))
    parser.add_argument("--set", dest="overrides", action="append", default=[],
                        help="override a field of the run's configuration, e.g. --set sampler.engine=blocking")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:  # the run's stored configuration; an unknown run or version is one line on stderr
        store_cfg = StoreConfig(root=args.root) if args.root else StoreConfig()
        config = stored_run_config(args.run, store_cfg, args.overrides)
        store = open_store(config.store)
        version = resolve_version(AdapterRegistry(store, args.run), args.version)
    except typer.Exit as exc:
        raise SystemExit(exc.exit_code) from None
    model_path = resolve_model(config.model)
    sampler = sampler_for_run(config, model_path)
    seconds: dict[int, list[float]] = {n: [] for n in args.compare}
    try:
        with LoadAverage() as load:
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
    print(f"{args.run} v{version}, {args.episodes} episodes ({config.sampler.backend}, engine "
          f"{config.sampler.engine}), {load}: {args.compare[0]} in flight {low:.1f} s, {args.compare[1]} in flight "
          f"{high:.1f} s -> x{low / high:.2f}")


if __name__ == "__main__":
    main()
