"""SQLite's ``printf``/``format`` for the text-to-SQL guard (``producers.envs.sql``), refusing huge widths.

The guard's step budget and time guard are checked between SQLite VM instructions, never inside one built-in
call, and ``printf`` with a width of a billion took seconds a call; so every database of the guard replaces both
functions with ``capped_printf``, which refuses a width or precision above ``MAX_FORMAT_WIDTH`` and hands the
rest to a plain connection's own ``printf``.
"""

from __future__ import annotations

import re
import sqlite3
import threading

MAX_FORMAT_WIDTH = 10_000  # printf/format widths and precisions above this are refused (one call took seconds)
_FORMAT_SPEC = re.compile(r"%[-+ 0#,!]*(\*|\d*)(?:\.(\*|\d*))?(?:ll|l)?([a-zA-Z%])")
_PLAIN = sqlite3.connect(":memory:", check_same_thread=False)  # its own printf, for capped_printf to call
_PLAIN_LOCK = threading.Lock()
REFUSED = threading.local()  # why capped_printf refused a call (SQLite reports only that a function raised)


def capped_printf(format_text: object, *args: object) -> object:
    """SQLite's ``printf(format, ...)``, refusing a width or precision (written, or ``*`` from an argument) above
    ``MAX_FORMAT_WIDTH``: the budget and the time guard are checked between VM instructions, never inside one call."""
    if not isinstance(format_text, str):
        return None if format_text is None else str(format_text)
    consumed = 0
    for match in _FORMAT_SPEC.finditer(format_text):
        width, precision, kind = match.groups()
        for part in (width, precision):
            if part == "*":
                value = args[consumed] if consumed < len(args) else 0
                consumed += 1
            else:
                value = part or 0
            try:
                too_wide = abs(int(float(value))) > MAX_FORMAT_WIDTH  # type: ignore[arg-type]
            except (TypeError, ValueError, OverflowError):
                too_wide = False
            if too_wide:
                REFUSED.message = f"printf/format width or precision above {MAX_FORMAT_WIDTH}; use a smaller one"
                raise ValueError(REFUSED.message)
        consumed += kind != "%"
    with _PLAIN_LOCK:
        placeholders = ", ".join("?" * (len(args) + 1))
        return _PLAIN.execute(f"SELECT printf({placeholders})", (format_text, *args)).fetchone()[0]
