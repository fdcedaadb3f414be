"""Text-to-SQL: the shipped tasks, the scoring rules, the read-only guard and the time limit."""

from __future__ import annotations

import json
import random
import sqlite3
import threading
import time
from pathlib import Path

import pytest

from producers.envs.parsing import format_answer
from producers.envs.registry import make_env
from producers.envs.sql import (
    SHIPPED_TASKS_PATH,
    QueryScore,
    build_database,
    load_tasks,
    orders_rows,
    parse_tasks,
    results_match,
    run_query,
    score_query,
    select_split,
)
from producers.envs.text2sql import TextToSQL

# A hand-built database: t has 4 rows, u has 2; the expected figures below are read off it.
SCHEMA = """
CREATE TABLE t (a INTEGER, b REAL, c TEXT);
CREATE TABLE u (k INTEGER PRIMARY KEY, note TEXT);
INSERT INTO t VALUES (3, 0.1, 'x'), (1, 0.2, 'y'), (2, 0.3, NULL), (1, 0.4, 'z');
INSERT INTO u VALUES (1, 'one'), (2, 'two');
"""
ROW_COUNTS = {"t": 4, "u": 2}
LIMIT_S = 0.25


@pytest.fixture
def db() -> sqlite3.Connection:
    return build_database(SCHEMA)


def row_counts(db: sqlite3.Connection) -> dict[str, int]:
    return {table: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0] for table in ROW_COUNTS}


def task_line(task_id: str, question: str, gold_sql: str, schema_sql: str = SCHEMA, db_id: str = "tiny") -> str:
    return json.dumps({"id": task_id, "db_id": db_id, "schema_sql": schema_sql, "question": question,
                       "gold_sql": gold_sql})


# ---- the shipped task set ---------------------------------------------------------------------
def test_shipped_set_has_enough_varied_tasks() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 36
    assert len({t.id for t in tasks}) == len(tasks)
    by_db: dict[str, set[str]] = {}
    for task in tasks:
        by_db.setdefault(task.db_id, set()).add(task.schema_sql)
    assert len(by_db) >= 4
    assert all(len(schemas) == 1 for schemas in by_db.values())  # one schema text per db_id
    golds = " ".join(t.gold_sql.upper() for t in tasks)
    for construct in (" JOIN ", "GROUP BY", "ORDER BY", "LIMIT", "AVG(", "(SELECT", "HAVING", "LEFT JOIN"):
        assert construct in golds, construct


def test_every_shipped_gold_query_runs_and_scores_the_maximum() -> None:
    tasks = load_tasks()
    databases = {t.db_id: build_database(t.schema_sql) for t in tasks}
    for task in tasks:
        score = score_query(databases[task.db_id], task.gold_sql, task.gold_sql, LIMIT_S)
        assert score.runs and score.matches, task.id
        assert score.reward == pytest.approx(2.25), task.id  # 0.25 (runs) + 2.0 (match)
        assert len(score.rows) >= 1, f"{task.id}: an empty gold result is matched by too many wrong queries"


def test_shipped_file_is_the_package_data_path() -> None:
    assert SHIPPED_TASKS_PATH.is_file()
    assert SHIPPED_TASKS_PATH.parent.name == "data"
    assert load_tasks(SHIPPED_TASKS_PATH) == load_tasks()


