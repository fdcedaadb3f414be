"""The busy-CPU meter and the bound it puts on several jobs at once."""

import time

import pytest

from bench.cpu import CpuMeter, busy_core_seconds, cpu_bound
from bench.packing import level_bounds


def test_the_bound_is_what_the_cores_give_at_one_jobs_cost():
    assert cpu_bound(3, 2, alone_wall_s=10.0, alone_busy_s=8.0) == pytest.approx(2.5)  # 24 core-s on 2 cores: 12 s
    assert cpu_bound(2, 2, alone_wall_s=10.0, alone_busy_s=8.0) == 2.0  # no job faster than alone
    assert cpu_bound(3, 2, alone_wall_s=10.0, alone_busy_s=20.0) == pytest.approx(1.0)  # alone it used both cores
    assert cpu_bound(3, 2, alone_wall_s=10.0, alone_busy_s=0.0) == 3.0


def test_the_meter_reads_any_window_between_its_samples():
    meter = CpuMeter()
    meter.times, meter.busy = [100.0, 102.0, 104.0], [50.0, 52.0, 56.0]
    assert meter.busy_between(100.0, 104.0) == pytest.approx(6.0)
    assert meter.busy_between(101.0, 103.0) == pytest.approx(3.0)  # 1 + 2, linear between samples
    assert meter.busy_between(90.0, 200.0) == pytest.approx(6.0)  # clamped to what was sampled


def test_the_meter_sees_this_process_spin():
    with CpuMeter(period_s=0.05) as meter:
        start = time.time()
        while time.time() - start < 0.4:
            pass
        end = time.time()
    assert busy_core_seconds() > 0
    assert meter.busy_between(start, end) >= 0.2  # one core spun for 0.4 s (other processes only add)


def test_packing_bounds_come_from_the_first_one_run_level():
    one = {"runs": 1, "combined": {"window_s": 100.0, "cpu_busy_s": 80.0}}
    three = {"runs": 3, "combined": {"window_s": 60.0, "cpu_busy_s": 110.0}}
    assert level_bounds([one, three], cores=2) == {1: 1.0, 3: pytest.approx(2.5)}
    assert level_bounds([three], cores=2) == {}


def test_the_load_average_is_named_before_and_after_a_measurement():
    from bench.cpu import LoadAverage, load_text

    assert load_text(1.234, 3.0) == "load average 1.23 before, 3.00 after"
    with LoadAverage() as load:
        assert load.before >= 0 and load.after is None
    assert load.after is not None and str(load) == load_text(load.before, load.after)
