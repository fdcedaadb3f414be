"""``rlpipe report`` on a value run: return per step, TD error, Q values and replay memory size from its step log."""

from __future__ import annotations

from pathlib import Path

from consumers.value.service import replay_train_value
from pipeline.analysis.report import gather_report, render_html, summary_lines
from pipeline.analysis.report.metrics import value_traces
from pipeline.analysis.report.plots import render_figures
from pipeline.config import load_preset
from pipeline.io.archive import TrajectoryArchive
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ObjectStore
from producers.envs.classic import CartPole
from producers.value_actor import ValueActor, ValueNetworkWatcher
from schemas.config import RunConfig
from schemas.value import ValueActorConfig


def test_value_traces_take_the_value_learners_fields_and_skip_other_steps() -> None:
    log = [
        {"step": 1, "transitions": 40, "updates": 0, "replay_size": 40, "episode_return_mean": 21.0, "episodes": 2.0,
         "version": 0},
        {"step": 2, "transitions": 40, "updates": 40, "replay_size": 80, "loss": 0.5, "td_abs_mean": 0.7,
         "q_mean": 1.5, "version": 1},
        {"step": 3, "rows": 8, "loss": 0.1},  # a LoRA learner's step: not a value step
    ]
    traces = value_traces(log)
    assert [t["step"] for t in traces] == [1, 2]
    assert traces[0] == {"step": 1, "episode_return_mean": 21.0, "episodes": 2.0, "td_abs_mean": None,
                         "q_mean": None, "loss": None, "replay_size": 40, "updates": 0, "transitions": 40,
                         "version": 0}
    assert (traces[1]["td_abs_mean"], traces[1]["q_mean"], traces[1]["replay_size"]) == (0.7, 1.5, 80)


def test_report_of_a_value_run_plots_its_learner(tmp_path: Path) -> None:
    store = ObjectStore((tmp_path / "store").as_uri())
    actor = ValueActor(run_id="actors", actor_id="a0", env=CartPole(), archive=TrajectoryArchive(store),
                       watcher=ValueNetworkWatcher(AdapterRegistry(store, "actors"), tmp_path / "cache"),
                       config=ValueActorConfig(steps_per_batch=50))
    for _ in range(4):
        actor.write_batch()
    raw = load_preset("dqn-cartpole")
    raw.update(run_id="value-report", store={"root": (tmp_path / "store").as_uri()})
    raw["value"]["learner"].update(min_replay_size=32, batch_size=16, checkpoint_every=2, publish_every=2)
    replay_train_value(RunConfig.model_validate(raw), "actors")

    report = gather_report(store, "value-report")
    traces = report.series["value"]
    assert [t["step"] for t in traces] == [1, 2, 3, 4]
    assert all(t["replay_size"] > 0 and t["episode_return_mean"] > 0 for t in traces)
    assert any(t["td_abs_mean"] is not None and t["q_mean"] is not None for t in traces)
    assert report.summary["value_replay_size"] == traces[-1]["replay_size"]
    images = render_figures(report)
    assert "value" in images and images["value"].startswith(b"\x89PNG")
    assert "Value learner" in render_html(report, images)
    labels = dict(summary_lines(report.summary))
    assert labels["value-network versions"] == "2 (latest v2)" and "adapter versions" not in labels
    assert not {"trajectories", "dropped stale rows", "mean reward, last version"} & set(labels)
    assert not {"reward", "staleness", "importance", "collapse"} & set(report.notes)  # a language-model run's
    assert report.notes["throughput"] == ["event log skipped (--no-bus)"]  # heartbeats come from the log
    page = render_html(report, images)
    assert "Staleness of trained rows" not in page and "Importance ratios" not in page
    lanes = report.series["duty_cycle"]["lanes"]
    assert [lane["name"] for lane in lanes] == ["learner"] and len(lanes[0]["intervals"]) == 4
    assert "started_at" not in AdapterRegistry(store, "value-report").list()[-1].metrics


