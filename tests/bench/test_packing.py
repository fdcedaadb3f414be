"""The packing benchmark's pure parts: options and the processes of each arm."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.async_vs_sync import Bench
from bench.children import Clock
from bench.packing import level_commands, overrides, parse_args


def bench(argv: list[str]) -> Bench:
    args = parse_args(argv)
    return Bench(args, Path("/tmp/home"), overrides(args, None), "127.0.0.1:9092", "file:///tmp/store", Clock(), "t")


def test_packed_starts_one_producer_and_one_learner_for_every_run_and_separate_two_per_run():
    packed = level_commands(bench([]), "packed", ["r0", "r1", "r2"], 2)
    assert [(name, learner) for name, _, learner in packed] == [("r0-producer", False), ("r0-learner", True)]
    for _, argv, _ in packed:
        assert argv[argv.index("--run") :].count("--run") == 3 and argv[-6:] == ["--run", "r0", "--run", "r1",
                                                                                   "--run", "r2"]
    assert "--max-steps" in packed[1][1] and "--max-steps" not in packed[0][1]
    separate = level_commands(bench([]), "separate", ["r0", "r1"], 3)
    assert [name for name, _, _ in separate] == ["r0-producer", "r0-learner", "r1-producer", "r1-learner"]
    assert all(argv[-2:] == ["--run", name.split("-")[0]] for name, argv, _ in separate)


def test_every_run_gets_the_slow_step_and_batch_size_and_the_users_sets_last():
    items = overrides(parse_args(["--step-delay-s", "0.1", "--batch-rows", "32", "--set", "learner.lora_rank=8"]), None)
    assert items[:2] == ["env.step_delay_s=0.1", "learner.batch_rows=32"] and items[-1] == "learner.lora_rank=8"


@pytest.mark.parametrize("argv", [["--arms", "both"], ["--steps", "0"], ["--step-delay-s", "61"]])
def test_bad_options_are_refused(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_a_bad_level_names_the_option_given(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--levels", "0,2"])
    err = capsys.readouterr().err
    assert "argument --levels" in err and "--concurrency" not in err
