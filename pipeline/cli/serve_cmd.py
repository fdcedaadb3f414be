"""``rlpipe serve``: the Tinker-compatible API on this machine, or one of its parts.

Set up (one line each): the embedded stack if no broker is configured (as
``rlpipe run`` does), the base models (``tiny`` is built once), the API's
topics; then the parts of ``--role``: a trainer process per base model
(``python -m consumers.api.worker``, the same command a cluster runs; ``pipeline``
never imports the engine), a sampler process per base model
(``python -m producers.api_sampler``, transformers by default, ``--sampler vllm``)
and the gateway, served by uvicorn in this process.
The base URL and an SDK example are printed once the gateway listens.
"""

from __future__ import annotations

import json
import logging
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from pipeline.cli.common import EXIT_FAILURE, EXIT_USAGE, console, fail, handle_user_errors, reachable_store
from pipeline.cli.options import SetOpt, run_config, setup_logging
from pipeline.devstack.process import free_port, stop_processes
from schemas.config import MAX_BATCH_SEQUENCES

if TYPE_CHECKING:
    from pipeline.io.store import ObjectStore
    from schemas.config import BusConfig

app = typer.Typer(name="serve", add_completion=False)
log = logging.getLogger("rlpipe.serve")
Role = Literal["all", "gateway", "trainer", "sampler"]
DEFAULT_MAX_LORA_RANK = 32  # the tinker SDK's default rank


def trainer_command(base_model: str, store_root: str, bootstrap: str, namespace: str,
                    max_adapters: int | None = None, idle_unload_s: float | None = None,
                    health_port: int | None = None) -> list[str]:
    """The argv of one trainer process (one per base model); ``max_adapters``: training clients held in its
    engine at once; ``idle_unload_s``: how long one without a call stays (both: the trainer's default if None);
    ``health_port``: where it serves /healthz and /readyz (none if None)."""
    command = [sys.executable, "-m", "consumers.api.worker", "--base-model", base_model, "--store", store_root,
               "--bootstrap", bootstrap, "--namespace", namespace]
    if max_adapters is not None:
        command += ["--max-adapters", str(max_adapters)]
    if idle_unload_s is not None:
        command += ["--idle-unload-s", f"{idle_unload_s:g}"]
    return command + (["--health-port", str(health_port)] if health_port else [])


def sampler_command(base_model: str, store_root: str, bootstrap: str, namespace: str, backend: str,
                    direct_port: int | None = None, max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
                    health_port: int | None = None, max_batch_sequences: int | None = None) -> list[str]:
    """The argv of one sampler process (one per base model); ``direct_port``: its direct endpoint;
    ``max_lora_rank``: the largest adapter rank a vLLM sampler loads; ``health_port``: where it serves
    /healthz and /readyz (none if None); ``max_batch_sequences``: a transformers sampler's batch (its
    default if None)."""
    command = [sys.executable, "-m", "producers.api_sampler", "--base-model", base_model, "--store", store_root,
               "--bootstrap", bootstrap, "--namespace", namespace, "--backend", backend]
    if backend == "vllm":
        command += ["--max-lora-rank", str(max_lora_rank)]
    if max_batch_sequences is not None:
        command += ["--max-batch-sequences", str(max_batch_sequences)]
    if direct_port:
        command += ["--direct-port", str(direct_port)]
    return command + (["--health-port", str(health_port)] if health_port else [])


def bus_environment(bus: BusConfig) -> dict[str, str]:
    """``RLPIPE_BUS__`` variables that give an engine process the settings of ``bus`` that differ from the
    defaults (the bootstrap servers and namespace excepted: its command line names them)."""
    from schemas.config import BusConfig

    defaults, variables = BusConfig(), {}
    for name in BusConfig.model_fields:
        value = getattr(bus, name)
        if name in ("bootstrap_servers", "namespace") or value == getattr(defaults, name):
            continue
        secret = getattr(value, "get_secret_value", None)
        variables[f"RLPIPE_BUS__{name.upper()}"] = str(secret() if secret else value)
    return variables