# ---- the read-only guard and the time limit --------------------------------------------------
@pytest.mark.parametrize(
    "statement",
    [
        "INSERT INTO t VALUES (9, 9.0, 'w')",
        "UPDATE t SET a = 0",
        "DELETE FROM t",
        "DROP TABLE u",
        "CREATE TABLE v (x)",
        "CREATE TEMP TABLE v (x)",
        "ALTER TABLE t ADD COLUMN d",
        "REPLACE INTO u VALUES (1, 'uno')",
        "PRAGMA query_only = OFF",
        "PRAGMA user_version = 7",
        "VACUUM",
        "BEGIN",
        "SELECT 1; DELETE FROM t",
        "WITH gone AS (SELECT 1) DELETE FROM t",
    ],
)
def test_write_statements_are_refused_without_touching_the_database(db: sqlite3.Connection, statement: str) -> None:
    changes = db.total_changes
    start = time.monotonic()
    score = score_query(db, statement, "SELECT a FROM t", LIMIT_S)
    assert time.monotonic() - start < 1.0
    assert not score.runs and not score.matches and score.error
    assert score.reward <= -0.25 + 0.2  # the error penalty (plus at most the similarity bonus)
    assert row_counts(db) == ROW_COUNTS
    assert db.total_changes == changes
    assert db.execute("PRAGMA query_only").fetchone()[0] == 1
    assert db.execute("PRAGMA user_version").fetchone()[0] == 0


def test_a_refused_write_gets_exactly_the_error_penalty(db: sqlite3.Connection) -> None:
    score = score_query(db, "DELETE FROM t WHERE a = 1", "SELECT a FROM t WHERE a = 1", LIMIT_S)
    assert score.refused and score.reward == -0.25  # no similarity bonus for a refused query


def test_attach_is_refused_and_creates_no_file(db: sqlite3.Connection, tmp_path: Path) -> None:
    target = tmp_path / "escape.db"
    score = score_query(db, f"ATTACH DATABASE '{target}' AS other", "SELECT 1", LIMIT_S)
    assert score.refused and score.reward == -0.25
    assert not target.exists()
    assert [r[1] for r in db.execute("PRAGMA database_list")] == ["main"]
    with pytest.raises(ValueError, match="does not build"):  # a schema may not attach files either
        build_database(f"ATTACH DATABASE '{target}' AS other; CREATE TABLE other.x (a);")
    assert not target.exists()


FOREVER = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n) SELECT COUNT(*) FROM n"


def test_an_infinite_recursive_query_is_stopped_at_its_step_budget_whatever_the_clock_says(
        db: sqlite3.Connection, monkeypatch) -> None:
    """The budget counts SQLite VM steps, so the same query is refused the same way on a fast or a stalled clock."""
    import producers.envs.sql as sql

    first = score_query(db, FOREVER, "SELECT 1", max_steps=200_000)
    monkeypatch.setattr(sql.time, "monotonic", lambda: 0.0)  # a clock that never moves: only the budget can stop it
    again = score_query(db, FOREVER, "SELECT 1", max_steps=200_000)
    for score in (first, again):
        assert score.timed_out and not score.runs and score.reward == -0.25
        assert "200,000 SQLite steps" in score.error
    assert first == again
    assert score_query(db, "SELECT SUM(a) FROM t", "SELECT 7", max_steps=200_000).matches  # a small query runs
    assert row_counts(db) == ROW_COUNTS


def test_the_wall_clock_guard_still_stops_a_query_the_step_budget_allows(db: sqlite3.Connection) -> None:
    scores: list[QueryScore] = []
    # A daemon thread, so a broken guard fails this test instead of hanging the run.
    worker = threading.Thread(
        target=lambda: scores.append(score_query(db, FOREVER, "SELECT 1", LIMIT_S, max_steps=10**12)), daemon=True)
    start = time.monotonic()
    worker.start()
    worker.join(timeout=3.0)
    elapsed = time.monotonic() - start
    assert not worker.is_alive() and scores, "the infinite query was not interrupted"
    score = scores[0]
    assert elapsed >= LIMIT_S  # it really ran until the guard (and, alive no more, stopped)
    assert score.timed_out and not score.runs and score.reward == -0.25 and "time limit" in score.error
    assert row_counts(db) == ROW_COUNTS


