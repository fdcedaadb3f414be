"""Every setting the README and docs/ name exists: ``RLPIPE_`` variables and dotted fields (``learner.lora_rank``).

A variable or field renamed in the configuration and left in the docs is refused when
a user sets it as shown. The docs show two misspellings on purpose, as examples of what is
refused; those must stay refused.
"""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from pipeline.config import PROCESS_ENV, SERVICE_LINK, ConfigError, check_env_names, config_env_names, resolve_config
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "examples").rglob("*.md")),
        *sorted((ROOT / "infra").rglob("*.md"))]
REFUSED_EXAMPLES = {"RLPIPE_LERNER__LEARNING_RATE", "learner.lerning_rate"}  # the docs' examples of a refusal


def section_model(annotation: typing.Any) -> type[BaseModel] | None:
    """The configuration section a field holds, if any (``LearnerConfig``; ``ValueRunConfig`` of ``... | None``)."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    return next((option for option in (typing.get_args(annotation) if union else (annotation,))
                 if isinstance(option, type) and issubclass(option, BaseModel)), None)


SECTIONS = sorted(name for name, field in RunConfig.model_fields.items() if section_model(field.annotation))
DOTTED = re.compile(rf"(?<![\w./$-])((?:{'|'.join(SECTIONS)})(?:\.(?!(?:py|md|yaml|json)\b)[a-z_][a-z0-9_]*)+)(?![\w(/*])")


def is_setting(path: str) -> bool:
    """Whether ``section.field[.field...]`` names a field of RunConfig (keys inside a mapping field are free)."""
    model: type[BaseModel] | None = RunConfig
    annotation: typing.Any = None
    for name in path.split("."):
        if model is None:
            return typing.get_origin(annotation) is dict or annotation is dict  # env.overrides.max_turns
        field = model.model_fields.get(name)
        if field is None:
            return False
        annotation, model = field.annotation, section_model(field.annotation)
    return True


def named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return [(f"{doc.relative_to(ROOT)}:{number}", match.group(1)) for doc in DOCS
            for number, line in enumerate(doc.read_text().splitlines(), 1) for match in pattern.finditer(line)]


def test_every_rlpipe_variable_named_in_the_docs_is_read() -> None:
    valid = config_env_names() | set(PROCESS_ENV)
    found = named(re.compile(r"\b(RLPIPE_[A-Z0-9_]*[A-Z0-9])\b"))
    assert len(found) > 20
    wrong = [f"{where}: {name}" for where, name in found
             if name not in valid | REFUSED_EXAMPLES and not SERVICE_LINK.fullmatch(name)]
    assert not wrong, "RLPIPE_ variables named that rlpipe does not read:\n" + "\n".join(wrong)


def test_every_dotted_setting_named_in_the_docs_is_a_field() -> None:
    found = named(DOTTED)
    assert len(found) > 100
    wrong = [f"{where}: {name}" for where, name in found if name not in REFUSED_EXAMPLES and not is_setting(name)]
    assert not wrong, "settings named that RunConfig does not have:\n" + "\n".join(wrong)


def test_the_docs_examples_of_a_refused_setting_are_refused() -> None:
    with pytest.raises(ConfigError, match="RLPIPE_LEARNER__LEARNING_RATE"):
        check_env_names(["RLPIPE_LERNER__LEARNING_RATE"])
    with pytest.raises(ConfigError, match=r"did you mean learner\.learning_rate"):
        resolve_config(overrides=["learner.lerning_rate=1e-4"])


def test_a_renamed_setting_is_found() -> None:
    assert not is_setting("learner.lora_rnk") and not is_setting("sampler.engine.kind")
    assert is_setting("learner.lora_rank") and is_setting("env.overrides.max_turns")
    assert DOTTED.findall("`learner.warn_*` and sampler.generate() and learner.py, `bus.namespace`") == ["bus.namespace"]
