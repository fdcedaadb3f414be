"""Several researchers at once: 1, 2 and 3 copies of the CartPole loop against one Tinker-compatible server.

One server (a private Tansu broker, a file:// store under ``--out``: a new temporary
folder unless given, printed at the start and the end; ``rlpipe serve``
with its trainer and sampler for the tiny model), warmed up with one sample and one
training call.  Then, level by level, that many copies of ``examples/tinker_cartpole.py``
run at once, client ``k`` with ``--seed k`` and its own API key (its own tenant), each
writing ``--result-file``.  Per level:

- wall time, and the combined throughput: the clients' trained tokens (tokens in
  ``forward_backward`` calls) and sampled tokens, summed, over the level's wall time;
- the trainer's and the sampler's busy fraction in the level's window, from the
  activity the engines record (``rlpipe report --server``; the level's figure is
  written to ``OUT/level-N/server_duty_cycle.png``);
- the machine's CPU: core-seconds busy in the level's window (every process: server,
  broker, clients) over what its cores could give, and from level 1's the **CPU bound**
  on any level's ratio: with each client costing what it costs alone, N clients need N
  times level 1's core-seconds, so their throughput over level 1's is at most
  ``min(N, cores x level-1 wall / level-1 busy core-seconds)``;
- per client, the last version's held-out mean return with its 95% interval, next to
  the same seed's run alone (seed 0 alone is level 1; the other seeds are run alone
  first, unless ``--no-alone``), and whether the two intervals overlap: a client that
  shares the server should end where it ends alone, within sampling noise.

The goal: 3 clients reach at least 2x the combined throughput of 1.

    python bench/tinker_clients.py                                  # levels 1 2 3, the short loop
    python bench/tinker_clients.py --levels 1 3 --loop-args "--rl-steps 10 --eval-episodes 32"
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.cpu import LoadAverage, busy_core_seconds, cpu_bound  # noqa: E402 - after the project root is on the path
from bench.options import model_folder, positive_int  # noqa: E402
from schemas.evaluation import mean_ci95  # noqa: E402

EXAMPLE = ROOT / "examples" / "tinker_cartpole.py"
SHORT_LOOP = ("--demo-episodes 10 --sft-steps 4 --batch 32 --rl-steps 3 --group-size 4 --eval-episodes 8 "
              "--max-steps 30")  # a few minutes per client on a CPU
GOAL, GOAL_CLIENTS = 2.0, 3  # the goal: level 3's combined throughput at least 2x level 1's
ACTIVITY_FLUSH_WAIT_S = 12.0  # the engines write their activity every 10 s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--levels", type=positive_int, nargs="+", default=[1, 2, 3], help="clients at once, per level")
    parser.add_argument("--loop-args", default=SHORT_LOOP,
                        help="options of examples/tinker_cartpole.py for every client (not --seed/--result-file)")
    parser.add_argument("--no-alone", action="store_true",
                        help="do not run seeds 1.. alone first (then only client 0 has a result alone)")
    parser.add_argument("--base-model", type=model_folder, default="tiny", help="a model folder, or 'tiny' (built once)")
    parser.add_argument("--sampler", default="transformers", choices=["transformers", "vllm"])
    parser.add_argument("--out", type=Path, default=None,
                        help="results, client logs, the server's log and store, a figure per level (default: a new "
                             "temporary folder, kept and printed)")
    args = parser.parse_args(argv)
    if 1 not in args.levels:
        parser.error("--levels needs level 1 (the baseline), e.g. --levels 1 2 3")
    if any(flag in shlex.split(args.loop_args) for flag in ("--seed", "--result-file", "--base-url", "--base-model")):
        parser.error("--loop-args sets the loop's own options; the bench sets --seed, --result-file and the server")
    return args


# ---- pure figures -------------------------------------------------------------------------------------------------


def mean_interval(samples: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval (``mean_ci95``; NaN for fewer than two samples)."""
    if not samples:
        return math.nan, math.nan
    mean, half = mean_ci95(samples)
    return mean, half if len(samples) > 1 else math.nan


