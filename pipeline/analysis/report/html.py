"""The report's output: ``report.html`` (PNGs inlined), the PNGs next to it, and ``report.json``.

The page is rendered from the packaged Jinja2 template ``templates/report.html.jinja``
with autoescaping on and undefined names refused; Python only prepares plain values
(summary lines, per-section notes, images as base64, tables) for it.
"""

from __future__ import annotations

import base64
import functools
import json
from pathlib import Path
from typing import Any

import jinja2

from pipeline.analysis.report.model import (
    FIGURE_FILES,
    RunReport,
    half_width,
    percent,
    readable,
    report_sections,
)
from pipeline.analysis.report.plots import render_figures
from pipeline.analysis.runs import shown_policy


def write_report(report: RunReport, out_dir: str | Path) -> Path:
    """Write ``report.html`` (images inline), each figure as a PNG, and ``report.json``; return the HTML path."""
    folder = Path(out_dir)
    folder.mkdir(parents=True, exist_ok=True)
    images = render_figures(report)
    for section, data in images.items():
        (folder / FIGURE_FILES[section]).write_bytes(data)
    (folder / "report.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    path = folder / "report.html"
    path.write_text(render_html(report, images), encoding="utf-8")
    return path


TEMPLATE = "report.html.jinja"  # in pipeline/analysis/report/templates, shipped with the package


@functools.cache
def report_templates() -> jinja2.Environment:
    """The packaged page templates, autoescaped (every value is text) and strict about missing names."""
    return jinja2.Environment(
        loader=jinja2.PackageLoader("pipeline.analysis.report", "templates"), autoescape=True, undefined=jinja2.StrictUndefined,
        trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
    )  # fmt: skip


def render_html(report: RunReport, images: dict[str, bytes]) -> str:
    """A self-contained page: summary table first, then one section per figure."""
    sections = [
        {"id": section, "title": title, "notes": report.notes.get(section, []),
         "image": base64.b64encode(images[section]).decode("ascii") if section in images else None,
         "table": section_table(section, report)}
        for section, title in report_sections(report.summary).items()
    ]  # fmt: skip
    summary_notes = [text for key in ("summary", "learner") for text in report.notes.get(key, [])]
    return report_templates().get_template(TEMPLATE).render(
        report=report, summary=summary_lines(report.summary), summary_notes=summary_notes, sections=sections
    )


_SUMMARY_LABELS = (
    ("run_id", "run id"), ("status", "status"), ("env", "environment"), ("base_model", "base model"), ("learner_steps", "learner steps"),
    ("adapter_versions", "adapter versions"), ("trajectories", "trajectories"),
    ("dropped_stale_rows", "dropped stale rows"), ("reward_first_version", "mean reward, first version"),
    ("reward_last_version", "mean reward, last version"), ("eval", "evaluations"),
    ("busy_fraction", "busy fraction over the run"), ("time_span", "time span"), ("run_stopped_at", "stopped"),
    ("checkpoint", "newest checkpoint"),
    ("value_replay_size", "value learner: replay memory size"), ("value_return_last", "value learner: last return"),
)  # fmt: skip


_LANGUAGE_MODEL_SUMMARY = ("trajectories", "dropped_stale_rows", "reward_first_version", "reward_last_version")
_VALUE_SUMMARY = ("value_replay_size", "value_return_last")


def summary_lines(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, text) pairs of the summary, for the terminal and the HTML alike (a value run's without the
    language-model lines, its versions named as value-network versions; a LoRA run's without the value learner's)."""
    if summary.get("kind") != "value-network":
        return [(label, _format_summary_value(summary, key)) for key, label in _SUMMARY_LABELS
                if key not in _VALUE_SUMMARY]
    return [("value-network versions" if key == "adapter_versions" else label, _format_summary_value(summary, key))
            for key, label in _SUMMARY_LABELS if key not in _LANGUAGE_MODEL_SUMMARY]


def _format_summary_value(summary: dict[str, Any], key: str) -> str:
    value = summary.get(key)
    if key == "run_stopped_at" and value is None and summary.get("run_stopped"):  # a damaged membership record
        return f"at no recorded time ({summary['run_stopped']})"
    if value is None or value == [] or value == {}:
        return "-"
    if key == "trajectories":
        return (f"{value['rows']} rows, {value['episodes']} episodes, {value['tokens']} tokens "
                f"({value['generated_tokens']} generated), {value['batches']} batches")  # fmt: skip
    if key == "adapter_versions":
        return f"{value} (latest v{summary.get('latest_version', 0)})"
    if key.startswith("reward_"):
        mean, ci95 = readable(value["reward_mean"]), half_width(value["reward_ci95"], value["episodes"])
        return (f"v{value['version']}: {mean} ± {ci95} "
                f"({value['episodes']} episodes, success {percent(value['success_rate'])})")  # fmt: skip
    if key == "eval":
        kind = summary.get("kind", "lora")
        return "; ".join(f"{shown_policy(e['policy'], e['version'], kind)} v{e['version']}{_elsewhere(e, summary)}: "
                         f"{readable(e['mean_return'])} ± "
                         f"{half_width(e['ci95'], e['episodes'])} "
                         f"(success {percent(e['success_rate'])}, 95% CI {percent(e['success_low'])} to "
                         f"{percent(e['success_high'])}, {e['episodes']} ep)" for e in value)  # fmt: skip
    if key == "busy_fraction":
        return ", ".join(f"{name} {percent(fraction)}" for name, fraction in value.items())
    if key == "run_stopped_at":
        return f"{value} ({summary.get('run_stopped')})"
    if key == "time_span":
        return f"{value['start']} to {value['end']} ({value['seconds']:.0f} s)"
    return str(value)


def _elsewhere(evaluation: dict[str, Any], summary: dict[str, Any]) -> str:
    """The words " on ENV" for an evaluation on an environment other than the run's (``rlpipe eval --env``)."""
    env = evaluation.get("env")
    return f" on {env}" if env and env != summary.get("env") else ""


def section_table(section: str, report: RunReport) -> dict[str, list[Any]] | None:
    """The numbers under a figure (``head`` and ``rows``), where a table helps (eval details, busy fractions)."""
    if section == "eval" and report.series["eval"]:
        keys = sorted({k for p in report.series["eval"] for k in p["breakdown"]})
        head = ["policy", "environment", "version", "episodes", "seed start", "mean return", "95% CI", "success",
                "success 95% CI (Wilson)", *keys]
        rows = [
            [shown_policy(p["policy"], p["version"], report.summary.get("kind", "lora")), p["env"], p["version"],
             p["episodes"], p["seed_start"], readable(p["mean_return"]),
             f"± {half_width(p['ci95'], p['episodes'])}", percent(p["success_rate"]),
             f"{percent(p['success_low'])} to {percent(p['success_high'])}",
             *(f"{p['breakdown'][k]:.4g}" if k in p["breakdown"] else "-" for k in keys)]
            for p in report.series["eval"]
        ]  # fmt: skip
        return {"head": head, "rows": rows}
    if section == "duty_cycle" and report.series["duty_cycle"]["lanes"]:
        rows = [[lane["name"], lane["kind"], f"{lane['busy_s']:.1f}", percent(lane["busy_fraction"]),
                 percent(lane["busy_fraction_active"])] for lane in report.series["duty_cycle"]["lanes"]]  # fmt: skip
        return {"head": ["lane", "kind", "busy seconds", "busy over the run", "busy while active"], "rows": rows}
    return None
