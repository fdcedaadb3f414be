"""The report's figures: one matplotlib figure per section, rendered to PNG.

matplotlib's object API on the Agg canvas: no pyplot, no global backend switch, so
the report can be drawn inside any process.  A section with nothing to plot gets no
figure (``None``); the page shows its notes instead.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl
from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.cm import ScalarMappable
from matplotlib.colors import Normalize
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from pipeline.analysis.report.metrics import COLLAPSE_FIELDS
from pipeline.analysis.report.model import RunReport, finite, percent
from pipeline.analysis.runs import version_zero
from pipeline.timefmt import utc_text

_ESS_WARNING = 0.3  # below this normalised ESS the off-policy correction is doing heavy lifting
_LEARNER_COLOR = "#1f4e9c"
_MAX_MARKED_POINTS = 80  # longer series are drawn faint with a rolling mean on top
_MAX_EDGED_INTERVALS = 60  # heartbeat intervals per lane up to which each bar gets a separating edge
# Evaluated policies whose results are a run's trained versions (a point at each version, even when one is evaluated);
# any other policy (the base model, a scripted baseline) evaluated at one version is a horizontal reference band.
_VERSIONED_POLICIES = ("adapter", "value-network")


def render_figures(report: RunReport) -> dict[str, bytes]:
    """PNG bytes per section that has something to plot."""
    series = report.series
    t0 = _time_origin(report)
    figures = {
        "reward": plot_reward(series["reward_by_version"], series["reward_over_time"], t0),
        "eval": plot_eval(series["eval"], report.summary.get("kind", "lora")),
        "staleness": plot_staleness(series["staleness_histogram"], series["max_staleness"]),
        "importance": plot_importance(series["learner_steps"]),
        "collapse": plot_collapse(series["learner_steps"], series.get("collapse_thresholds") or {}),
        "throughput": plot_throughput(series["throughput"], t0),
        "duty_cycle": plot_duty_cycle(series["duty_cycle"], t0),
        "value": plot_value(series.get("value") or []),
    }
    return {section: png_bytes(fig) for section, fig in figures.items() if fig is not None}


def png_bytes(fig: Figure) -> bytes:
    """Render ``fig`` to PNG with the Agg canvas."""
    FigureCanvasAgg(fig)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight", facecolor="white")
    return buffer.getvalue()


def plot_reward(by_version: list[dict[str, Any]], over_time: dict[str, Any], t0: float | None) -> Figure | None:
    """Mean reward and success rate per version (95% CIs), and reward over time with its rolling mean."""
    if not by_version:
        return None
    fig = Figure(figsize=(15, 4.4), layout="constrained")
    ax_reward, ax_success, ax_time = fig.subplots(1, 3)
    versions = [p["version"] for p in by_version]
    ax_reward.errorbar(versions, [p["reward_mean"] for p in by_version], yerr=[p["reward_ci95"] for p in by_version],
                       marker="o", capsize=4, color="tab:blue")  # fmt: skip
    for p in by_version:
        ax_reward.annotate(f"n={p['episodes']}", (p["version"], p["reward_mean"]), textcoords="offset points",
                           xytext=(6, -12), fontsize=8, color="dimgray")  # fmt: skip
    _style(ax_reward, "mean episode reward per version (95% CI)", "adapter version (0 = base)", "reward")
    rates = np.array([p["success_rate"] for p in by_version])
    lows, highs = np.array([p["success_low"] for p in by_version]), np.array([p["success_high"] for p in by_version])
    ax_success.errorbar(
        versions, rates, yerr=np.vstack([rates - lows, highs - rates]), marker="s", capsize=4, color="tab:green"
    )
    ax_success.set_ylim(-0.03, 1.03)
    _style(ax_success, "success rate per version (95% Wilson CI)", "adapter version (0 = base)", "success rate")
    for ax in (ax_reward, ax_success):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.margins(x=0.1)
    points = over_time["points"]
    origin = t0 if t0 is not None else points[0]["time"]
    divisor, unit = _time_unit(points[-1]["time"] - origin)
    times = [(p["time"] - origin) / divisor for p in points]
    few = len(points) < 300  # a few dots can be big and opaque; thousands must be faint
    ax_time.scatter(times, [p["reward"] for p in points], s=14 if few else 5, alpha=0.6 if few else 0.2,
                    color="tab:blue", linewidths=0, label="episode")  # fmt: skip
    ax_time.plot(times, [p["rolling_mean"] for p in points], color="tab:red", linewidth=2,
                 label=f"rolling mean ({over_time['window']} episodes)")  # fmt: skip
    ax_time.legend(loc="best", fontsize=8)
    _style(ax_time, "reward over time", _time_label(origin, unit), "reward")
    return fig


def plot_eval(points: list[dict[str, Any]], kind: str = "lora") -> Figure | None:
    """Mean return (95% CI) and success rate (95% Wilson CI) per evaluated version, one series per (policy, environment) named
    in the legend; a baseline evaluated at one version only is a band (one per seed range).  The version axis names
    what a run of ``kind`` (``run_kind``) has at v0, as ``rlpipe eval`` does.

    A (policy, environment) evaluated on more than one seed range is one series per range, named with its seeds
    ("adapter on cartpole, seeds 1000-1099"): one line through both would join two points at one version.
    """
    if not points:
        return None
    fig = Figure(figsize=(12, 4.4), layout="constrained")
    ax_return, ax_success = fig.subplots(1, 2)
    ranges: dict[tuple[str, str], set[tuple[int, int]]] = {}
    for p in points:
        ranges.setdefault((p["policy"], p["env"]), set()).add((p["seed_start"], p["episodes"]))
    series: dict[tuple[str, str, int, int], list[dict[str, Any]]] = {}
    for p in points:  # eval_series sorts them by version within a (policy, env, seed range)
        seeds = (p["seed_start"], p["episodes"]) if len(ranges[(p["policy"], p["env"])]) > 1 else (-1, 0)
        series.setdefault((p["policy"], p["env"], *seeds), []).append(p)
    versions = [p["version"] for p in points]
    x_low, x_high = min(versions) - 0.4, max(versions) + 0.4
    color_index = 0
    adapter_first = sorted(series.items(), key=lambda item: (item[0][0] != "adapter", item[0]))
    for (policy, env, first, count), mine in adapter_first:
        label = f"{policy} on {env}" + (f", seeds {first}-{first + count - 1}" if count else "")
        if policy not in _VERSIONED_POLICIES and len({p["version"] for p in mine}) == 1:  # a reference band
            for p in mine:
                color = f"C{color_index}"
                color_index += 1
                ax_return.axhline(p["mean_return"], color=color, linestyle="--", label=f"{label} ({p['episodes']} ep)")
                ax_return.axhspan(p["mean_return"] - p["ci95"], p["mean_return"] + p["ci95"], color=color, alpha=0.12)
                ax_success.axhline(p["success_rate"], color=color, linestyle="--", label=label)
                ax_success.axhspan(p["success_low"], p["success_high"], color=color, alpha=0.12)
            continue
        color = f"C{color_index}"
        color_index += 1
        xs = [p["version"] for p in mine]
        ax_return.errorbar(xs, [p["mean_return"] for p in mine], yerr=[p["ci95"] for p in mine], marker="o",
                           capsize=4, color=color, label=label)  # fmt: skip
        rates = np.array([p["success_rate"] for p in mine])
        lows, highs = np.array([p["success_low"] for p in mine]), np.array([p["success_high"] for p in mine])
        ax_success.errorbar(xs, rates, yerr=np.vstack([rates - lows, highs - rates]), marker="s", capsize=4,
                            color=color, label=label)  # fmt: skip
    for ax in (ax_return, ax_success):
        ax.set_xlim(x_low, x_high)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize=8)
    ax_success.set_ylim(-0.03, 1.03)
    axis = f"value-network version (0 = {version_zero(kind)})" if kind == "value-network" else "adapter version (0 = base)"
    _style(ax_return, "held-out mean return (95% CI)", axis, "mean return")
    _style(ax_success, "held-out success rate (95% Wilson CI)", axis, "success rate")
    return fig


def plot_staleness(histogram: dict[str, int], max_staleness: int | None) -> Figure | None:
    """Rows per staleness, summed over learner steps; rows beyond ``max_staleness`` (dropped) in red."""
    if not histogram:
        return None
    fig = Figure(figsize=(7, 4), layout="constrained")
    ax = fig.subplots()
    staleness = [int(k) for k in histogram]
    colors = ["tab:red" if max_staleness is not None and s > max_staleness else "tab:blue" for s in staleness]
    bars = ax.bar(staleness, list(histogram.values()), color=colors, width=0.7)
    ax.bar_label(bars, fontsize=8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    limit = f" (red: beyond max_staleness {max_staleness}, dropped)" if max_staleness is not None else ""
    _style(ax, f"staleness of rows reaching the learner{limit}", "versions behind the learner", "rows")
    return fig


def plot_importance(steps: list[dict[str, Any]]) -> Figure | None:
    """Importance-ratio mean and normalised effective sample size per learner step."""
    trained = [s for s in steps if finite(s.get("ratio_mean")) or finite(s.get("effective_sample_size"))]
    if not trained:
        return None
    fig = Figure(figsize=(10, 5.5), layout="constrained")
    ax_ratio, ax_ess = fig.subplots(2, 1, sharex=True)
    xs = [s["step"] for s in trained]
    _trace(ax_ratio, xs, [_nan(s.get("ratio_mean")) for s in trained], "tab:purple", None)
    ax_ratio.axhline(1.0, color="gray", linestyle=":", linewidth=1, label="on-policy (1.0)")
    ax_ratio.legend(loc="best", fontsize=8)
    _style(ax_ratio, "importance ratio mean (learner / sampler probability)", "", "ratio mean")
    _trace(ax_ess, xs, [_nan(s.get("effective_sample_size")) for s in trained], "tab:orange", None)
    ax_ess.axhline(_ESS_WARNING, color="tab:red", linestyle=":", linewidth=1, label=f"drift warning ({_ESS_WARNING})")
    ax_ess.set_ylim(0, 1.05)
    ax_ess.legend(loc="best", fontsize=8)
    ax_ess.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(ax_ess, "effective sample size (normalised; 1 = on-policy)", "learner step", "ESS")
    return fig


def plot_collapse(steps: list[dict[str, Any]], thresholds: dict[str, float]) -> Figure | None:
    """Per learner step: policy entropy, the shares of identical groups and zero advantages, and the
    within-group reward spread beside the mean reward (the spread falls first: the early warning).
    Dotted lines are the learner's warning thresholds; the relative ones scale its first steps' mean."""
    trained = [s for s in steps if any(finite(s.get(name)) for name in COLLAPSE_FIELDS)]
    if not trained:
        return None
    fig = Figure(figsize=(10, 8), layout="constrained")
    ax_entropy, ax_share, ax_spread = fig.subplots(3, 1, sharex=True)
    xs = [s["step"] for s in trained]
    baseline_steps = int(thresholds.get("collapse_baseline_steps", 3))

    def relative_line(ax: Any, name: str, fraction: float | None) -> None:
        first = [s[name] for s in trained if finite(s.get(name))][:baseline_steps]
        if fraction is not None and len(first) == baseline_steps:
            ax.axhline(fraction * float(np.mean(first)), color="tab:red", linestyle=":", linewidth=1,
                       label=f"warning ({fraction:g} x first {baseline_steps} steps)")  # fmt: skip
            ax.legend(loc="best", fontsize=8)

    _trace(ax_entropy, xs, [_nan(s.get("entropy_mean")) for s in trained], "tab:green", None)
    relative_line(ax_entropy, "entropy_mean", thresholds.get("warn_entropy_fraction"))
    _style(ax_entropy, "policy entropy of the sampled tokens", "", "nats / token")
    for name, color, label in (("identical_group_share", "tab:purple", "groups with identical samples"),
                               ("zero_advantage_share", "tab:orange", "rows with advantage 0")):
        _trace(ax_share, xs, [_nan(s.get(name)) for s in trained], color, label)
        if thresholds.get(f"warn_{name}") is not None:
            ax_share.axhline(thresholds[f"warn_{name}"], color=color, linestyle=":", linewidth=1)
    ax_share.set_ylim(-0.02, 1.05)
    ax_share.legend(loc="best", fontsize=8)
    _style(ax_share, "share of the step (dotted: warning thresholds)", "", "share")
    _trace(ax_spread, xs, [_nan(s.get("reward_spread")) for s in trained], "tab:blue", "within-group reward std")
    relative_line(ax_spread, "reward_spread", thresholds.get("warn_reward_spread_fraction"))
    ax_mean = ax_spread.twinx()
    ax_mean.plot(xs, [_nan(s.get("reward_mean")) for s in trained], color="gray", linewidth=1, label="reward mean")
    ax_mean.set_ylabel("reward mean", color="gray")
    ax_mean.legend(loc="lower left", fontsize=8)
    ax_spread.xaxis.set_major_locator(MaxNLocator(integer=True))
    _style(ax_spread, "reward spread within groups (falls before the mean: the Echo Trap warning)", "learner step",
           "reward std")  # fmt: skip
    return fig


def plot_throughput(series: dict[str, list[dict[str, Any]]], t0: float | None) -> Figure | None:
    """Samples/s and tokens/s per producer over time; without the tokens/s panel when no producer sent a token (a
    value run's actors step numeric environments)."""
    if not series:
        return None
    tokens = any(p["tokens_per_s"] for points in series.values() for p in points)
    fig = Figure(figsize=(12, 5.5 if tokens else 3.2), layout="constrained")
    ax_samples, ax_tokens = fig.subplots(2, 1, sharex=True) if tokens else (fig.subplots(), None)
    origin = t0 if t0 is not None else min(points[0]["time"] for points in series.values())
    divisor, unit = _time_unit(max(points[-1]["time"] for points in series.values()) - origin)
    for index, (producer, points) in enumerate(series.items()):
        times = [(p["time"] - origin) / divisor for p in points]
        _trace(ax_samples, times, [p["samples_per_s"] for p in points], f"C{index}", producer)
        if ax_tokens is not None:
            _trace(ax_tokens, times, [p["tokens_per_s"] for p in points], f"C{index}", producer)
    ax_samples.legend(loc="best", fontsize=8, ncols=min(4, len(series)))
    time_label = _time_label(origin, unit)
    _style(ax_samples, "producer throughput (from heartbeats)", "" if ax_tokens is not None else time_label,
           "samples / s")
    if ax_tokens is not None:
        _style(ax_tokens, "", time_label, "tokens / s")
    return fig


def plot_duty_cycle(duty: dict[str, Any], t0: float | None) -> Figure | None:
    """One lane per producer (heartbeat intervals shaded by busy share) and one for the learner (solid steps)."""
    lanes = duty["lanes"]
    if not lanes:
        return None
    origin = duty["start"] if t0 is None else t0
    start, end = duty["start"] - origin, duty["end"] - origin
    divisor, unit = _time_unit(end)
    fig = Figure(figsize=(13, 1.6 + 0.75 * len(lanes)), layout="constrained")
    ax = fig.subplots()
    cmap = colormaps["Greens"]
    labels = []
    for row, lane in enumerate(reversed(lanes)):  # the learner (first) ends up on top
        bars = [((s - origin) / divisor, (e - s) / divisor) for s, e, _ in lane["intervals"]]
        if lane["kind"] == "learner":
            ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=_LEARNER_COLOR, linewidth=0)
        else:  # thin white edges keep a few wide intervals apart; with many they would hide the colours
            colors = [cmap(0.12 + 0.88 * share) for _, _, share in lane["intervals"]]
            edge = 0.6 if len(bars) <= _MAX_EDGED_INTERVALS else 0.0
            ax.broken_barh(bars, (row - 0.38, 0.76), facecolors=colors, edgecolors="white", linewidth=edge)
        labels.append(f"{lane['name']}\n{percent(lane['busy_fraction'])} busy")
    ax.set_yticks(range(len(lanes)), labels)
    ax.set_ylim(-0.6, len(lanes) - 0.4)
    ax.set_xlim(start / divisor, end / divisor)
    if any(lane["kind"] == "producer" for lane in lanes):
        mappable = ScalarMappable(norm=Normalize(0, 1), cmap=cmap)
        fig.colorbar(mappable, ax=ax, label="producer busy share", fraction=0.04, pad=0.01)
    _style(ax, "duty cycle (learner: training steps; producers: busy share per heartbeat interval)",
           _time_label(origin, unit), "")  # fmt: skip
    ax.grid(axis="y", visible=False)
    return fig


