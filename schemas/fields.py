"""What every configuration section refuses, or reads as text, beyond its fields' own types.

pydantic's lax mode (needed: ``--set`` values and ``RLPIPE_*`` variables arrive as text)
also reads ``true``/``false`` as 1 and 0, so a YAML ``max_steps: yes`` became a budget of
one step without a word.  A number field given a yes/no is refused in one line instead.
A text field given a number or a yes/no (``run_id: 2024``, ``--set producer.producer_id=true``)
takes it as the text YAML read it from.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

YES_NO_WORDS = frozenset({"true", "false", "yes", "no", "on", "off"})  # what a number field given them is refused for


def _kinds(annotation: Any) -> list[Any]:
    """The types ``annotation`` allows besides None."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    return [kind for kind in options or (annotation,) if kind is not type(None)]


def _numeric(annotation: Any) -> bool:
    """Whether ``annotation`` is int or float, or one of them or None."""
    kinds = _kinds(annotation)
    return bool(kinds) and all(kind in (int, float) for kind in kinds)


class NoYesNoNumbers(BaseModel):
    """A base for configuration sections: a number field given true/false (YAML's yes/no) is an error, and a text
    field given a number or true/false takes it as text."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_no_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if field is None:
            return value
        yes_no = isinstance(value, bool) or (isinstance(value, str) and value.strip().lower() in YES_NO_WORDS)
        if yes_no and _numeric(field.annotation):
            word = str(value).strip().lower()
            raise ValueError(f"{info.field_name} is {word} (a yes/no), not a number; write a number")
        if not isinstance(value, bool | int | float):
            return value
        if _kinds(field.annotation) == [str]:
            return str(value).lower() if isinstance(value, bool) else str(value)
        return value


class ConfigSection(NoYesNoNumbers):
    """A section of the run configuration: unknown keys are refused (a typo should not fall back to a default),
    and an assignment is validated as the section's fields are."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
