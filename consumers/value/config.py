"""Configuration of the value-based learner (``schemas.value``, where the run configuration reads it too)."""

from __future__ import annotations

from schemas.value import ValueLearnerConfig

__all__ = ["ValueLearnerConfig"]