def engine_environment(bus: BusConfig) -> dict[str, str]:
    """The environment of an engine process: this one's, with the settings of ``bus`` it needs passed on."""
    from pipeline.config import child_environment

    return child_environment({**bus_environment(bus), "RLPIPE_BUS__BOOTSTRAP_SERVERS": bus.bootstrap_servers})


def sdk_example(base_url: str, base_model: str, open_keys: bool = True) -> str:
    """Three lines that point the tinker SDK at this server (with configured keys: a tenant's key)."""
    key = "tml-anything" if open_keys else "<a tenant's key from RLPIPE_API_KEYS>"
    return (f"import tinker  # TINKER_API_KEY={key}\n"
            f"service = tinker.ServiceClient(base_url={base_url!r})\n"
            f"training = service.create_lora_training_client(base_model={base_model!r}, rank=8).result()")


def resolve_models(names: list[str]) -> list[str]:
    """``tiny`` becomes the tiny model's folder (built here on first use); paths are made absolute."""
    from pipeline.devstack.launcher import rlpipe_command
    from pipeline.models import ModelNotBuiltError, resolve_base_model
    from schemas.config import ModelConfig

    resolved = []
    for name in names:
        try:
            resolved.append(resolve_base_model(ModelConfig(base_model=name)))
        except ModelNotBuiltError:
            log.info("initialising the tiny base model (built once, then cached)")
            subprocess.run(rlpipe_command("model", "init-tiny"), check=True)
            resolved.append(resolve_base_model(ModelConfig(base_model=name)))
    return [str(Path(p).resolve()) if Path(p).exists() else p for p in resolved]


@app.command(epilog="Examples: rlpipe serve;  rlpipe serve --base-model /models/a --base-model /models/b;  "
                    "rlpipe serve --role trainer --base-model /models/a")
