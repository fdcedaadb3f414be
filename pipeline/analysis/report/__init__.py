"""``rlpipe report``: one run's story in numbers and pictures, from the store and the event log alone.

Store + ``<ns>.control`` -> ``gather_report`` -> ``RunReport`` (summary, series,
notes) -> ``write_report`` -> ``report.html`` (PNGs inlined as data URIs, so the
file can be mailed), the same PNGs next to it, and ``report.json``.  The page is
rendered from the Jinja2 template ``pipeline/analysis/report/templates/report.html.jinja`` with
autoescaping on; Python only prepares plain values for it.

Where each number comes from (nothing else is read; no hidden state):

- trajectories: every Parquet batch of the run (``TrajectoryArchive.scan``).
  Rewards are episode-level: long-horizon environments write one row per turn
  (``turn`` > 0 exists), and there each episode counts once with its ``reward``
  (the episode return), its first turn's ``policy_version`` and its last row's time.
- adapters: the registry's manifests (versions, base model); an unreadable one is noted and skipped.
- learner: ``state.json`` of the newest complete checkpoint, its digest checked
  against the checkpoint's manifest (the contract of ``schemas.checkpoint``),
  and the step log up to its step (``pipeline.io.steplog``; a checkpoint of the old
  layout carries it inline): staleness, importance ratios, ESS, step times and the
  signs of collapse (entropy, identical groups, zero advantages, reward spread).
- evaluations: ``runs/<run>/eval/*.json`` (``schemas.evaluation.EvalResult``), the newest one per
  (policy, environment, version, seed range), drawn as one series per (policy, environment).
- producers: ``ProducerHeartbeat`` events on ``<ns>.control`` (rates, busy fraction),
  plus ``RunStarted``/``RunStopped``/``LearnerCheckpointed``; the read is bounded, and an event
  resent by its publisher (two copies with one ``event_id``) counts once.
- the run's status (the summary's ``status``: running, finished, stopped, idle or unknown), as
  ``rlpipe runs show`` gives it (``pipeline.analysis.runs.summarize``).
- whether the run is stopped (the summary's ``stopped``, and the end of the run window): read as
  ``rlpipe runs list|show`` read it (``pipeline.analysis.runs.RunActivity``), from the topic and from the
  run's newest start or stop as the store keeps it (``runs/<run>/membership.json``, which retention does not
  trim): its newest ``RunStopped`` unless a ``RunStarted`` or the run going on came after; a damaged record
  is a stop.

The duty-cycle timeline puts every producer and the learner on one time axis.
A lane's busy fraction is its busy seconds inside the run window divided by the
window's length; the window runs from the earliest known moment (``RunStarted``
or the first lane activity) to the latest (``RunStopped`` or the last activity).
A producer interval counts ``busy_fraction * interval_s`` busy seconds (the
heartbeat only knows the share, not where inside the interval it fell).

Anything missing (no checkpoint yet, no evaluations, an unreachable broker)
leaves its section empty with a note saying why; it never fails the report.

The modules, in the order the data flows: ``gather`` (the store and the log ->
``RunReport``, with the summary and the notes on what is missing), ``metrics``
(pure functions of the gathered rows, steps and events), ``plots`` (one
matplotlib figure per section) and ``html`` (the page, the PNGs and
``report.json``); ``model`` holds the ``RunReport`` they pass along.
"""

from pipeline.analysis.report.gather import DEFAULT_BUS_TIMEOUT_S, UnknownRunError, checkpoint_folders, gather_report
from pipeline.analysis.report.html import render_html, summary_lines, write_report
from pipeline.analysis.report.metrics import busy_seconds
from pipeline.analysis.report.model import FIGURE_FILES, SECTIONS, RunReport

__all__ = [
    "DEFAULT_BUS_TIMEOUT_S", "FIGURE_FILES", "SECTIONS", "RunReport", "UnknownRunError", "busy_seconds",
    "checkpoint_folders", "gather_report", "render_html", "summary_lines", "write_report",
]  # fmt: skip
