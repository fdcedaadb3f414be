"""The learner-overhead bench's own parts: the arms do the same arithmetic, and --toggle-writes splits the learner."""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.learner_overhead import NO_WRITES, measure, report
from producers.tiny_model import build_tiny_model


def test_toggled_writes_split_the_learner_over_the_same_batches_as_the_bare_loops(tmp_path: Path) -> None:
    args = argparse.Namespace(loss="importance_sampling", rows=4, prompt_tokens=16, answer_tokens=4,
                              publish_every=1, checkpoint_every=1, threads=1, warmup_steps=1, steps=4,
                              block_steps=1, toggle_writes=True)
    model = str(build_tiny_model(tmp_path / "model", pretrain=False))
    arms, diffs = measure(args, model, tmp_path / "store", lambda line: None)
    by_name = {arm.name: arm for arm in arms}
    assert list(by_name) == ["learner", NO_WRITES, "bare (head at generated)", "bare (full logits)"]
    assert list(by_name["learner"].blocks) == [2, 4] and list(by_name[NO_WRITES].blocks) == [1, 3]  # alternating
    bare_arms = ("bare (head at generated)", "bare (full logits)")
    assert all(list(by_name[name].blocks) == [1, 2, 3, 4] for name in bare_arms)
    assert diffs and max(diffs.values()) < 1e-6  # every arm trained the same steps on the same batches
    versions = sorted(path.name for path in (tmp_path / "store/runs/bench/adapters").iterdir())
    assert len(versions) == 3  # a version per step written with writes on (warm-up 0, blocks 2 and 4), none between
    text = report(arms, args, (0.0,), (0.0,))
    assert f"| {NO_WRITES} / bare (full logits) |" in text and "(standard error, 2 blocks)" in text
