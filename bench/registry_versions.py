"""What it costs a publisher to find its next version number as a run's versions pile up (local store).

Two ways, side by side, on registries of 35, 2,000 and 10,000 committed versions (empty manifests; only
the folders and names matter):

- listing: ``AdapterRegistry._next_version``, one listing of every version folder (what a publisher that
  does not know its number does);
- probe: ``_follows_a_committed``, one check that the version below the expected one is committed (what the
  learner does, since it counts its own versions).

Run: .venv/bin/python bench/registry_versions.py [--versions 35 2000 10000] [--repeat 20]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore


def time_ms(call: Callable[[], object], repeat: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1e3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=positive_int, nargs="+", default=[35, 2000, 10000])
    parser.add_argument("--repeat", type=positive_int, default=20, help="timed calls per figure (after one untimed)")
    return parser.parse_args(argv)


def measure(count: int, repeat: int) -> str:
    """The table row of a registry of ``count`` committed versions: listing and probe, ms per call."""
    with tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as tmp:
        registry = AdapterRegistry(ObjectStore(Path(tmp).as_uri()), "bench")
        for version in range(1, count + 1):
            folder = Path(tmp) / registry.version_key(version)
            folder.mkdir(parents=True)
            (folder / "manifest.json").write_bytes(b"{}")
        listing = time_ms(registry._next_version, repeat)
        probe = time_ms(partial(registry._follows_a_committed, count + 1), repeat)
        return f"| {count:,} | {listing:.2f} | {probe:.3f} |"


def main() -> None:
    args = parse_args()
    print("| committed versions | listing ms | probe ms |\n| ---: | ---: | ---: |")
    with LoadAverage() as load:
        for count in args.versions:
            print(measure(count, args.repeat), flush=True)
    print(f"\n{load}")


if __name__ == "__main__":
    main()
