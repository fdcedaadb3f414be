"""``rlpipe datasets``: import, generate, inspect, convert and evaluate offline datasets.

Thin by design: the work is in ``producers.offline`` (importers, generator,
to-trajectories, evaluation) and ``pipeline.io.datasets`` (cards, partitions, scans);
this module parses options and prints.  A user mistake ends with one red line
and a non-zero exit code, never a traceback.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.cli.common import (
    GcsEndpointOpt,
    StoreRootOpt,
    check_folder_option,
    console,
    err_console,
    error_line,
    fail,
    handle_user_errors,
    print_json,
)
from pipeline.config import parse_overrides
from pipeline.io.datasets import (
    BASE_COLUMNS,
    CARD_NAME,
    DATASETS_PREFIX,
    DatasetCard,
    dataset_names,
    dataset_prefix,
    read_card,
    read_steps,
    verify_dataset,
)
from pipeline.io.store import ObjectStore
from pipeline.runtime import refuse_case_twin, refuse_new_run_case_twin
from schemas.names import validate_name

app = typer.Typer(
    name="datasets",
    help="Offline datasets: import logs (Smart Buildings, CSV/Parquet), generate building telemetry, "
    "inspect them, turn them into trajectories and evaluate what was trained on them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
import_app = typer.Typer(name="import", help="Import logged data into the store.", no_args_is_help=True)
generate_app = typer.Typer(name="generate", help="Generate a dataset from an environment.", no_args_is_help=True)
app.add_typer(import_app, name="import")
app.add_typer(generate_app, name="generate")

NameOpt = Annotated[str, typer.Option("--name", help="dataset name (datasets/<name>/ in the store)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print JSON instead of tables")]


def _store(root: str | None, gcs_endpoint: str | None) -> ObjectStore:
    from pipeline.runtime import open_store
    from schemas.config import StoreConfig

    return open_store(StoreConfig(root=root or "", gcs_endpoint=gcs_endpoint))


# ---- list / show / sample -----------------------------------------------------------------------


@app.command("list", epilog="Example: rlpipe datasets list --root file:///data/rlpipe")
@handle_user_errors
def list_datasets(root: StoreRootOpt = None, gcs_endpoint: GcsEndpointOpt = None, as_json: JsonOpt = False) -> None:
    """List the datasets in the store (those whose card is written).

    A card that cannot be read is listed as unreadable with the reason, among the others; then the command exits 1.
    """
    store = _store(root, gcs_endpoint)
    cards, broken = _read_cards(store)
    if as_json:
        print_json(sorted([*map(_summary, cards), *({"name": n, "error": e} for n, e in broken.items())],
                          key=lambda row: row["name"]))
    elif not cards and not broken:
        console.print(f"no datasets in {store.url('datasets')}; import one with `rlpipe datasets import ...`")
    else:
        _print_listing(cards, broken)
    if broken:
        where = store.url(dataset_prefix(next(iter(broken))) if len(broken) == 1 else DATASETS_PREFIX)
        fail(f"{len(broken)} dataset card{'s' if len(broken) > 1 else ''} cannot be read: {', '.join(broken)}; "
             f"restore the card ({CARD_NAME}) or delete the dataset's folder ({where})")


def _read_cards(store: ObjectStore) -> tuple[list[DatasetCard], dict[str, str]]:
    """Every dataset's card, and name -> why its card cannot be read (one broken card hides no other)."""
    cards, broken = [], {}
    for name in dataset_names(store):
        try:
            cards.append(read_card(store, name))
        except ValueError as exc:  # DatasetError: not JSON, not a valid card, a newer schema
            broken[name] = error_line(exc)
    return cards, broken


def _print_listing(cards: list[DatasetCard], broken: dict[str, str]) -> None:
    table = Table("name", "source", "rows", "episodes", "from", "to", "files", "MB", title="rlpipe datasets")
    rows = {card.name: _listing_row(card) for card in cards}
    rows |= {name: [name, "[red]unreadable[/red]", *["-"] * 6] for name in broken}
    for name in sorted(rows):
        table.add_row(*rows[name])
    console.print(table)
    for name, reason in broken.items():
        console.print(f"{name}: {reason}", style="red", markup=False)


def _listing_row(card: DatasetCard) -> list[str]:
    s = _summary(card)
    return [card.name, card.source, f"{card.num_rows:,}", f"{card.num_episodes:,}", s["from"], s["to"],
            str(len(card.files)), f"{s['bytes'] / 1e6:.1f}"]


