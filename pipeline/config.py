"""Resolve a run configuration from its layers, lowest first:

1. the model defaults (``schemas.config.RunConfig``),
2. a preset shipped with the package (``--preset NAME``),
3. a YAML or JSON file (``--config FILE``),
4. ``RLPIPE_``-prefixed environment variables, nested with ``__``
   (``RLPIPE_BUS__BOOTSTRAP_SERVERS=kafka:9092``, ``RLPIPE_LEARNER__LEARNING_RATE=1e-4``),
5. ``--set dotted.key=value`` flags.

Why this order: a deployment (Kubernetes) sets environment variables over a
preset or a ConfigMap file, and a person at a terminal overrides anything with a
flag.  Environment variables are read by pydantic-settings; values that look like
JSON (lists, numbers, objects) are decoded, the rest stay strings for pydantic's
own coercion.  Secrets stay ``SecretStr`` and print as ``***``.  A variable
with the prefix that names no field (``RLPIPE_LERNER__LEARNING_RATE``) is
refused with the closest valid name rather than ignored: a typo must not
silently leave the default in place.  Names match whatever their case
(``rlpipe_learner__max_steps`` sets ``learner.max_steps``), as pydantic-settings
reads them, whether they come from the process or from ``environ=``; one name
given twice in different cases with different values is refused.  The few
``RLPIPE_`` variables that are not run configuration are listed in
``PROCESS_ENV``; they are read by their exact name, so one of them written in
another case is refused rather than ignored.
"""

from __future__ import annotations

import difflib
import json
import os
import re
import types
import typing
from collections.abc import Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from schemas.config import LearnerConfig, RunConfig
from schemas.names import InvalidNameError, echoed, validate_name
from schemas.value import ValueLearnerConfig

ENV_PREFIX = "RLPIPE_"
VALUE_RUN_LEARNER_FIELDS = {"torch_threads"}  # the one `learner` field a value run reads
# RLPIPE_ variables that configure a process rather than a run (never checked against RunConfig's fields).
PROCESS_ENV = {
    "RLPIPE_HOME": "where the embedded stack, caches and local store live (pipeline.devstack.stack)",
    "RLPIPE_KAFKA_GROUP_TIMINGS_MS": "consumer-group timings as JSON (pipeline.io.bus)",
    "RLPIPE_KAFKA_PORT": "port of a broker started by `python -m pipeline.devstack.broker`",
    "RLPIPE_FAULT": "the learner's crash-test hook (consumers.faults)",
    "RLPIPE_API_KEYS": "the Tinker API's tenants and their keys, tenant=key,... (pipeline.api.tenants)",
    "RLPIPE_API_MAX_SESSIONS": "sessions one Tinker API tenant may hold that have not ended (pipeline.api.tenants)",
    "RLPIPE_API_MAX_MODELS": "training clients one Tinker API tenant may hold in them (pipeline.api.tenants)",
    "RLPIPE_API_MAX_SAMPLING_SESSIONS": "sampling sessions one Tinker API tenant may hold in them "
                                        "(pipeline.api.tenants)",
    "RLPIPE_API_MAX_CALL_TOKENS": "tokens one Tinker API forward_backward or forward request may hold "
                                  "(pipeline.api.tenants)",
    "RLPIPE_API_THREADS": "worker threads the Tinker API gateway does its store and log work in (pipeline.api.threads)",
    "RLPIPE_API_THREADS_PER_TENANT": "most of those threads one Tinker API tenant's calls hold at once "
                                     "(pipeline.api.threads)",
    "RLPIPE_API_THREADS_RESERVED": "the last free threads, taken only by a Tinker API tenant holding none "
                                   "(pipeline.api.threads)",
    "RLPIPE_SWEEP_EXPERIMENT": "a sweep experiment's name, for its script (pipeline.sweeps.runner)",
}
# What Kubernetes sets in a pod for each Service of its namespace (a Service named rlpipe-kafka-bootstrap gives
# RLPIPE_KAFKA_BOOTSTRAP_SERVICE_HOST, ..._PORT_9093_TCP_ADDR): never run configuration, never refused.
SERVICE_LINK = re.compile(r"RLPIPE_(?!.*__)[A-Z0-9_]+_(SERVICE_HOST|SERVICE_PORT(_[A-Z0-9_]+)?"
                          r"|PORT(_[0-9]+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)")


