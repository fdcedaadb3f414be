"""Evaluation results: how one policy did on held-out seeds.

``rlpipe eval`` -> store (``runs/<run_id>/eval/<policy>-v000003-seed1000000-<UTC time>.json``)
-> ``rlpipe report``.  One file is one evaluation: a policy (an adapter version,
or a baseline such as a heuristic or a random policy) played ``episodes``
episodes on consecutive seeds starting at ``seed_start`` (held out from training
by ``env.eval_seed_offset``).  Per-episode returns and successes are kept, so a
reader can recompute any statistic; the summary fields must agree with them.

The 95% confidence interval is ``mean +- ci95`` with a Student-t critical value
(a normal 1.96 under-covers with the few dozen episodes an evaluation usually has).
Unknown fields are ignored (a newer minor version may add optional ones); a newer
major version is refused.

``rlpipe eval --validation`` -> store (``runs/<run_id>/validation/<env>-seed1000064-episodes64.json``)
-> ``rlpipe eval``: a validation's results are not stored (runs are chosen on them, so they are
not reported), but the seeds it played are (``ValidationPlayed``), so a later held-out
evaluation refuses to report on them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.names import validate_name
from schemas.records import record_from_bytes, record_to_bytes
from schemas.versions import check_readable

EVAL_SCHEMA_VERSION = "1.0"
EVAL_FOLDER = "eval"
VALIDATION_FOLDER = "validation"
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]
# Two-sided 95% Student-t critical values t_{0.975, df} for df = 1..30 (a t table, 6 decimals); an expansion beyond.
_T_975 = (
    12.706205, 4.302653, 3.182446, 2.776445, 2.570582, 2.446912, 2.364624, 2.306004, 2.262157, 2.228139,
    2.200985, 2.178813, 2.160369, 2.144787, 2.131450, 2.119905, 2.109816, 2.100922, 2.093024, 2.085963,
    2.079614, 2.073873, 2.068658, 2.063899, 2.059539, 2.055529, 2.051831, 2.048407, 2.045230, 2.042272,
)  # fmt: skip
_CONSISTENCY_TOLERANCE = 1e-6


class EvalResultError(ValueError):
    """Bytes that are not a readable evaluation result."""


Z_975 = 1.959963984540054  # the two-sided 95% normal quantile (the t quantile tends to it)


def t_critical_95(dof: int) -> float:
    """Two-sided 95% critical value of Student's t with ``dof`` degrees of freedom.

    Up to 30: the t table.  Beyond: the expansion of t in powers of 1/dof around the normal
    quantile z (Abramowitz & Stegun 26.7.5), within 3e-8 of the exact value from dof 31 on
    (a plain 1.96 there made intervals of 32 to 100 values 2-4% too narrow):
    t = z + g1/v + g2/v^2 + g3/v^3 + g4/v^4,  g1 = (z^3 + z)/4,  g2 = (5z^5 + 16z^3 + 3z)/96,
    g3 = (3z^7 + 19z^5 + 17z^3 - 15z)/384,  g4 = (79z^9 + 776z^7 + 1482z^5 - 1920z^3 - 945z)/92160.
    No scipy: ``schemas`` imports only pydantic and pyarrow.
    """
    if dof < 1:
        raise ValueError(f"degrees of freedom must be at least 1, got {dof}")
    if dof <= len(_T_975):
        return _T_975[dof - 1]
    z, v = Z_975, float(dof)
    g1 = (z**3 + z) / 4
    g2 = (5 * z**5 + 16 * z**3 + 3 * z) / 96
    g3 = (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384
    g4 = (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160
    return z + g1 / v + g2 / v**2 + g3 / v**3 + g4 / v**4


def mean_ci95(values: Sequence[float]) -> tuple[float, float]:
    """(mean, half-width of its 95% CI) of ``values``; the half-width is 0.0 for fewer than two values.

    half-width = t_{0.975, n-1} * s / sqrt(n), s the sample standard deviation (n - 1 in the denominator).
    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_ci95 needs at least one value")
    mean = math.fsum(values) / n
    if n < 2:
        return mean, 0.0
    variance = math.fsum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, t_critical_95(n - 1) * math.sqrt(variance) / math.sqrt(n)


