"""The learner-overhead bench's own parts: the arms do the same arithmetic, and --toggle-writes splits the learner."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.learner_overhead import NO_WRITES, measure, report, same_work_failure
from producers.tiny_model import build_tiny_model


def test_toggled_writes_split_the_learner_over_the_same_batches_as_the_bare_loops(tmp_path: Path) -> None:
    args = argparse.Namespace(loss="importance_sampling", rows=4, prompt_tokens=16, answer_tokens=4,
                              publish_every=1, checkpoint_every=1, threads=1, warmup_steps=1, steps=4,
                              block_steps=1, toggle_writes=True)
    model = str(build_tiny_model(tmp_path / "model", pretrain=False))
    arms, moved, diffs = measure(args, model, tmp_path / "store", lambda line: None)
    by_name = {arm.name: arm for arm in arms}
    assert list(by_name) == ["learner", NO_WRITES, "bare (head at generated)", "bare (full logits)"]
    assert list(by_name["learner"].blocks) == [2, 4] and list(by_name[NO_WRITES].blocks) == [1, 3]  # alternating
    bare_arms = ("bare (head at generated)", "bare (full logits)")
    assert all(list(by_name[name].blocks) == [1, 2, 3, 4] for name in bare_arms)
    assert diffs and max(diffs.values()) < 1e-6  # every arm trained the same steps on the same batches
    assert moved > 0 and same_work_failure(moved, diffs) is None
    versions = sorted(path.name for path in (tmp_path / "store/runs/bench/adapters").iterdir())
    assert len(versions) == 3  # a version per step written with writes on (warm-up 0, blocks 2 and 4), none between
    text = report(arms, args, (0.0,), (0.0,))
    assert f"| {NO_WRITES} / bare (full logits) |" in text and "(standard error, 2 blocks)" in text


def test_arms_that_did_not_do_the_same_work_fail_the_run() -> None:
    assert same_work_failure(0.01, {"bare (full logits)": 0.0, "bare (head at generated)": 1e-9}) is None
    stuck = same_work_failure(0.0, {"bare (full logits)": 0.0})
    assert stuck is not None and "did not move" in stuck
    apart = same_work_failure(0.01, {"bare (full logits)": 0.0, "bare (head at generated)": 1e-3})
    assert apart is not None and "bare (head at generated)" in apart and "1.00e-03" in apart