def intervals_overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Whether mean +/- half of ``a`` and of ``b`` overlap (a NaN half-width counts as overlapping)."""
    if math.isnan(a[1]) or math.isnan(b[1]):
        return True
    return abs(a[0] - b[0]) <= a[1] + b[1]


@dataclass
class Level:
    """One level's measured figures."""

    clients: int
    seconds: float
    trained_tokens: int
    sampled_tokens: int
    trainer_busy: float
    sampler_busy: float
    results: list[dict[str, Any]]  # per client: its result file
    window: tuple[float, float] | None = None  # unix seconds: rlpipe report --server --since A --until B redraws it
    cpu_busy_s: float = math.nan  # core-seconds the whole machine was busy in the window
    cores: int = 1

    @property
    def cpu_busy_fraction(self) -> float:
        return self.cpu_busy_s / (self.cores * self.seconds)

    @property
    def trained_per_s(self) -> float:
        return self.trained_tokens / self.seconds

    @property
    def sampled_per_s(self) -> float:
        return self.sampled_tokens / self.seconds

    @property
    def tokens_per_s(self) -> float:
        return (self.trained_tokens + self.sampled_tokens) / self.seconds

    def to_json(self) -> dict[str, Any]:
        return {"clients": self.clients, "window": self.window, "seconds": self.seconds, "trained_tokens": self.trained_tokens,
                "sampled_tokens": self.sampled_tokens, "trained_tokens_per_s": self.trained_per_s,
                "sampled_tokens_per_s": self.sampled_per_s, "tokens_per_s": self.tokens_per_s,
                "trainer_busy_fraction": self.trainer_busy, "sampler_busy_fraction": self.sampler_busy,
                "cpu_busy_core_seconds": self.cpu_busy_s, "cores": self.cores,
                "cpu_busy_fraction": self.cpu_busy_fraction, "results": self.results}


def level_cpu_bound(first: Level, clients: int) -> float:
    """The most ``clients`` at once can reach over level 1's throughput on this machine's CPU (``cpu_bound``)."""
    return cpu_bound(clients, first.cores, first.seconds, first.cpu_busy_s)


def busy_by_kind(summary: dict[str, Any], lanes: list[dict[str, Any]]) -> dict[str, float]:
    """The busy fraction of the trainer and of the sampler (the busiest engine of each kind)."""
    busy = {"trainer": 0.0, "sampler": 0.0}
    for lane in lanes:
        fraction = summary["busy_fraction"].get(lane["name"])
        if lane["kind"] in busy and fraction is not None:
            busy[lane["kind"]] = max(busy[lane["kind"]], fraction)
    return busy


# ---- the server ---------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def server(base_model: str, sampler: str, out: Path) -> Iterator[str]:
    """A private broker, a store in ``out/store`` and ``rlpipe serve`` (gateway, trainer, sampler); the base URL."""
    import httpx

    from bench.tinker_overhead import wait_for
    from pipeline.devstack.broker import TansuBroker
    from pipeline.devstack.process import free_port
    from pipeline.io.bus import GROUP_TIMINGS_ENV

    with tempfile.TemporaryDirectory() as folder, TansuBroker(log_path=out / "tansu.log") as broker:
        port = free_port()
        env = {**os.environ, "RLPIPE_BUS__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
               "RLPIPE_BUS__NAMESPACE": f"bench{uuid.uuid4().hex[:8]}", "RLPIPE_STORE__ROOT": store_root(out),
               "RLPIPE_HOME": f"{folder}/home", GROUP_TIMINGS_ENV: json.dumps(
                   {"session_timeout_ms": 6000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 600_000})}
        with open(out / "server.log", "ab") as log:
            process = subprocess.Popen(
                [sys.executable, "-c", "from pipeline.cli.main import main; main()", "serve", "--base-model",
                 base_model, "--port", str(port), "--sampler", sampler], env=env, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200, 180)
            yield url
        finally:
            _stop(process)


def output_folder(out: Path | None) -> Path:
    """``out`` (created), or a new temporary folder: never the working directory the bench was started in."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="rlpipe-bench-clients-"))
    out.mkdir(parents=True, exist_ok=True)
    return out


def store_root(out: Path) -> str:
    return f"file://{(out / 'store').resolve()}"


def _stop(process: subprocess.Popen[bytes]) -> None:
    """Stop ``rlpipe serve`` (it stops its engines), then whatever of its process group is left."""
    from pipeline.devstack.process import stop_processes

    stop_processes([process], timeout_s=90.0)
    for sig in (signal.SIGTERM, signal.SIGKILL):  # serve's own group: its engines, should any outlive it
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        time.sleep(10.0)


def warm_up(url: str, base_model: str) -> None:
    """One sample and one training step, so level 1 does not pay for the engines' start."""
    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-bench-warmup")
    sampling = service.create_sampling_client(base_model=base_model).result()
    sampling.sample(types.ModelInput.from_ints([5, 17, 42]), 1, types.SamplingParams(max_tokens=4)).result()
    training = service.create_lora_training_client(base_model=base_model, rank=8).result()
    datum = types.Datum(model_input=types.ModelInput.from_ints([5, 17, 42]),
                        loss_fn_inputs={"target_tokens": [17, 42, 9], "weights": [1.0] * 3})
    training.forward_backward([datum], "cross_entropy").result()
    training.optim_step(types.AdamParams(learning_rate=1e-4)).result()