def paired_difference(a: Mapping[int, Sequence[float]], b: Mapping[int, Sequence[float]]) -> dict[str, float]:
    """Mean of ``a - b`` over the same (episode, seed) with its 95% CI; ``above``: the whole CI above 0.

    ``a`` and ``b`` map a seed to per-episode returns in the same episode order, so an
    episode's conditions (a held-out day's weather and occupancy) cancel in the difference;
    a seed ``b`` lacks (a deterministic policy plays seed 0 only) is compared with ``b``'s seed 0.
    """
    differences = [x - y for seed, returns in a.items()
                   for x, y in zip(returns, b[seed] if seed in b else b[0], strict=True)]
    mean, ci95 = mean_ci95(differences)
    return {"mean": mean, "ci95": ci95, "pairs": len(differences), "above": mean - ci95 > 0}

class EvalResult(BaseModel):
    """One evaluation of one policy on ``episodes`` held-out seeds (``rlpipe eval`` -> store -> ``rlpipe report``)."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: str = Field(EVAL_SCHEMA_VERSION, description="MAJOR.MINOR of this record")
    run_id: str = Field(description="the run whose policy was evaluated")
    env: str = Field(min_length=1, max_length=64, description="registered environment name")
    policy: str = Field(
        "adapter", min_length=1, max_length=64, description="'adapter', or a baseline: 'heuristic', 'random', ..."
    )
    version: int = Field(ge=0, description="adapter version evaluated; 0 = the base model (or a baseline)")
    episodes: int = Field(ge=1, le=10_000_000, description="episodes played, one per seed")
    seed_start: int = Field(ge=0, description="first seed; episode i used seed_start + i")
    returns: list[FiniteFloat] = Field(description="episode returns, in seed order")
    successes: list[bool] = Field(description="episode successes, in seed order")
    mean_return: FiniteFloat = Field(description="mean of returns")
    ci95: FiniteFloat = Field(ge=0.0, description="half-width of the 95% CI of mean_return (Student t)")
    success_rate: float = Field(ge=0.0, le=1.0, description="share of successful episodes")
    breakdown: dict[str, FiniteFloat] = Field(
        default_factory=dict, description="optional per-component means, e.g. energy, carbon, comfort"
    )
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC), description="when it was evaluated (UTC)")

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: object) -> object:
        if isinstance(data, dict) and "schema_version" in data:
            check_readable(str(data["schema_version"]), EVAL_SCHEMA_VERSION, "evaluation result")
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_name(value, "run_id")

    @field_validator("policy")
    @classmethod
    def _policy(cls, value: str) -> str:
        return validate_name(value, "policy")

    @field_validator("created_at")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    @model_validator(mode="after")
    def _consistent(self) -> EvalResult:
        """The summary must agree with the per-episode lists, so a reader can trust either."""
        if len(self.returns) != self.episodes or len(self.successes) != self.episodes:
            raise ValueError(
                f"episodes is {self.episodes} but there are {len(self.returns)} returns and "
                f"{len(self.successes)} successes; they must all agree"
            )
        mean, ci95 = mean_ci95(self.returns)
        rate = sum(self.successes) / self.episodes
        for name, stated, derived in (("mean_return", self.mean_return, mean), ("ci95", self.ci95, ci95),
                                      ("success_rate", self.success_rate, rate)):  # fmt: skip
            if not math.isclose(stated, derived, rel_tol=_CONSISTENCY_TOLERANCE, abs_tol=_CONSISTENCY_TOLERANCE):
                raise ValueError(f"{name} is {stated} but the episodes give {derived}; build it with from_episodes")
        return self

    @classmethod
    def from_episodes(
        cls,
        run_id: str,
        env: str,
        version: int,
        seed_start: int,
        returns: Sequence[float],
        successes: Sequence[bool],
        policy: str = "adapter",
        breakdown: dict[str, float] | None = None,
        created_at: datetime | None = None,
    ) -> EvalResult:
        """Build a result from per-episode outcomes, computing mean, CI and success rate."""
        if not returns:
            raise ValueError("an evaluation needs at least one episode")
        mean, ci95 = mean_ci95([float(r) for r in returns])
        return cls(
            run_id=run_id, env=env, policy=policy, version=version, episodes=len(returns), seed_start=seed_start,
            returns=[float(r) for r in returns], successes=[bool(s) for s in successes], mean_return=mean,
            ci95=ci95, success_rate=sum(bool(s) for s in successes) / len(returns), breakdown=dict(breakdown or {}),
            created_at=created_at or datetime.now(UTC),
        )  # fmt: skip


def eval_prefix(run_id: str) -> str:
    """Folder key of a run's evaluation results."""
    return f"runs/{validate_name(run_id, 'run_id')}/{EVAL_FOLDER}"


