"""The report's evaluation section: which results it keeps, how it groups them, what its figure and table show."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from pipeline.analysis.report.html import section_table
from pipeline.analysis.report.metrics import eval_series
from pipeline.analysis.report.model import RunReport
from pipeline.analysis.report.plots import plot_eval
from schemas.evaluation import EvalResult

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def result(policy: str, env: str, version: int, seed_start: int, returns: list[float], minutes: int) -> EvalResult:
    """An evaluation stored ``minutes`` after T0; episode i succeeds when its return is at least 1."""
    return EvalResult.from_episodes(run_id="r", env=env, version=version, seed_start=seed_start, policy=policy,
                                    returns=returns, successes=[r >= 1 for r in returns],
                                    created_at=T0 + timedelta(minutes=minutes))


EVALS = [
    result("adapter", "cartpole", 3, 1000, [1.0, 1.0, 1.0], minutes=0),  # replaced by the one at minute 5
    result("adapter", "acrobot", 3, 1000, [0.0, 0.0, 0.0], minutes=1),  # `rlpipe eval --env acrobot`: its own point
    result("adapter", "cartpole", 3, 2000, [0.0, 1.0, 1.0], minutes=2),  # another seed range: its own point
    result("adapter", "cartpole", 1, 1000, [0.0, 0.0, 1.0], minutes=3),
    result("random", "cartpole", 0, 1000, [0.0, 0.0, 0.0], minutes=4),
    result("adapter", "cartpole", 3, 1000, [2.0, 2.0, 2.0], minutes=5),
]


def test_only_a_result_of_the_same_policy_version_environment_and_seeds_replaces_an_older_one() -> None:
    points = eval_series(EVALS)
    assert [(p["policy"], p["env"], p["version"], p["seed_start"], p["mean_return"]) for p in points] == [
        ("adapter", "acrobot", 3, 1000, 0.0),
        ("adapter", "cartpole", 1, 1000, 1 / 3),
        ("adapter", "cartpole", 3, 1000, 2.0),  # the newer of the two on seeds 1000-1002
        ("adapter", "cartpole", 3, 2000, 2 / 3),
        ("random", "cartpole", 0, 1000, 0.0),
    ]


def test_the_figure_draws_one_series_per_policy_and_environment_named_in_its_legend() -> None:
    fig = plot_eval(eval_series(EVALS))
    assert fig is not None
    ax_return = fig.axes[0]
    series = {bars.get_label(): bars for bars in ax_return.containers}  # errorbars: one per series
    assert "adapter on acrobot" in series  # one seed range: named by policy and environment alone
    assert list(series["adapter on acrobot"].lines[0].get_xdata()) == [3]
    bands = [line.get_label() for line in ax_return.get_lines() if line.get_label().startswith("random")]
    assert bands == ["random on cartpole (3 ep)"]


def test_a_version_evaluated_on_two_seed_ranges_is_a_point_in_two_series_named_by_their_seeds() -> None:
    # adapter v3 on cartpole has seeds 1000-1002 and 2000-2002: one series would zig-zag at x = 3
    fig = plot_eval(eval_series(EVALS))
    assert fig is not None
    for ax in fig.axes:
        series = {bars.get_label(): bars for bars in ax.containers}
        assert set(series) == {"adapter on acrobot", "adapter on cartpole, seeds 1000-1002",
                               "adapter on cartpole, seeds 2000-2002"}
        for bars in series.values():
            xs = list(bars.lines[0].get_xdata())
            assert xs == sorted(set(xs))  # each version once, in order
    returns = {b.get_label(): list(b.lines[0].get_ydata()) for b in fig.axes[0].containers}
    assert returns["adapter on cartpole, seeds 1000-1002"] == [1 / 3, 2.0]
    assert returns["adapter on cartpole, seeds 2000-2002"] == [2 / 3]


def test_the_table_names_each_results_environment() -> None:
    points = eval_series(EVALS)
    table = section_table("eval", RunReport("r", "file:///s", "now", {}, {"eval": points}))
    assert table is not None and table["head"][:4] == ["policy", "environment", "version", "episodes"]
    assert [row[:3] for row in table["rows"]][:2] == [["adapter", "acrobot", 3], ["adapter", "cartpole", 1]]


def test_the_summary_names_the_environment_of_an_evaluation_on_another_one() -> None:
    from pipeline.analysis.report.html import summary_lines

    line = dict(summary_lines({"env": "cartpole", "eval": eval_series(EVALS)}))["evaluations"]
    assert line.startswith("adapter v3 on acrobot: 0 ± 0") and "; adapter v1: 0.333 ± " in line


# 95% Wilson interval of 1 success in 3 (z = 1.959964, z^2 = 3.841459, p = 1/3, n = 3):
# centre = (p + z^2/2n) / (1 + z^2/n) = 0.973577 / 2.280486 = 0.426916
# half = z * sqrt(p(1-p)/n + z^2/4n^2) / (1 + z^2/n) = 1.959964 * sqrt(0.180781) / 2.280486 = 0.365426
ONE_IN_THREE = (0.426916 - 0.365426, 0.426916 + 0.365426)


def test_each_evaluation_point_carries_the_wilson_interval_of_its_success_rate() -> None:
    point = next(p for p in eval_series(EVALS) if p["env"] == "cartpole" and p["version"] == 1)  # 1 success in 3
    assert abs(point["success_low"] - ONE_IN_THREE[0]) < 1e-5 and abs(point["success_high"] - ONE_IN_THREE[1]) < 1e-5


def test_the_success_figure_and_table_show_the_wilson_interval() -> None:
    points = eval_series(EVALS)
    fig = plot_eval(points)
    assert fig is not None
    bars = {b.get_label(): b for b in fig.axes[1].containers}["adapter on cartpole, seeds 1000-1002"]  # v1 first
    (caps_low, caps_high) = (bars.lines[1][0].get_ydata(), bars.lines[1][1].get_ydata())
    assert abs(caps_low[0] - ONE_IN_THREE[0]) < 1e-5 and abs(caps_high[0] - ONE_IN_THREE[1]) < 1e-5
    table = section_table("eval", RunReport("r", "file:///s", "now", {}, {"eval": points}))
    assert table is not None and table["head"][8] == "success 95% CI (Wilson)"
    assert table["rows"][1][7:9] == ["33.3%", "6.1% to 79.2%"]  # adapter on cartpole, v1


def test_the_summary_gives_the_success_interval_of_each_evaluation() -> None:
    from pipeline.analysis.report.html import summary_lines

    point = next(p for p in eval_series(EVALS) if p["env"] == "cartpole" and p["version"] == 1)
    line = dict(summary_lines({"env": "cartpole", "eval": [point]}))["evaluations"]
    assert line == "adapter v1: 0.333 ± 1.43 (success 33.3%, 95% CI 6.1% to 79.2%, 3 ep)"
