"""How rlpipe writes a moment for people to read: in UTC, to the second, marked ``UTC``.

One spelling wherever a moment is shown (the report, the command line's lines, the API's
refusals), so that two of them compare by eye.
"""

from __future__ import annotations

from datetime import UTC, datetime


def utc_text(unix_s: float) -> str:
    """``unix_s`` (seconds since the epoch) as ``2026-12-07 01:02:03 UTC``; the fraction of a second is cut."""
    return datetime.fromtimestamp(unix_s, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
