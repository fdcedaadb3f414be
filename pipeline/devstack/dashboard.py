"""The live view of ``rlpipe run``: one panel per run, fed by its control events.

Each panel shows the learner's step, version and recent rewards, and one row per producer from its newest
``ProducerHeartbeat``.  A reward is a checkpoint's ``reward_mean`` (a LoRA learner's sampled trajectories) or, for a
value run, its actors' ``episode_return_mean``, as ``rlpipe runs list`` shows it.  A producer beats between two
rounds of its loop, so a hung one (its process still running) would keep showing its last rates as if current: its
row says instead how long it has been silent.
Once the run has ended (its learner at its step budget, or ``RunStopped``: a packed run is let go while the
others go on) its producers stop beating for it by design, so their rows say ``done`` or ``stopped`` instead.
A ``RunStarted`` after that (``rlpipe runs resume``, perhaps with a raised budget, which the launcher then reads
from the store) ends the end: the rows show beats and silences again until the next stop.

Without a live view (``--no-dashboard``, or standard output not a terminal) the same events give one plain line
per learner step instead (``StepLines``), so a long run is never silent between its first and last lines.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from pipeline.analysis.runs import episode_reward
from schemas.config import RunConfig
from schemas.events import LearnerCheckpointed, LearnerProgress, ProducerHeartbeat, RunStarted, RunStopped

# A producer beats between two rounds of its loop, so one long round delays a beat: it is shown as silent only after
# this many of its heartbeat intervals, and never before SILENT_FLOOR_S.
SILENT_BEATS = 3
SILENT_FLOOR_S = 30.0


@dataclass
class Dashboard:
    """What the live view shows, updated from control events (thread-safe enough: one writer).

    A producer whose last heartbeat arrived more than ``silent_after_s`` ago (a hung one: its process still runs)
    is shown as silent for that long, not with its last rates as if they were current; once the run has ended
    (``ended``) no beat is due, and the row says so instead.
    """

    silent_after_s: float = SILENT_FLOOR_S
    producers: dict[str, ProducerHeartbeat] = field(default_factory=dict)
    heard: dict[str, float] = field(default_factory=dict)  # producer id -> when its last heartbeat arrived (monotonic)
    learner: LearnerCheckpointed | None = None
    newest_version: int = 0  # the newest version known published: announced by the learner, or held by a producer
    rewards: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    lag: int | None = None
    stopped: RunStopped | None = None  # the run's newest RunStopped, None once a RunStarted follows it
    resumed_at_step: int | None = None  # the learner step shown when the newest RunStarted arrived
    started: float = field(default_factory=time.monotonic)

    def apply(self, payload: Any) -> None:
        if isinstance(payload, ProducerHeartbeat):
            self.producers[payload.producer_id] = payload
            self.heard[payload.producer_id] = time.monotonic()
            self.newest_version = max(self.newest_version, payload.adapter_version)
        elif isinstance(payload, LearnerProgress):
            self.newest_version = max(self.newest_version, payload.version)
        elif isinstance(payload, LearnerCheckpointed):
            shown = self.learner
            if shown is not None and (payload.step < shown.step or payload.path == shown.path):
                return  # an older checkpoint late, or the one shown announced again (``consumers.reannounce``)
            self.learner = payload
            self.newest_version = max(self.newest_version, payload.version)
            reward = episode_reward(payload.metrics)
            if reward is not None:
                self.rewards.append(reward)
        elif isinstance(payload, RunStopped):
            self.stopped = payload
        elif isinstance(payload, RunStarted):  # started, or resumed after a stop
            self.stopped = None
            self.resumed_at_step = self.learner.step if self.learner else 0

    def ended(self, max_steps: int | None) -> str | None:
        """While the run's newest start or stop is a ``RunStopped``: ``done`` if it (or the learner's checkpoint)
        is at ``max_steps``, else ``stopped``.  Otherwise ``done`` once the learner's checkpoint is at
        ``max_steps``, unless the run was started again there (its budget was raised since ``max_steps`` was
        read); None while the run goes on."""
        step = self.learner.step if self.learner else 0
        if self.stopped is not None:
            reached = max_steps is not None and max(step, self.stopped.final_step) >= max_steps
            return "done" if reached else "stopped"
        past_budget = self.resumed_at_step is not None and max_steps is not None and self.resumed_at_step >= max_steps
        return "done" if max_steps is not None and step >= max_steps and not past_budget else None

    def render(self, run_id: str, max_steps: int | None) -> Any:
        from rich.console import Group
        from rich.table import Table

        elapsed = time.monotonic() - self.started
        head = Table.grid(padding=(0, 2))
        learner = self.learner
        step = learner.step if learner else 0
        head.add_row(
            f"[bold]run[/] {run_id}", f"[bold]elapsed[/] {elapsed:5.0f}s",
            f"[bold]learner step[/] {step}/{max_steps or '∞'}", f"[bold]version[/] v{learner.version if learner else 0}",
            f"[bold]reward (avg of last {len(self.rewards)})[/] "
            + self.reward_text(),
            f"[bold]lag[/] {self.lag if self.lag is not None else '-'}",
        )
        if learner:
            m = learner.metrics
            head.add_row(
                f"ratio {m.get('ratio_mean', float('nan')):.3f}", f"ess {m.get('effective_sample_size', float('nan')):.3f}",
                f"stale dropped {int(m.get('dropped_stale_rows', 0))}", f"tok/s {m.get('tokens_per_s', 0):.0f}", "", "",
            )
        table = Table("producer", "adapter", "samples", "samples/s", "tokens/s", "env steps/s", "busy", "last beat",
                      title="producers")
        newest = self.newest_version
        ended = self.ended(max_steps)
        for pid, beat in sorted(self.producers.items()):
            rates = [f"{beat.samples_per_s:.2f}", f"{beat.tokens_per_s:.0f}", f"{beat.env_steps_per_s:.1f}",
                     f"{beat.busy_fraction:.0%}"]  # the last beat's: current only while the run goes on
            table.add_row(pid, f"v{beat.adapter_version} (stale {newest - beat.adapter_version})",
                          str(beat.samples_total), *(["-"] * len(rates) if ended else rates),
                          ended or self.last_beat(pid), style="dim" if ended else None)
        return Group(head, table)

    def reward_text(self) -> str:
        """The mean reward of the last checkpoints' steps, ``-`` before the first."""
        return f"{sum(self.rewards) / len(self.rewards):.3f}" if self.rewards else "-"

    def producer_staleness(self) -> int | None:
        """How many versions the most stale producer's adapter is behind the newest version known published; None
        before a beat.

        The newest checkpoint would not do: a value learner publishes every step but checkpoints every few, so a
        producer is often ahead of it.  Its progress (sent after every step) names the version it published, and a
        producer's own version was published too, so no producer is ever shown behind by less than 0.
        """
        return max((self.newest_version - beat.adapter_version for beat in self.producers.values()), default=None)

    def last_beat(self, producer_id: str) -> str:
        """``Ns ago``, or ``silent Ns`` (in red) past ``silent_after_s``."""
        age = time.monotonic() - self.heard.get(producer_id, time.monotonic())
        return f"[red]silent {age:.0f}s[/]" if age > self.silent_after_s else f"{age:.0f}s ago"