def _summary(card: DatasetCard) -> dict[str, Any]:
    def when(moment: datetime | None) -> str:
        return moment.strftime("%Y-%m-%d %H:%M") if moment else "-"

    return {"name": card.name, "source": card.source, "rows": card.num_rows, "episodes": card.num_episodes,
            "from": when(card.time_start), "to": when(card.time_end), "files": len(card.files),
            "bytes": sum(f.size_bytes for f in card.files)}


@app.command(epilog="Example: rlpipe datasets show office-jan --fields")
@handle_user_errors
def show(
    name: Annotated[str, typer.Argument(help="dataset name")],
    fields: Annotated[bool, typer.Option("--fields", help="list every field with its unit")] = False,
    verify: Annotated[bool, typer.Option("--verify", help="re-hash every file against the card")] = False,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show a dataset's card: source, span, counts, files, and (with --fields) its fields and units."""
    store = _store(root, gcs_endpoint)
    card = read_card(store, name)
    problems = verify_dataset(store, card) if verify else []
    if as_json:
        print_json(card.model_dump(mode="json") | ({"problems": problems} if verify else {}))
    else:
        _print_card(card, fields)
    if verify:
        for line in problems:
            console.print(f"[red]{line}[/red]")
        if problems:
            fail(f"{len(problems)} files of dataset {name} do not match its card")
        console.print(f"all {len(card.files)} files match their sha256")


def _print_written(card: DatasetCard, as_json: bool) -> None:
    """The card of a dataset just written: as JSON (the same document as `datasets show --json`) or a table."""
    if as_json:
        print_json(card.model_dump(mode="json"))
    else:
        _print_card(card, False)


def _print_card(card: DatasetCard, with_fields: bool) -> None:
    s = _summary(card)
    table = Table(show_header=False, title=f"dataset {card.name}")
    for key, value in (
        ("source", card.source), ("description", card.description), ("rows", f"{card.num_rows:,}"),
        ("episodes", f"{card.num_episodes:,}"), ("time span (UTC)", f"{s['from']} .. {s['to']}"),
        ("step", f"{card.step_seconds:g} s" if card.step_seconds else "-"), ("episodes are", card.episode_rule),
        ("fields", f"{len(card.fields)} ({len(card.observation_columns)} observation, "
                   f"{len(card.action_columns)} action)"),
        ("reward", card.reward_column or "-"), ("files", f"{len(card.files)} ({s['bytes'] / 1e6:.1f} MB)"),
        ("source files", ", ".join(f"{k} ({v[:12]})" for k, v in card.source_files.items()) or "-"),
        ("created", card.created_at.isoformat(timespec="seconds")),
    ):  # fmt: skip
        table.add_row(key, str(value))
    console.print(table)
    if with_fields:
        listing = Table("field", "role", "unit", "source id", title="fields")
        for f in card.fields:
            listing.add_row(f.name, f.role, f.unit or "-", f.source_id)
        console.print(listing)


@app.command(epilog="Example: rlpipe datasets sample office-jan -n 5 --columns zone_0_0@zone_air_temperature_sensor")
@handle_user_errors
def sample(
    name: Annotated[str, typer.Argument(help="dataset name")],
    n: Annotated[int, typer.Option("-n", min=1, max=10_000, help="rows to show")] = 5,
    columns: Annotated[str | None, typer.Option(help="comma-separated feature columns to show")] = None,
    start: Annotated[datetime | None, typer.Option(help="first time (UTC), e.g. 2023-01-06T12:00")] = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show the first N steps (from --start on) with the base columns and a few features."""
    store = _store(root, gcs_endpoint)
    card = read_card(store, name)
    chosen = [c.strip() for c in columns.split(",") if c.strip()] if columns else [f.name for f in card.fields[:4]]
    base = [c for c in BASE_COLUMNS if c not in ("observation", "action")]
    table = read_steps(store, name, start=start, columns=[*base, *chosen]).slice(0, n)
    rows = table.to_pylist()
    if not rows and start is not None:  # the only way a dataset (at least one row) shows none
        s = _summary(card)
        note = f"no steps of {name} from {start:%Y-%m-%d %H:%M} on: it spans {s['from']} .. {s['to']} (UTC)"
        (err_console if as_json else console).print(note, markup=False)
    if as_json:
        print_json(rows)
        return
    if not rows:
        return
    view = Table(*base, *chosen, title=f"{name}: {len(rows)} of {card.num_rows:,} steps")
    for row in rows:
        view.add_row(*(_cell(row[c]) for c in [*base, *chosen]))
    console.print(view)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, datetime):
        return value.strftime("%Y-%m-%d %H:%M")
    return str(value)


# ---- import / generate --------------------------------------------------------------------------


@import_app.command("smart-buildings", epilog="Example: rlpipe datasets import smart-buildings ./sb1/2022_a "
                    "--name sb1-2022a --trust-pickle")
@handle_user_errors
def import_smart_buildings_cmd(
    path: Annotated[Path, typer.Argument(help="a partition folder (data.npy.npz + metadata) or a folder of them")],
    name: NameOpt,
    trust_pickle: Annotated[bool, typer.Option(
        "--trust-pickle", help="allow metadata.pickle (loaded with a restricted unpickler); JSON needs no flag")] = False,
    utc_offset_hours: Annotated[float | None, typer.Option(
        help="local time = UTC + this, for day episodes and partitions (default: the metadata's, else 0)")] = None,
    split: Annotated[str, typer.Option(help="episodes: 'day' (local days) or 'gap' (between gaps)")] = "day",
    reward_id: Annotated[str, typer.Option(help="reward matrix column used as the reward")] = "agent_reward_value",
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Import Smart Buildings Dataset partitions (npz + metadata) as a steps dataset.

    The metadata may be JSON (same keys as upstream), or the upstream pickle with
    --trust-pickle; without the flag a pickle is refused and nothing is written.
    """
    from producers.offline.smart_buildings import import_smart_buildings

    if split not in ("day", "gap"):
        fail(f"--split must be day or gap, got {split!r}", 2)
    card = import_smart_buildings(_store(root, gcs_endpoint), path, name, trust_pickle=trust_pickle,
                                  utc_offset_hours=utc_offset_hours, split=split, reward_id=reward_id)  # type: ignore[arg-type]
    _print_written(card, as_json)


@import_app.command("table", epilog="Example: rlpipe datasets import table log.csv --mapping map.yaml --name plant")
@handle_user_errors
def import_table_cmd(
    path: Annotated[Path, typer.Argument(help="a .csv or .parquet file")],
    mapping: Annotated[Path, typer.Option(help="YAML/JSON column mapping (episode_id, timestamp, observation, "
                                               "action, reward, terminal, units, exclude)")],
    name: NameOpt,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Import a CSV or Parquet log with a column mapping; unmapped numeric columns become features."""
    from producers.offline.table import import_table, load_mapping

    card = import_table(_store(root, gcs_endpoint), path, name, load_mapping(mapping))
    _print_written(card, as_json)


@generate_app.command("building-hvac", epilog="Example: rlpipe datasets generate building-hvac --days 28 "
                      "--policy mixed --name hvac-mixed --seed 1")
@handle_user_errors
def generate_building(
    days: Annotated[int, typer.Option(min=1, max=3650, help="days to simulate (one episode each)")],
    name: NameOpt,
    policy: Annotated[str, typer.Option(help="heuristic, random, mixed (each day one of them), or varied (the "
                                        "heuristic, its preheat drawn per day: 1-4 h)")] = "mixed",
    seed: Annotated[int, typer.Option(min=0, help="seeds the controllers' random choices")] = 0,
    first_day: Annotated[int, typer.Option(min=0, help="index of the first day (its date and weather seed)")] = 0,
    random_fraction: Annotated[float, typer.Option(min=0.0, max=1.0, help="share of random days (mixed)")] = 0.5,
    preheat_hours: Annotated[str, typer.Option(help=(
        "varied: the hours of preheat drawn from per day, comma-separated (repeat one to draw it more often)"))]
    = "1,2,3,4",
    overrides: Annotated[list[str] | None, typer.Option("--set", help="building setting, e.g. --set grid_rows=3")]
    = None,
    raw_dir: Annotated[Path | None, typer.Option(help="also keep the npz + metadata.json written on the way")] = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Simulate days of the building under scripted controllers, write them in the Smart Buildings layout,
    and import that with the same importer as real data."""
    from producers.offline.generation import GenerationSpec, generate_building_dataset

    check_folder_option(raw_dir, "--raw-dir")
    spec = GenerationSpec(days=days, policy=policy, seed=seed, first_day=first_day,  # type: ignore[arg-type]
                          random_fraction=random_fraction, env_overrides=parse_overrides(overrides or []),
                          preheat_hours=parse_preheat_hours(preheat_hours))
    with console.status(f"simulating {days} days"):
        card = generate_building_dataset(_store(root, gcs_endpoint), name, spec, raw_dir)
    _print_written(card, as_json)


def parse_preheat_hours(text: str) -> tuple[float, ...]:
    """``"1,2,2,4"`` -> (1.0, 2.0, 2.0, 4.0): hours between 0 and 24, at least one."""
    try:
        hours = tuple(float(part) for part in text.split(","))
    except ValueError:
        hours = ()
    if not hours or not all(0 < h < 24 for h in hours):
        fail(f"--preheat-hours takes hours between 0 and 24 separated by commas, e.g. 1,2,3,4; got {text!r}", 2)
    return hours


# ---- to trajectories / evaluate ---------------------------------------------------------------------


def _model_path(model: str) -> str:
    """``tiny``: the tiny model's folder (built the first time); else ``model``: a model folder or a hub id."""
    if model != "tiny":
        from pipeline.models import check_model_path

        return check_model_path(model)
    from producers.tiny_model import resolve_model
    from schemas.config import ModelConfig

    with console.status("building the tiny model (first time only)"):
        return resolve_model(ModelConfig(base_model="tiny"))


@app.command("to-trajectories", epilog="Example: rlpipe datasets to-trajectories hvac-mixed --run hvac-offline "
             "--model tiny --episodes-per-batch 8")
@handle_user_errors
def to_trajectories(
    name: Annotated[str, typer.Argument(help="dataset name")],
    run: Annotated[str, typer.Option("--run", help="run id that receives the trajectory batches")],
    model: Annotated[str, typer.Option(help="model folder whose tokenizer and chat template are used, or 'tiny'")],
    episodes_per_batch: Annotated[int, typer.Option(min=1, help="episodes (days) per batch")] = 8,
    turns_per_batch: Annotated[int, typer.Option(min=1, help="turns of each episode per batch")] = 24,
    epochs: Annotated[int, typer.Option(min=1, max=1000, help="passes over the data")] = 1,
    discount: Annotated[float, typer.Option(min=0.0, max=1.0, help="gamma of the return-to-go")] = 1.0,
    history_turns: Annotated[int | None, typer.Option(min=0, max=64, help="earlier turns per prompt")] = None,
    max_episodes: Annotated[int | None, typer.Option(min=1, help="use only the first N episodes")] = None,
    answer_format: Annotated[str, typer.Option(
        help="kelvin (<answer>330K, 292K</answer>) or normalized (<answer>0.3, -0.9</answer>, each in [-1, 1])",
    )] = "kelvin",
    answer_decimals: Annotated[int | None, typer.Option(
        min=0, max=6, help="decimals of each answer value (default: 0 for kelvin, 1 for normalized)",
    )] = None,
    with_text: Annotated[bool, typer.Option("--with-text", help="store the decoded text of each row")] = False,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
) -> None:
    """Render every logged step as the online building prompt (the logged action as the answer) and write
    token trajectories under --run, ready for `rlpipe replay --run RUN --train`."""
    from pipeline.analysis.runs import refuse_training_run
    from producers.offline.evaluation import model_tokenizer
    from producers.offline.trajectories import TrajectoryOptions, dataset_to_trajectories

    options = TrajectoryOptions(episodes_per_batch=episodes_per_batch, turns_per_batch=turns_per_batch, epochs=epochs,
                                discount=discount, history_turns=history_turns, max_episodes=max_episodes,
                                answer_format=answer_format,  # type: ignore[arg-type]  # checked by the model
                                answer_decimals=answer_decimals, with_text=with_text)
    validate_name(run, "run_id")  # a run that cannot take the batches is named before a model is loaded
    store = _store(root, gcs_endpoint)
    refuse_new_run_case_twin(store, run)  # its batches would go into the other run's folder
    read_card(store, name)  # and so is a missing dataset (building tiny takes minutes)
    refuse_training_run(store, run, f"convert into a run of its own (--run {run}-data), then train with "
                                    f"rlpipe replay --run {run}-data --train")
    model_path = _model_path(model)
    tokenizer = model_tokenizer(model_path)
    with console.status("rendering and tokenizing"):
        report = dataset_to_trajectories(store, name, run, tokenizer, options, model_path)
    console.print(f"wrote {report.batches} batches ({report.rows:,} rows, {report.tokens:,} tokens, "
                  f"{report.generated_tokens:,} answer tokens) from {report.episodes} episodes into run {run}")
    console.print(
        f"train: rlpipe replay --run {run} --train --preset building-hvac --set run_id={run}-awr "
        f"--set model.base_model={model_path} --set learner.loss=awr --set learner.advantage=return_to_go "
        "--set learner.awr_beta=2 "  # raw return-to-go advantages are in reward units (docs/offline.md's recipe)
        f"--set learner.batch_rows={report.smallest_batch_rows} "  # the learner steps once enough rows wait
        "--set learner.max_staleness=1000"
    )


@app.command("eval-building", epilog="Example: rlpipe datasets eval-building --run hvac-offline-awr "
             "--dataset hvac-mixed --model tiny --days 7 --policies adapter,behaviour,random")
@handle_user_errors
def eval_building(
    run: Annotated[str, typer.Option("--run", help="run whose adapter is evaluated; results go to runs/RUN/eval/")],
    dataset: Annotated[str | None, typer.Option(help="the training dataset: env settings, logged controller, "
                                                     "held-out days")] = None,
    model: Annotated[str | None, typer.Option(help="base model folder or 'tiny' (for adapter and base)")] = None,
    version: Annotated[int | None, typer.Option(min=1, help="adapter version (default: latest)")] = None,
    policies: Annotated[str, typer.Option(help="comma-separated: adapter, base, behaviour, heuristic, random")]
    = "adapter,behaviour,random",
    days: Annotated[int, typer.Option(min=1, max=1000, help="held-out days to play")] = 7,
    first_day: Annotated[int | None, typer.Option(min=0, help="first day index (default: after the dataset's)")]
    = None,
    temperature: Annotated[float, typer.Option(min=0.0, max=10.0, help="sampling temperature (0 = greedy)")] = 1.0,
    seed: Annotated[int, typer.Option(min=0, help="sampling seed")] = 0,
    history_turns: Annotated[int | None, typer.Option(min=0, max=64, help="as in to-trajectories")] = None,
    overrides: Annotated[list[str] | None, typer.Option(
        "--set", help="building setting for the evaluation, e.g. --set episode_days=0.5")] = None,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Play held-out days of the building with the offline-trained adapter and with baselines (the logged
    controller, random, ...); energy, carbon and comfort broken out; results stored as EvalResult JSON."""
    from producers.offline.evaluation import (
        SamplingSettings,
        adapter_version,
        evaluate_building,
        refuse_validated_days,
    )

    store = _store(root, gcs_endpoint)
    refuse_case_twin(store, run)  # its results would go into the other run's folder
    card = read_card(store, dataset) if dataset else None
    chosen = [p.strip() for p in policies.split(",") if p.strip()]
    if first_day is None and card is None:
        first_day = 1_000_000
    day_list = _held_out(card, days, first_day)
    refuse_validated_days(store, run, day_list)  # before the model too: days a validation of the run played
    if "adapter" in chosen and model:
        adapter_version(store, run, version)  # before the model: loading (or building the tiny one) takes long
    model_path = _model_path(model) if model else None
    with console.status(f"playing {days} days x {len(chosen)} policies") as status:

        def progress(line: str) -> None:  # a line per day played; off a terminal (no spinner) on stderr
            if console.is_terminal:
                status.update(f"playing {days} days x {len(chosen)} policies: {line}")
            else:
                err_console.print(line, markup=False)

        results = evaluate_building(
            store, run, chosen, day_list, card=card, model_path=model_path, version=version,
            sampling=SamplingSettings(temperature=temperature, seed=seed), history_turns=history_turns,
            env_overrides=parse_overrides(overrides or []), progress=progress,
        )
    if as_json:  # one day has no interval: ci95 null (the stored EvalResult keeps 0.0)
        print_json([r.model_dump(mode="json") | ({"ci95": None} if r.episodes < 2 else {}) for r in results])
        return
    table = Table("policy", "version", "days", "mean return", "95% CI", "comfort", "energy", "carbon", "energy $",
                  "carbon kg", "invalid", title=f"building-hvac, days {day_list[0]}..{day_list[-1]}")
    for r in results:
        b = r.breakdown
        table.add_row(r.policy, str(r.version), str(r.episodes), f"{r.mean_return:.3f}",
                      f"± {r.ci95:.3f}" if r.episodes > 1 else "n/a",
                      f"{b['comfort']:.2f}", f"{b['energy']:.2f}", f"{b['carbon']:.2f}", f"{b['energy_usd']:.2f}",
                      f"{b['carbon_kg']:.1f}", f"{b['invalid_rate']:.1%}")
    console.print(table)
    console.print("comfort, energy, carbon: per-day sums of the reward's normalised parts "
                  "(reward = -(0.2 comfort + 0.4 energy + 0.4 carbon) per step by default)")


def _held_out(card: DatasetCard | None, count: int, first_day: int | None) -> list[int]:
    from producers.offline.evaluation import held_out_days

    if card is None:
        start = first_day if first_day is not None else 1_000_000
        return list(range(start, start + count))
    return held_out_days(card, count, first_day)