def eval_key(result: EvalResult) -> str:
    """Object key of one result: ``runs/<run>/eval/<policy>-v000003-seed1000000-20250101T120000Z.json``."""
    stamp = result.created_at.strftime("%Y%m%dT%H%M%S%fZ")
    return f"{eval_prefix(result.run_id)}/{result.policy}-v{result.version:06d}-seed{result.seed_start}-{stamp}.json"


def eval_to_bytes(result: EvalResult) -> bytes:
    """Canonical JSON (sorted keys): what ``rlpipe eval`` writes create-only at ``eval_key(result)``."""
    return record_to_bytes(result)


def eval_from_bytes(data: bytes, where: str = "evaluation result") -> EvalResult:
    """Bytes -> validated result; ``EvalResultError`` (``SchemaVersionError`` for a newer major) says what is wrong."""
    return record_from_bytes(data, EvalResult, EVAL_SCHEMA_VERSION, EvalResultError, where, "evaluation result")


class ValidationPlayedError(ValueError):
    """Bytes that are not a readable validation record."""


class ValidationPlayed(BaseModel):
    """The seeds one ``rlpipe eval --validation`` played (``rlpipe eval --validation`` -> store -> ``rlpipe eval``).

    No time and no returns: the same validation repeated (each run compared, each version) writes the same bytes
    under the same key, so the folder holds one record per distinct range."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    schema_version: str = Field(EVAL_SCHEMA_VERSION, description="MAJOR.MINOR of this record")
    run_id: str = Field(description="the run that was validated")
    env: str = Field(min_length=1, max_length=64, description="registered environment name")
    seed_start: int = Field(ge=0, description="first seed played (a building run's: first day)")
    episodes: int = Field(ge=1, le=10_000_000, description="episodes played, one per seed from seed_start")

    @model_validator(mode="before")
    @classmethod
    def _readable(cls, data: object) -> object:
        if isinstance(data, dict) and "schema_version" in data:
            check_readable(str(data["schema_version"]), EVAL_SCHEMA_VERSION, "validation record")
        return data

    @field_validator("run_id")
    @classmethod
    def _run_id(cls, value: str) -> str:
        return validate_name(value, "run_id")

    @field_validator("env")
    @classmethod
    def _env(cls, value: str) -> str:
        return validate_name(value, "env")


def validation_prefix(run_id: str) -> str:
    """Folder key of the seeds a run's validations played."""
    return f"runs/{validate_name(run_id, 'run_id')}/{VALIDATION_FOLDER}"


def validation_key(played: ValidationPlayed) -> str:
    """Object key of one validation range: ``runs/<run>/validation/cartpole-seed1000064-episodes64.json``."""
    return f"{validation_prefix(played.run_id)}/{played.env}-seed{played.seed_start}-episodes{played.episodes}.json"


def validation_to_bytes(played: ValidationPlayed) -> bytes:
    """Canonical JSON (sorted keys), written create-only at ``validation_key(played)``."""
    return record_to_bytes(played)


def validation_from_bytes(data: bytes, where: str = "validation record") -> ValidationPlayed:
    """Bytes -> validated record; ``ValidationPlayedError`` (``SchemaVersionError`` for a newer major) says what."""
    return record_from_bytes(data, ValidationPlayed, EVAL_SCHEMA_VERSION, ValidationPlayedError, where,
                             "validation record")
