"""Scanning a 10-million-row steps dataset: does a time + zone query cost what it matches?

Writes a synthetic building log through the real writer (``pipeline.io.datasets.DatasetWriter``:
one partition file per day, card last): ``--buildings`` episodes per day (one per
building), 288 five-minute steps each, ``--days`` days (100 x 288 x 348 = 10,022,400
rows), 4 zones with temperature and occupancy, outside air, two actions and the
reward.  Values are vectorised numpy (a daily sine plus noise, quantised to 1/64 K so
Parquet's encodings have something to work with), not the simulator.

Then times queries of growing time windows, each for one zone's columns:
- ``scan_steps``: ``pipeline.io.datasets.scan_steps`` (partition pruning on the card's per-file
  time ranges, then polars on the chosen files with the time filter and the column
  projection pushed down), collected;
- ``read_steps``: the same selection through pyarrow, as an Arrow table with the steps schema;
- ``polars, all files``: ``pl.scan_parquet`` over every file of the dataset, same filter and
  columns (polars skips row groups by their statistics, but opens every file's footer).
Prints matched rows, median seconds of ``--repeats`` runs and rows/s as a markdown table.

Run: .venv/bin/python bench/steps_scan.py [--days 348] [--buildings 100] [--root DIR] [--keep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import polars as pl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.cpu import LoadAverage
from bench.options import positive_int
from pipeline.io.datasets import (
    BASE_COLUMNS,
    DatasetField,
    DatasetWriter,
    device_columns,
    read_card,
    read_steps,
    scan_steps,
    select_files,
)
from pipeline.io.steps_arrays import steps_table_from_arrays
from pipeline.io.store import ObjectStore

STEPS_PER_DAY = 288
ZONES = 4
START = dt.datetime(2023, 1, 1, 8, 0, tzinfo=dt.UTC)  # local midnight at UTC-8
US = 1_000_000


def day_arrays(day: int, buildings: int, rng: np.random.Generator) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """One day of every building: timestamps and feature columns (row = building-major, then step)."""
    steps = np.arange(STEPS_PER_DAY)
    t0 = int((START + dt.timedelta(days=day)).timestamp()) * US
    times = np.tile(t0 + steps * 300 * US, buildings)
    hour = np.tile(steps / 12.0, buildings)
    daily = np.sin(2 * np.pi * (hour - 9) / 24)
    features: dict[str, np.ndarray] = {}
    for z in range(ZONES):
        noise = rng.normal(0, 0.3, times.size)
        features[f"zone_{z}@zone_air_temperature_sensor"] = np.round((293 + 2 * daily + noise) * 64) / 64
        occupied = (hour >= 8) & (hour < 18) & (day % 7 < 5)
        features[f"zone_{z}@zone_occupancy"] = np.where(occupied, rng.integers(0, 9, times.size), 0).astype(float)
    features["outside@outside_air_temperature_sensor"] = np.round((278 + 5 * daily) * 64) / 64
    features["action:boiler_0@supply_water_setpoint"] = np.round(rng.uniform(310, 355, times.size), 1)
    features["action:ahu_0@supply_air_heating_temperature_setpoint"] = np.round(rng.uniform(285, 300, times.size), 1)
    features["reward:agent_reward_value"] = np.round(-rng.uniform(0, 0.3, times.size) * 1024) / 1024
    return times, features


def write_dataset(store: ObjectStore, name: str, days: int, buildings: int) -> float:
    """Write the synthetic dataset; return seconds taken."""
    started = time.perf_counter()
    rng = np.random.default_rng(0)
    writer = DatasetWriter(store, name).open()
    fields = None
    for day in range(days):
        times, features = day_arrays(day, buildings, rng)
        names = list(features)
        observation = [n for n in names if not n.startswith(("action:", "reward:"))]
        action = [n for n in names if n.startswith("action:")]
        starts = np.arange(buildings) * STEPS_PER_DAY
        ids = [f"b{b:03d}-d{day:04d}" for b in range(buildings)]
        table = steps_table_from_arrays(ids, starts, times, features, observation, action,
                                        features["reward:agent_reward_value"])
        writer.write_partition((START - dt.timedelta(hours=8) + dt.timedelta(days=day)).date(), table)
        fields = [DatasetField(name=n, role="observation" if n in observation else n.split(":")[0],
                               source_id=n.split(":")[-1], unit=None) for n in names]
        if day % 50 == 0:
            print(f"  wrote day {day}/{days}", flush=True)
    writer.commit(source="synthetic", fields=fields, observation_columns=observation, action_columns=action,
                  reward_column="reward:agent_reward_value", step_seconds=300.0,
                  description="bench/steps_scan.py synthetic building log")
    return time.perf_counter() - started


def timed(fn, repeats: int) -> tuple[float, int]:
    """Median seconds over ``repeats`` runs (after one warm-up) and the rows of the last result."""
    rows = fn()
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        rows = fn()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--days", type=positive_int, default=348)
    parser.add_argument("--buildings", type=positive_int, default=100)
    parser.add_argument("--root", type=Path, default=None, help="folder for the store (default: a temporary one)")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed runs per query (median)")
    parser.add_argument("--keep", action="store_true", help="keep the dataset afterwards")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    folder = args.root or Path(tempfile.mkdtemp(prefix="rlpipe-scan-"))
    store = ObjectStore(folder.resolve().as_uri())
    name = f"scan-{args.days}d-{args.buildings}b"
    try:
        if not store.exists(f"datasets/{name}/dataset.json"):
            print(f"writing {args.days * args.buildings * STEPS_PER_DAY:,} rows to {store.url('datasets/' + name)}")
            print(f"  {write_dataset(store, name, args.days, args.buildings):.0f} s")
        card = read_card(store, name)
        size = sum(f.size_bytes for f in card.files)
        print(f"{card.num_rows:,} rows in {len(card.files)} files, {size / 2**20:.0f} MiB on disk")
        columns = [*BASE_COLUMNS[:3], *device_columns(card, ["zone_2"])]  # episode_id, step, timestamp + one zone
        glob = store.path(f"datasets/{name}/steps") + "/**/*.parquet"
        print("\n| window | matched rows | files read | scan_steps s | scan_steps rows/s | read_steps (Arrow) s "
              "| polars, all files s | polars, all files rows/s |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- |")
        load = LoadAverage()  # around the queries, named after the table
        for days in (1, 7, 30, 90, args.days):
            start = START + dt.timedelta(days=args.days // 2 - days // 2 if days < args.days else 0, hours=3)
            end = start + dt.timedelta(days=days)

            def ours(start=start, end=end) -> int:
                return scan_steps(store, name, start, end, columns=columns).collect().height

            def ours_arrow(start=start, end=end) -> int:
                return read_steps(store, name, start, end, columns=columns).num_rows

            def direct(start=start, end=end) -> int:
                frame = pl.scan_parquet(glob).filter((pl.col("timestamp") >= start) & (pl.col("timestamp") < end))
                return frame.select(columns).collect().height

            our_s, our_rows = timed(ours, args.repeats)
            arrow_s, arrow_rows = timed(ours_arrow, args.repeats)
            pl_s, pl_rows = timed(direct, args.repeats)
            assert our_rows == pl_rows == arrow_rows, (our_rows, pl_rows, arrow_rows)
            files = len(select_files(card, start, end))
            print(f"| {days} d | {our_rows:,} | {files} | {our_s:.3f} | {our_rows / our_s:,.0f} | {arrow_s:.3f} | "
                  f"{pl_s:.3f} | {pl_rows / pl_s:,.0f} |", flush=True)
        print(f"\n{load}")
    finally:
        if not args.keep and args.root is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
