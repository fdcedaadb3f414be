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

from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore


def time_ms(call: Callable[[], object], repeat: int) -> float:
    call()
    started = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - started) / repeat * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", type=int, nargs="+", default=[35, 2000, 10000])
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print("| committed versions | listing ms | probe ms |\n| ---: | ---: | ---: |")
    for count in args.versions:
        with tempfile.TemporaryDirectory(prefix="rlpipe-bench-") as tmp:
            registry = AdapterRegistry(ObjectStore(Path(tmp).as_uri()), "bench")
            for version in range(1, count + 1):
                folder = Path(tmp) / registry.version_key(version)
                folder.mkdir(parents=True)
                (folder / "manifest.json").write_bytes(b"{}")
            listing = time_ms(registry._next_version, args.repeat)
            probe = time_ms(partial(registry._follows_a_committed, count + 1), args.repeat)
            print(f"| {count:,} | {listing:.2f} | {probe:.3f} |")


if __name__ == "__main__":
    main()
