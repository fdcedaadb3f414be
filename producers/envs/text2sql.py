"""Text-to-SQL: answer a question about a small SQLite database with one read-only query.

After the self-hosted post-training API's recipe: each task is a schema (CREATE
statements plus INSERTs), a question and a gold query.  This module is the
environment: prompts, turns, feedback and rewards.  The tasks, the read-only
database, running a query within a step budget and scoring it live in
``producers.envs.sql``, which also describes the task file and the safety layers.

Episode for ``seed``: task ``tasks[seed % len(tasks)]`` of the configured split,
so seeds ``0 .. len - 1`` visit every task once (``select_split`` in
``producers.envs.sql`` says which tasks a split holds).
"""

from __future__ import annotations

import random
import re
import sqlite3
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field

from producers.envs.base import ActionOutcome, EnvConfig, TextEnv
from producers.envs.parsing import format_answer
from producers.envs.sql import (
    ERROR_REWARD,
    MATCH_REWARD,
    MAX_QUERY_STEPS,
    MAX_VALUE_BYTES,
    RUN_REWARD,
    TIME_GUARD_S,
    QueryScore,
    SQLTask,
    build_database,
    create_statements,
    gold_result,
    load_tasks,
    score_query,
    select_split,
    table_columns,
)

_FENCE = re.compile(r"^```[A-Za-z]*\s*|\s*```$")


# ---- the environment --------------------------------------------------------------------------
class TextToSQLConfig(EnvConfig):
    """Text-to-SQL settings: two turns (one retry after seeing the error or the first rows)."""

    max_turns: int = Field(2, ge=1, le=100_000, description="Turns (queries) per episode; >1 allows retries.")
    max_actions_per_turn: int = Field(1, ge=1, le=1_000, description="Queries run from one answer (always 1).")
    max_actions_total: int = Field(2, ge=1, le=1_000_000, description="Queries run in one episode.")
    tasks_path: str | None = Field(
        None, min_length=1, max_length=4_096,
        description="JSONL task file (id, db_id, schema_sql, question, gold_sql per line); None: the shipped set.",
    )
    split: Literal["train", "test", "all"] = Field(
        "train", description="Task subset: every test_every-th task (by file position) is test, the rest train.",
    )
    test_every: int = Field(5, ge=2, le=1_000, description="Hold out every n-th task as the test split.")
    max_query_steps: int = Field(
        MAX_QUERY_STEPS, ge=1_000, le=10_000_000_000,
        description=(
            "SQLite VM instructions one query may run, checked every 1,000 (about 33 million a second on one idle "
            "core): a cost limit that does not depend on how busy the machine is."
        ),
    )
    time_limit_s: float = Field(
        TIME_GUARD_S, gt=0.0, le=600.0,
        description="Wall-clock guard per query, seconds: a last resort for slow built-in calls the step budget "
                    "counts as one step; keep it far above what max_query_steps takes.",
    )
    float_digits: int = Field(4, ge=0, le=15, description="Decimals floats are rounded to before comparing.")
    max_result_rows: int = Field(1_000, ge=1, le=1_000_000, description="Rows fetched per query; more never match.")
    max_value_bytes: int = Field(
        MAX_VALUE_BYTES, ge=1_000, le=1_000_000_000,
        description="Longest string or blob a database may hold or a query may build (bounds slow built-ins).",
    )
    preview_rows: int = Field(5, ge=0, le=100, description="Result rows shown as feedback after a wrong query.")
    similarity_weight: float = Field(
        0.2, ge=0.0, le=0.5, description="Largest similarity bonus for a query whose result does not match.",
    )
    reward_mode: Literal["final", "per_query"] = Field(
        "final",
        description=(
            "final: each turn earns the change in query score, so the episode return is the last query's score "
            "(a throw-away first query earns nothing); per_query: each turn earns its own query's score."
        ),
    )


@dataclass(frozen=True)
class Attempt:
    """One query the model submitted and how it scored."""

    sql: str
    score: QueryScore
    turn: int  # 1-based turn that submitted it


