"""Offline RL on logged building telemetry: advantage-weighted regression vs. behaviour cloning.

The whole offline path, on the tiny local model:
1. ``rlpipe datasets generate building-hvac --policy mixed``: ``--days`` simulated days, each
   run by the heuristic or the random controller (half each, drawn per day);
2. ``rlpipe datasets to-trajectories``: every logged step as the online prompt, the logged
   action as the answer (``--answer-format``: normalised to [-1, 1] by default, as in
   ``<answer>-0.1, -1.0</answer>``, which the tiny model writes more reliably than kelvin),
   return-to-go from the logged rewards, batches of ``--episodes-per-batch`` days x
   ``--turns-per-batch`` turns;
3. ``rlpipe replay --train`` (``consumers.service.replay_train``) once per method:
   ``bc`` (cross_entropy), ``awr-raw`` (advantage-weighted regression on the return-to-go
   minus its same-hour, same-kind-of-day baseline, in reward units, ``--awr-beta`` 2),
   optionally ``awr`` (the same advantage std-normalised per cell) and ``fbc`` (filtered
   BC: the top half of each step by that advantage);
4. ``rlpipe datasets eval-building``: ``--eval-days`` held-out days (after the dataset's)
   played online by each adapter and by the pre-trained base model (at each of
   ``--temperatures``, ``--seeds`` sampling seeds; 0 = greedy), and by the logged
   (behaviour), random and heuristic controllers.
Prints a markdown table for docs/offline.md: mean daily return with its 95% CI over
days x seeds, and the reward's parts (per-day sums of the normalised comfort regret,
energy cost and carbon; reward = -(0.2 comfort + 0.4 energy + 0.4 carbon)), then each AWR
adapter's paired difference against the others (same day, same sampling seed).

Without ``--root`` the store is a temporary folder, removed at the end; with it, the dataset, the
trajectories and the adapters stay there and a second run reuses them.  Each training logs a line
per learner step.

Run: .venv/bin/python bench/offline_building.py [--days 14] [--eval-days 7] [--threads 1] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.options import model_folder, non_negative_int, positive_int, scratch_folder
from consumers.service import replay_train
from pipeline.io.datasets import read_card
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.offline.evaluation import SamplingSettings, evaluate_building, held_out_days
from producers.offline.generation import GenerationSpec, generate_building_dataset
from producers.offline.trajectories import TrajectoryOptions, dataset_to_trajectories
from schemas.config import LearnerConfig, ModelConfig, RunConfig, StoreConfig
from schemas.evaluation import mean_ci95, paired_difference

DATASET, DATA_RUN = "hvac-mixed", "hvac-mixed-data"
METHODS = {
    "bc": {"loss": "cross_entropy", "advantage": "raw"},
    "awr": {"loss": "awr", "advantage": "return_to_go", "normalize_advantage_std": True},
    # AWR on the raw return-to-go advantage (reward units, awr_beta the same): a (kind of day, time of day, turn)
    # cell holds 2-5 rows per step, and dividing by the std of so few rows makes every advantage about +/-1,
    # including late in the day where the returns still to come barely differ.
    "awr-raw": {"loss": "awr", "advantage": "return_to_go", "normalize_advantage_std": False},
    "fbc": {"loss": "filtered_bc", "advantage": "return_to_go", "normalize_advantage_std": True,
            "filtered_bc_fraction": 0.5},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=positive_int, default=14, help="logged days (one episode each)")
    parser.add_argument("--eval-days", type=positive_int, default=7, help="held-out days played online")
    parser.add_argument("--seeds", type=positive_int, default=2, help="sampling seeds per adapter")
    parser.add_argument("--methods", default="bc,awr-raw",
                        help="comma-separated: bc, awr-raw (AWR on the raw advantage), awr (std-normalised per "
                             "cell), fbc")
    parser.add_argument("--episodes-per-batch", type=positive_int, default=7)
    parser.add_argument("--turns-per-batch", type=positive_int, default=16)
    parser.add_argument("--epochs", type=positive_int, default=2)
    parser.add_argument("--learning-rate", type=float, default=1e-2)
    parser.add_argument("--awr-beta", type=float, default=2.0,
                        help="AWR temperature, in reward units for awr-raw (a day's return spans about 2-4 between "
                             "similar days)")
    parser.add_argument("--lora-rank", type=positive_int, default=8)
    parser.add_argument("--temperatures", default="0.5,0", help="sampling temperatures of the model (0: greedy)")
    parser.add_argument("--history-turns", type=non_negative_int, default=0, help="earlier turns per prompt (0: shortest)")
    parser.add_argument("--answer-format", choices=("normalized", "kelvin"), default="normalized",
                        help="how the logged setpoints are written as answers")
    parser.add_argument("--answer-decimals", type=int, default=None, help="default: 1 normalised, 0 kelvin")
    parser.add_argument("--no-base", action="store_true",
                        help="skip the base model (its figures depend only on the model and the held-out days)")
    parser.add_argument("--model", type=model_folder, default="tiny",
                        help="'tiny' (pre-trained locally, cached) or a model folder")
    parser.add_argument("--threads", type=non_negative_int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--root", type=Path, default=None, help="store folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the logged controllers")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.methods.split(",")) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    return args


def resolve_model(name: str) -> str:
    if name != "tiny":
        return name
    from producers.tiny_model import build_tiny_model

    return str(build_tiny_model())


def prepare_data(store: ObjectStore, args: argparse.Namespace, model: str) -> None:
    """Steps 1-2: the logged dataset and its trajectories (skipped when already in the store)."""
    from transformers import AutoTokenizer

    if not store.exists(f"datasets/{DATASET}/dataset.json"):
        spec = GenerationSpec(days=args.days, policy="mixed", random_fraction=0.5, seed=args.seed)
        card = generate_building_dataset(store, DATASET, spec)
        policies = [e["policy"] for e in card.extras["episodes"]]
        print(f"dataset: {card.num_rows:,} steps, {policies.count('heuristic')} heuristic and "
              f"{policies.count('random')} random days", flush=True)
    if not store.exists(f"runs/{DATA_RUN}/offline/{DATASET}.json"):
        options = TrajectoryOptions(episodes_per_batch=args.episodes_per_batch, turns_per_batch=args.turns_per_batch,
                                    epochs=args.epochs, history_turns=args.history_turns, seed=args.seed,
                                    answer_format=args.answer_format, answer_decimals=args.answer_decimals)
        report = dataset_to_trajectories(store, DATASET, DATA_RUN, AutoTokenizer.from_pretrained(model), options,
                                         model)
        print(f"trajectories: {report.batches} batches, {report.rows:,} rows, {report.tokens:,} tokens", flush=True)


def train(store: ObjectStore, args: argparse.Namespace, model: str, method: str) -> str:
    """Step 3 for one method: replay the trajectories into a LoRA adapter; return the run id."""
    run_id = f"{DATASET}-{method}"
    if AdapterRegistry(store, run_id).latest() is not None:
        return run_id
    learner = LearnerConfig(
        **METHODS[method], awr_beta=args.awr_beta, learning_rate=args.learning_rate, lora_rank=args.lora_rank,
        lora_alpha=2.0 * args.lora_rank, batch_rows=args.episodes_per_batch * args.turns_per_batch,
        publish_every=1, checkpoint_every=1_000_000, max_staleness=1000, seed=args.seed,
    )
    config = RunConfig(run_id=run_id, model=ModelConfig(base_model=model), store=StoreConfig(root=store.root),
                       learner=learner)
    started = time.perf_counter()
    print(f"{method}: training (a line per learner step)", flush=True)
    trained = replay_train(config, DATA_RUN)
    print(f"{method}: {trained.state.step} steps, adapter v{trained.state.version}, "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    return run_id


def evaluate(store: ObjectStore, args: argparse.Namespace, model: str, runs: dict[str, str]) -> dict[str, Any]:
    """Step 4: every policy on the same held-out days; per policy the pooled returns and mean parts.

    The language-model policies are played at each temperature (``name@T``); the scripted
    ones once (the random policy with each sampling seed).
    """
    card = read_card(store, DATASET)
    days = held_out_days(card, args.eval_days)
    pooled: dict[str, list[Any]] = {}
    by_seed: dict[str, dict[int, list[float]]] = {}  # policy -> sampling seed -> daily returns, in `days` order
    for temperature in [float(t) for t in args.temperatures.split(",")]:
        seeds = range(args.seeds) if temperature > 0 else range(1)  # greedy decoding needs one seed
        base = [] if args.no_base else [("base", next(iter(runs.values())))]
        for name, run_id in [*runs.items(), *base]:
            for seed in seeds:
                sampling = SamplingSettings(temperature=temperature, seed=seed)
                key = f"{name}@T={temperature:g}"
                pooled.setdefault(key, []).extend(evaluate_building(
                    store, run_id, ["base" if name == "base" else "adapter"], days, card=card, model_path=model,
                    sampling=sampling, history_turns=args.history_turns))
                by_seed.setdefault(key, {})[seed] = list(pooled[key][-1].returns)
                print(f"  {key} seed {seed}: {pooled[key][-1].mean_return:.3f}", flush=True)
    for baseline in ("behaviour", "random", "heuristic"):
        for seed in range(args.seeds if baseline != "heuristic" else 1):
            pooled.setdefault(baseline, []).extend(evaluate_building(
                store, f"{DATASET}-baselines", [baseline], days, card=card, sampling=SamplingSettings(seed=seed),
                history_turns=args.history_turns))
            by_seed.setdefault(baseline, {})[seed] = list(pooled[baseline][-1].returns)
    model_keys = [key for key in by_seed if "@T=" in key and not key.startswith("base@")]
    others = [key for key in model_keys if not key.startswith("awr")] + ["random", "behaviour", "heuristic"]
    paired = {f"{key} - {other}": paired_difference(by_seed[key], by_seed[other])
              for key in model_keys if key.startswith("awr") for other in others if other in by_seed}
    return {"days": days, "results": {name: summarise(results) for name, results in pooled.items()},
            "paired": paired}


def summarise(results: list[Any]) -> dict[str, float]:
    """Mean daily return over every (day, seed) with its 95% CI, and the mean parts."""
    returns = [r for result in results for r in result.returns]
    mean, ci95 = mean_ci95(returns)
    parts = {key: statistics.fmean(r.breakdown[key] for r in results)
             for key in ("comfort", "energy", "carbon", "energy_usd", "carbon_kg", "invalid_rate")}
    return {"mean_return": mean, "ci95": ci95, "episodes": len(returns), **parts}


def print_table(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nheld-out days {summary['days'][0]}..{summary['days'][-1]} (x {args.seeds} sampling seeds for the "
          "sampled model policies and the random ones)\n")
    print("| policy | mean daily return (95% CI) | comfort | energy | carbon | energy $ | carbon kg | invalid |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, s in summary["results"].items():
        print(f"| {name} | {s['mean_return']:.3f} ± {s['ci95']:.3f} | {s['comfort']:.2f} | {s['energy']:.2f} | "
              f"{s['carbon']:.2f} | {s['energy_usd']:.2f} | {s['carbon_kg']:.1f} | {s['invalid_rate']:.1%} |")
    print("\npaired differences (same day, same sampling seed; above = the whole 95% CI above 0)\n")
    print("| comparison | mean difference per day (95% CI) | pairs | above |")
    print("| --- | --- | --- | --- |")
    for name, d in summary["paired"].items():
        print(f"| {name} | {d['mean']:+.3f} ± {d['ci95']:.3f} | {d['pairs']} | {'yes' if d['above'] else 'no'} |")


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    logging.getLogger("rlpipe.learner").setLevel(logging.INFO)  # replay_train's line per learner step
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with scratch_folder(args.root, "rlpipe-offline-") as folder:
        store = ObjectStore(folder.resolve().as_uri())
        started = time.perf_counter()
        model = resolve_model(args.model)
        print(f"model {model}; store {store.root}", flush=True)
        prepare_data(store, args, model)
        runs = {method: train(store, args, model, method) for method in args.methods.split(",")}
        summary = evaluate(store, args, model, runs)
    print_table(summary, args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
