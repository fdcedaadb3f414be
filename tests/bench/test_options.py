"""The option types the benchmarks share, and every benchmark refusing a bad option in one line before it starts."""

from __future__ import annotations

import argparse
import importlib
import tempfile
from pathlib import Path

import pytest

from bench.options import model_folder, non_negative_int, positive_int, scratch_folder


def test_the_shared_types_name_the_bad_value(tmp_path: Path) -> None:
    assert positive_int("3") == 3 and non_negative_int("0") == 0
    for parse, bad in ((positive_int, "0"), (positive_int, "-2"), (positive_int, "two"), (non_negative_int, "-5")):
        with pytest.raises(argparse.ArgumentTypeError, match=repr(bad)):
            parse(bad)
    assert model_folder("tiny") == "tiny"
    with pytest.raises(argparse.ArgumentTypeError, match=r"no config\.json"):
        model_folder(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert model_folder(str(tmp_path)) == str(tmp_path)


def test_a_scratch_folder_is_removed_and_a_given_root_is_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with scratch_folder(None, "rlpipe-x-") as folder:
        (folder / "file").write_text("x")
        assert folder.parent == tmp_path / "tmp" and folder.name.startswith("rlpipe-x-")
    assert not list((tmp_path / "tmp").iterdir())
    with scratch_folder(tmp_path / "mine", "rlpipe-x-") as folder:
        assert folder == tmp_path / "mine"
    assert (tmp_path / "mine").is_dir()


# (benchmark, argv, what the one error line must name)
REFUSED = [
    ("registry_versions", ["--repeat", "0"], "--repeat"),
    ("checkpoint_size", ["--repeats", "0"], "--repeats"),
    ("checkpoint_size", ["--early", "20", "--late", "10"], "--early"),
    ("learner_overhead", ["--steps", "0", "--warmup-steps", "0"], "--steps"),
    ("learner_overhead", ["--threads", "-1"], "--threads"),
    ("learner_overhead", ["--rows", "0"], "--rows"),
    ("learner_overhead", ["--toggle-writes", "--block-steps", "10", "--steps", "10", "--warmup-steps", "10"],
     "--toggle-writes"),
    ("learner_train_step", ["--rounds", "0"], "--rounds"),
    ("shared_prefix", ["--steps", "0"], "--steps"),
    ("shared_prefix", ["--env", "nosuch"], "--env"),
    ("warm_start", ["--every", "0"], "--every"),
    ("value_pipeline", ["learn", "--eval-every", "0"], "--eval-every"),
    ("value_pipeline", ["learn", "--preset", "nosuch"], "nosuch"),
    ("value_pipeline", ["throughput", "--preset", "demo"], "--preset"),
    ("slateq_recsim", ["--users", "0"], "--users"),
    ("slateq_recsim", ["--episodes", "0"], "--episodes"),
    ("steps_scan", ["--repeats", "0"], "--repeats"),
    ("steps_scan", ["--days", "0"], "--days"),
    ("building_heuristic_variants", ["--days", "0"], "--days"),
    ("building_heuristic_variants", ["--first-day", "-5"], "--first-day"),
    ("distributed_learner", ["--steps", "0"], "--steps"),
    ("tinker_overhead", ["--base-model", "/nonexistent"], "--base-model"),
    ("tinker_clients", ["--base-model", "/nonexistent"], "--base-model"),
    ("api_sample_latency", ["--rounds", "0"], "--rounds"),
    ("eval_in_flight", ["--run", "r", "--rounds", "0"], "--rounds"),
    ("sync_loop", ["--set", "learner.nosuch=1"], "learner.nosuch"),
    ("async_vs_sync", ["--set", "learner.nosuch=1"], "learner.nosuch"),
    ("packing", ["--levels", "0"], "--levels"),
    ("packing", ["--set", "learner.nosuch=1"], "learner.nosuch"),
    ("demo_reliability", ["--preset", "nosuch"], "nosuch"),
    ("demo_reliability", ["--preset", "text2sql"], "text2sql"),
    ("demo_reliability", ["--runs", "0"], "--runs"),
    ("offline_value_building", ["--seeds", "0"], "--seeds"),
    ("offline_building", ["--seeds", "0"], "--seeds"),
]


@pytest.mark.parametrize(("bench", "argv", "named"), REFUSED, ids=[f"{b} {' '.join(a)}" for b, a, _ in REFUSED])
def test_a_bad_option_is_one_argparse_line_before_anything_starts(bench, argv, named, capsys) -> None:
    module = importlib.import_module(f"bench.{bench}")
    with pytest.raises(SystemExit) as exc:
        module.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]
    assert "Traceback" not in err and ": error: " in last and named in last, err
    if bench == "packing":
        assert "--concurrency" not in err  # the parser it shares names the option it was given