@handle_user_errors
def serve(
    base_model: Annotated[list[str] | None, typer.Option(
        "--base-model", "-m", help="A base model to serve (a local folder, a hub id, or 'tiny'); repeat for "
        "several. --role gateway only names it: a folder only the engines have needs no copy there.")] = None,
    role: Annotated[str, typer.Option(help="all | gateway | trainer | sampler")] = "all",
    host: Annotated[str, typer.Option(help="Address the gateway listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the gateway.")] = 8000,
    sampler: Annotated[str, typer.Option(help="Sampling engine: transformers | vllm.")] = "transformers",
    max_lora_rank: Annotated[int, typer.Option(
        help="--sampler vllm: the largest LoRA rank it samples (vLLM reserves a slot this wide per adapter; "
             "one of 1, 8, 16, 32, 64, 128, 256, 320, 512).")] = DEFAULT_MAX_LORA_RANK,
    max_batch_sequences: Annotated[int | None, typer.Option(
        min=1, max=MAX_BATCH_SEQUENCES, help="--sampler transformers, --role all|sampler: the most sequences a sampler decodes "
                              "together, as one batch of calls sharing weights and settings; smaller lets other "
                              "tenants' calls in sooner (default 16).")] = None,
    direct_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="--role sampler: also take calls straight from a gateway on 127.0.0.1:PORT "
                               "(PORT+1, ... for further base models).")] = None,
    direct_sampler: Annotated[list[str] | None, typer.Option(
        help="--role gateway: a sampler's direct endpoint (http://127.0.0.1:PORT), one per --base-model in "
             "order; --role all wires its own.")] = None,
    public_url: Annotated[str | None, typer.Option(
        help="--role all|gateway: the gateway's address as clients reach it (e.g. https://rl.example.org behind a "
             "proxy), for the download URLs it signs; default: the address each request came to.")] = None,
    max_adapters: Annotated[int | None, typer.Option(
        min=1, help="--role all|trainer: training clients held in a trainer's engine at once; the least recently "
                    "used are saved to the store and leave, and reload at their next call (default: no limit).")
    ] = None,
    idle_unload_s: Annotated[float | None, typer.Option(
        min=0.0, help="--role all|trainer: a training client without a call this many seconds is saved to the "
                      "store and leaves the trainer's engine until its next call (default 600).")] = None,
    health_port: Annotated[int | None, typer.Option(
        min=1, max=65535, help="--role trainer|sampler: each engine serves /healthz and /readyz (loaded, reading "
                               "calls) on 0.0.0.0:PORT (PORT+1, ... for further base models), for probes.")] = None,
    overrides: SetOpt = None,
) -> None:
    """Serve the Tinker-compatible API: the gateway, one trainer and one sampler per base model (the embedded
    stack is started if nothing is configured).  Point the tinker SDK at the printed base URL."""
    from pipeline.devstack.launcher import EMBEDDED_GROUP_TIMINGS_MS, ensure_stack
    from pipeline.io.bus import GROUP_TIMINGS_ENV, ensure_topics
    from pipeline.models import check_model_path
    from pipeline.runtime import resolved_bus
    from pipeline.topics import API_TOPIC_KINDS
    from schemas.config import LORA_RANK_SLOTS

    if role not in ("all", "gateway", "trainer", "sampler"):
        fail(f"--role {role!r} is not one of all, gateway, trainer, sampler", EXIT_USAGE)
    if sampler not in ("transformers", "vllm"):
        fail(f"--sampler {sampler!r} is not one of transformers, vllm", EXIT_USAGE)
    if max_lora_rank not in LORA_RANK_SLOTS:
        fail(f"--max-lora-rank {max_lora_rank} is not a vLLM rank slot; use one of "
             f"{', '.join(map(str, LORA_RANK_SLOTS))}", EXIT_USAGE)
    if max_batch_sequences is not None and (sampler != "transformers" or role not in ("all", "sampler")):
        fail("--max-batch-sequences is the transformers sampler's (vLLM batches continuously); use it with "
             "--sampler transformers and --role all or sampler", EXIT_USAGE)
    if direct_sampler and role != "gateway":
        fail("--direct-sampler is for --role gateway; --role all wires its samplers itself", EXIT_USAGE)
    bad = [url for url in direct_sampler or [] if not url.startswith(("http://", "https://"))]
    if bad:
        fail(f"--direct-sampler {bad[0]!r} is not a URL; give http://HOST:PORT of a sampler's --direct-port",
             EXIT_USAGE)
    if direct_sampler and len(direct_sampler) != len(base_model or ["tiny"]):
        fail(f"{len(direct_sampler)} --direct-sampler URLs for {len(base_model or ['tiny'])} base models; give one "
             "per --base-model", EXIT_USAGE)
    if public_url is not None and not public_url.startswith(("http://", "https://")):
        fail(f"--public-url {public_url!r} is not a URL; give the gateway's address as clients reach it, "
             "e.g. https://rl.example.org", EXIT_USAGE)
    if (max_adapters is not None or idle_unload_s is not None) and role not in ("all", "trainer"):
        fail("--max-adapters and --idle-unload-s are the trainer's; use them with --role all or trainer", EXIT_USAGE)
    if direct_port and role != "sampler":
        fail("--direct-port is for --role sampler; --role all picks its own ports", EXIT_USAGE)
    if health_port and role not in ("trainer", "sampler"):
        fail("--health-port is for --role trainer or sampler (the gateway answers /api/v1/healthz on its --port)",
             EXIT_USAGE)
    # before the stack, the models and the engines take minutes to start
    if role in ("all", "gateway"):
        check_listen_address("the gateway", host, port, "--port")
        check_gateway_settings()
    for offset in range(len(base_model or ["tiny"]) if health_port and role in ("trainer", "sampler") else 0):
        check_listen_address("an engine's health endpoints", "0.0.0.0", health_port + offset, "--health-port")
    setup_logging()
    cfg = run_config(None, None, overrides or [])
    # the gateway only names the models (it routes calls to their engines): a folder it lacks is the engines'
    named = [name for name in base_model or ["tiny"] if role != "gateway" or name == "tiny" or Path(name).exists()]
    for name in named:
        check_model_path(name)  # before anything starts
    ensure_stack(cfg, outlives="the server")
    bus, store = resolved_bus(cfg.bus), reachable_store(cfg.store)
    resolved = dict(zip(named, resolve_models(named), strict=True))  # as the engines name them
    models = [resolved.get(name, name) for name in base_model or ["tiny"]]
    ensure_topics(bus, API_TOPIC_KINDS)
    env = engine_environment(bus)
    if not cfg.bus.bootstrap_servers:
        env.setdefault(GROUP_TIMINGS_ENV, json.dumps(EMBEDDED_GROUP_TIMINGS_MS))
    stop_on_sigterm()
    health_ports = {m: health_port + i for i, m in enumerate(models)} if health_port else {}
    engines = [(f"trainer for {m}", trainer_command(m, store.root, bus.bootstrap_servers, bus.namespace,
                                                    max_adapters, idle_unload_s, health_ports.get(m)))
               for m in models] if role in ("all", "trainer") else []
    # with the gateway in this process, each sampler also takes its calls straight from it (pipeline.api.direct)
    direct_ports = ({m: free_port() for m in models} if role == "all"
                    else {m: direct_port + i for i, m in enumerate(models)} if direct_port else {})
    engines += [(f"sampler for {m}", sampler_command(m, store.root, bus.bootstrap_servers, bus.namespace, sampler,
                                                     direct_ports.get(m), max_lora_rank, health_ports.get(m),
                                                     max_batch_sequences))
                for m in models] if role in ("all", "sampler") else []
    if role in ("trainer", "sampler"):  # one role per process: its supervisor (Kubernetes) starts it again
        workers = [start_engine(command, env) for _, command in engines]
        try:
            raise typer.Exit(max(process.wait() for process in workers))
        finally:
            stop_workers(workers)
    supervisor = EngineSupervisor(engines, env).start()
    try:
        urls = dict(zip(models, direct_sampler, strict=True)) if direct_sampler else {
            m: f"http://127.0.0.1:{p}" for m, p in direct_ports.items()}
        run_gateway(store, bus, models, host, port, urls, public_url)
    finally:
        supervisor.stop()


