"""Parsing of model answers: ``<think>...</think>`` then ``<answer>a || b</answer>``.

Pure functions on strings; never raise on any input.  Search is linear
(``str.find``/``rfind``), so a multi-megabyte answer costs one pass, not a
regex backtrack.
"""

from __future__ import annotations

from dataclasses import dataclass

ANSWER_OPEN = "<answer>"
ANSWER_CLOSE = "</answer>"
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
ACTION_SEPARATOR = "||"
MAX_ACTION_CHARS = 4_096  # one action's text longer than this is invalid


@dataclass(frozen=True)
class ParsedAnswer:
    """The actions found in one answer (at most the caller's limit) and why it failed, if it did."""

    actions: tuple[str, ...]
    ok: bool
    error: str = ""


def parse_answer(text: object, max_actions: int, split: bool = True) -> ParsedAnswer:
    """Extract up to ``max_actions`` action strings from the last ``<answer>`` block.

    Text inside ``<think>`` is ignored: only what follows the last ``</think>`` counts, and an
    answer block after a ``<think>`` never closed (a turn cut by ``max_tokens`` mid-thought)
    is a thought, not an answer.  ``ok`` is False when there is no complete answer block
    outside a thought, it is empty, an action is empty or too long, or it holds more
    actions than ``max_actions`` (the first ``max_actions`` are still returned).
    """
    if not isinstance(text, str):
        return ParsedAnswer((), False, "answer is not text")
    if max_actions <= 0:
        return ParsedAnswer((), False, "no actions left")
    think_end = text.rfind(THINK_CLOSE)
    tail = text[think_end + len(THINK_CLOSE):] if think_end >= 0 else text
    start = tail.rfind(ANSWER_OPEN)
    if start < 0:
        return ParsedAnswer((), False, "missing <answer>")
    if 0 <= tail.find(THINK_OPEN) < start:  # the answer block lies inside a thought never closed (cut by max_tokens)
        return ParsedAnswer((), False, "unclosed <think>")
    end = tail.find(ANSWER_CLOSE, start)
    if end < 0:
        return ParsedAnswer((), False, "missing </answer>")
    body = tail[start + len(ANSWER_OPEN):end].strip()
    if not body:
        return ParsedAnswer((), False, "empty answer")
    pieces = body.split(ACTION_SEPARATOR, max_actions) if split else [body]
    actions = [p.strip() for p in pieces[:max_actions]]
    if len(pieces) > max_actions:
        return ParsedAnswer(tuple(a for a in actions if a and len(a) <= MAX_ACTION_CHARS), False, "too many actions")
    for a in actions:
        if not a:
            return ParsedAnswer((), False, "empty action")
        if len(a) > MAX_ACTION_CHARS:
            return ParsedAnswer((), False, "action too long")
    return ParsedAnswer(tuple(actions), True)


def format_answer(actions: list[str] | tuple[str, ...], thinking: str = "") -> str:
    """The canonical answer text for ``actions`` (used by scripted policies and demos)."""
    think = f"<think>{thinking}</think>" if thinking else ""
    return f"{think}<answer>{f' {ACTION_SEPARATOR} '.join(actions)}</answer>"


def match_action(text: str, names: tuple[str, ...]) -> str | None:
    """Exact name, then case-insensitive name, then its number (1-based); else None."""
    if text in names:
        return text
    lowered = text.lower()
    for name in names:
        if name.lower() == lowered:
            return name
    if text.isascii() and text.isdigit() and 1 <= int(text) <= len(names):  # '²'.isdigit() is True
        return names[int(text) - 1]
    return None