def plot_value(steps: list[dict[str, Any]]) -> Figure | None:
    """A value learner per step: episode return, mean |TD error|, mean Q and the replay memory's size."""
    if not steps:
        return None
    fig = Figure(figsize=(10, 7), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True).ravel()
    xs = [s["step"] for s in steps]
    panels = (("episode_return_mean", "return of the batch's finished episodes", "return", "tab:green"),
              ("td_abs_mean", "mean |TD error| of the updates", "|TD|", "tab:red"),
              ("q_mean", "mean Q(s, a) of the actions taken", "Q", _LEARNER_COLOR),
              ("replay_size", "replay memory size (transitions)", "transitions", "tab:gray"))  # fmt: skip
    for ax, (name, title, ylabel, color) in zip(axes, panels, strict=True):
        _trace(ax, xs, [_nan(s.get(name)) for s in steps], color, None)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        _style(ax, title, "learner step", ylabel)
    return fig


def _trace(ax: Any, xs: Sequence[float], ys: Sequence[float], color: str, label: str | None) -> None:
    """A short series as dots on a line; a long one as a faint line under its rolling mean (noise would hide it)."""
    if len(xs) <= _MAX_MARKED_POINTS:
        ax.plot(xs, ys, marker=".", color=color, label=label)
        return
    window = max(3, len(xs) // 40)
    smooth = pl.Series(ys, dtype=pl.Float64).rolling_mean(window_size=window, min_samples=1, center=True)
    ax.plot(xs, ys, color=color, alpha=0.2, linewidth=0.6)
    ax.plot(xs, smooth.to_list(), color=color, linewidth=1.8,
            label=f"{label} (rolling mean of {window})" if label else f"rolling mean of {window}")  # fmt: skip


def _style(ax: Any, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.set_axisbelow(True)


def _time_unit(span_s: float) -> tuple[float, str]:
    """Seconds, minutes or hours, whichever keeps the axis numbers readable."""
    if span_s > 2 * 3600:
        return 3600.0, "h"
    if span_s > 2 * 60:
        return 60.0, "min"
    return 1.0, "s"


def _time_label(origin: float, unit: str) -> str:
    return f"time since {utc_text(origin)} ({unit})"


def _time_origin(report: RunReport) -> float | None:
    """The common start of every time axis: the duty-cycle window's start, else the first episode."""
    duty_start = report.series["duty_cycle"]["start"]
    points = report.series["reward_over_time"]["points"]
    first_episode = points[0]["time"] if points else None
    known = [t for t in (duty_start, first_episode) if t is not None]
    return min(known) if known else None


def _nan(value: Any) -> float:
    return float(value) if finite(value) else math.nan
