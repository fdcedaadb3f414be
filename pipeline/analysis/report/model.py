"""What the report's modules pass along: ``RunReport``, the control events, the duty-cycle lanes.

Also the sections (title and figure file of each) and the small value helpers the
summary, the figures and the page share.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.analysis.runs import RunActivity
from schemas.events import LearnerCheckpointed, ProducerHeartbeat, RunStarted

SECTIONS: dict[str, str] = {
    "reward": "Reward and success per adapter version",
    "eval": "Evaluation on held-out seeds",
    "staleness": "Staleness of trained rows",
    "importance": "Importance ratios and effective sample size",
    "collapse": "Signs of collapse: entropy, identical groups, zero advantages, reward spread",
    "throughput": "Producer throughput",
    "duty_cycle": "Duty cycle: producers and learner on one time axis",
    "value": "Value learner: return, TD error, Q values and replay memory size per step",
}
FIGURE_FILES: dict[str, str] = {section: f"{section}.png" for section in SECTIONS}
# Sections about sampled token trajectories: a value run (numeric actors, a value network) has none of them.
LANGUAGE_MODEL_SECTIONS = ("reward", "staleness", "importance", "collapse")


def report_sections(summary: dict[str, Any]) -> dict[str, str]:
    """The sections a run's report has: a value run's leave out the language-model ones."""
    if summary.get("kind") != "value-network":
        return dict(SECTIONS)
    return {section: title for section, title in SECTIONS.items() if section not in LANGUAGE_MODEL_SECTIONS}


@dataclass
class RunReport:
    """Everything ``rlpipe report`` shows: a summary, the plotted series, and notes on what is missing."""

    run_id: str
    store: str
    generated_at: str
    summary: dict[str, Any]
    series: dict[str, Any]
    notes: dict[str, list[str]] = field(default_factory=dict)  # section -> why it is empty or partial

    def note(self, section: str, text: str) -> None:
        self.notes.setdefault(section, []).append(text)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (NaN and infinities become null)."""
        return _finite_json(
            {"run_id": self.run_id, "store": self.store, "generated_at": self.generated_at,
             "summary": self.summary, "series": self.series, "notes": self.notes}
        )  # fmt: skip


@dataclass
class ControlEvents:
    """What ``<ns>.control`` says about one run; times are unix seconds.

    ``activity`` reads the same events as ``rlpipe runs list|show`` do, with the run's recorded start or stop
    added (``with_recorded_membership``), so the report's stop is theirs.
    """

    heartbeats: list[tuple[float, ProducerHeartbeat]] = field(default_factory=list)
    started: tuple[float, RunStarted] | None = None  # the first start: where the run's window opens
    checkpoints: list[tuple[float, LearnerCheckpointed]] = field(default_factory=list)
    activity: RunActivity = field(default_factory=RunActivity)
    log_read: bool = False  # the topic was read (else nothing above is known from it)

    @property
    def stopped(self) -> tuple[float | None, str | None] | None:
        """The run's stop time and reason when nothing after it shows the run going (``RunActivity.stopped_last``),
        else None; the time is None for a damaged membership record (a stop older than any event, at no time)."""
        if not self.activity.stopped_last():
            return None
        return self.activity.stopped_s or None, self.activity.stop_reason


@dataclass
class Lane:
    """One row of the duty-cycle timeline: (start, end, busy share) intervals in unix seconds."""

    name: str
    kind: str  # "learner" or "producer"
    intervals: list[tuple[float, float, float]]


def dig(data: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def first_known(*values: Any) -> Any:
    return next((v for v in values if v not in (None, "")), None)


def finite(value: Any) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def readable(value: Any, significant: int = 3) -> str:
    """A number in fixed notation with about ``significant`` significant digits and never an exponent
    (123.4 -> 123, -31.63 -> -31.6, 0.01234 -> 0.0123); "-" when it is not a finite number."""
    if not finite(value):
        return "-"
    if value == 0:
        return "0"
    decimals = significant - 1 - math.floor(math.log10(abs(value)))
    return f"{value:.{min(max(decimals, 0), 6)}f}"


def half_width(ci95: Any, episodes: int) -> str:
    """The half-width of a mean's 95% interval, ``readable``; "n/a" below two episodes, where there is none
    (a 0 there would read as certainty)."""
    return readable(ci95) if episodes >= 2 else "n/a"


def percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if finite(value) else "-"


def _finite_json(obj: Any) -> Any:
    """Replace NaN and infinities by None (JSON has neither), recursively; numpy scalars become Python ones."""
    if isinstance(obj, dict):
        return {str(k): _finite_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite_json(v) for v in obj]
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj
