"""The learner's crash-test hook: ``RLPIPE_FAULT=<point>:<n>`` SIGKILLs the learner at a commit boundary.

The learner (``consumers.learner``) passes each point of its commit sequence
through a ``FaultInjector``; the crash tests set the variable to stop it in the
windows that decide exactly-once.  Unset, the injector does nothing.
"""

from __future__ import annotations

import logging
import os
import signal
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("rlpipe.learner")

FAULT_ENV = "RLPIPE_FAULT"
FaultPoint = Literal["before_version_event", "after_publish", "before_checkpoint", "before_checkpoint_event",
                     "after_checkpoint"]
FAULT_POINTS: tuple[FaultPoint, ...] = ("before_version_event", "after_publish", "before_checkpoint",
                                        "before_checkpoint_event", "after_checkpoint")


@dataclass
class FaultInjector:
    """Crash-test hook: ``RLPIPE_FAULT=<point>:<n>`` SIGKILLs this process the n-th time it passes ``point``.

    Why: the windows that matter for exactly-once (a checkpoint durable but its
    offsets not committed, a version published but no checkpoint naming it) last
    milliseconds, too short to hit with a timer from outside.  Points:
    ``before_version_event`` (adapter version committed, its ``AdapterPublished``
    not tried yet), ``after_publish`` (adapter version committed and announced,
    before the step's checkpoint), ``before_checkpoint`` (nothing of the checkpoint
    written yet), ``before_checkpoint_event`` (checkpoint durable, its
    ``LearnerCheckpointed`` not tried yet), ``after_checkpoint`` (checkpoint durable
    and announced, offsets not yet committed).  Counts are per process.  Unset (the
    normal case), it does nothing.
    """

    point: FaultPoint | None = None
    at: int = 0
    passed: int = 0

    @classmethod
    def from_env(cls) -> FaultInjector:
        spec = os.environ.get(FAULT_ENV, "")
        if not spec:
            return cls()
        point, _, count = spec.partition(":")
        if point not in FAULT_POINTS or not count.isdigit() or int(count) < 1:
            raise ValueError(f"{FAULT_ENV}={spec!r} is not <point>:<n> with point one of {', '.join(FAULT_POINTS)} "
                             "and n >= 1; fix or unset it")
        return cls(point, int(count))  # type: ignore[arg-type]  # checked just above

    def reached(self, point: FaultPoint) -> None:
        if point != self.point:
            return
        self.passed += 1
        if self.passed == self.at:
            log.warning("%s=%s:%d: killing this process with SIGKILL", FAULT_ENV, point, self.at)
            os.kill(os.getpid(), signal.SIGKILL)