def check_gateway_settings() -> None:
    """Fail in one line on API keys or a gateway limit set wrong in the environment (``RLPIPE_API_KEYS``,
    ``RLPIPE_API_MAX_*``, ``RLPIPE_API_THREADS*``), before anything starts."""
    from pipeline.api.tenants import TenantLimits, Tenants
    from pipeline.api.threads import ThreadLimits

    try:
        Tenants.from_env()
        TenantLimits.from_env()
        ThreadLimits.from_env()
    except ValueError as exc:
        fail(str(exc), EXIT_USAGE)


def check_listen_address(what: str, host: str, port: int, option: str) -> None:
    """Fail in one line if ``what`` could not listen on ``host:port`` (a port in use, an unknown host)."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                             flags=socket.AI_PASSIVE)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no conflict
            sock.bind(address)
    except OSError as exc:
        fail(f"{what} cannot listen on {host}:{port} ({exc.strerror or exc}); choose another {option}"
             + (", or another --host" if option == "--port" else ""), EXIT_FAILURE)


def stop_on_sigterm() -> None:
    """Make SIGTERM and SIGHUP raise ``SystemExit`` here, so serve's ``finally`` stops its engine processes.

    uvicorn shuts down gracefully on SIGTERM, then restores the handler it found and raises the
    signal again; under Python's default handler that ended serve at once and left its engines running.
    A closed terminal (SIGHUP) reaches serve alone, its engines being in process groups of their own.
    """
    signal.signal(signal.SIGTERM, _exit_on_signal)
    signal.signal(signal.SIGHUP, _exit_on_signal)


def _exit_on_signal(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def start_engine(command: list[str], env: dict[str, str] | None) -> subprocess.Popen[bytes]:
    """An engine process in a process group of its own: a Ctrl-C at serve's terminal reaches serve alone, which then
    stops each engine once with SIGTERM (the terminal's SIGINT and then serve's request made it abort its shutdown)."""
    return subprocess.Popen(command, env=env, process_group=0)


def stop_workers(workers: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> None:
    """Ask the engine processes to stop; kill those still running after ``timeout_s``.

    An engine whose broker went away first (``rlpipe down`` before serve) can hang in its
    shutdown while its client waits for the broker; serve never leaves one running.
    """
    stop_processes(workers, timeout_s)


class EngineSupervisor:
    """Starts serve's engine processes and starts again one that exits while serve runs.

    A trainer resumes from its folds and its request log, a sampler holds nothing, so a
    restart loses no call: the calls after the last fold run again in order.  An engine
    that exits ``max_restarts`` times within ``window_s`` is left stopped, with an error
    naming it (a crash loop, such as a base model that no longer loads, is not retried
    for ever).  ``stop()`` stops them all and starts nothing after.
    """

    def __init__(self, engines: list[tuple[str, list[str]]], env: dict[str, str] | None, max_restarts: int = 5,
                 window_s: float = 600.0, poll_s: float = 1.0) -> None:
        self.engines, self.env = engines, env
        self.max_restarts, self.window_s, self.poll_s = max_restarts, window_s, poll_s
        self.processes = [start_engine(command, env) for _, command in engines]
        self._restarts: list[list[float]] = [[] for _ in engines]
        self._given_up: set[int] = set()
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._watch, name="engine-supervisor", daemon=True)

    def start(self) -> EngineSupervisor:
        self._thread.start()
        return self

    def _watch(self) -> None:
        while not self._stopping.wait(self.poll_s):
            with self._lock:
                for index in range(len(self.engines)):
                    if not self._stopping.is_set():
                        self._check(index)

    def _check(self, index: int) -> None:
        code = self.processes[index].poll()
        if code is None or index in self._given_up:
            return
        name, command = self.engines[index]
        now = time.monotonic()
        recent = [t for t in self._restarts[index] if now - t < self.window_s]
        if len(recent) >= self.max_restarts:
            self._given_up.add(index)
            log.error("%s exited with code %s after %d restarts in %.0f s; giving up on it (see its log above)",
                      name, code, len(recent), self.window_s)
            return
        log.error("%s exited with code %s; starting it again (calls after its last fold run again)", name, code)
        self.processes[index] = start_engine(command, self.env)
        self._restarts[index] = [*recent, now]

    def stop(self, timeout_s: float = 60.0) -> None:
        """Stop watching, then stop every engine (killing those still running after ``timeout_s``)."""
        self._stopping.set()
        with self._lock:
            stop_workers(self.processes, timeout_s)
        self._thread.join(timeout=self.poll_s + 5)


def run_gateway(store: ObjectStore, bus: BusConfig, models: list[str], host: str, port: int,
                direct_urls: dict[str, str] | None = None, public_url: str | None = None) -> None:
    """Serve the gateway with uvicorn until Ctrl-C; ``direct_urls``: samplers that take calls straight from it;
    ``public_url``: its address as clients reach it (for signed download URLs)."""
    import uvicorn

    from pipeline.api.app import create_app
    from pipeline.api.direct import DirectSamplers
    from pipeline.api.gateway import Gateway, ServedModel
    from pipeline.api.results import ResultSignals
    from pipeline.api.tenants import TenantLimits, Tenants
    from pipeline.api.threads import ThreadLimits
    from pipeline.io.bus import EventPublisher
    from schemas.config import SamplerConfig

    tenants, threads = Tenants.from_env(), ThreadLimits.from_env()
    publisher = EventPublisher(bus, create_topics=False)
    gateway = Gateway(store, lambda event, key: publisher.publish("requests", event, key),
                      [ServedModel(m, m, SamplerConfig().max_model_len) for m in models],  # the samplers' context
                      limits=TenantLimits.from_env())
    base_url = f"http://{host}:{port}"
    console.print(f"rlpipe Tinker-compatible API at {base_url}  (store {store.root}, topics {bus.namespace}.requests"
                  f"/.results)\n{tenants.describe()}\nserving: {', '.join(models)}\n\n"
                  f"{sdk_example(base_url, models[0], tenants.open)}", markup=False, soft_wrap=True)
    signals, stopping = ResultSignals(), threading.Event()
    signals.follow(bus, stopping.is_set)
    try:
        direct = DirectSamplers(direct_urls, signals) if direct_urls else None
        uvicorn.run(create_app(gateway, tenants, signals=signals, direct=direct, public_url=public_url,
                               threads=threads),
                    host=host, port=port, log_level="warning")
    finally:
        stopping.set()
        publisher.close()


command = typer.main.get_command(app)
