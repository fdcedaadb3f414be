"""Sampling latency through the Tinker-compatible API: the direct path against the log alone, side by side.

One stack as ``rlpipe serve`` runs it on a laptop: a private Tansu broker whose log
lives in the local S3 server (the embedded stack's durable log; ``--log-storage
memory`` for Tansu's in-memory log), a file:// store, one sampler for the tiny model
(``python -m producers.api_sampler --direct-port P``) and two gateways on it:

- **direct**: ``rlpipe serve --role gateway --direct-sampler http://127.0.0.1:P``,
  which hands each sample call to the sampler as well as putting it on the log;
- **log**: ``rlpipe serve --role gateway``, the log and ``<ns>.results`` alone.

Each round sends N concurrent ``sample`` calls (a turn of N live episodes: a
CartPole-sized prompt, up to 12 tokens, temperature 1) through the real SDK and
waits for all N.  Rounds alternate between the two gateways, so the machine's load
and the log's length fall on both alike.  Then ``--grow`` filler events (accepted
calls for a model nobody serves, skipped by every engine) lengthen
``<ns>.requests`` as a long session does, and the rounds run again.

    python bench/api_sample_latency.py                       # N = 1, 8, 32; 10 rounds each; then +10,000 events
    python bench/api_sample_latency.py --rounds 4 --grow 0 --json-out latency.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.options import model_folder, non_negative_int, positive_int

PROMPT_WORDS = ("CartPole: keep a pole balanced upright on a moving cart by pushing the cart left or right. "
                "Cart position 0.012, velocity -0.031, pole angle 0.044, angular velocity 0.020. Your action?")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=positive_int, nargs="+", default=[1, 8, 32], help="concurrent calls per round")
    parser.add_argument("--rounds", type=positive_int, default=10, help="timed rounds per arm and round size")
    parser.add_argument("--grow", type=non_negative_int, default=10_000,
                        help="filler events put on <ns>.requests before a second pass (0: one pass)")
    parser.add_argument("--log-storage", choices=["s3", "memory"], default="s3",
                        help="where the broker keeps its log (s3: the embedded stack's local S3 server)")
    parser.add_argument("--base-model", type=model_folder, default="tiny", help="a model folder, or 'tiny' (built once)")
    parser.add_argument("--json-out", type=Path, default=None)
    return parser.parse_args(argv)


# ---- the stack ------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def stack(base_model: str, log_storage: str, folder: Path) -> Iterator[dict[str, Any]]:
    """Broker (and S3 server), a sampler with a direct endpoint, and the two gateways; their URLs and env."""
    import httpx

    from bench.tinker_overhead import wait_for
    from pipeline.devstack.broker import TansuBroker
    from pipeline.devstack.process import free_port, stop_processes
    from pipeline.devstack.s3_server import LocalS3Server

    with contextlib.ExitStack() as exits:
        storage, environment = "memory://tansu/", None
        if log_storage == "s3":
            s3 = exits.enter_context(LocalS3Server(log_path=folder / "s3.log"))
            storage, environment = s3.storage_url(), s3.broker_environment()
        broker = TansuBroker(log_path=folder / "tansu.log", storage_engine=storage, environment=environment)
        exits.enter_context(broker)
        namespace = f"bench{uuid.uuid4().hex[:8]}"
        env = {**os.environ, "RLPIPE_BUS__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
               "RLPIPE_BUS__NAMESPACE": namespace, "RLPIPE_STORE__ROOT": f"file://{folder}/store",
               "RLPIPE_HOME": f"{folder}/home", "TINKER_TELEMETRY": "0"}
        direct_port, ports = free_port(), {"direct": free_port(), "log": free_port()}
        rlpipe = [sys.executable, "-c", "from pipeline.cli.main import main; main()"]
        processes: list[subprocess.Popen[bytes]] = []
        exits.callback(stop_processes, processes, 60.0)
        with open(folder / "engines.log", "ab") as log:
            processes.append(subprocess.Popen(
                [sys.executable, "-m", "producers.api_sampler", "--base-model", base_model, "--store",
                 env["RLPIPE_STORE__ROOT"], "--bootstrap", broker.bootstrap_servers, "--namespace", namespace,
                 "--direct-port", str(direct_port)], env=env, stdout=log, stderr=subprocess.STDOUT))
            for arm, port in ports.items():
                extra = ["--direct-sampler", f"http://127.0.0.1:{direct_port}"] if arm == "direct" else []
                processes.append(subprocess.Popen(
                    [*rlpipe, "serve", "--role", "gateway", "--base-model", base_model, "--port", str(port), *extra],
                    env=env, stdout=log, stderr=subprocess.STDOUT))
        urls = {arm: f"http://127.0.0.1:{port}" for arm, port in ports.items()}
        for url in urls.values():
            wait_for(lambda url=url: httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200, 180)
        yield {"urls": urls, "bootstrap": broker.bootstrap_servers, "namespace": namespace}


def grow_log(bootstrap: str, namespace: str, events: int) -> float:
    """Put ``events`` filler calls (for a model nobody serves) on ``<ns>.requests``, one record batch each."""
    from kafka import KafkaProducer

    from schemas.api import ApiRequestAccepted
    from schemas.events import encode_event, make_event

    filler = ApiRequestAccepted(request_id="filler.sample.0.1", tenant="filler", session_id="filler", op="sample",
                                model_id="filler.sample.0", seq_id=1, base_model="/models/served-by-nobody",
                                body_path="sessions/filler/requests/x.json", body_sha256="0" * 64)
    value = encode_event(make_event("filler", filler))
    producer = KafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, batch_size=1)  # one batch per event
    started = time.monotonic()
    for n in range(events):
        producer.send(f"{namespace}.requests", value=value, key=b"filler")
        if n % 500 == 499:
            producer.flush()
    producer.flush()
    producer.close()
    return time.monotonic() - started


# ---- the rounds -----------------------------------------------------------------------------------------------------


def measure(urls: dict[str, str], base_model: str, sizes: list[int], rounds: int) -> dict[str, dict[str, list[float]]]:
    """Seconds per round, per arm and round size; the arms alternate round by round (who goes first swaps)."""
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base_model)
    prompt = tokenizer(PROMPT_WORDS)["input_ids"]
    clients = {arm: tinker.ServiceClient(base_url=url, api_key=f"tml-{arm}").create_sampling_client(
        base_model=base_model) for arm, url in urls.items()}

    async def one_round(arm: str, size: int, seed: int) -> float:
        started = time.perf_counter()
        await asyncio.gather(*(clients[arm].sample_async(
            types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=12, temperature=1.0, seed=seed + i))
            for i in range(size)))
        return time.perf_counter() - started

    async def all_rounds() -> dict[str, dict[str, list[float]]]:
        times: dict[str, dict[str, list[float]]] = {arm: {} for arm in urls}
        for size in sizes:
            for arm in urls:  # warm-up round per arm and size
                await one_round(arm, size, 0)
            for r in range(rounds):
                order = list(urls) if r % 2 == 0 else list(reversed(urls))
                for arm in order:
                    times[arm].setdefault(str(size), []).append(await one_round(arm, size, 1000 * r))
            print(f"  {size:>3} calls: direct {statistics.median(times['direct'][str(size)]) * 1000:.0f} ms, "
                  f"log {statistics.median(times['log'][str(size)]) * 1000:.0f} ms (medians)", flush=True)
        return times

    return asyncio.run(all_rounds())


def main(argv: list[str] | None = None) -> int:
    from pipeline.cli.serve_cmd import resolve_models

    args = parse_args(argv)
    base_model = resolve_models([args.base_model])[0]
    load_before = os.getloadavg()
    passes = []
    with tempfile.TemporaryDirectory() as folder, stack(base_model, args.log_storage, Path(folder)) as served:
        print(f"sampler + 2 gateways on a Tansu broker ({args.log_storage} log); {args.rounds} rounds per arm",
              flush=True)
        print("fresh log:", flush=True)
        passes.append({"filler_events": 0, "seconds": measure(served["urls"], base_model, args.calls, args.rounds)})
        if args.grow:
            took = grow_log(served["bootstrap"], served["namespace"], args.grow)
            print(f"+{args.grow:,} events on <ns>.requests ({took:.0f} s):", flush=True)
            passes.append({"filler_events": args.grow,
                           "seconds": measure(served["urls"], base_model, args.calls, args.rounds)})
    load_after = os.getloadavg()
    print("\n| log | calls per round | direct (median s) | log only (median s) | log / direct |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for one in passes:
        for size in args.calls:
            direct = statistics.median(one["seconds"]["direct"][str(size)])
            alone = statistics.median(one["seconds"]["log"][str(size)])
            print(f"| +{one['filler_events']:,} events | {size} | {direct:.3f} | {alone:.3f} | x{alone / direct:.2f} |")
    print(f"\nload average {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f} before, "
          f"{load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} after")
    if args.json_out:
        args.json_out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "passes": passes,
                                             "load_before": load_before, "load_after": load_after}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
