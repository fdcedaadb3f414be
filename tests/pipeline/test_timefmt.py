"""``pipeline.timefmt``: the one way rlpipe writes a moment for people."""

from __future__ import annotations

from pipeline.timefmt import utc_text


def test_a_moment_is_written_in_utc_to_the_second_and_says_so() -> None:
    # 86,399.9 s after the epoch is the last second of its first day (the fraction is cut, not rounded up)
    assert utc_text(86_399.9) == "1970-01-01 23:59:59 UTC"
    # 2026-12-07 is 20,794 days after 1970-01-01: 1,796,601,600 s; then 1 h 2 min 3 s = 3,723 s
    assert utc_text(1_796_601_600 + 3_723) == "2026-12-07 01:02:03 UTC"
