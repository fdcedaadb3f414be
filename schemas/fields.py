"""What every configuration section refuses beyond its fields' own types.

pydantic's lax mode (needed: ``--set`` values and ``RLPIPE_*`` variables arrive as text)
also reads ``true``/``false`` as 1 and 0, so a YAML ``max_steps: yes`` became a budget of
one step without a word.  A number field given a yes/no is refused in one line instead.
"""

from __future__ import annotations

import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationInfo, field_validator


def _numeric(annotation: Any) -> bool:
    """Whether ``annotation`` is int or float, or one of them or None."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    kinds = [kind for kind in options or (annotation,) if kind is not type(None)]
    return bool(kinds) and all(kind in (int, float) for kind in kinds)


class NoYesNoNumbers(BaseModel):
    """A base for configuration sections: a number field given true/false (YAML's yes/no) is an error."""

    @field_validator("*", mode="before")
    @classmethod
    def _no_yes_no_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        if isinstance(value, bool) and field is not None and _numeric(field.annotation):
            raise ValueError(f"{info.field_name} is {str(value).lower()} (a yes/no), not a number; write a number")
        return value
