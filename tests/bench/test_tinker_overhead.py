"""The Tinker-overhead benchmark's pure parts: options, the batch, the ratio, step timing."""

import pytest

from bench.tinker_overhead import interleaved, make_batch, parse_args, speed_ratio


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
    direct_s, api_s = interleaved(lambda: calls.append("d"), lambda: calls.append("a"), 3)
    assert len(direct_s) == len(api_s) == 3
    assert calls == ["d", "a", "d", "a", "a", "d", "d", "a"]  # warm-ups, then alternating who goes first


def test_every_timed_step_is_reported_as_it_ends():
    lines: list[str] = []
    interleaved(lambda: None, lambda: None, 2, log=lines.append)
    assert len(lines) == 2 and lines[0].startswith("step 1/2: direct ") and " API " in lines[0]
