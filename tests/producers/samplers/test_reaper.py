"""The engine reaper: an engine's processes end when their owner dies, however it dies, and nothing else does.

A stand-in owner (a small script, no vLLM) starts a long-sleeping "engine" child, registers it with the
watcher as ``VLLMEngine`` registers its engine core and worker (the multiprocessing children the engine's
start added, and theirs), then starts a bystander the watcher was never told about.  SIGKILL of the owner must
end the engine child within a few seconds; a clean close must end the watcher and leave the bystander.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from producers.samplers.reaper import EngineReaper, engine_processes, reap, started_children

REPO_ROOT = Path(__file__).resolve().parents[3]
SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]

OWNER = textwrap.dedent(
    """
    import multiprocessing, subprocess, sys, time
    from producers.samplers.reaper import EngineReaper, engine_processes, started_children

    before = started_children()
    engine = multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,))  # vLLM's: spawn
    engine.start()
    reaper = EngineReaper(engine_processes(before))
    bystander = subprocess.Popen({sleeper!r})
    print(engine.pid, bystander.pid, reaper.watcher_pid, flush=True)
    if sys.argv[1] == "close":  # as VLLMEngine.close: vLLM stops its processes, then the reaper stands down
        engine.terminate()
        engine.join()
        reaper.close()
        print("closed", flush=True)
    time.sleep(600)
    """
)


def _ended(pid: int) -> bool:
    """True once ``pid`` is gone (a zombie waiting for its reaping parent counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_ended(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if _ended(pid):
            return True
        time.sleep(0.05)
    return _ended(pid)


@pytest.fixture
def owner(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], list[int]]]:
    """Start the stand-in owner; yields it and a list the test fills with pids to clean up afterwards."""
    script = tmp_path / "owner.py"
    script.write_text(OWNER.format(sleeper=SLEEPER))
    started: list[subprocess.Popen[str]] = []
    leftovers: list[int] = []

    def start(mode: str) -> subprocess.Popen[str]:
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
        process = subprocess.Popen([sys.executable, str(script), mode], stdout=subprocess.PIPE, text=True, env=env)
        started.append(process)
        return process

    yield start, leftovers  # type: ignore[misc]
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()
        if process.stdout is not None:
            process.stdout.close()
    for pid in leftovers:
        if not _ended(pid):
            os.kill(pid, signal.SIGKILL)


def _read_pids(process: subprocess.Popen[str]) -> tuple[int, int, int]:
    assert process.stdout is not None
    engine_pid, bystander_pid, watcher_pid = (int(word) for word in process.stdout.readline().split())
    return engine_pid, bystander_pid, watcher_pid


def test_sigkill_of_the_owner_ends_its_engine_processes_and_nothing_else(owner) -> None:
    start, leftovers = owner
    process = start("stay")
    engine_pid, bystander_pid, watcher_pid = _read_pids(process)
    leftovers += [engine_pid, bystander_pid, watcher_pid]
    assert not _ended(engine_pid) and not _ended(watcher_pid)
    assert os.getsid(watcher_pid) != os.getsid(process.pid)  # a terminal's Ctrl-C reaches the owner, not it

    process.kill()
    process.wait()

    assert _wait_ended(engine_pid, timeout_s=5.0), "the engine process outlived its SIGKILLed owner"
    assert _wait_ended(watcher_pid, timeout_s=5.0), "the watcher did not exit after reaping"
    assert not _ended(bystander_pid), "the watcher ended a process it was not told about"


def test_a_clean_close_ends_the_watcher_and_kills_nothing(owner) -> None:
    start, leftovers = owner
    process = start("close")
    engine_pid, bystander_pid, watcher_pid = _read_pids(process)
    leftovers += [engine_pid, bystander_pid, watcher_pid]
    assert process.stdout.readline().strip() == "closed"

    assert _wait_ended(watcher_pid, timeout_s=5.0), "the watcher outlived the engine's clean close"
    assert not _ended(bystander_pid)
    assert process.poll() is None  # the owner itself lives on


def test_a_reused_pid_is_never_killed() -> None:
    """A listed pid whose process started at another time is another process: left alone."""
    sleeper = subprocess.Popen(SLEEPER)
    try:
        started = psutil.Process(sleeper.pid).create_time()
        assert reap([(sleeper.pid, started - 60.0)], grace_s=1.0) == []
        assert sleeper.poll() is None
        assert reap([(sleeper.pid, started)], grace_s=1.0) == [sleeper.pid]
        assert _wait_ended(sleeper.pid, timeout_s=5.0)  # reap waited for it: its exit status is psutil's now
    finally:
        if sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()


def _start_a_grandchild() -> None:  # an engine core that starts its worker
    subprocess.run(SLEEPER, check=False)


def test_the_owner_lists_only_its_engine_processes() -> None:
    """What a start began with multiprocessing, children's children too; not a process another thread started
    meanwhile with subprocess."""
    import multiprocessing

    before = started_children()
    engine = multiprocessing.get_context("fork").Process(target=_start_a_grandchild)
    engine.start()
    other = subprocess.Popen(SLEEPER)
    try:
        deadline = time.monotonic() + 10.0
        while len(engine_processes(before)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        new = engine_processes(before)
        assert {p.pid for p in new} == {engine.pid, *(c.pid for c in psutil.Process(engine.pid).children())}
        assert len(new) == 2 and other.pid not in {p.pid for p in new}
        assert EngineReaper.identities(new) == sorted((p.pid, p.create_time()) for p in new)
    finally:
        for p in engine_processes(before):
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        engine.join()
        other.kill()
        other.wait()


def test_the_resource_tracker_is_not_an_engine_process() -> None:
    """vLLM's spawn starts multiprocessing's resource tracker; it is the owner's and cleans up after it."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    tracker_pid = resource_tracker._resource_tracker._pid
    assert tracker_pid in {p.pid for p in psutil.Process().children()}
    assert tracker_pid not in {p.pid for p in engine_processes(set())}
