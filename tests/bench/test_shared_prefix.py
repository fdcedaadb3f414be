"""The shared-prefix bench's check: the compared steps train, and the two arms agree step by step."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from bench.shared_prefix import TOLERANCE, measure, step_failure


def _step(loss: float, grad_norm: float) -> SimpleNamespace:
    return SimpleNamespace(loss=loss, grad_norm=grad_norm)


def test_a_step_that_trained_nothing_or_arms_that_differ_fail_the_run():
    assert step_failure([_step(0.5, 2.0), _step(0.4, 1.0)], [_step(0.5, 2.0), _step(0.4, 1.0 + 1e-7)]) is None
    nothing = step_failure([_step(0.5, 2.0), _step(0.0, 0.0)], [_step(0.5, 2.0), _step(0.0, 0.0)])
    assert nothing is not None and "step 1" in nothing and "gradient norm 0" in nothing  # step 0 is the warm-up
    apart = step_failure([_step(0.5, 2.0)], [_step(0.5, 2.0 * (1 + 10 * TOLERANCE))])
    assert apart is not None and "step 0" in apart and "differ" in apart


def test_the_compared_steps_train_and_the_arms_agree(tiny_model_dir):
    args = argparse.Namespace(env="cartpole", rows=12, steps=2, micro_batch_tokens=2048, threads=1)
    measured = measure(args, tiny_model_dir, lambda line: None)
    shared, plain = measured.results["shared"], measured.results["plain"]
    assert len(shared) == len(plain) == 3  # the warm-up step and two measured ones
    assert all(step.grad_norm > 0 and step.loss != 0 for step in shared + plain)  # every step trained
    assert step_failure(shared, plain) is None
    assert len(measured.times["shared"]) == len(measured.times["plain"]) == 2
