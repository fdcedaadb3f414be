"""bench/checkpoint_size.py measures both steps and leaves no folder behind."""

from __future__ import annotations

import argparse
import tempfile

from bench.checkpoint_size import measure


def test_both_steps_are_measured_in_a_folder_that_is_removed(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    rows = measure(argparse.Namespace(early=1, late=3, batches_per_step=2, repeats=1), tiny_model_dir)
    assert [row["step"] for row in rows] == [1, 3] and all(row["bytes"] > 0 for row in rows)
    assert rows[1]["old_bytes"] > rows[0]["old_bytes"]  # the old layout grows with the steps
    assert not list(tmp_path.iterdir())