class ConfigError(ValueError):
    """A configuration that cannot be used, with a message naming the fix."""


class _EnvLayer(BaseSettings):
    """Collects ``RLPIPE_*`` variables into nested dicts (validation happens in RunConfig)."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, env_nested_delimiter="__", extra="ignore")

    run_id: str | None = None
    num_producers: str | None = None
    env: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    bus: dict[str, Any] | None = None
    store: dict[str, Any] | None = None
    sampler: dict[str, Any] | None = None
    producer: dict[str, Any] | None = None
    learner: dict[str, Any] | None = None
    value: dict[str, Any] | None = None


def preset_names() -> list[str]:
    """Presets shipped with the package."""
    folder = resources.files("pipeline") / "presets"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


class _Yaml12Booleans(yaml.SafeLoader):
    """YAML as configuration reads it: only true/false are booleans (YAML 1.2), so ``run_id: off`` or ``--set
    producer.producer_id=no`` stay text; a boolean field still reads yes/no/on/off (pydantic's lax mode)."""


_Yaml12Booleans.yaml_implicit_resolvers = {
    first: [(tag, pattern) for tag, pattern in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Booleans.add_implicit_resolver("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
                                      list("tTfF"))


def load_yaml(text: str) -> Any:
    """``text`` read as configuration reads YAML (``_Yaml12Booleans``)."""
    return yaml.load(text, Loader=_Yaml12Booleans)  # a SafeLoader: plain data only


def load_preset(name: str) -> dict[str, Any]:
    """A shipped preset as a dict; a clear error lists the choices.  ``name`` is a name, never a path (a file is
    read with ``--config``), so it cannot reach a YAML file outside the shipped presets."""
    try:
        validate_name(name, "preset")
    except InvalidNameError:
        raise ConfigError(f"preset {name!r} is not a preset name; choose one of: {', '.join(preset_names())} "
                          "(read a file of your own with --config PATH)") from None
    path = resources.files("pipeline") / "presets" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(preset_names())}")
    return load_yaml(path.read_text()) or {}


def load_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A YAML or JSON config file as a dict."""
    file = Path(path)
    if file.is_dir():
        raise ConfigError(f"config file {str(file)!r} is a folder; give the path of a YAML or JSON file")
    if not file.is_file():
        raise ConfigError(f"config file {str(file)!r} does not exist")
    try:
        data = load_yaml(file.read_text())
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(file)!r} is not text ({exc.reason} at byte {exc.start}); "
                          "give a YAML or JSON file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {str(file)!r} is not valid YAML/JSON: {exc}".splitlines()[0]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(file)!r} must hold a mapping at the top level")
    return data


def config_env_names() -> set[str]:
    """Every ``RLPIPE_`` name that sets a field: top-level fields, sections and their fields at any depth
    (``SECTION__FIELD``, ``VALUE__LEARNER__MAX_STEPS``)."""
    return _env_names(RunConfig, ENV_PREFIX)


def _env_names(model: type[BaseModel], prefix: str) -> set[str]:
    """``prefix`` + each field of ``model``, and of the sections nested in it, ``__``-joined and upper case."""
    names = set()
    for name, field in model.model_fields.items():
        full = f"{prefix}{name.upper()}"
        names.add(full)
        section = _section_model(field.annotation)
        if section is not None:
            names |= _env_names(section, f"{full}__")
    return names


def _section_model(annotation: Any) -> type[BaseModel] | None:
    """The configuration section a field holds (``LearnerConfig``, or ``ValueRunConfig`` of ``... | None``)."""
    options = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) else ()
    for option in options or (annotation,):
        if isinstance(option, type) and issubclass(option, BaseModel):
            return option
    return None


def _is_rlpipe(name: str) -> bool:
    return name.upper().startswith(ENV_PREFIX)


def check_env_case(environ: Mapping[str, str]) -> None:
    """Refuse one ``RLPIPE_`` name set in two cases to different values: which one is read would be an accident."""
    seen: dict[str, str] = {}
    for name, value in environ.items():
        if not _is_rlpipe(name):
            continue
        other = seen.setdefault(name.upper(), name)
        if other != name and environ[other] != value:
            raise ConfigError(f"environment variables {other} and {name} set the same field to different values; "
                              "unset one of them")


def child_environment(settings: Mapping[str, str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default the process's) with the ``RLPIPE_`` ``settings`` a child process is given on top.

    A name set here drops its other spellings (``rlpipe_bus__bootstrap_servers`` for
    ``RLPIPE_BUS__BOOTSTRAP_SERVERS``): the child would read both and refuse them when their values differ
    (``check_env_case``), and the value given here is the one meant.
    """
    given = {name.upper() for name in settings}
    kept = {name: value for name, value in (os.environ if environ is None else environ).items()
            if not (_is_rlpipe(name) and name.upper() in given)}
    return {**kept, **settings}


def check_env_names(names: Sequence[str]) -> None:
    """Refuse an ``RLPIPE_`` variable that sets no field, naming the closest valid one (``ConfigError``)."""
    valid = config_env_names()
    for name in names:
        upper = name.upper()
        if upper in PROCESS_ENV and name != upper:  # read by its exact name (os.environ.get): other cases are ignored
            raise ConfigError(f"environment variable {name} is read only as {upper}; rename it {upper}")
        if not upper.startswith(ENV_PREFIX) or upper in valid or upper in PROCESS_ENV or SERVICE_LINK.fullmatch(upper):
            continue
        section, _, rest = upper.partition("__")
        if f"{section}__{rest.partition('__')[0]}" in valid and _is_mapping_field(section, rest.partition("__")[0]):
            continue  # a key inside a mapping field, e.g. RLPIPE_ENV__OVERRIDES__MAX_TURNS
        closest = difflib.get_close_matches(upper, sorted(valid | set(PROCESS_ENV)), n=1, cutoff=0.6)
        hint = f"did you mean {closest[0]}?" if closest else "unset it (fields look like RLPIPE_LEARNER__LEARNING_RATE)"
        raise ConfigError(f"environment variable {name} sets no configuration field; {hint}")


def _is_mapping_field(section: str, field: str) -> bool:
    model = RunConfig.model_fields.get(section.removeprefix(ENV_PREFIX).lower())
    annotation = _section_model(model.annotation) if model else None
    if annotation is None:
        return False
    inner = annotation.model_fields.get(field.lower())
    return inner is not None and getattr(inner.annotation, "__origin__", inner.annotation) is dict


def env_layer(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The ``RLPIPE_*`` variables of ``environ`` (default ``os.environ``) as a nested dict.

    Names match whatever their case, as pydantic-settings reads them.  ``ConfigError`` names a variable that
    sets no field (see ``check_env_names``) or a name set twice in different cases (``check_env_case``).
    """
    source = os.environ if environ is None else environ
    check_env_case(source)
    check_env_names(list(source))
    try:
        if environ is None:
            layer = _EnvLayer()
        else:  # pydantic-settings reads only os.environ: swap the RLPIPE_ variables in for the duration
            saved = {k: v for k, v in os.environ.items() if _is_rlpipe(k)}
            try:
                for k in saved:
                    del os.environ[k]
                os.environ.update({k: v for k, v in environ.items() if _is_rlpipe(k)})
                layer = _EnvLayer()
            finally:
                for k in [k for k in os.environ if _is_rlpipe(k)]:
                    del os.environ[k]
                os.environ.update(saved)
    except ValidationError as exc:  # a section given one value (RLPIPE_LEARNER=3), not its fields
        section = str(exc.errors()[0]["loc"][0])
        name = env_variable(source, (section,)) or f"{ENV_PREFIX}{section.upper()}"
        raise ConfigError(f"{name}={echoed(source.get(name, ''))}: {section} is a section, not a value; set its "
                          f"settings one by one as {name}__<SETTING> (rlpipe config show lists them)") from None
    return _decode_json_leaves(layer.model_dump(exclude_none=True))


def env_variable(environ: Mapping[str, str], loc: Sequence[int | str]) -> str | None:
    """The ``RLPIPE_*`` variable of ``environ`` that sets the field at ``loc`` (whatever its case), if one does."""
    wanted = (ENV_PREFIX + "__".join(str(part) for part in loc)).upper()
    return next((name for name in environ if name.upper() == wanted), None)


def _decode_json_leaves(value: Any) -> Any:
    if isinstance(value, dict):
        return {k.lower(): _decode_json_leaves(v) for k, v in value.items()}
    if isinstance(value, str) and value[:1] in "[{":
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            return value
    return value


def parse_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """``["learner.learning_rate=1e-4", "env.name=sokoban"]`` -> nested dict (values YAML-decoded)."""
    result: dict[str, Any] = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {item!r} is not KEY=VALUE (e.g. --set learner.learning_rate=1e-4)")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as exc:
            problem = getattr(exc, "problem", None) or str(exc).strip().splitlines()[0]
            raise ConfigError(f"--set {item!r}: the value is not valid YAML ({problem}); write a mapping as JSON "
                              '({"key": 1}) and quote text that holds YAML\'s marks ({, [, :, #)') from None
        node = result
        parts = key.strip().split(".")
        if not all(part.strip() for part in parts):
            raise ConfigError(f"--set {item!r}: the key has an empty part; write it as section.field, "
                              "e.g. --set learner.learning_rate=1e-4")
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                where = ".".join(parts[:depth + 1])
                raise ConfigError(f"--set {item!r}: {where} is already set to {node!r} by another --set, so it "
                                  "has no fields to set; drop one of the two")
        earlier = node.get(parts[-1])
        if isinstance(earlier, dict) and earlier:  # fields another --set gave: a mapping adds to them
            if not isinstance(value, dict):
                raise ConfigError(f"--set {item!r}: {key.strip()} already has fields set by another --set "
                                  f"({', '.join(sorted(earlier))}); drop one of the two")
            value = deep_merge(earlier, value)
        node[parts[-1]] = value
    return result


def deep_merge(base: dict[str, Any], update: Mapping[str, Any]) -> dict[str, Any]:
    """``update`` over ``base`` recursively (mappings merge, everything else replaces)."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = deep_merge(dict(merged[key]), value)
        else:
            merged[key] = value
    return merged


def validation_message(exc: ValidationError, shown: int = 3, sources: Mapping[tuple[Any, ...], str] | None = None
                       ) -> str:
    """Every validation error in one line (the first ``shown``, then how many more), so a file with several
    mistakes is fixed in one go: ``learner.learning_rate: Input should be > 0; learner.max_steps: ...``;
    ``sources``: the environment variable each field's value came from, named after its error."""
    errors, sources = exc.errors(), sources or {}
    parts = [f"{'.'.join(str(p) for p in error['loc']) or 'config'}: {_error_text(error)}"
             + (f" (set by {sources[tuple(error['loc'])]})" if tuple(error["loc"]) in sources else "")
             for error in errors[:shown]]
    more = f" (and {len(errors) - shown} more)" if len(errors) > shown else ""
    return f"invalid configuration: {'; '.join(parts)}{more}"


def unknown_setting(loc: tuple[int | str, ...], model: type[BaseModel] = RunConfig,
                    listing: str = "rlpipe config show") -> str:
    """Why key ``loc`` of ``model`` was refused, naming the closest field of its section (a misspelt key), else the
    command ``listing`` them."""
    section: type[BaseModel] | None = model
    for part in loc[:-1]:
        field = section.model_fields.get(str(part)) if section else None
        section = _section_model(field.annotation) if field else None
    closest = difflib.get_close_matches(str(loc[-1]), sorted(section.model_fields) if section else [], n=1, cutoff=0.6)
    if not closest:
        return f"no such setting ({listing} lists them)"
    return f"no such setting; did you mean {'.'.join([*map(str, loc[:-1]), closest[0]])}?"


def setting_error(exc: ValueError, model: type[BaseModel], listing: str) -> str:
    """One line for settings of ``model`` that were refused: the first problem, a misspelt key with its closest field."""
    if not isinstance(exc, ValidationError):
        text = str(exc).strip()
        return text.splitlines()[0] if text else type(exc).__name__
    first = exc.errors()[0]
    where = ".".join(str(part) for part in first["loc"])
    what = _error_text(first, model, listing)
    return f"{where}: {what}" if where else what


def _error_text(error: Any, model: type[BaseModel] = RunConfig, listing: str = "rlpipe config show") -> str:
    """What is wrong with one setting: pydantic's message, or for a misspelt key the closest field (``unknown_setting``)."""
    return unknown_setting(error["loc"], model, listing) if error["type"] == "extra_forbidden" else str(error["msg"])


def _env_sources(exc: ValidationError, environ: Mapping[str, str] | None,
                 overrides: Mapping[str, Any]) -> dict[tuple[Any, ...], str]:
    """The ``RLPIPE_*`` variable behind each refused field whose value ``--set`` (``overrides``) did not replace."""
    source = os.environ if environ is None else environ
    found = {}
    for error in exc.errors():
        loc, layer = tuple(error["loc"]), overrides
        for part in loc:  # a field --set gave, or a section it gave whole
            layer = layer.get(str(part)) if isinstance(layer, Mapping) else None
        if layer is None and (name := env_variable(source, loc)):
            found[loc] = name
    return found


def resolve_config(
    preset: str | None = None,
    config_file: str | os.PathLike[str] | None = None,
    overrides: Sequence[str] = (),
    environ: Mapping[str, str] | None = None,
) -> RunConfig:
    """Merge every layer and validate; ``ConfigError`` carries one line naming the bad field."""
    layers: list[Mapping[str, Any]] = []
    if preset:
        layers.append(load_preset(preset))
    if config_file:
        layers.append(load_file(config_file))
    layers.append(env_layer(environ))
    layers.append(parse_overrides(overrides))
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = deep_merge(merged, layer)
    try:
        config = RunConfig.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(validation_message(exc, sources=_env_sources(exc, environ, layers[-1]))) from None
    check_value_run_settings(config, layers[1 if preset else 0:])
    return config


def check_value_run_settings(config: RunConfig, layers: Sequence[Mapping[str, Any]]) -> None:
    """Refuse a LoRA learner setting given for a value run: ``learner.max_steps`` would be accepted and do nothing
    (its budget is ``value.learner.max_steps``).  A value run reads only ``VALUE_RUN_LEARNER_FIELDS`` of ``learner``;
    a setting equal to the default (a whole configuration written by ``rlpipe config show``) changes nothing."""
    if config.value is None:
        return
    defaults = LearnerConfig()
    for layer in layers:
        for key in layer.get("learner") or {}:
            if key in VALUE_RUN_LEARNER_FIELDS or getattr(config.learner, key) == getattr(defaults, key):
                continue
            fix = (f"set value.learner.{key}" if key in ValueLearnerConfig.model_fields
                   else "a value run's learner settings are value.learner.* (rlpipe config show --preset NAME)")
            raise ConfigError(f"learner.{key} does not apply to a value run (it trains value.learner, not a LoRA "
                              f"adapter); {fix}")


def config_to_json(config: RunConfig, reveal_secrets: bool = False) -> str:
    """The resolved configuration as JSON; secrets as ``***`` unless asked (only for run.json-free uses)."""
    data = config.model_dump(mode="json")
    if reveal_secrets and config.bus.sasl_password is not None:
        data["bus"]["sasl_password"] = config.bus.sasl_password.get_secret_value()
    elif config.bus.sasl_password is not None:
        data["bus"]["sasl_password"] = "***"
    return json.dumps(data, indent=2, sort_keys=True)


def check_env(config: RunConfig) -> RunConfig:
    """``config`` if its environment exists and takes its ``env.overrides``, else ``ConfigError`` naming the name or
    field (a producer would otherwise fail only when it builds the environment)."""
    from producers.envs.registry import env_class, env_names

    if config.env.name not in env_names():
        raise ConfigError(f"env.name {config.env.name!r} is no environment; choose one of: {', '.join(env_names())}")
    settings = env_class(config.env.name).Config
    try:
        settings.model_validate(config.env.overrides)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        problem = setting_error(exc, settings, listing=f"rlpipe envs show {config.env.name}")
        raise ConfigError(f"env.overrides of {config.env.name}: {problem}") from None
    return config