# ---- the clients --------------------------------------------------------------------------------------------------


def run_clients(url: str, base_model: str, seeds: list[int], loop_args: str, folder: Path,
                label: str) -> tuple[float, float, list[dict[str, Any]], float]:
    """Run one client per seed at once.

    (start, end) in unix seconds, each client's result in seed order, and the core-seconds
    the machine was busy meanwhile.
    """
    folder.mkdir(parents=True, exist_ok=True)
    processes = []
    start, busy_before = time.time(), busy_core_seconds()
    for seed in seeds:
        env = {**os.environ, "TINKER_API_KEY": f"tml-bench-client-{seed}", "TINKER_TELEMETRY": "0"}
        log = open(folder / f"client-{seed}.log", "wb")  # noqa: SIM115 - the child owns it
        processes.append(subprocess.Popen(
            [sys.executable, str(EXAMPLE), "--base-url", url, "--base-model", base_model, *shlex.split(loop_args),
             "--seed", str(seed), "--result-file", str(folder / f"client-{seed}.json")],
            env=env, stdout=log, stderr=subprocess.STDOUT))
    try:
        _follow(processes, seeds, folder, label, start)
    finally:
        for process in processes:
            if process.poll() is None:
                process.terminate()
                process.wait(timeout=30)
    end, busy = time.time(), busy_core_seconds() - busy_before
    failed = [seed for seed, p in zip(seeds, processes, strict=True) if p.returncode != 0]
    if failed:
        raise RuntimeError(f"{label}: the clients with seeds {failed} failed; see {folder}/client-<seed>.log")
    return start, end, [json.loads((folder / f"client-{seed}.json").read_text()) for seed in seeds], busy


def _follow(processes: list[subprocess.Popen[bytes]], seeds: list[int], folder: Path, label: str,
            start: float) -> None:
    """Print each client's newest progress line as it changes, until every client has ended."""
    shown: dict[int, str] = {}
    while any(p.poll() is None for p in processes):
        time.sleep(2.0)
        for seed in seeds:
            line = _last_line(folder / f"client-{seed}.log")
            if line and shown.get(seed) != line:
                shown[seed] = line
                print(f"  [{label} {time.time() - start:6.0f} s] seed {seed}: {line}", flush=True)


def _last_line(path: Path) -> str:
    try:
        lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except FileNotFoundError:
        return ""
    progress = [line for line in lines if line.startswith(("sft step", "rl step", "held-out", "base "))]
    return progress[-1][:140] if progress else ""


def measure_level(store_url: str, clients: int, start: float, end: float, results: list[dict[str, Any]],
                  folder: Path, cpu_busy_s: float) -> Level:
    """The level's figures, and its duty-cycle figure and JSON in ``folder`` (``rlpipe report --server``)."""
    from pipeline.analysis.report.server import write_server_report
    from pipeline.io.store import ObjectStore

    _, body = write_server_report(ObjectStore(store_url), folder, start, end)
    busy = busy_by_kind(body["summary"], body["duty_cycle"]["lanes"])
    return Level(clients, end - start, sum(int(r["tokens"]["trained"]) for r in results),
                 sum(int(r["tokens"]["sampled"]) for r in results), busy["trainer"], busy["sampler"], results,
                 (start, end), cpu_busy_s, os.cpu_count() or 1)


# ---- the table ----------------------------------------------------------------------------------------------------


def cpu_busy_text(level: Level) -> str:
    """``76% of 2 cores``, or ``-`` when the level's CPU was not measured."""
    return "-" if math.isnan(level.cpu_busy_s) else f"{level.cpu_busy_fraction:.0%} of {level.cores} cores"


