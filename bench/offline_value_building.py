"""Offline value learning on logged building telemetry: conservative Q-learning vs. behaviour cloning.

The offline path with a small Q-network instead of a language model:
1. ``--days`` simulated building-hvac days logged by the mixed controller (heuristic or
   random, half each, drawn per day; the same dataset as bench/offline_building.py);
2. the steps table -> ``consumers.value.offline.prepare_offline_data``: the two setpoints
   on a ``--levels`` x ``--levels`` grid (nearest cell), the observation vector plus time
   of day and day-off features, standardised with the training days' statistics, n-step
   transitions;
3. per network seed (``--seeds``): CQL(H) (``--cql-alpha``) and behaviour cloning on the same
   MLP, ``--steps`` updates each, no interaction;
4. ``--eval-days`` held-out days after the dataset's played in the simulator by each network
   (greedy), the logged (behaviour) controller, the heuristic and the random controller
   (one run per seed).
Prints a markdown table for docs/value.md: mean daily return with its 95% CI over days x
seeds and the reward's parts (per-day sums of the normalised comfort regret, energy cost
and carbon), then paired differences (same day, same seed) of CQL against the others.

Run: nice .venv/bin/python bench/offline_value_building.py [--days 14] [--eval-days 7] [--seeds 3] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from consumers.value.config import ValueLearnerConfig
from consumers.value.offline import (
    BehaviourCloningAgent,
    CQLAgent,
    OfflineData,
    OfflinePolicy,
    SetpointGrid,
    prepare_offline_data,
    train_offline,
)
from pipeline.io.datasets import read_card, read_steps
from pipeline.io.store import ObjectStore
from producers.offline.evaluation import (
    SamplingSettings,
    controller_outcomes,
    eval_result,
    evaluate_building,
    held_out_days,
    numeric_controller,
)
from producers.offline.generation import GenerationSpec, day_env, generate_building_dataset
from schemas.evaluation import mean_ci95, paired_difference

DATASET = "hvac-mixed"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=int, default=14, help="logged days (one episode each)")
    parser.add_argument("--eval-days", type=int, default=7, help="held-out days played in the simulator")
    parser.add_argument("--seeds", type=int, default=3, help="network seeds (and random-controller seeds)")
    parser.add_argument("--levels", type=int, default=5, help="grid levels per setpoint (levels^2 actions)")
    parser.add_argument("--steps", type=int, default=8000, help="training updates per agent")
    parser.add_argument("--cql-alpha", type=float, default=0.1, help="weight of the CQL(H) regulariser")
    parser.add_argument("--gamma", type=float, default=0.9, help="discount per 5-minute step")
    parser.add_argument("--n-step", type=int, default=3)
    parser.add_argument("--hidden", default="128,128", help="MLP hidden widths")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--target-period", type=int, default=100, help="updates between target-network copies")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--root", type=Path, default=None, help="store folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the logged controllers")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args()


def prepare(store: ObjectStore, args: argparse.Namespace) -> tuple[Any, OfflineData]:
    """Steps 1-2: the logged dataset (generated unless already in the store) and its transitions."""
    if not store.exists(f"datasets/{DATASET}/dataset.json"):
        spec = GenerationSpec(days=args.days, policy="mixed", random_fraction=0.5, seed=args.seed)
        card = generate_building_dataset(store, DATASET, spec)
        policies = [e["policy"] for e in card.extras["episodes"]]
        print(f"dataset: {card.num_rows:,} steps, {policies.count('heuristic')} heuristic and "
              f"{policies.count('random')} random days", flush=True)
    card = read_card(store, DATASET)
    cfg = day_env(0, card.extras.get("env_overrides")).config
    grid = SetpointGrid(cfg.supply_water_range_k, cfg.supply_air_heating_range_k, args.levels, args.levels)
    data = prepare_offline_data(read_steps(store, DATASET), grid, float(card.extras.get("utc_offset_hours", 0.0)),
                                n_step=args.n_step, gamma=args.gamma)
    print(f"transitions: {len(data.transitions['action']):,}, {data.observation_size} features, "
          f"{grid.num_actions} actions", flush=True)
    return card, data


def train_and_play(card: Any, data: OfflineData, args: argparse.Namespace, days: list[int]) -> dict[str, Any]:
    """Steps 3-4 for the networks: per method, seed -> EvalResult."""
    results: dict[str, dict[int, Any]] = {"cql": {}, "bc": {}}
    for seed in range(args.seeds):
        config = ValueLearnerConfig(
            seed=seed, hidden_sizes=tuple(int(w) for w in args.hidden.split(",")), gamma=args.gamma,
            n_step=args.n_step, learning_rate=args.learning_rate, batch_size=args.batch_size,
            target_update_period=args.target_period, replay_capacity=max(len(data.transitions["action"]), 1),
        )
        agents = {"cql": CQLAgent(config, data.observation_size, data.grid.num_actions, cql_alpha=args.cql_alpha),
                  "bc": BehaviourCloningAgent(config, data.observation_size, data.grid.num_actions)}
        for method, agent in agents.items():
            started = time.perf_counter()
            log = train_offline(agent, data, args.steps, seed=seed)
            policy = OfflinePolicy.from_training(agent, data)
            controller = numeric_controller(policy.setpoints, card.observation_columns)
            outcomes = controller_outcomes(controller, days, card.extras.get("env_overrides"))
            results[method][seed] = eval_result(f"{DATASET}-{method}", method, 0, outcomes)
            print(f"  {method} seed {seed}: loss {log.loss:.4f}, Q {log.q_mean:.2f}, "
                  f"return {results[method][seed].mean_return:.3f} ({time.perf_counter() - started:.0f} s)",
                  flush=True)
    return results


def play_baselines(store: ObjectStore, card: Any, args: argparse.Namespace, days: list[int]) -> dict[str, Any]:
    """Step 4 for the scripted controllers (the heuristic is deterministic: seed 0 only)."""
    results: dict[str, dict[int, Any]] = {}
    for baseline in ("behaviour", "heuristic", "random"):
        for seed in range(args.seeds if baseline != "heuristic" else 1):
            (result,) = evaluate_building(store, f"{DATASET}-baselines", [baseline], days, card=card,
                                          sampling=SamplingSettings(seed=seed), store_results=False)
            results.setdefault(baseline, {})[seed] = result
    return results


def summarise(by_seed: dict[int, Any]) -> dict[str, float]:
    """Mean daily return over every (day, seed) with its 95% CI, and the mean parts."""
    results = list(by_seed.values())
    mean, ci95 = mean_ci95([r for result in results for r in result.returns])
    parts = {key: statistics.fmean(r.breakdown[key] for r in results)
             for key in ("comfort", "energy", "carbon", "energy_usd", "carbon_kg")}
    return {"mean_return": mean, "ci95": ci95, "episodes": sum(len(r.returns) for r in results), **parts}


def print_table(summary: dict[str, Any], args: argparse.Namespace) -> None:
    print(f"\nheld-out days {summary['days'][0]}..{summary['days'][-1]} x {args.seeds} seeds (networks, random, "
          "behaviour; the heuristic is deterministic)\n")
    print("| policy | mean daily return (95% CI) | comfort | energy | carbon | energy $ | carbon kg |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in summary["results"].items():
        print(f"| {name} | {s['mean_return']:.3f} ± {s['ci95']:.3f} | {s['comfort']:.2f} | {s['energy']:.2f} | "
              f"{s['carbon']:.2f} | {s['energy_usd']:.2f} | {s['carbon_kg']:.1f} |")
    print("\npaired differences (same day, same seed; above = the whole 95% CI above 0)\n")
    print("| comparison | mean difference per day (95% CI) | pairs | above |")
    print("| --- | --- | --- | --- |")
    for name, d in summary["paired"].items():
        print(f"| {name} | {d['mean']:+.3f} ± {d['ci95']:.3f} | {d['pairs']} | {'yes' if d['above'] else 'no'} |")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    folder = args.root or Path(tempfile.mkdtemp(prefix="rlpipe-offline-value-"))
    store = ObjectStore(folder.resolve().as_uri())
    started = time.perf_counter()
    card, data = prepare(store, args)
    days = held_out_days(card, args.eval_days)
    played = train_and_play(card, data, args, days) | play_baselines(store, card, args, days)
    returns = {name: {seed: list(r.returns) for seed, r in by_seed.items()} for name, by_seed in played.items()}
    summary = {
        "days": days,
        "results": {name: summarise(by_seed) for name, by_seed in played.items()},
        "paired": {f"cql - {other}": paired_difference(returns["cql"], returns[other])
                   for other in ("bc", "behaviour", "heuristic", "random")},
    }
    print_table(summary, args)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
