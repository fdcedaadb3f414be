"""The Tinker-overhead benchmark's pure parts: options, the batch, the ratio, step timing."""

import pytest

from bench.tinker_overhead import make_batch, parse_args, speed_ratio, time_steps


def test_defaults_are_the_acceptance_shape():
    args = parse_args([])
    assert (args.batch, args.seq_len, args.steps, args.base_model) == (64, 256, 5, "tiny")
    with pytest.raises(SystemExit):
        parse_args(["--steps", "0"])


def test_batch_ratio_and_timing():
    data = make_batch(3, 5, vocab=50)
    assert len(data) == 3 and data[0].model_input.length == 5
    assert data[0].loss_fn_inputs["target_tokens"].data[:4] == data[0].model_input.to_ints()[1:]
    assert speed_ratio(0.9, 1.0) == pytest.approx(0.9)
    calls = []
    assert time_steps(lambda: calls.append(1), 3) >= 0 and len(calls) == 4  # one warm-up, three timed