@dataclass
class StepLines:
    """One plain line per learner step of a run, from the control events its ``board`` reads.

    A step the learner checkpoints (every ``checkpoint_every``-th) gets its line from the ``LearnerCheckpointed``,
    which carries the step's reward; any other from the ``LearnerProgress`` sent after it.  Progress repeated while
    the learner waits, and a checkpoint announced again, add no line; nor does any step up to ``shown_step``, which
    the launcher starts at the step a resumed run's checkpoint holds.  Call it after ``board.apply(payload)``.
    """

    run_id: str
    board: Dashboard
    max_steps: int | None = None
    checkpoint_every: int = 1
    shown_step: int = 0  # the newest step with a line

    def __call__(self, payload: Any) -> str | None:
        """The line ``payload`` completes, else None."""
        checkpointed = isinstance(payload, LearnerCheckpointed)
        unchecked = isinstance(payload, LearnerProgress) and payload.step % self.checkpoint_every != 0
        if not (checkpointed or unchecked) or payload.step <= self.shown_step:
            return None
        self.shown_step = payload.step
        return self.line(payload.step, payload.version)

    def line(self, step: int, version: int) -> str:
        board = self.board
        stale = board.producer_staleness()
        parts = [f"run {self.run_id}", f"step {step}/{self.max_steps or '∞'}", f"version v{version}",
                 f"reward {board.reward_text()} (avg of last {len(board.rewards)} checkpoints)"]
        if board.learner is not None:
            parts.append(f"stale dropped {int(board.learner.metrics.get('dropped_stale_rows', 0))}")
        parts += [f"producers {len(board.producers)}" + (f" (most stale {stale} behind)" if stale is not None else ""),
                  f"lag {board.lag if board.lag is not None else '-'}",
                  f"elapsed {time.monotonic() - board.started:.0f}s"]
        return "  ".join(parts)


def silent_after_s(config: RunConfig) -> float:
    """How long a producer of ``config``'s may go without a heartbeat before its dashboard row says it is silent."""
    return max(SILENT_BEATS * config.producer.heartbeat_interval_s, SILENT_FLOOR_S)