def test_a_gold_query_over_the_step_budget_names_the_setting_to_raise(tmp_path: Path) -> None:
    count = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 100000) SELECT COUNT(*) FROM n"
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(task_line("big", "How many?", count) + "\n")
    env = TextToSQL(tasks_path=str(tasks), split="all", max_query_steps=100_000)
    with pytest.raises(ValueError, match="raise max_query_steps"):
        env.reset(0)
    env = TextToSQL(tasks_path=str(tasks), split="all")  # the default budget holds it
    env.reset(0)
    assert env.step(env.heuristic_answer()).info["success"]


def test_a_built_in_call_that_would_outrun_the_time_limit_is_refused_and_an_overrun_scores_as_an_error(
        db: sqlite3.Connection) -> None:
    """One built-in call runs between two time checks: printf with a width of 1e9 took seconds a call, and a query
    of 194 of them (one answer's length) about 20 minutes, scored as a query that ran."""
    for call in ("printf('%.*c', 1000000000, 'x')", "format('%*d', 2000000000, 1)", "printf('%1000000000d', 1)"):
        start = time.monotonic()
        score = score_query(db, f"SELECT length({call}), length({call})", "SELECT 1", LIMIT_S)
        assert time.monotonic() - start < 1.0 and not score.runs and "width" in score.error, call
    assert score_query(db, "SELECT printf('%d items at %.2f', 3, 1.234)", "SELECT '3 items at 1.23'", LIMIT_S).matches
    assert score_query(db, "SELECT format('%5s|%-3d|%%', 'ab', 7)", "SELECT '   ab|7  |%'", LIMIT_S).matches
    assert row_counts(db) == ROW_COUNTS


def test_a_query_that_overran_its_time_limit_scores_as_timed_out(db: sqlite3.Connection, monkeypatch) -> None:
    import producers.envs.sql as sql

    clock = iter([0.0, 5.0, 5.0, 5.0])  # the query returned, but 5 s after it started (past LIMIT_S)
    monkeypatch.setattr(sql.time, "monotonic", lambda: next(clock))
    run = sql.run_query(db, "SELECT 1", LIMIT_S)
    assert run.timed_out and run.rows == () and "time limit" in run.error


def test_a_function_that_reveals_the_process_is_refused(db: sqlite3.Connection) -> None:
    run = run_query(db, "SELECT hex(fts3_tokenizer('simple'))", LIMIT_S)
    assert run.refused and run.rows == ()
    assert run_query(db, "SELECT upper('ok')", LIMIT_S).rows == (("OK",),)


def test_floats_that_differ_in_the_last_bit_match_whichever_side_of_a_rounding_boundary_they_fall() -> None:
    """The same average summed in another order (another query plan): 44.19625 and 44.196250000000006 rounded to
    4 decimals land on 44.1962 and 44.1963; a correct query was scored wrong."""
    gold, pred = [(44.19625, "a"), (1.0, "b")], [(1.0, "b"), (44.196250000000006, "a")]
    assert results_match(pred, gold, ordered=False) and results_match(pred[::-1], gold, ordered=True)
    assert not results_match([(44.1964, "a"), (1.0, "b")], gold, ordered=False)  # a real difference still counts
    assert not results_match([(44.19625, "b"), (1.0, "a")], gold, ordered=False)
    assert not results_match([(44.19625, "a")], gold, ordered=False) and results_match([(2,)], [(2.0,)], ordered=True)


def test_a_finite_recursive_query_is_allowed(db: sqlite3.Connection) -> None:
    ten = "WITH RECURSIVE n(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM n WHERE x < 10) SELECT SUM(x) FROM n"
    assert score_query(db, ten, "SELECT 55", LIMIT_S).matches  # 1 + ... + 10 = 55


def test_a_syntax_error_gets_the_penalty_quickly(db: sqlite3.Connection) -> None:
    start = time.monotonic()
    score = score_query(db, "SELEC a FROM t", "SELECT a FROM t", LIMIT_S)
    assert time.monotonic() - start < 1.0
    assert not score.runs and not score.timed_out and not score.refused
    assert "syntax error" in score.error
    assert -0.25 <= score.reward <= -0.25 + 0.2  # penalty plus a bounded similarity term
    assert row_counts(db) == ROW_COUNTS


