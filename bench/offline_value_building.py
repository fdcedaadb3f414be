"""Offline value learning on logged building telemetry: conservative Q-learning vs. behaviour cloning.

The offline path with a small Q-network instead of a language model:
1. ``--days`` simulated building-hvac days logged by the mixed controller (heuristic or
   random, half each, drawn per day; the same dataset as bench/offline_building.py), or
   with ``--policy heuristic`` by the heuristic alone, or with ``--policy varied`` by the
   heuristic preheating 1, 2, 3 or 4 hours (drawn per day; ``--preheat-hours`` sets the choices);
2. the steps table -> ``consumers.value.offline.prepare_offline_data``: the two setpoints
   on a ``--levels`` x ``--levels`` grid (nearest cell), the observation vector less the
   columns echoing the last setpoints (``--with-echoes`` keeps them) plus time of day and
   day-off features, standardised with the training days' statistics, n-step transitions;
3. per network seed (``--seeds``): CQL(H) (``--cql-alpha``) and behaviour cloning on the same
   MLP, ``--steps`` updates each, no interaction; optionally (each adds a row)
   - ``--support-threshold T``: the same CQL network acting only on cells whose cloned
     probability is at least T times the most likely cell's (discrete BCQ's filter), "cql-filtered";
   - ``--bcq-alpha A`` (with T): a CQL network (alpha A) whose target also takes the filtered argmax, "bcq";
   - ``--ensemble K``: K CQL networks (seeds s, s + seeds, ...) acting on their mean Q (``--ensemble-min``:
     the minimum), "cql-ensemble";
   ``--standardise-rewards`` trains every network on standardised n-step returns;
4. ``--eval-days`` held-out days after the dataset's played in the simulator by each network
   (greedy), the logged (behaviour) controller, the heuristic and the random controller
   (one run per seed); ``--validation-days N`` also plays the N days after those, for choosing
   settings on days the comparison does not use; with them ``--select-from K`` also reports, per
   network kind, the seed with the best validation return out of each K ("<kind>-picked"; BC picked the
   same way; "cql-any-picked": the best of every CQL kind).  ``--first-seed`` starts the seeds elsewhere, so
   runs side by side cover different seeds, and ``--pool A.json B.json [--select-from K]`` (no training)
   pools their per-day returns into one table.
Prints a markdown table for docs/value.md: mean daily return with its 95% CI over days x
seeds and the reward's parts (per-day sums of the normalised comfort regret, energy cost
and carbon), then paired differences (same day, same seed) of each network against the others.

Without ``--root`` the store is a temporary folder, removed at the end; with it, the logged dataset
stays there and a second run reuses it.

Run: nice .venv/bin/python bench/offline_value_building.py [--days 14] [--eval-days 7] [--seeds 3] [--root DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.options import non_negative_int, positive_int, scratch_folder
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
from pipeline.building_policy import BuildingPolicy, network_columns
from pipeline.io.datasets import read_card, read_steps
from pipeline.io.store import ObjectStore
from producers.envs.building import BuildingHVAC
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


def dataset_name(args: argparse.Namespace) -> str:
    """The logged dataset's name in the store: one per logging controller (and the varied log's hours)."""
    hours = "" if args.preheat_hours == "1,2,3,4" else "-" + args.preheat_hours.replace(",", "-").replace(".", "p")
    return f"hvac-{args.policy}{hours}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=positive_int, default=14, help="logged days (one episode each)")
    parser.add_argument("--eval-days", type=positive_int, default=7, help="held-out days played in the simulator")
    parser.add_argument("--seeds", type=positive_int, default=3, help="network seeds (and random-controller seeds)")
    parser.add_argument("--first-seed", type=non_negative_int, default=0,
                        help="the first of the --seeds seeds (a later run adds seeds without repeating)")
    parser.add_argument("--levels", type=positive_int, default=5, help="grid levels per setpoint (levels^2 actions)")
    parser.add_argument("--steps", type=positive_int, default=8000, help="training updates per agent")
    parser.add_argument("--cql-alpha", type=float, default=0.1, help="weight of the CQL(H) regulariser")
    parser.add_argument("--gamma", type=float, default=0.9, help="discount per 5-minute step")
    parser.add_argument("--n-step", type=positive_int, default=3)
    parser.add_argument("--hidden", default="128,128", help="MLP hidden widths")
    parser.add_argument("--learning-rate", type=float, default=3e-4)
    parser.add_argument("--batch-size", type=positive_int, default=128)
    parser.add_argument("--target-period", type=positive_int, default=100, help="updates between target-network copies")
    parser.add_argument("--support-threshold", type=float, default=0.0,
                        help="> 0: also CQL acting only on cells with cloned probability >= T x the most likely's")
    parser.add_argument("--bcq-alpha", type=float, default=None,
                        help="with --support-threshold: also CQL (this alpha) with the filtered target (discrete BCQ)")
    parser.add_argument("--ensemble", type=positive_int, default=1, help="> 1: also this many CQL networks on their mean Q")
    parser.add_argument("--ensemble-min", action="store_true", help="the ensemble acts on its members' minimum Q")
    parser.add_argument("--standardise-rewards", action="store_true",
                        help="train on (R - mean) / std of the n-step returns instead of R")
    parser.add_argument("--validation-days", type=non_negative_int, default=0,
                        help="also play the days after the held-out ones (for choosing settings)")
    parser.add_argument("--threads", type=positive_int, default=1, help="torch threads")
    parser.add_argument("--root", type=Path, default=None, help="store folder (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=1, help="seeds the logged controllers")
    parser.add_argument("--policy", default="mixed", choices=["mixed", "heuristic", "varied"],
                        help="the logging controller: heuristic or random per day (half each), the heuristic alone, "
                             "or the heuristic preheating 1-4 h (drawn per day)")
    parser.add_argument("--preheat-hours", default="1,2,3,4",
                        help="varied: the hours of preheat drawn from per day (repeat one to draw it more often)")
    parser.add_argument("--preheat-report", action="store_true",
                        help="also print how warm each controller keeps the water before comfort hours")
    parser.add_argument("--with-echoes", action="store_true",
                        help="let the networks read the columns that echo the last setpoints (as before)")
    parser.add_argument("--later-days", type=non_negative_int, default=0,
                        help="with --validation-days: also play the N days after the validation ones (a second "
                             "held-out set, for how far a result carries to other days)")
    parser.add_argument("--select-from", type=non_negative_int, default=0,
                        help="> 1 (with --validation-days): also each network kind picked per group of this many "
                             "seeds by its validation return, a '-picked' row per group")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--pool", type=Path, nargs="+", default=None,
                        help="train nothing: pool the per-day returns of these --json files (runs over different "
                             "--first-seed ranges) and print the paired differences over all their seeds "
                             "(with --select-from K, picking again per K seeds)")
    args = parser.parse_args(argv)
    if args.pool:
        return args
    if args.bcq_alpha is not None and args.support_threshold <= 0:
        parser.error("--bcq-alpha needs --support-threshold above 0 (the filter of its target)")
    if args.select_from > 1 and (not args.validation_days or args.seeds % args.select_from):
        parser.error("--select-from K needs --validation-days and a multiple of K seeds")
    if args.later_days and not args.validation_days:
        parser.error("--later-days needs --validation-days (they come after the validation days)")
    if args.first_seed + args.seeds > ENSEMBLE_SEED_STRIDE:
        parser.error(f"network seeds go up to {ENSEMBLE_SEED_STRIDE - 1}")
    return args


def prepare(store: ObjectStore, args: argparse.Namespace) -> tuple[Any, OfflineData]:
    """Steps 1-2: the logged dataset (generated unless already in the store) and its transitions."""
    dataset = dataset_name(args)
    if not store.exists(f"datasets/{dataset}/dataset.json"):
        spec = GenerationSpec(days=args.days, policy=args.policy, random_fraction=0.5, seed=args.seed,
                              preheat_hours=tuple(float(h) for h in args.preheat_hours.split(",")))
        card = generate_building_dataset(store, dataset, spec)
        policies = Counter(e["policy"] for e in card.extras["episodes"])
        print(f"dataset: {card.num_rows:,} steps, days by controller: {dict(sorted(policies.items()))}", flush=True)
    card = read_card(store, dataset)
    cfg = day_env(0, card.extras.get("env_overrides")).config
    grid = SetpointGrid(cfg.supply_water_range_k, cfg.supply_air_heating_range_k, args.levels, args.levels)
    keep = card.observation_columns if args.with_echoes else network_columns(card.observation_columns,
                                                                             card.action_columns)
    data = prepare_offline_data(read_steps(store, dataset), grid, float(card.extras.get("utc_offset_hours", 0.0)),
                                n_step=args.n_step, gamma=args.gamma, columns=card.observation_columns, keep=keep)
    if args.standardise_rewards:  # a shift c of every n-step return shifts Q by c / (1 - gamma^n): same argmax
        reward_R = data.transitions["reward"]
        data.transitions["reward"] = ((reward_R - reward_R.mean()) / reward_R.std()).astype(reward_R.dtype)
    print(f"transitions: {len(data.transitions['action']):,}, {data.observation_size} features, "
          f"{grid.num_actions} actions", flush=True)
    return card, data


def learner_config(args: argparse.Namespace, seed: int, transitions: int) -> ValueLearnerConfig:
    return ValueLearnerConfig(
        seed=seed, hidden_sizes=tuple(int(w) for w in args.hidden.split(",")), gamma=args.gamma,
        n_step=args.n_step, learning_rate=args.learning_rate, batch_size=args.batch_size,
        target_update_period=args.target_period, replay_capacity=max(transitions, 1), min_replay_size=1,  # offline: all data in at once
    )


class EnsembleQ(torch.nn.Module):
    """An ensemble's Q: the mean (or the minimum) over its members' Q-values."""

    def __init__(self, members: list[torch.nn.Module], minimum: bool = False) -> None:
        super().__init__()
        self.members, self.minimum = torch.nn.ModuleList(members), minimum

    def q_values(self, obs_BO: torch.Tensor) -> torch.Tensor:
        q_MBA = torch.stack([m.q_values(obs_BO) for m in self.members])
        return q_MBA.min(dim=0).values if self.minimum else q_MBA.mean(dim=0)


def trained(agent: Any, data: OfflineData, args: argparse.Namespace, seed: int, name: str) -> Any:
    started = time.perf_counter()
    log = train_offline(agent, data, args.steps, seed=seed)
    print(f"  {name} seed {seed}: loss {log.loss:.4f}, Q {log.q_mean:.2f} ({time.perf_counter() - started:.0f} s)",
          flush=True)
    return agent


def seed_policies(data: OfflineData, args: argparse.Namespace, seed: int) -> dict[str, BuildingPolicy]:
    """Step 3 for one seed: the trained networks as policies (as a published version acts), by method name."""
    n, cells, count = data.observation_size, data.grid.num_actions, len(data.transitions["action"])
    config = learner_config(args, seed, count)
    bc = trained(BehaviourCloningAgent(config, n, cells), data, args, seed, "bc")
    cql = trained(CQLAgent(config, n, cells, cql_alpha=args.cql_alpha), data, args, seed, "cql")
    policies = {"cql": OfflinePolicy.from_training(cql, data), "bc": OfflinePolicy.from_training(bc, data)}
    threshold = args.support_threshold
    if threshold > 0:
        policies["cql-filtered"] = OfflinePolicy.from_training(cql, data, bc, threshold)
    if threshold > 0 and args.bcq_alpha is not None:
        bcq = CQLAgent(config, n, cells, cql_alpha=args.bcq_alpha, behaviour=bc, support_threshold=threshold)
        policies["bcq"] = OfflinePolicy.from_training(trained(bcq, data, args, seed, "bcq"), data, bc, threshold)
    acting = {method: policy.acting() for method, policy in policies.items()}
    if args.ensemble > 1:  # members seeded seed + k x ENSEMBLE_SEED_STRIDE: never a network seed of any run
        members = [cql.online] + [
            trained(CQLAgent(learner_config(args, seed + k * ENSEMBLE_SEED_STRIDE, count), n, cells,
                             cql_alpha=args.cql_alpha),
                    data, args, seed + k * ENSEMBLE_SEED_STRIDE, "cql-member").online
            for k in range(1, args.ensemble)]
        ensemble = EnsembleQ(members, args.ensemble_min)
        acting["cql-ensemble"] = BuildingPolicy(ensemble, data.scaler, data.grid, data.utc_offset_hours)
    return acting


ENSEMBLE_SEED_STRIDE = 100_000  # network seeds (--first-seed + --seeds) stay below it
PREHEAT_HOURS = (2, 6)  # local hours (from, to) whose supply-water setpoint tells how early a controller preheats


def preheat_recorder(controller: Callable[[BuildingHVAC], str],
                     waters: list[float]) -> Callable[[BuildingHVAC], str]:
    """``controller``, also noting the supply-water setpoint in force at each workday step in ``PREHEAT_HOURS``."""

    def answer(env: BuildingHVAC) -> str:
        local = env.local_time()
        if local.weekday() < 5 and PREHEAT_HOURS[0] <= local.hour < PREHEAT_HOURS[1]:
            waters.append(float(env.telemetry()["boiler_0@supply_water_setpoint"]))
        return controller(env)

    return answer


def print_preheat(card: Any, days: list[int], recorded: dict[str, list[float]]) -> None:
    """Mean supply water (K) on the held-out workdays' early hours: per network (seed 0), the heuristic
    and the heuristic preheating 4 h (which beats it)."""
    overrides = card.extras.get("env_overrides")
    for name, hours in (("heuristic", 2.0), ("heuristic, preheat 4 h", 4.0)):
        waters: list[float] = []
        controller_outcomes(preheat_recorder(lambda env, h=hours: env.heuristic_answer(h), waters), days, overrides)
        recorded[name] = waters
    print(f"\nmean supply-water setpoint, {PREHEAT_HOURS[0]:02d}:00-{PREHEAT_HOURS[1]:02d}:00 on the held-out "
          "workdays (networks: seed 0)\n")
    print("| controller | K |\n| --- | --- |")
    for name, waters in recorded.items():
        print(f"| {name} | {statistics.fmean(waters):.1f} |")


def train_and_play(card: Any, data: OfflineData, args: argparse.Namespace,
                   day_sets: dict[str, list[int]]) -> dict[str, dict[str, Any]]:
    """Steps 3-4 for the networks: per day set, method, seed -> EvalResult."""
    results: dict[str, dict[str, dict[int, Any]]] = {name: {} for name in day_sets}
    recorded: dict[str, list[float]] = {}
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for method, policy in seed_policies(data, args, seed).items():
            controller = numeric_controller(policy.setpoints, data.observation_columns)
            for name, days in day_sets.items():
                playing = controller
                if args.preheat_report and seed == args.first_seed and name == "held-out":
                    playing = preheat_recorder(controller, recorded.setdefault(method, []))
                outcomes = controller_outcomes(playing, days, card.extras.get("env_overrides"))
                results[name].setdefault(method, {})[seed] = eval_result(f"{dataset_name(args)}-{method}", method, 0, outcomes)
            scores = ", ".join(f"{name} {results[name][method][seed].mean_return:.3f}" for name in day_sets)
            print(f"  {method} seed {seed}: return on {scores}", flush=True)
    if args.preheat_report:
        print_preheat(card, day_sets["held-out"], recorded)
    return results


def play_baselines(store: ObjectStore, card: Any, args: argparse.Namespace, days: list[int]) -> dict[str, Any]:
    """Step 4 for the scripted controllers (the heuristic is deterministic: seed 0 only)."""
    results: dict[str, dict[int, Any]] = {}
    for baseline in ("behaviour", "heuristic", "random"):
        seeds = range(args.first_seed, args.first_seed + args.seeds) if baseline != "heuristic" else [0]
        for seed in seeds:
            (result,) = evaluate_building(store, f"{dataset_name(args)}-baselines", [baseline], days, card=card,
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


def print_table(summary: dict[str, Any], args: argparse.Namespace, title: str) -> None:
    print(f"\n{title}: days {summary['days'][0]}..{summary['days'][-1]} x {args.seeds} seeds (networks, random, "
          "behaviour; the heuristic is deterministic)\n")
    print("| policy | mean daily return (95% CI) | comfort | energy | carbon | energy $ | carbon kg |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, s in summary["results"].items():
        print(f"| {name} | {s['mean_return']:.3f} ± {s['ci95']:.3f} | {s['comfort']:.2f} | {s['energy']:.2f} | "
              f"{s['carbon']:.2f} | {s['energy_usd']:.2f} | {s['carbon_kg']:.1f} |")
    print_paired(summary["paired"])


def paired_summary(a: dict[int, list[float]], b: dict[int, list[float]]) -> dict[str, Any]:
    """``paired_difference`` over every (day, seed) pair, plus the same mean's 95% CI with each seed's mean
    difference as one sample (the days fixed: how far it holds across training seeds; ``seeds_above`` counts the
    seeds whose mean difference is above 0) and with each day's mean over the seeds as one sample (the seeds
    averaged: how far it holds across days)."""
    d = paired_difference(a, b)
    by_seed = {seed: [x - y for x, y in zip(returns, b[seed] if seed in b else b[0], strict=True)]
               for seed, returns in a.items()}
    seed_means = [statistics.fmean(values) for values in by_seed.values()]
    day_means = [statistics.fmean(day) for day in zip(*by_seed.values(), strict=True)]
    _, seeds_ci95 = mean_ci95(seed_means)
    _, days_ci95 = mean_ci95(day_means)
    return d | {"seeds": len(seed_means), "seeds_above": sum(m > 0 for m in seed_means), "seeds_ci95": seeds_ci95,
                "days": len(day_means), "days_ci95": days_ci95}


def print_paired(paired: dict[str, dict[str, Any]]) -> None:
    print("\npaired differences (same day, same seed; above = the whole 95% CI above 0); the same mean with its CI "
          "over the seeds' means (days fixed) and over the days' means (seeds averaged)\n")
    print("| comparison | mean difference per day (95% CI, pairs) | pairs | above | CI over seeds | seeds above 0 "
          "| CI over days | above |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, d in paired.items():
        print(f"| {name} | {d['mean']:+.3f} ± {d['ci95']:.3f} | {d['pairs']} | {'yes' if d['above'] else 'no'} | "
              f"± {d['seeds_ci95']:.3f} | {d['seeds_above']} of {d['seeds']} | ± {d['days_ci95']:.3f} | "
              f"{'yes' if d['mean'] - d['days_ci95'] > 0 else 'no'} |")


BASELINES = ("bc", "bc-picked", "behaviour", "heuristic", "random")  # what the networks are compared with


def comparisons(returns: dict[str, dict[int, list[float]]]) -> dict[str, dict[str, Any]]:
    """Each network's ``paired_summary`` against BC and the scripted controllers (a picked one: the picked BC)."""
    return {f"{net} - {other}": paired_summary(returns[net], returns[other])
            for net in returns if net not in BASELINES
            for other in ("bc-picked" if net.endswith("-picked") else "bc", "behaviour", "heuristic", "random")}


