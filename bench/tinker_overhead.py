"""Tinker-compatible API overhead: forward_backward + optim_step through the SDK and the server, against the
same operations called directly on the training engine, with the same data.

- **direct**: a ``TrainingEngine`` in this process; per step one ``forward_backward``
  (cross_entropy) over the whole batch and one ``optim_step``, through the same
  translation of the SDK's types the trainer uses (``consumers.api.worker.ops``).
- **api**: a private Tansu broker and file:// store, ``rlpipe serve --role gateway``
  and a trainer process (``python -m consumers.api.worker``), driven by the real
  ``tinker`` SDK: ``forward_backward(batch).result()`` then ``optim_step().result()``.

Both arms run one warm-up step, then ``--steps`` timed steps each, alternating step
by step (who goes first swaps every step), so a shared machine's load falls on both
alike; neither computes while the other does.  The figure is the API's speed as a
fraction of direct (direct seconds per step / API seconds per step; goal >= 0.9
for 64 sequences of 256 tokens on the tiny model).

    python bench/tinker_overhead.py                          # 64 x 256, 5 timed steps
    python bench/tinker_overhead.py --batch 8 --seq-len 64 --steps 2 --json-out overhead.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import model_folder, positive_int


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=64, help="sequences per forward_backward")
    parser.add_argument("--seq-len", type=positive_int, default=256, help="tokens per sequence")
    parser.add_argument("--steps", type=positive_int, default=5, help="timed steps per arm (after one warm-up step)")
    parser.add_argument("--base-model", type=model_folder, default="tiny", help="a model folder, or 'tiny' (built once)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json-out", default=None, help="also write the figures here as JSON")
    parser.add_argument("--server-log", default=None, help="keep the gateway's and trainer's log here")
    return parser.parse_args(argv)


def make_batch(batch: int, seq_len: int, vocab: int, seed: int = 0) -> list[Any]:
    """``batch`` datums of ``seq_len`` random tokens (targets = the next token, weight 1)."""
    from tinker import types

    rng = np.random.default_rng(seed)
    rows = rng.integers(3, vocab, (batch, seq_len + 1))
    return [types.Datum(model_input=types.ModelInput.from_ints(row[:-1].tolist()),
                        loss_fn_inputs={"target_tokens": row[1:].tolist(), "weights": [1.0] * seq_len})
            for row in rows]


def speed_ratio(direct_s_per_step: float, api_s_per_step: float) -> float:
    """The API's speed as a fraction of direct (1.0 = no overhead)."""
    return direct_s_per_step / api_s_per_step


def interleaved(direct_step: Any, api_step: Any, steps: int,
                log: Callable[[str], None] | None = None) -> tuple[list[float], list[float]]:
    """Seconds of each timed step per arm, after one warm-up step each; the arms alternate step by step
    and swap who goes first every step, so a shared machine's load falls on both alike.  ``log`` gets a
    line as each timed step ends."""
    direct_step()
    api_step()
    direct_s, api_s = [], []
    for index in range(steps):
        order = [(direct_step, direct_s), (api_step, api_s)]
        for step, times in order if index % 2 == 0 else order[::-1]:
            started = time.perf_counter()
            step()
            times.append(time.perf_counter() - started)
        if log is not None:
            log(f"step {index + 1}/{steps}: direct {direct_s[-1]:.3f} s, API {api_s[-1]:.3f} s")
    return direct_s, api_s


def direct_step(base_model: str, data: list[Any], device: str) -> Any:
    """One direct step (forward_backward + optim_step on an engine in this process), as a callable."""
    from tinker import types

    from consumers.api.worker import ops
    from consumers.engine import TrainingEngine

    engine = TrainingEngine(base_model, device=device)
    request = types.CreateModelRequest(session_id="bench", model_seq_id=0, base_model=base_model,
                                       lora_config=types.LoraConfig(rank=8))
    ops.create_model(engine, "bench:train:0", request)
    fb = types.ForwardBackwardRequest(types.ForwardBackwardInput(data, "cross_entropy"), "bench:train:0")
    adam = types.OptimStepRequest(adam_params=types.AdamParams(learning_rate=1e-4), model_id="bench:train:0")

    def step() -> None:  # the trainer's translation both times, so the step's undo point is paid in both arms
        ops.forward_backward(engine, "bench:train:0", fb, False)
        ops.optim_step(engine, "bench:train:0", adam)

    return step


@contextlib.contextmanager
def api_server(base_model: str, device: str, server_log: str | None = None) -> Iterator[str]:
    """A private broker and store, the gateway and a trainer (real processes); yields the base URL."""
    import httpx

    from pipeline.devstack.broker import TansuBroker
    from pipeline.devstack.process import free_port

    with tempfile.TemporaryDirectory() as folder, TansuBroker(log_path=Path(folder) / "tansu.log") as broker:
        port, store = free_port(), f"file://{folder}/store"
        env = {**os.environ, "RLPIPE_BUS__BOOTSTRAP_SERVERS": broker.bootstrap_servers,
               "RLPIPE_BUS__NAMESPACE": f"bench{uuid.uuid4().hex[:8]}", "RLPIPE_STORE__ROOT": store,
               "RLPIPE_HOME": f"{folder}/home", "RLPIPE_KAFKA_GROUP_TIMINGS_MS": json.dumps(
                   {"session_timeout_ms": 6000, "heartbeat_interval_ms": 300, "max_poll_interval_ms": 600_000})}
        log = open(server_log or Path(folder) / "server.log", "ab")  # noqa: SIM115 - the children own it
        processes = [
            subprocess.Popen([sys.executable, "-c", "from pipeline.cli.main import main; main()", "serve", "--role",
                              "gateway", "--base-model", base_model, "--port", str(port)], env=env, stdout=log,
                             stderr=subprocess.STDOUT),
            subprocess.Popen([sys.executable, "-m", "consumers.api.worker", "--base-model", base_model, "--store",
                              store, "--bootstrap", broker.bootstrap_servers, "--namespace",
                              env["RLPIPE_BUS__NAMESPACE"], "--device", device, "--log-level", "DEBUG"], env=env,
                             stdout=log, stderr=subprocess.STDOUT),
        ]
        try:
            url = f"http://127.0.0.1:{port}"
            wait_for(lambda: httpx.get(f"{url}/api/v1/healthz", timeout=2).status_code == 200, 120)
            yield url
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                process.wait(timeout=60)


def api_step(url: str, base_model: str, data: list[Any]) -> Any:
    """One step through the SDK and the server (forward_backward, then optim_step, each to its result)."""
    import tinker
    from tinker import types

    os.environ["TINKER_TELEMETRY"] = "0"
    training = tinker.ServiceClient(base_url=url, api_key="tml-bench").create_lora_training_client(
        base_model=base_model, rank=8).result()

    def step() -> None:
        training.forward_backward(data, "cross_entropy").result()
        training.optim_step(types.AdamParams(learning_rate=1e-4)).result()

    return step


def wait_for(check: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except Exception:  # not listening yet
            pass
        time.sleep(0.5)
    raise TimeoutError(f"the server did not answer within {timeout_s:.0f} s; see its log")


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoConfig

    from pipeline.cli.serve_cmd import resolve_models

    args = parse_args(argv)
    (base_model,) = resolve_models([args.base_model])
    data = make_batch(args.batch, args.seq_len, int(AutoConfig.from_pretrained(base_model).vocab_size))
    print(f"starting a broker, the gateway and a trainer for {base_model}", flush=True)
    with api_server(base_model, args.device, args.server_log) as url, LoadAverage() as load:
        print(f"server up at {url}; one warm-up step per arm, then {args.steps} timed", flush=True)
        direct_s, api_s = interleaved(direct_step(base_model, data, args.device), api_step(url, base_model, data),
                                      args.steps, lambda line: print(line, flush=True))
    direct, api = sum(direct_s) / len(direct_s), sum(api_s) / len(api_s)
    figures = {"batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "direct_s": direct_s,
               "api_s": api_s, "direct_s_per_step": direct, "api_s_per_step": api,
               "api_speed_vs_direct": speed_ratio(direct, api),
               "median_step_ratio": statistics.median(d / a for d, a in zip(direct_s, api_s, strict=True)),
               "load_average_before": load.before, "load_average_after": load.after}
    print(f"{args.batch} x {args.seq_len} tokens, {args.steps} steps per arm: direct {direct:.3f} s/step, "
          f"API {api:.3f} s/step -> API at {figures['api_speed_vs_direct']:.2f} of direct speed "
          f"(median per-step ratio {figures['median_step_ratio']:.2f}; goal >= 0.9); {load}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