@pytest.mark.parametrize("text", ["-- only a comment", "/* nothing */", ";"])
def test_text_that_runs_nothing_is_an_error_not_a_free_reward(db: sqlite3.Connection, text: str) -> None:
    score = score_query(db, text, "SELECT a FROM t", LIMIT_S)
    assert not score.runs and score.reward < 0


def test_long_values_are_capped(db: sqlite3.Connection) -> None:
    run = run_query(db, "SELECT hex(zeroblob(60000))", LIMIT_S)  # 120,000 characters > the 100 kB cap
    assert "too big" in run.error
    with pytest.raises(ValueError, match="max_value_bytes"):
        build_database("CREATE TABLE big (x); INSERT INTO big VALUES (hex(zeroblob(2000)));", max_value_bytes=1_000)
    assert build_database("CREATE TABLE big (x); INSERT INTO big VALUES (hex(zeroblob(2000)));")


# 50 kB rows sorted by their value: 800 of them are 40 MB, twenty times the 2 MB a sort keeps in memory
# before it spills to temporary files.
SORT_LARGE_VALUES = ("WITH RECURSIVE c(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM c WHERE i < {rows}) "
                     "SELECT length(b) FROM (SELECT randomblob(50000) AS b FROM c ORDER BY b) LIMIT 1")
THREAD_IO = Path("/proc/thread-self/io")


def bytes_written_by_this_thread() -> int:
    """The calling thread's write counter (write/pwrite bytes): what SQLite wrote to its temporary files."""
    fields = dict(line.split(": ") for line in THREAD_IO.read_text().splitlines())
    return int(fields["wchar"])


@pytest.mark.skipif(not THREAD_IO.exists(), reason="per-thread I/O counters are Linux's")
def test_sorting_many_large_values_stops_at_the_temporary_storage_bound(db: sqlite3.Connection) -> None:
    before = bytes_written_by_this_thread()
    run = run_query(db, SORT_LARGE_VALUES.format(rows=800), max_temp_bytes=4_000_000)
    written = bytes_written_by_this_thread() - before
    assert "temporary storage" in run.error and not run.rows and not run.timed_out
    assert written < 16_000_000  # the bound plus at most one check's worth (4,000 steps: 200 rows of 50 kB)
    small = run_query(db, SORT_LARGE_VALUES.format(rows=20), max_temp_bytes=4_000_000)  # 1 MB: sorted in memory
    assert small.rows == ((50_000,),)


def test_too_many_rows_never_match_and_the_guard_is_removed_afterwards(db: sqlite3.Connection) -> None:
    run = run_query(db, "SELECT * FROM t, t AS t2, t AS t3", LIMIT_S, max_rows=10)
    assert not run.error and len(run.rows) == 11  # 64 rows exist; fetching stops at max_rows + 1
    db.execute("PRAGMA query_only = OFF")  # our own connection is usable again after run_query
    db.execute("PRAGMA query_only = ON")


# ---- comparison rules -----------------------------------------------------------------------
def test_row_order_counts_only_when_the_gold_query_orders(db: sqlite3.Connection) -> None:
    descending = "SELECT a FROM t ORDER BY a DESC"
    assert not score_query(db, descending, "SELECT a FROM t ORDER BY a", LIMIT_S).matches
    assert score_query(db, "SELECT a FROM t ORDER BY a", "SELECT a FROM t ORDER BY a", LIMIT_S).matches
    assert score_query(db, descending, "SELECT a FROM t", LIMIT_S).matches  # unordered gold: sorted compare
    # duplicates count: t has a = 1 twice
    assert not score_query(db, "SELECT DISTINCT a FROM t", "SELECT a FROM t", LIMIT_S).matches