class TextToSQL(TextEnv[str]):
    """Write one SQLite SELECT query answering a question about a small database."""

    name: ClassVar[str] = "text2sql"
    description: ClassVar[str] = "Text-to-SQL: answer a question about a SQLite database with one SELECT query."
    Config: ClassVar[type[EnvConfig]] = TextToSQLConfig
    split_actions: ClassVar[bool] = False  # SQL uses || for concatenation

    def __init__(self, config: EnvConfig | None = None, **overrides: Any) -> None:
        super().__init__(config, **overrides)
        cfg: TextToSQLConfig = self.config  # type: ignore[assignment]
        self.tasks = select_split(load_tasks(cfg.tasks_path), cfg.split, cfg.test_every)
        self.task: SQLTask | None = None
        self.attempts: list[Attempt] = []
        self._score_so_far = 0.0  # the last query's score (reward_mode "final")
        self._db: sqlite3.Connection | None = None
        self._db_schema_sql = ""
        self._create_sql = ""
        self._tables: dict[str, list[str]] = {}
        self._gold_rows: tuple[tuple[Any, ...], ...] = ()  # the task's gold result, run once at reset

    @classmethod
    def held_out_overrides(cls, overrides: dict[str, Any]) -> dict[str, Any]:
        """A run on the train split is evaluated on the test split: seeds index the task list (``seed % len``), so
        seeds the run never played still replay its training tasks."""
        split = overrides.get("split", cls.Config.model_fields["split"].default)
        return {**overrides, "split": "test"} if split == "train" else dict(overrides)

    # ---- hooks ------------------------------------------------------------------------
    def _reset(self, seed: int) -> None:
        task = self.tasks[seed % len(self.tasks)]
        self._open_database(task.schema_sql)
        try:  # the database never changes, so the gold result holds for every query of the episode
            self._gold_rows = gold_result(self._require_db(), task.gold_sql, self._cfg.time_limit_s,
                                          self._cfg.max_result_rows, self._cfg.max_query_steps)
        except ValueError as e:
            raise ValueError(f"text2sql: task {task.id!r}: {str(e).removeprefix('text2sql: ')}") from None
        self.task = task
        self.attempts = []
        self._score_so_far = 0.0

    def _open_database(self, schema_sql: str) -> None:
        """Build the task's database, keeping the open one when the schema is the same (queries never change it)."""
        if self._db is not None and schema_sql == self._db_schema_sql:
            return
        if self._db is not None:
            self._db.close()
        self._db = build_database(schema_sql, self._cfg.max_value_bytes)
        self._db_schema_sql = schema_sql
        self._create_sql = create_statements(self._db)
        self._tables = table_columns(self._db)

    def _parse_action(self, text: str) -> str | None:
        sql = _FENCE.sub("", text.strip()).strip()  # tolerate a ```sql fence inside the answer
        return sql or None

    def _apply_action(self, action: str) -> ActionOutcome:
        cfg = self._cfg
        score = score_query(
            self._require_db(), action, self._require_task().gold_sql, cfg.time_limit_s,
            float_digits=cfg.float_digits, max_rows=cfg.max_result_rows, similarity_weight=cfg.similarity_weight,
            gold_rows=self._gold_rows, max_steps=cfg.max_query_steps,
        )
        self.attempts.append(Attempt(action, score, turn=self.turn + 1))  # base counts the turn after
        reward = score.reward
        if cfg.reward_mode == "final":  # telescoping: the turn rewards sum to the last query's score
            reward, self._score_so_far = score.reward - self._score_so_far, score.reward
        return ActionOutcome(reward, effective=score.runs, terminated=score.matches, success=score.matches)

    def _render(self) -> str:
        task = self._require_task()
        text = f"Database schema:\n{self._create_sql}\n\nQuestion: {task.question}"
        if self.turn == 0:
            return text
        if not self.attempts or self.attempts[-1].turn != self.turn:  # the last answer held no query
            feedback = "Your last answer held no query; put one SELECT query inside <answer>...</answer>."
        else:
            feedback = self._feedback(self.attempts[-1])
        return f"{text}\n\n{feedback}"

    def _feedback(self, attempt: Attempt) -> str:
        score = attempt.score
        head = f"Your query:\n{attempt.sql}\n"
        if score.matches:
            return f"{head}Result: correct, it matches the expected result."
        if score.error:
            result = f"Result: error: {score.error}"
        else:
            result = f"Result: {self._preview(score.rows)}\nThis is not the expected result."
        left = self.queries - self.turn
        return f"{head}{result}" + (f"\nTurns left: {left}." if left > 0 else "")

    def _preview(self, rows: tuple[tuple[Any, ...], ...]) -> str:
        cfg = self._cfg
        count = f"more than {cfg.max_result_rows}" if len(rows) > cfg.max_result_rows else str(len(rows))
        shown = rows[: cfg.preview_rows]
        lines = [" | ".join(_cell(v, cfg.float_digits) for v in row) for row in shown]
        label = f"{count} row(s)" + (f", the first {len(shown)}:" if len(shown) < len(rows) else ":")
        return "\n".join([label, *lines]) if rows else "0 rows."

    @property
    def queries(self) -> int:
        """The queries one episode runs: a turn each, up to ``max_actions_total``."""
        return min(self._cfg.max_turns, self._cfg.max_actions_total)

    # ---- prompt -------------------------------------------------------------------------
    def system_prompt(self) -> str:
        retry = (
            f" After a wrong query you see its error or its first rows and may try again ({self.queries} "
            "queries in all)." if self.queries > 1 else ""
        )
        return (
            "You translate questions into SQL. Each task shows a SQLite database schema and a question; answer "
            "with ONE SQLite SELECT query whose result answers the question.\n"
            "Rules: the database is read-only, so statements that would change it (INSERT, UPDATE, DELETE, "
            "CREATE, DROP, ATTACH, PRAGMA, ...) are refused; a query that runs too long (such as endless recursion) fails. "
            "Column names do not matter; the columns asked for, their order and the rows do. Row order matters "
            "only when the question asks for an order.\n"
            f"Rewards: +{RUN_REWARD:g} if the query runs ({ERROR_REWARD:g} if it fails), +{MATCH_REWARD:g} more "
            "if its result matches the expected result (the episode then ends)." + retry + "\n"
            "You may think inside <think>...</think>. Give the query inside <answer>...</answer>, for example "
            "<answer>SELECT name FROM planets WHERE moons > 2</answer>. The whole answer is one query; "
            "|| is SQL string concatenation here."
        )

    # ---- policies -----------------------------------------------------------------------
    def heuristic_answer(self) -> str:
        """The gold query (an upper bound, and demonstrations for supervised warm-up)."""
        return format_answer([self._require_task().gold_sql])

    def random_answer(self, rng: random.Random) -> str:
        """A plausible query over the schema: all of a table, one column of it, or another task's gold query."""
        task = self._require_task()
        others = [t.gold_sql for t in self.tasks if t.db_id == task.db_id and t.id != task.id]
        table = rng.choice(sorted(self._tables))
        kind = rng.randrange(3)
        if kind == 2 and others:
            return format_answer([rng.choice(others)])
        if kind == 1 and self._tables[table]:
            return format_answer([f"SELECT {rng.choice(self._tables[table])} FROM {table}"])
        return format_answer([f"SELECT * FROM {table}"])

    # ---- helpers --------------------------------------------------------------------------
    @property
    def _cfg(self) -> TextToSQLConfig:
        return self.config  # type: ignore[return-value]

    def _require_task(self) -> SQLTask:
        if self.task is None:
            raise RuntimeError(f"{self.name}: no task yet; call reset(seed) first")
        return self.task

    def _require_db(self) -> sqlite3.Connection:
        if self._db is None:
            raise RuntimeError(f"{self.name}: no database yet; call reset(seed) first")
        return self._db


def _cell(value: Any, float_digits: int, width: int = 60) -> str:
    """One result value as feedback text: NULL, rounded floats, long text cut."""
    if value is None:
        return "NULL"
    if isinstance(value, float):
        return repr(round(value, float_digits))
    if isinstance(value, bytes):
        return f"<blob {len(value)} bytes>"
    text = str(value)
    return text if len(text) <= width else text[: width - 3] + "..."
