"""Retention of published versions: a learner's registry keeps the newest versions' files, not every version's.

A run that publishes every step adds one adapter (or value network) per step to
the store, for as long as it runs.  With a ``keep`` setting, after each publish
the versions older than the ``keep`` newest are retired
(``AdapterRegistry.retire``): their files are deleted, their manifests and
numbers stay (versions stay dense, and a number never names other weights), and
a pull of one is refused naming the setting.  Without it every version is kept,
as evaluation, reports and warm starts may name any of them.
"""

from __future__ import annotations

import logging

from pipeline.io.registry import AdapterRegistry

log = logging.getLogger("rlpipe.learner")


class VersionRetention:
    """Retires a run's versions older than the ``keep`` newest after each publish (None: keeps every version)."""

    def __init__(self, registry: AdapterRegistry, setting: str, keep: int | None,
                 keep_also: frozenset[int] = frozenset()) -> None:
        """``setting``: the configuration field that sets ``keep``, named in a retired version's reason;
        ``keep_also``: versions kept whatever their age (a warm start's v1)."""
        if keep is not None and keep < 1:
            raise ValueError(f"{setting} must be at least 1 (the newest version is never retired), got {keep}")
        self.registry, self.setting, self.keep, self.keep_also = registry, setting, keep, keep_also
        self.retired_through: int | None = None  # every version up to this one is retired (None: not looked yet)

    def after_publish(self, newest: int) -> int:
        """Retire the versions older than the ``keep`` newest up to ``newest``, but those in ``keep_also``; how many
        were retired.

        The first call lists the registry once (versions published before ``keep`` was set, or by a learner that
        died before retiring them), later ones retire only the versions that aged out since.  A store error is
        logged and the same versions are tried again after the next publish; a lost lease is raised.
        """
        if self.keep is None:
            return 0
        last = newest - self.keep
        if last < 1 or (self.retired_through is not None and last <= self.retired_through):
            return 0
        reason = (f"{self.setting}={self.keep} keeps the files of the newest {self.keep} versions only; use a newer "
                  f"version, or raise {self.setting} for versions to outlive that")
        retired, first = 0, self.retired_through is None
        try:
            if first:
                aged = [version for version in self.registry.versions_with_files() if version <= last]
            else:
                aged = list(range(self.retired_through + 1, last + 1))
            for version in aged:
                if version not in self.keep_also and self.registry.retire(version, reason):
                    retired += 1
        except (OSError, LookupError) as exc:
            log.warning("could not delete the files of run %s's versions up to v%d (tried again after the next "
                        "publish): %s", self.registry.run_id, last, exc)
            return retired
        self.retired_through = last
        if retired:  # said once at the first look (it may retire many), then per publish only in the debug log
            log.log(logging.INFO if first else logging.DEBUG, "retired %d version(s) of run %s up to v%d (%s=%d)",
                    retired, self.registry.run_id, last, self.setting, self.keep)
        return retired