def test_a_limit_makes_order_count(db: sqlite3.Connection) -> None:
    gold = "SELECT a, c FROM t WHERE c IS NOT NULL ORDER BY b LIMIT 2"  # (3, 'x'), (1, 'y')
    assert score_query(db, "SELECT a, c FROM t WHERE b < 0.25 ORDER BY b", gold, LIMIT_S).matches
    assert not score_query(db, "SELECT a, c FROM t WHERE b < 0.25 ORDER BY b DESC", gold, LIMIT_S).matches


def test_orders_rows_looks_only_at_the_outer_query() -> None:
    assert orders_rows("SELECT a FROM t ORDER BY a")
    assert orders_rows("select a from t limit 3")
    assert orders_rows("SELECT a FROM t UNION SELECT k FROM u ORDER BY 1")
    assert not orders_rows("SELECT a FROM t")
    assert not orders_rows("SELECT * FROM (SELECT a FROM t ORDER BY a LIMIT 2)")
    assert not orders_rows("WITH s AS (SELECT a FROM t ORDER BY a) SELECT a FROM s")
    assert not orders_rows("SELECT a, ROW_NUMBER() OVER (ORDER BY b) FROM t")
    assert not orders_rows("SELECT 'order by x limit 1' FROM t -- ORDER BY a")


def test_floats_are_rounded_before_comparing(db: sqlite3.Connection) -> None:
    assert 0.1 + 0.2 != 0.3  # the binary floats differ...
    assert score_query(db, "SELECT 0.3", "SELECT 0.1 + 0.2", LIMIT_S).matches  # ...but agree to 4 decimals
    assert not score_query(db, "SELECT 0.3001", "SELECT 0.1 + 0.2", LIMIT_S).matches
    assert score_query(db, "SELECT SUM(b) / COUNT(b) FROM t", "SELECT AVG(b) FROM t", LIMIT_S).matches
    assert results_match([(2,)], [(2.0,)], ordered=True)  # numbers compare by value
    assert results_match([(1.23456,)], [(1.23461,)], ordered=True, float_digits=3)
    assert not results_match([(1.23456,)], [(1.23461,)], ordered=True, float_digits=5)
    assert results_match([(None, "a"), (1, None)], [(1, None), (None, "a")], ordered=False)


def test_reward_ladder_and_bounded_similarity(db: sqlite3.Connection) -> None:
    gold = "SELECT c FROM t WHERE a = 1"
    near = score_query(db, "SELECT c FROM t WHERE a = 2", gold, LIMIT_S)  # runs, wrong rows
    far = score_query(db, "SELECT note FROM u", gold, LIMIT_S)
    broken = score_query(db, "SELECT c FROM t WHERE a = = 1", gold, LIMIT_S)
    assert near.runs and not near.matches
    assert 0.25 < far.reward < near.reward <= 0.25 + 0.2  # more overlap, more bonus, never above 0.2
    assert 0.0 <= far.similarity < near.similarity <= 1.0
    assert -0.25 < broken.reward <= -0.05 + 1e-9  # same token set: the full 0.2 bonus, still below zero
    assert broken.reward < far.reward < 2.25


# ---- the environment ------------------------------------------------------------------------
def test_registry_builds_it_with_the_documented_defaults() -> None:
    env = make_env("text2sql")
    assert isinstance(env, TextToSQL) and env.name == "text2sql"
    assert (env.config.max_turns, env.config.max_actions_per_turn, env.config.max_actions_total) == (2, 1, 2)
    assert env.split_actions is False
    assert "<answer>" in env.system_prompt()


def test_same_seed_same_episode() -> None:
    first, second = TextToSQL(split="all"), TextToSQL(split="all")
    n = len(first.tasks)
    assert first.reset(7) == second.reset(7) == first.reset(7 + n)  # seed -> tasks[seed % n]
    assert first.task is not None and first.task.id == first.tasks[7].id
    assert first.random_answer(random.Random(3)) == second.random_answer(random.Random(3))
    answer = "<answer>SELECT * FROM books</answer>"
    one, two = first.step(answer), second.step(answer)
    assert (one.observation, one.reward) == (two.observation, two.reward)