def summarise_days(played: dict[str, Any], days: list[int]) -> dict[str, Any]:
    """Per policy its summary and per-day returns, and ``comparisons``."""
    returns = {name: {seed: list(r.returns) for seed, r in by_seed.items()} for name, by_seed in played.items()}
    return {
        "days": days,
        "results": {name: summarise(by_seed) for name, by_seed in played.items()},
        "returns": returns,
        "paired": comparisons(returns),
    }


def picks(validation: dict[str, dict[int, float]], group: int) -> dict[str, dict[int, tuple[str, int]]]:
    """Choosing among seeds on days the comparison does not use, as settings are chosen.

    ``validation``: network kind -> seed -> mean validation return.  Per group of ``group`` consecutive seeds
    (keyed by its first seed, so it pairs with that seed's scripted controllers): '<kind>-picked' is the kind's
    seed with the best validation return (BC is picked the same way), and 'cql-any-picked' the best of every
    CQL kind's seeds (with the filter: plain or filtered, whichever did better).
    """
    seeds = sorted(next(iter(validation.values())))
    cql_kinds = [kind for kind in validation if kind != "bc"]
    rows = [(f"{kind}-picked", [kind]) for kind in validation] + ([("cql-any-picked", cql_kinds)]
                                                                 if len(cql_kinds) > 1 else [])
    chosen: dict[str, dict[int, tuple[str, int]]] = {}
    for g in range(len(seeds) // group):
        members = seeds[g * group:(g + 1) * group]
        for row, kinds in rows:
            candidates = [(kind, seed) for kind in kinds for seed in members]
            chosen.setdefault(row, {})[members[0]] = max(candidates, key=lambda c: validation[c[0]][c[1]])
    return chosen


def add_picked(networks: dict[str, dict[str, Any]], group: int) -> None:
    """``picks`` of the trained networks added to every other day set: row -> group's first seed -> the
    chosen network's result there."""
    validation = {kind: {seed: r.mean_return for seed, r in by_seed.items()}
                  for kind, by_seed in networks["validation"].items()}
    for row, by_group in picks(validation, group).items():
        for first, (kind, seed) in by_group.items():
            scores = ", ".join(f"{name} {played[kind][seed].mean_return:.3f}" for name, played in networks.items())
            print(f"  {row} from seeds {first}-{first + group - 1}: {kind} seed {seed} ({scores})", flush=True)
            for name, played in networks.items():
                if name != "validation":
                    played.setdefault(row, {})[first] = played[kind][seed]


POOL_MAY_DIFFER = ("seeds", "first_seed", "json", "root", "threads", "pool")  # what pooled runs may set apart


def pool(paths: list[Path], group: int) -> None:
    """Per day set, every policy's mean return and each network's paired differences over the files' seeds;
    with ``group`` > 1 the picked rows are chosen again from the pooled validation returns.  The files must
    come from the same settings (``POOL_MAY_DIFFER`` aside) and days, and share no network seed."""
    runs = [json.loads(path.read_text()) for path in paths]
    settings = [{k: v for k, v in run["args"].items() if k not in POOL_MAY_DIFFER} for run in runs]
    for path, other in zip(paths[1:], settings[1:], strict=True):
        if other != settings[0]:
            differ = sorted(k for k in other.keys() | settings[0].keys() if other.get(k) != settings[0].get(k))
            raise SystemExit(f"{path} was run with other settings than {paths[0]} ({', '.join(differ)})")
    names = [name for name in ("validation", "later", "held-out") if "returns" in runs[0].get(name, {})]
    pooled: dict[str, dict[str, dict[int, list[float]]]] = {}
    for name in names:
        if any(run.get(name, {}).get("days") != runs[0][name]["days"] for run in runs):
            raise SystemExit(f"the pooled files played different {name} days")
        returns = pooled.setdefault(name, {})
        for run in runs:
            for policy, by_seed in run[name]["returns"].items():
                if policy.endswith("-picked"):
                    continue
                for seed, values in by_seed.items():
                    if policy != "heuristic" and int(seed) in returns.get(policy, {}):
                        raise SystemExit(f"{policy} seed {seed} is in two of the pooled files")
                    returns.setdefault(policy, {})[int(seed)] = values
    if group > 1:
        if "validation" not in pooled:
            raise SystemExit("picking needs the validation days' returns (--validation-days)")
        validation = {kind: {seed: statistics.fmean(values) for seed, values in by_seed.items()}
                      for kind, by_seed in pooled["validation"].items() if kind not in BASELINES or kind == "bc"}
        for row, by_group in picks(validation, group).items():
            for name in names:
                if name != "validation":
                    pooled[name][row] = {first: pooled[name][kind][seed] for first, (kind, seed) in by_group.items()}
    for name, returns in pooled.items():
        print(f"\n{name}: days {runs[0][name]['days'][0]}..{runs[0][name]['days'][-1]}, pooled over {len(paths)} "
              "files\n")
        print("| policy | seeds | mean daily return (95% CI) |\n| --- | --- | --- |")
        for policy, by_seed in returns.items():
            mean, ci95 = mean_ci95([r for values in by_seed.values() for r in values])
            print(f"| {policy} | {len(by_seed)} | {mean:.3f} ± {ci95:.3f} |")
        print_paired(comparisons(returns))


def main() -> None:
    args = parse_args()
    if args.pool:
        pool(args.pool, args.select_from)
        return
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    with scratch_folder(args.root, "rlpipe-offline-value-") as folder:
        store = ObjectStore(folder.resolve().as_uri())
        card, data = prepare(store, args)
        held_out = held_out_days(card, args.eval_days)
        day_sets = {"held-out": held_out}
        if args.validation_days:
            day_sets["validation"] = list(range(held_out[-1] + 1, held_out[-1] + 1 + args.validation_days))
        if args.later_days:
            first = held_out[-1] + 1 + args.validation_days
            day_sets["later"] = list(range(first, first + args.later_days))
        networks = train_and_play(card, data, args, day_sets)
        if args.select_from > 1:
            add_picked(networks, args.select_from)
        summary = {name: summarise_days(networks[name] | play_baselines(store, card, args, days), days)
                   for name, days in day_sets.items()}
    for name in ("validation", "later", "held-out"):  # the held-out table, the result, last
        if name in summary:
            print_table(summary[name], args, name)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, **summary}, indent=2))


if __name__ == "__main__":
    main()
