"""A sweep's leaderboard: every grid point ranked by its held-out score, with 95% intervals.

A grid point's score is the mean of its finished seeds' mean ``samples``.  Its
interval: with one finished seed, the t interval over that seed's samples
(evaluation episodes); with several, the t interval over the seeds' means, so
that it holds the variation between training runs, not only between
evaluation episodes.  Other evaluations a script reports (``evaluations``, e.g.
its base model's) are shown as their mean over the finished seeds.

Written to the sweep's folder: ``leaderboard.json``, ``leaderboard.md``,
``leaderboard.png`` and ``leaderboard.html`` (the table and the plot).
"""

from __future__ import annotations

import base64
import html
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from pipeline.analysis.report.plots import png_bytes
from pipeline.sweeps.plan import SweepDir, SweepSpec, experiments
from schemas.evaluation import mean_ci95

FIGURE = "leaderboard.png"


@dataclass
class Entry:
    """One grid point's row."""

    label: str
    config: dict[str, str]
    seeds: int  # planned
    finished: int
    failed: int
    mean: float | None = None
    half: float | None = None  # 95% half-width
    samples: int = 0  # evaluation episodes over the finished seeds
    seed_means: dict[str, float] = field(default_factory=dict)
    evaluations: dict[str, float] = field(default_factory=dict)  # label -> mean over the seeds that report it
    metric: str = "score"


def interval(values: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t interval (NaN for fewer than two values)."""
    mean, half = mean_ci95(values)
    return mean, half if len(values) > 1 else float("nan")


def gather(sweep: SweepDir, spec: SweepSpec) -> list[Entry]:
    """Every grid point's entry, best first; points with no finished seed last."""
    entries: dict[str, Entry] = {}
    reported: dict[str, dict[str, list[float]]] = {}  # label -> evaluation label -> one mean per seed reporting it
    for experiment in experiments(spec):
        entry = entries.setdefault(experiment.label, Entry(experiment.label, experiment.config, 0, 0, 0))
        entry.seeds += 1
        result = sweep.result(experiment)
        if result is None:
            entry.failed += sweep.failure(experiment) is not None
            continue
        entry.finished += 1
        entry.metric = str(result.get("metric", entry.metric))
        entry.samples += len(result["samples"])
        entry.seed_means[str(experiment.seed)] = float(np.mean(result["samples"]))
        for label, values in result.get("evaluations", {}).items():
            if values:
                reported.setdefault(entry.label, {}).setdefault(label, []).append(float(np.mean(values)))
        if entry.finished == 1:
            entry.mean, entry.half = interval(result["samples"])
    for entry in entries.values():
        if entry.finished > 1:
            entry.mean, entry.half = interval(list(entry.seed_means.values()))
        if entry.half is not None and not math.isfinite(entry.half):
            entry.half = None  # one evaluation episode: no interval
        entry.evaluations = {label: float(np.mean(means)) for label, means in reported.get(entry.label, {}).items()}
    return sorted(entries.values(), key=lambda e: (e.mean is None, -(e.mean or 0.0)))


def shown(mean: float | None, half: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.2f}" + (f" ± {half:.2f}" if half is not None else "")


def markdown(entries: list[Entry]) -> str:
    """The leaderboard as a Markdown table."""
    labels = sorted({label for e in entries for label in e.evaluations})
    metric = next((e.metric for e in entries if e.finished), "score")
    head = ["rank", "configuration", f"{metric} (95%)", "seeds finished", "failed", *labels]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rank, entry in enumerate(entries, 1):
        row = [str(rank) if entry.finished else "-", entry.label, shown(entry.mean, entry.half),
               f"{entry.finished} of {entry.seeds}", str(entry.failed),
               *[f"{entry.evaluations[label]:.2f}" if label in entry.evaluations else "-" for label in labels]]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def plot(entries: list[Entry], title: str) -> Figure | None:
    """Each finished grid point's score with its 95% interval, best at the top."""
    done = [e for e in entries if e.mean is not None]
    if not done:
        return None
    fig = Figure(figsize=(9, 1.2 + 0.45 * len(done)), layout="constrained")
    ax = fig.add_subplot()
    ys = np.arange(len(done))[::-1]
    halves = [e.half if e.half is not None else 0.0 for e in done]
    ax.errorbar([e.mean for e in done], ys, xerr=halves, fmt="o", color="C0", capsize=4, label=done[0].metric)
    for label in sorted({label for e in done for label in e.evaluations}):
        values = [e.evaluations.get(label, np.nan) for e in done]
        ax.scatter(values, ys, marker="|", s=160, label=label, zorder=3)
    ax.set_yticks(ys, [e.label for e in done])
    ax.set_xlabel(f"{done[0].metric} (mean, 95% interval)")
    ax.set_title(title, loc="left", fontsize=11)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(loc="best", fontsize=8)
    return fig


def write_leaderboard(sweep: SweepDir, spec: SweepSpec) -> list[Entry]:
    """Gather the leaderboard and write its JSON, Markdown, PNG and HTML into the sweep's folder."""
    entries = gather(sweep, spec)
    table = markdown(entries)
    title = f"{Path(spec.script).name}: {' x '.join(f'{k} ({len(v)})' for k, v in spec.grid.items())}, " \
            f"{len(spec.seeds)} seed(s)"
    (sweep.path / "leaderboard.json").write_text(json.dumps(
        {"script": spec.script, "grid": spec.grid, "fixed": spec.fixed, "seeds": spec.seeds,
         "entries": [asdict(e) for e in entries]}, indent=2, allow_nan=False))
    (sweep.path / "leaderboard.md").write_text(f"# {title}\n\n{table}")
    fig = plot(entries, title)
    image = png_bytes(fig) if fig is not None else None
    if image is not None:
        (sweep.path / FIGURE).write_bytes(image)
    (sweep.path / "leaderboard.html").write_text(_html(title, entries, image))
    return entries


def _html(title: str, entries: list[Entry], image: bytes | None) -> str:
    labels = sorted({label for e in entries for label in e.evaluations})
    rows = "".join(
        "<tr>" + "".join(f"<td>{html.escape(cell)}</td>" for cell in (
            str(rank) if e.finished else "-", e.label, shown(e.mean, e.half), f"{e.finished} of {e.seeds}",
            str(e.failed), *[f"{e.evaluations[label]:.2f}" if label in e.evaluations else "-" for label in labels]))
        + "</tr>" for rank, e in enumerate(entries, 1))
    metric = next((e.metric for e in entries if e.finished), "score")
    head = "".join(f"<th>{html.escape(h)}</th>" for h in
                   ("rank", "configuration", f"{metric} (95%)", "seeds finished", "failed", *labels))
    figure = f'<img alt="leaderboard" src="data:image/png;base64,{base64.b64encode(image).decode()}">' \
        if image else "<p>No experiment has finished yet.</p>"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
            "td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}</style></head><body>"
            f"<h1>{html.escape(title)}</h1>{figure}<table><tr>{head}</tr>{rows}</table></body></html>")