def report_lines(levels: list[Level], alone: dict[int, dict[str, Any]]) -> list[str]:
    """The printed table: throughput and duty per level, then each client against its seed alone."""
    lines = ["clients | wall s | trained tok/s | sampled tok/s | all tok/s | trainer busy | sampler busy | CPU busy",
             "---: | ---: | ---: | ---: | ---: | ---: | ---: | ---:"]
    for level in levels:
        lines.append(f"{level.clients} | {level.seconds:.0f} | {level.trained_per_s:.1f} | {level.sampled_per_s:.1f} "
                     f"| {level.tokens_per_s:.1f} | {level.trainer_busy:.0%} | {level.sampler_busy:.0%} "
                     f"| {cpu_busy_text(level)}")
    lines += ["", "clients | seed | held-out return (95%) | alone | overlap", "---: | ---: | --- | --- | ---"]
    for level in levels:
        for seed, result in enumerate(level.results):
            mine = mean_interval(result["samples"])
            base = mean_interval(alone[seed]["samples"]) if seed in alone else None
            shown_alone = f"{base[0]:.1f} +/- {base[1]:.1f}" if base else "-"
            overlap = ("yes" if intervals_overlap(mine, base) else "NO") if base else "-"
            lines.append(f"{level.clients} | {seed} | {mine[0]:.1f} +/- {mine[1]:.1f} | {shown_alone} | {overlap}")
    first, last = levels[0], levels[-1]
    goal = next((level for level in levels if level.clients == GOAL_CLIENTS), None)
    if goal is not None and goal is not last:
        lines += ["", versus_first(first, goal)]
    if last.clients != first.clients:
        ratio = last.tokens_per_s / first.tokens_per_s
        lines += ["", versus_first(first, last)]
        if not math.isnan(first.cpu_busy_s):
            bound = level_cpu_bound(first, last.clients)
            lines.append(f"CPU bound on this machine: x{bound:.2f} ({first.cpu_busy_s:.0f} busy core-seconds per "
                         f"client alone, {first.cores} cores); reached {ratio / bound:.2f} of it")
    return lines


def versus_first(first: Level, level: Level) -> str:
    """``level``'s throughput over level 1's; at ``GOAL_CLIENTS`` clients, whether it meets the goal."""
    ratio = level.tokens_per_s / first.tokens_per_s
    line = (f"{level.clients} clients vs 1: x{ratio:.2f} all tokens/s (trained x{level.trained_per_s / first.trained_per_s:.2f}, "
            f"sampled x{level.sampled_per_s / first.sampled_per_s:.2f})")
    if level.clients == GOAL_CLIENTS:
        line += f"; goal x{GOAL:.1f}: {'met' if ratio >= GOAL else 'not met'}"
    return line


def main(argv: list[str] | None = None) -> int:
    from pipeline.cli.serve_cmd import resolve_models

    args = parse_args(argv)
    (base_model,) = resolve_models([args.base_model])
    out = output_folder(args.out)
    levels = sorted(set(args.levels))
    print(f"loop: examples/tinker_cartpole.py {args.loop_args}\nlevels: {levels}; out: {out}", flush=True)
    alone: dict[int, dict[str, Any]] = {}
    measured: list[Level] = []
    with server(base_model, args.sampler, out) as url, LoadAverage() as load:
        print(f"server at {url}; warming up", flush=True)
        warm_up(url, base_model)
        for clients in levels:
            print(f"level {clients}: {clients} client(s) at once", flush=True)
            folder = out / f"level-{clients}"
            start, end, results, cpu_busy_s = run_clients(url, base_model, list(range(clients)), args.loop_args,
                                                          folder, f"level {clients}")
            time.sleep(ACTIVITY_FLUSH_WAIT_S)  # the window's activity reaches the store
            measured.append(measure_level(store_root(out), clients, start, end, results, folder, cpu_busy_s))
            if clients == 1:
                alone[0] = results[0]
                for seed in [] if args.no_alone else range(1, max(levels)):
                    print(f"seed {seed} alone", flush=True)
                    _, _, (result,), _ = run_clients(url, base_model, [seed], args.loop_args,
                                                  out / f"alone-{seed}", f"seed {seed} alone")
                    alone[seed] = result
            print(f"level {clients}: {measured[-1].seconds:.0f} s, {measured[-1].tokens_per_s:.1f} tokens/s, "
                  f"trainer {measured[-1].trainer_busy:.0%} busy, sampler {measured[-1].sampler_busy:.0%} busy, "
                  f"CPU {measured[-1].cpu_busy_fraction:.0%} busy", flush=True)
    lines = [*report_lines(measured, alone), str(load)]
    print("\n".join(lines))
    (out / "summary.json").write_text(json.dumps(
        {"loop_args": args.loop_args, "levels": [level.to_json() for level in measured],
         "alone": {str(seed): result for seed, result in alone.items()}, "table": lines,
         "load_average": {"before": load.before, "after": load.after}}, indent=2))
    print(f"results, logs and the server's store: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