def test_one_evaluated_value_network_version_is_a_point_at_its_version_not_a_baseline_band() -> None:
    """``rlpipe eval`` of a value run's latest version alone stores one ``value-network`` result: the figure must
    show it at v7 with its interval, as the adapter's versions are, while a scripted baseline stays a band."""
    from pipeline.analysis.report.metrics import eval_series
    from pipeline.analysis.report.plots import plot_eval
    from schemas.evaluation import EvalResult

    evals = [EvalResult.from_episodes(run_id="v", env="cartpole", version=version, seed_start=1000, policy=policy,
                                      returns=[10.0, 20.0, 30.0], successes=[False, True, True])
             for policy, version in (("value-network", 7), ("random", 0))]
    fig = plot_eval(eval_series(evals))
    assert fig is not None
    ax_return = fig.axes[0]
    points = [bars for bars in ax_return.containers if bars.get_label() == "value-network on cartpole"]  # errorbar
    assert len(points) == 1
    assert list(points[0].lines[0].get_xdata()) == [7] and list(points[0].lines[0].get_ydata()) == [20.0]
    bands = [line for line in ax_return.get_lines() if line.get_label().startswith("random")]
    assert len(bands) == 1 and list(bands[0].get_ydata()) == [20.0, 20.0]  # axhline: a horizontal reference


def _value_evals() -> list:
    from pipeline.analysis.report.metrics import eval_series
    from schemas.evaluation import EvalResult

    return eval_series([EvalResult.from_episodes(run_id="v", env="cartpole", version=version, seed_start=1000,
                                                 policy="value-network", returns=[20.0, 24.4],
                                                 successes=[False, True]) for version in (0, 3)])


def test_a_value_runs_version_0_is_named_uniform_random_as_rlpipe_eval_names_it() -> None:
    """A value run's v0 plays no network (``rlpipe eval`` calls it ``uniform random``): the summary, the eval table
    and the figure's axis say so; a LoRA run's v0 stays the base model."""
    from pipeline.analysis.report.html import section_table
    from pipeline.analysis.report.model import RunReport
    from pipeline.analysis.report.plots import plot_eval

    summary = {"kind": "value-network", "env": "cartpole", "eval": _value_evals()}
    line = dict(summary_lines(summary))["evaluations"]
    assert line.startswith("uniform random v0: 22.2 ± ") and "; value-network v3: 22.2" in line, line
    table = section_table("eval", RunReport("v", "file:///s", "now", summary, {"eval": summary["eval"]}))
    assert table is not None and [row[0] for row in table["rows"]] == ["uniform random", "value-network"]
    fig = plot_eval(summary["eval"], kind="value-network")
    assert fig is not None and fig.axes[0].get_xlabel() == "value-network version (0 = uniform random)"
    lora = plot_eval(summary["eval"])
    assert lora is not None and lora.axes[0].get_xlabel() == "adapter version (0 = base)"


def test_throughput_leaves_out_the_tokens_panel_when_no_producer_sent_tokens() -> None:
    """A value run's actors step numeric environments: their heartbeats carry no tokens, so a tokens/s panel would
    be a flat zero line."""
    from pipeline.analysis.report.plots import plot_throughput

    def points(tokens_per_s: float) -> list[dict[str, float]]:
        return [{"time": t, "samples_per_s": 2.0, "tokens_per_s": tokens_per_s} for t in (0.0, 5.0)]

    numeric = plot_throughput({"a0": points(0.0)}, None)
    assert numeric is not None and [ax.get_ylabel() for ax in numeric.axes] == ["samples / s"]
    tokens = plot_throughput({"p0": points(40.0), "a0": points(0.0)}, None)
    assert tokens is not None and [ax.get_ylabel() for ax in tokens.axes] == ["samples / s", "tokens / s"]


def test_a_lora_runs_summary_has_no_value_learner_lines() -> None:
    labels = [label for label, _ in summary_lines({"env": "cartpole", "run_id": "r"})]
    assert "run id" in labels and not [label for label in labels if label.startswith("value learner")], labels
    value = [label for label, _ in summary_lines({"kind": "value-network", "value_replay_size": 40})]
    assert "value learner: replay memory size" in value