def test_observation_shows_create_statements_question_and_feedback() -> None:
    env = TextToSQL(split="all")
    obs = env.reset(0)
    assert "CREATE TABLE" in obs and env.tasks[0].question in obs
    assert "INSERT" not in obs  # rows are for querying, not for reading off the prompt
    result = env.step("<answer>SELECT no_such_column FROM books</answer>")
    assert result.reward == pytest.approx(-0.25, abs=0.2) and result.reward < 0
    assert "no such column" in result.observation and not result.terminated and not result.truncated
    final = env.step(env.heuristic_answer())
    assert final.terminated and final.info["success"]


def test_wrong_then_right_returns_the_final_query_score() -> None:
    env = TextToSQL(split="all")
    env.reset(0)
    first = env.step("<answer>SELECT title FROM books</answer>")
    assert 0.25 <= first.reward <= 0.45  # runs, wrong result, bounded bonus
    assert "Result: " in first.observation and "not the expected result" in first.observation
    second = env.step(env.heuristic_answer())
    assert second.terminated and second.info["success"]
    assert first.reward + second.reward == pytest.approx(2.25)  # a throw-away first query earns nothing extra


def test_per_query_mode_pays_each_query() -> None:
    env = TextToSQL(split="all", reward_mode="per_query")
    env.reset(0)
    first = env.step("<answer>SELECT title FROM books</answer>")
    second = env.step(env.heuristic_answer())
    assert second.reward == pytest.approx(2.25)
    assert first.reward + second.reward > 2.25


def test_missing_answer_costs_the_format_penalty_and_the_episode_truncates() -> None:
    env = TextToSQL(split="all")
    env.reset(1)
    first = env.step("SELECT * FROM books")  # no <answer> block
    assert first.reward == pytest.approx(-0.1) and not first.info["action_is_valid"]
    assert "held no query" in first.observation
    second = env.step("<answer>SELECT * FROM books</answer>")
    assert second.truncated and not second.terminated
    assert "held no query" not in second.observation


