"""The SQL side of text-to-SQL: tasks, a read-only database, running a query, scoring it.

After the self-hosted post-training API's recipe: each task is a schema (CREATE
statements plus INSERTs), a question and a gold query.  The schema is loaded into
an in-memory SQLite database; the predicted and the gold query run there under a
budget of SQLite VM steps and their results are compared.  The environment that shows the tasks
to a model is ``producers.envs.text2sql``; this module knows nothing of episodes.

Task files are JSON lines, one task per line, with the fields ``id``, ``db_id``,
``schema_sql``, ``question`` and ``gold_sql`` (other fields are ignored).  The
schema is inline on every line, so any subset of lines is a valid task file;
tasks of one ``db_id`` simply repeat the same text, and the environment reuses
the open database while consecutive episodes share a schema.  The shipped set
(``data/text2sql_tasks.jsonl``, package data) has 44 tasks over four schemas
written for this project: a library, a shop, a school and a flight schedule.

Split: the task at 0-based file position ``i`` is a test task when
``i % test_every == test_every - 1`` (every 5th by default), a train task
otherwise; "all" keeps both.

Safety, in two layers: an authorizer that allows only what a SELECT needs (read,
select, function calls, recursive CTEs) and ``PRAGMA query_only`` on the
connection, so no statement can change the database; a progress handler that
interrupts any query past its budget of SQLite VM steps (``MAX_QUERY_STEPS``, ten
million by default: about a third of a second on an idle core); caps on result rows,
result bytes and the length of any one value, so a query cannot fill memory.

The budget counts VM instructions, not seconds, so a query's score does not depend on
how busy the machine is: the same query is refused, or runs, on every machine and every
try.  One built-in call is one instruction however long it takes, so the same handler
also keeps a generous wall-clock guard (``TIME_GUARD_S``, 10 s) for queries that repeat a
slow call; ``printf``/``format`` with a width of a billion took seconds a call, so they
refuse a width or precision above ``MAX_FORMAT_WIDTH`` (``capped_printf``).  A query that
returns after the guard all the same scores as timed out.

Temporary storage: a sort, DISTINCT or GROUP BY keeps 2 MB in memory and spills the rest to
temporary files; thousands of 100 kB ``randomblob`` rows under an ORDER BY cost ~20 steps a
row whatever their size, so the step budget cannot bound them.  ``temp_store=MEMORY`` would
move those gigabytes into this process, where SQLite has no per-connection cap (its heap
limits are process-wide and would fail other episodes' queries).  So they stay on disk,
written by the query's own thread (no sorter worker threads), and the progress handler
stops a query whose thread has written more than ``MAX_TEMP_BYTES`` (``ThreadWrites``;
without Linux's per-thread counter only the step budget and the time guard apply).
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from producers.envs.sql_printf import REFUSED, capped_printf
from producers.envs.thread_writes import ThreadWrites

SHIPPED_TASKS_PATH = Path(__file__).with_name("data") / "text2sql_tasks.jsonl"
RUN_REWARD = 0.25  # the predicted query ran
ERROR_REWARD = -0.25  # it failed: syntax error, unknown column, refused write, step budget or time guard
MATCH_REWARD = 2.0  # its result equals the gold result (on top of RUN_REWARD)
MAX_SCORE = RUN_REWARD + MATCH_REWARD

PROGRESS_OPS = 1_000  # SQLite VM instructions between budget checks (~30 microseconds)
MAX_QUERY_STEPS = 10_000_000  # SQLite VM instructions one query may run (the shipped gold queries take < 2,000)
TIME_GUARD_S = 10.0  # wall-clock last resort per query, for slow built-in calls the step budget counts as one
# SQLITE_LIMIT_LENGTH: the longest string/blob a statement may build (or a row may hold).  Small,
# because one built-in call on long values (instr on two long strings) runs between the
# budget checks: at 100 kB the worst such call takes about half a second.
MAX_VALUE_BYTES = 100_000
MAX_RESULT_BYTES = 8_000_000  # a result larger than this (roughly counted) is an error
MAX_TEMP_BYTES = 64_000_000  # bytes one query may write to SQLite's temporary files (module docstring)
TEMP_CHECK_EVERY = 4  # progress calls between reads of the write counter: 4,000 steps, ~200 rows of 100 kB
SORT_CACHE_KIB = 2_000  # what a sort keeps in memory before it spills to temporary files
# Authorizer actions a read-only query needs; everything else (writes, PRAGMA, ATTACH,
# transactions, DDL) is denied.  RECURSIVE is a read: the step budget bounds runaway CTEs.
_READ_ACTIONS = frozenset(
    {sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION, sqlite3.SQLITE_RECURSIVE}
)
_DENIED = frozenset({"fts3_tokenizer"})  # its one-argument form returns a pointer: an address of this process
_SQL_ERRORS = (sqlite3.Error, sqlite3.Warning, ValueError, OverflowError, MemoryError)

# One SQL token: literals and quoted names first (an unterminated one runs to the end, so
# matching stays linear), then comments, words, numbers, two-character operators, any char.
_TOKEN = re.compile(
    r"""'(?:[^']|'')*(?:'|$)
      | "(?:[^"]|"")*(?:"|$)
      | `[^`]*(?:`|$)
      | \[[^\]]*(?:\]|$)
      | --[^\n]*
      | /\*.*?(?:\*/|\Z)
      | [A-Za-z_][A-Za-z0-9_$]*
      | \d+(?:\.\d*)?(?:[eE][+-]?\d+)?
      | \.\d+(?:[eE][+-]?\d+)?
      | \|\| | <= | >= | <> | != | == | <<| >>
      | \S""",
    re.VERBOSE | re.DOTALL,
)
_PUNCTUATION = frozenset({",", "(", ")", ";", "."})


# ---- tasks ------------------------------------------------------------------------------
class SQLTask(BaseModel):
    """One task: a database (schema and rows as SQL), a question and the gold query answering it."""

    model_config = ConfigDict(extra="ignore", frozen=True, coerce_numbers_to_str=True)  # ids may be numbers

    id: str = Field(min_length=1, max_length=200, description="Unique task id.")
    db_id: str = Field(min_length=1, max_length=200, description="Which database the schema builds (shared by tasks).")
    schema_sql: str = Field(min_length=1, description="CREATE statements plus INSERTs, run as one script.")
    question: str = Field(min_length=1, description="The natural-language question shown to the model.")
    gold_sql: str = Field(min_length=1, description="A SELECT query whose result answers the question.")


def load_tasks(path: str | Path | None = None) -> tuple[SQLTask, ...]:
    """Tasks from a JSONL file (None: the shipped set); cached while the file is unchanged."""
    file = Path(path) if path is not None else SHIPPED_TASKS_PATH
    try:
        stat = file.stat()
    except OSError as e:
        raise ValueError(f"text2sql: cannot read tasks file {file} ({e.strerror}); fix tasks_path") from None
    return _load_tasks_cached(str(file.resolve()), stat.st_mtime_ns, stat.st_size)


@lru_cache(maxsize=8)
def _load_tasks_cached(path: str, mtime_ns: int, size: int) -> tuple[SQLTask, ...]:
    with open(path, encoding="utf-8") as f:
        return parse_tasks(f, source=path)


def parse_tasks(lines: Iterable[str], source: str = "<tasks>") -> tuple[SQLTask, ...]:
    """Validate JSON lines into tasks; blank lines are skipped, ids must be unique."""
    tasks: list[SQLTask] = []
    seen: set[str] = set()
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{lineno}"
        try:
            task = SQLTask.model_validate(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not JSON ({e.msg}); write one JSON object per line") from None
        except ValidationError as e:
            err = e.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "line"
            raise ValueError(
                f"{where}: {field}: {err['msg']}; each line needs id, db_id, schema_sql, question, gold_sql"
            ) from None
        if task.id in seen:
            raise ValueError(f"{where}: duplicate task id {task.id!r}; give every task its own id")
        seen.add(task.id)
        tasks.append(task)
    if not tasks:
        raise ValueError(f"{source}: no tasks; the file must hold at least one JSON line")
    return tuple(tasks)


def select_split(tasks: Sequence[SQLTask], split: str, test_every: int) -> tuple[SQLTask, ...]:
    """The ``split`` subset: file position ``i`` is a test task iff ``i % test_every == test_every - 1``."""
    if split == "all":
        return tuple(tasks)
    want_test = split == "test"
    chosen = tuple(t for i, t in enumerate(tasks) if (i % test_every == test_every - 1) == want_test)
    if not chosen:
        raise ValueError(
            f"text2sql: split {split!r} of {len(tasks)} tasks is empty with test_every={test_every}; "
            "use split='all', a smaller test_every or more tasks"
        )
    return chosen


# ---- the database -------------------------------------------------------------------------
def build_database(schema_sql: str, max_value_bytes: int = MAX_VALUE_BYTES) -> sqlite3.Connection:
    """A fresh in-memory database holding ``schema_sql``, then switched to read-only (query_only)."""
    db = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    db.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, max_value_bytes)
    db.setlimit(sqlite3.SQLITE_LIMIT_WORKER_THREADS, 0)  # sorts write from the query's thread, which is metered
    # The schema is trusted task data, but it still may not reach outside memory.
    db.set_authorizer(lambda action, *_: sqlite3.SQLITE_DENY if action == sqlite3.SQLITE_ATTACH else sqlite3.SQLITE_OK)
    try:
        db.executescript(schema_sql)
    except _SQL_ERRORS as e:
        db.close()
        raise ValueError(
            f"text2sql: schema_sql does not build ({e}); fix the task's schema_sql (or raise max_value_bytes)"
        ) from None
    db.set_authorizer(None)
    db.execute("PRAGMA temp_store = FILE")  # bounded by MAX_TEMP_BYTES; memory would have no per-connection cap
    db.execute(f"PRAGMA cache_size = -{SORT_CACHE_KIB}")
    db.execute("PRAGMA query_only = ON")
    for name in ("printf", "format"):  # before any model-written query: a call that cannot be interrupted
        db.create_function(name, -1, capped_printf, deterministic=True)
    return db


def table_columns(db: sqlite3.Connection) -> dict[str, list[str]]:
    """Table (and view) name -> column names, in creation order."""
    names = [r[0] for r in db.execute(
        "SELECT name FROM sqlite_master WHERE type IN ('table', 'view') AND name NOT LIKE 'sqlite_%' ORDER BY rowid"
    )]
    return {name: [r[0] for r in db.execute("SELECT name FROM pragma_table_info(?)", (name,))] for name in names}


def schema_items(db: sqlite3.Connection) -> frozenset[str]:
    """Lower-cased table and column names: what the similarity term counts as schema items."""
    return frozenset(item.lower() for table, cols in table_columns(db).items() for item in (table, *cols))


def create_statements(db: sqlite3.Connection) -> str:
    """The schema as its CREATE statements only (no rows), as SQLite stored them."""
    rows = db.execute("SELECT sql FROM sqlite_master WHERE sql IS NOT NULL ORDER BY rowid")
    return "\n".join(f"{r[0]};" for r in rows)


# ---- running a query ----------------------------------------------------------------------
@dataclass(frozen=True)
class QueryRun:
    """One query's rows (at most ``max_rows + 1``) or why it failed."""

    rows: tuple[tuple[Any, ...], ...]
    error: str = ""
    refused: bool = False  # it would have changed the database (or used PRAGMA, ATTACH, ...)
    timed_out: bool = False
    seconds: float = 0.0


def run_query(
    db: sqlite3.Connection, sql: str, time_limit_s: float = TIME_GUARD_S, max_rows: int = 1_000,
    max_steps: int = MAX_QUERY_STEPS, max_temp_bytes: int = MAX_TEMP_BYTES,
) -> QueryRun:
    """Run ``sql`` read-only within ``max_steps`` SQLite VM instructions (``time_limit_s``: the wall-clock guard)
    and ``max_temp_bytes`` written to temporary files; never raises for a bad query."""
    denied: list[int] = []

    def authorize(action: int, first: object = None, second: object = None, *_: object) -> int:
        if action in _READ_ACTIONS and not (action == sqlite3.SQLITE_FUNCTION and str(second).lower() in _DENIED):
            return sqlite3.SQLITE_OK
        denied.append(action)
        return sqlite3.SQLITE_DENY

    start = time.monotonic()
    deadline = start + time_limit_s
    steps = [0]  # VM instructions run so far, counted in PROGRESS_OPS
    meter = ThreadWrites.start()
    over_temp = [False]

    def progress() -> int:  # nonzero interrupts the query
        steps[0] += PROGRESS_OPS
        if meter is not None and steps[0] % (TEMP_CHECK_EVERY * PROGRESS_OPS) == 0:
            over_temp[0] = meter.written() > max_temp_bytes
        return int(over_temp[0] or steps[0] > max_steps or time.monotonic() > deadline)

    REFUSED.message = ""
    db.set_authorizer(authorize)
    db.set_progress_handler(progress, PROGRESS_OPS)
    try:
        cursor = db.execute(sql)
        if cursor.description is None:  # empty text or only a comment: nothing ran, nothing to reward
            cursor.close()
            return QueryRun(rows=(), error="not a query: it returns no columns; write one SELECT query")
        rows = _fetch(cursor, max_rows)
    except _SQL_ERRORS as e:
        if over_temp[0]:
            return QueryRun(rows=(), error=f"the query wrote more than {max_temp_bytes:,} bytes of temporary storage "
                            "(sorting or grouping many large values); sort or group fewer, smaller values",
                            seconds=time.monotonic() - start)
        over_budget = steps[0] > max_steps
        return _failed_run(ValueError(REFUSED.message) if REFUSED.message else e, bool(denied),
                           time.monotonic() - start, time_limit_s, max_steps if over_budget else None)
    finally:
        db.set_authorizer(None)
        db.set_progress_handler(None, 0)
        if meter is not None:
            meter.close()
    seconds = time.monotonic() - start
    if seconds > time_limit_s:  # one call ran on past the checks: an overrun is an error all the same
        return QueryRun(rows=(), error=f"the query ran past the {time_limit_s:g} s time limit", timed_out=True,
                        seconds=seconds)
    return QueryRun(rows=rows, seconds=seconds)


def _fetch(cursor: sqlite3.Cursor, max_rows: int) -> tuple[tuple[Any, ...], ...]:
    """Up to ``max_rows + 1`` rows, one at a time so the byte budget is checked before memory runs out."""
    rows: list[tuple[Any, ...]] = []
    size = 0
    try:
        while len(rows) <= max_rows and (row := cursor.fetchone()) is not None:
            size += sum(len(v) if isinstance(v, str | bytes) else 8 for v in row)
            if size > MAX_RESULT_BYTES:
                raise ValueError(f"result larger than {MAX_RESULT_BYTES} bytes")
            rows.append(row)
    finally:
        cursor.close()
    return tuple(rows)


def _failed_run(
    error: BaseException, refused: bool, seconds: float, time_limit_s: float, over_steps: int | None,
) -> QueryRun:
    """``over_steps``: the step budget when the progress handler stopped the query for exceeding it."""
    message = str(error)
    refused = refused or "readonly database" in message
    interrupted = not refused and "interrupted" in message
    timed_out = interrupted and (over_steps is not None or seconds >= time_limit_s)
    if refused:
        message = f"refused: only read-only SELECT queries may run ({message})"
    elif timed_out and over_steps is not None:
        message = f"the query ran past its budget of {over_steps:,} SQLite steps; write a simpler query"
    elif timed_out:
        message = f"the query ran past the {time_limit_s:g} s time limit"
    return QueryRun(rows=(), error=message or type(error).__name__, refused=refused, timed_out=timed_out,
                    seconds=seconds)


# ---- comparing and scoring ------------------------------------------------------------------
def sql_tokens(sql: str) -> list[str]:
    """Lower-cased tokens without comments; quoted names lose their quotes."""
    tokens = []
    for tok in _TOKEN.findall(sql):
        if tok.startswith(("--", "/*")):
            continue
        if tok[0] in "\"`[" and len(tok) >= 2:
            tok = tok[1:-1] if tok[-1] in "\"`]" else tok[1:]
        tokens.append(tok.lower())
    return tokens


def orders_rows(sql: str) -> bool:
    """True when the query's own (top-level) clause has ORDER BY or LIMIT: then row order counts.

    ORDER BY inside a subquery, a CTE or a window (``OVER (ORDER BY ...)``) sits in
    parentheses and does not fix the order of the final result.
    """
    depth = 0
    tokens = [t for t in _TOKEN.findall(sql) if not t.startswith(("--", "/*"))]
    for i, tok in enumerate(tokens):
        if tok == "(":
            depth += 1
        elif tok == ")":
            depth = max(0, depth - 1)
        elif depth == 0 and (tok.lower() == "limit" or (
            tok.lower() == "order" and i + 1 < len(tokens) and tokens[i + 1].lower() == "by"
        )):
            return True
    return False


def normalize_rows(rows: Iterable[Sequence[Any]], float_digits: int) -> list[tuple[Any, ...]]:
    """Rows with floats rounded to ``float_digits`` decimals (2 == 2.0 as in Python)."""
    return [tuple(round(v, float_digits) if isinstance(v, float) else v for v in row) for row in rows]


def results_match(
    predicted: Iterable[Sequence[Any]], gold: Iterable[Sequence[Any]], ordered: bool, float_digits: int = 4,
) -> bool:
    """Equal results: same rows in the same order if ``ordered``, else the same rows in any order.

    Unordered comparison is multiset equality (the same as comparing the sorted rows,
    without needing an order between NULL, numbers, text and blobs).  Column names are
    ignored; column order and duplicate rows count.  Floats match within half a unit of
    their last kept decimal (``float_digits``).
    """
    predicted, gold = list(predicted), list(gold)
    pred, ref = normalize_rows(predicted, float_digits), normalize_rows(gold, float_digits)
    if (pred == ref) if ordered else (Counter(pred) == Counter(ref)):
        return True
    # Rounding alone is no tolerance: the same sum in another order (another query plan) may differ in its last
    # bit and round the other way.  Floats within half a unit of the last kept decimal match.
    if len(predicted) != len(gold) or not any(isinstance(v, float) for row in (*predicted, *gold) for v in row):
        return False
    if not ordered:
        predicted, gold = sorted(predicted, key=_sort_key), sorted(gold, key=_sort_key)
    tolerance = 0.5 * 10.0**-float_digits
    return all(_rows_close(p, g, tolerance) for p, g in zip(predicted, gold, strict=True))


def _sort_key(row: Sequence[Any]) -> tuple[tuple[int, Any], ...]:
    """An order over rows of NULLs, numbers, text and blobs (numbers by value, so near-equal floats sort alike)."""
    return tuple((0, 0) if v is None else (1, float(v)) if isinstance(v, int | float) else
                 (2, v) if isinstance(v, str) else (3, bytes(v)) for v in row)


def _rows_close(a: Sequence[Any], b: Sequence[Any], tolerance: float) -> bool:
    return len(a) == len(b) and all(
        math.isclose(x, y, rel_tol=0.0, abs_tol=tolerance) if isinstance(x, int | float) and isinstance(y, int | float)
        and (isinstance(x, float) or isinstance(y, float)) else x == y for x, y in zip(a, b, strict=True))


def _jaccard(a: set[str] | frozenset[str], b: set[str] | frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a or b else 0.0


def query_similarity(predicted_sql: str, gold_sql: str, items: frozenset[str]) -> float:
    """How close a query is to the gold one, in [0, 1]: the mean of two Jaccard overlaps.

    One over the schema items (tables and columns) each query names, one over their
    token sets (punctuation left out).
    """
    pred = set(sql_tokens(predicted_sql)) - _PUNCTUATION
    gold = set(sql_tokens(gold_sql)) - _PUNCTUATION
    return 0.5 * (_jaccard(pred & items, gold & items) + _jaccard(pred, gold))


@dataclass(frozen=True)
class QueryScore:
    """How a predicted query fared against the gold query on one database."""

    runs: bool
    error: str
    matches: bool
    similarity: float  # in [0, 1]; counted in the reward only when the result does not match
    reward: float
    refused: bool = False
    timed_out: bool = False
    rows: tuple[tuple[Any, ...], ...] = ()  # the predicted query's rows (at most max_rows + 1)
    ordered: bool = False  # the comparison respected row order (the gold query orders or limits)


def gold_result(
    db: sqlite3.Connection, gold_sql: str, time_limit_s: float = TIME_GUARD_S, max_rows: int = 1_000,
    max_steps: int = MAX_QUERY_STEPS,
) -> tuple[tuple[Any, ...], ...]:
    """The gold query's rows; ValueError (naming the fix) when it fails or returns more than ``max_rows``."""
    gold = run_query(db, gold_sql, time_limit_s, max_rows, max_steps)
    if gold.timed_out:
        raise ValueError(f"text2sql: gold query fails ({gold.error}); raise max_query_steps (or time_limit_s) "
                         "or fix the task's gold_sql")
    if gold.error:
        raise ValueError(f"text2sql: gold query fails ({gold.error}); fix the task's gold_sql")
    if len(gold.rows) > max_rows:
        raise ValueError(f"text2sql: gold result has over {max_rows} rows; raise max_result_rows")
    return gold.rows


def score_query(
    db: sqlite3.Connection,
    predicted_sql: str,
    gold_sql: str,
    time_limit_s: float = TIME_GUARD_S,
    *,
    float_digits: int = 4,
    max_rows: int = 1_000,
    max_steps: int = MAX_QUERY_STEPS,
    similarity_weight: float = 0.2,
    gold_rows: Sequence[Sequence[Any]] | None = None,
) -> QueryScore:
    """Score ``predicted_sql`` against ``gold_sql``: the recipe's reward, pure apart from the wall-clock guard.

    reward = +0.25 if it runs (-0.25 if not) + 2.0 if the results match; when they do
    not, + similarity_weight * similarity, except for refused or timed-out queries, which
    get exactly -0.25.  Order: errors < running non-matching queries < a match (2.25).
    ``gold_rows``: the gold query's result on ``db`` when the caller already has it (``gold_result``); then
    only the predicted query runs.  Raises ValueError only when the gold query itself fails.
    """
    gold = gold_result(db, gold_sql, time_limit_s, max_rows, max_steps) if gold_rows is None else gold_rows
    pred = run_query(db, predicted_sql, time_limit_s, max_rows, max_steps)
    ordered = orders_rows(gold_sql)
    runs = not pred.error
    matches = runs and results_match(pred.rows, gold, ordered, float_digits)
    similarity = query_similarity(predicted_sql, gold_sql, schema_items(db))
    reward = (RUN_REWARD if runs else ERROR_REWARD) + (MATCH_REWARD if matches else 0.0)
    if not matches and not (pred.refused or pred.timed_out):
        reward += similarity_weight * similarity
    return QueryScore(runs=runs, error=pred.error, matches=matches, similarity=similarity, reward=reward,
                      refused=pred.refused, timed_out=pred.timed_out, rows=pred.rows, ordered=ordered)