def test_sql_concatenation_is_one_query(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    path.write_text(task_line("concat", "Give each note with an exclamation mark.", "SELECT note || '!' FROM u") + "\n")
    env = TextToSQL(tasks_path=str(path), split="all")
    env.reset(0)
    result = env.step(format_answer(["SELECT note || '!' FROM u"]))
    assert result.info["action_is_valid"] and result.terminated and result.reward == pytest.approx(2.25)


def test_tasks_load_from_a_custom_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "tasks.jsonl"
    lines = [
        task_line("q1", "How many rows does t have?", "SELECT COUNT(*) FROM t"),
        "",
        task_line("q2", "What is the largest a?", "SELECT MAX(a) FROM t"),
    ]
    path.write_text("\n".join(lines) + "\n")
    env = TextToSQL(tasks_path=str(path), split="all")
    assert [t.id for t in env.tasks] == ["q1", "q2"]
    obs = env.reset(1)
    assert "What is the largest a?" in obs and "CREATE TABLE u" in obs
    assert env.step("<answer>SELECT 3</answer>").terminated  # max(a) = 3


def test_bad_task_files_fail_with_the_line_number(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r":2: gold_sql"):
        parse_tasks([task_line("a", "q", "SELECT 1"), json.dumps({"id": "b", "db_id": "x", "schema_sql": "S",
                                                                    "question": "q"})])
    with pytest.raises(ValueError, match="duplicate task id"):
        parse_tasks([task_line("a", "q", "SELECT 1"), task_line("a", "q", "SELECT 2")])
    with pytest.raises(ValueError, match="not JSON"):
        parse_tasks(["{oops"])
    with pytest.raises(ValueError, match="no tasks"):
        parse_tasks(["", "  "])
    with pytest.raises(ValueError, match="tasks_path"):
        TextToSQL(tasks_path=str(tmp_path / "missing.jsonl"))
    broken = tmp_path / "broken.jsonl"
    broken.write_text(task_line("bad", "q", "SELECT nope FROM t") + "\n")
    with pytest.raises(ValueError, match="gold query fails"):
        TextToSQL(tasks_path=str(broken), split="all").reset(0)


def test_splits_hold_out_every_fifth_task() -> None:
    tasks = load_tasks()
    train, test = TextToSQL(split="train").tasks, TextToSQL(split="test").tasks
    assert [t.id for t in test] == [tasks[i].id for i in range(4, len(tasks), 5)]
    assert {t.id for t in train} | {t.id for t in test} == {t.id for t in tasks}
    assert not {t.id for t in train} & {t.id for t in test}
    assert len({t.db_id for t in test}) >= 2  # the hold-out spans schemas
    with pytest.raises(ValueError, match="empty"):
        select_split(tasks[:3], "test", 5)


def test_heuristic_beats_random() -> None:
    env = TextToSQL(split="all")
    rng = random.Random(0)

    def episode_return(seed: int, policy) -> float:
        env.reset(seed)
        total, done = 0.0, False
        while not done:
            result = env.step(policy())
            total, done = total + result.reward, result.terminated or result.truncated
        return total

    n = len(env.tasks)
    heuristic = [episode_return(s, env.heuristic_answer) for s in range(n)]
    random_returns = [episode_return(s, lambda: env.random_answer(rng)) for s in range(n)]
    assert all(r == pytest.approx(2.25) for r in heuristic)
    assert sum(random_returns) / n < 1.0 < sum(heuristic) / n


def test_the_prompt_counts_the_queries_an_episode_really_runs() -> None:
    """max_turns 5 with the default max_actions_total 2 ends after two queries: the prompt and the feedback must
    say two, not five (and the defaults' prompt is unchanged)."""
    env = TextToSQL(split="all", max_turns=5)
    assert "(2 queries in all)" in env.system_prompt()
    env.reset(3)
    first = env.step("<answer>SELECT 1</answer>")
    assert "Turns left: 1." in first.observation
    second = env.step("<answer>SELECT 2</answer>")
    assert second.truncated and "Turns left" not in second.observation
    roomy = TextToSQL(split="all", max_turns=5, max_actions_total=5)
    assert "(5 queries in all)" in roomy.system_prompt()
    assert "(2 queries in all)" in TextToSQL(split="all").system_prompt()
    assert "try again" not in TextToSQL(split="all", max_actions_total=1).system_prompt()


def test_the_prompt_s_example_query_answers_no_shipped_task() -> None:
    """The format example in the system prompt must not be any task's answer: a model that copies it scores no match."""
    env = TextToSQL(split="all")
    prompt = env.system_prompt()
    example = prompt[prompt.index("for example <answer>") + len("for example <answer>"):]
    example = example[: example.index("</answer>")]
    leaked = []
    for seed, task in enumerate(env.tasks):
        env.reset(seed)
        score = score_query(env._require_db(), example, task.gold_sql)
        if score.matches:
            leaked.append(task.id)
    assert leaked == []


def test_a_correct_query_on_a_busy_machine_is_scored_correct_not_timed_out(monkeypatch) -> None:
    """Query cost is counted in SQLite VM steps, not seconds: on a machine so busy that every reading of the clock is
    a second after the one before (four times the old 0.25 s limit), the gold query still resets and matches."""
    import producers.envs.sql as sql

    ticks = iter(range(100_000))  # every reading of the clock is 1 s after the one before
    monkeypatch.setattr(sql.time, "monotonic", lambda: float(next(ticks)))
    env = TextToSQL(split="all")
    for seed in (0, len(env.tasks) - 1):
        env.reset(seed)
        result = env.step(env.heuristic_answer())
        assert result.terminated and result.info["success"], (seed, result.observation)
        assert result.reward == pytest.approx(2.25)
