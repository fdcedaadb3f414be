"""``rlpipe adapters list|show|pull``: look at and fetch a run's adapter versions.

Reads the store only (never Kafka), so it works against any root, including a
production ``gs://`` bucket from a laptop.  User mistakes (a bad URL, an unknown
run, a missing version) exit 2 with one line; runtime failures (unreachable
endpoint, checksum mismatch) exit 1 with one line; neither prints a traceback.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from pipeline.analysis.runs import runs_there
from pipeline.cli.common import (
    EXIT_FAILURE,
    EXIT_USAGE,
    GcsEndpointOpt,
    JsonOpt,
    StoreRootOpt,
    check_folder_option,
    console,
    fail,
    fitted_table,
    left_out_note,
    print_json,
    shown_model,
)
from pipeline.devstack.gcs_emulator import probe_endpoint
from pipeline.io.registry import AdapterNotFoundError, AdapterRegistry, version_folder
from pipeline.io.store import ChecksumError, InvalidKeyError, ObjectStore, StoreURLError, remote_failures
from pipeline.runtime import RunIdCaseError, refuse_case_twin
from schemas.names import InvalidNameError
from schemas.registry import AdapterManifest, ManifestError
from schemas.versions import SchemaVersionError

app = typer.Typer(
    name="adapters",
    help="List, inspect and pull the adapter versions of a run.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)
RunOption = Annotated[str, typer.Option("--run", "-r", help="run id, e.g. demo")]
VersionArgument = Annotated[str, typer.Argument(help="version number (7, v000007) or 'latest'")]


class UsageError(Exception):
    """A mistake the user can fix by changing the command line (exit 2)."""


@app.command("list")
def list_versions(
    run: RunOption, root: StoreRootOpt = None, gcs_endpoint: GcsEndpointOpt = None, as_json: JsonOpt = False
) -> None:
    """List the committed adapter versions of a run.

    Example: rlpipe adapters list --run demo --root gs://my-bucket/rlpipe
    """
    with _errors():
        registry = _registry(run, root, gcs_endpoint)
        manifests = registry.list()
        if as_json:
            print_json(manifests)
        elif not manifests:
            console.print(f"run {run} has no adapter versions yet")
        else:
            with_files = set(registry.versions_with_files())
            retired = [m.version for m in manifests if m.version not in with_files]
            table, left_out = _versions_table(run, manifests, set(retired))
            console.print(table)
            if left_out:
                console.print(left_out_note(left_out), markup=False)
            if retired:
                console.print(f"{len(retired)} version{'s' if len(retired) > 1 else ''} retired, files deleted "
                              f"(v{retired[-1]}: {registry.retired_reason(retired[-1]) or 'no reason recorded'})",
                              markup=False)


@app.command("show")
def show_version(
    version: VersionArgument,
    run: RunOption,
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Show one version's manifest: lineage, metrics and files with their digests.

    Example: rlpipe adapters show --run demo 3
    """
    with _errors():
        registry = _registry(run, root, gcs_endpoint)
        manifest = registry.show(_parse_version(version, registry))
        digest = registry.adapter_sha256(manifest.version)
        if as_json:
            print_json({**manifest.model_dump(mode="json"), "adapter_sha256": digest})
        else:
            console.print(_manifest_table(manifest, digest))
            console.print(_files_table(manifest))


@app.command("pull")
def pull_version(
    version: VersionArgument,
    run: RunOption,
    to: Annotated[Path, typer.Option("--to", help="cache folder; the adapter lands in DIR/RUN/vNNNNNN")],
    root: StoreRootOpt = None,
    gcs_endpoint: GcsEndpointOpt = None,
) -> None:
    """Download a version into a local folder, verifying every file's sha256.

    Example: rlpipe adapters pull --run demo latest --to ~/.cache/rlpipe/adapters
    """
    check_folder_option(to, "--to")
    with _errors():
        registry = _registry(run, root, gcs_endpoint)
        number = _parse_version(version, registry)
        folder = registry.pull(number, to)
        console.print(f"pulled version {number} of run {run} (verified) into {folder}")


# -- plumbing --------------------------------------------------------------------------------


@contextmanager
def _errors() -> Iterator[None]:
    """One line on stderr instead of a traceback; exit 2 for user mistakes, 1 for everything else."""
    logging.getLogger("gcsfs").setLevel(logging.CRITICAL)  # it logs whole tracebacks while retrying
    try:
        yield
    except typer.Exit:
        raise
    except (UsageError, StoreURLError, InvalidKeyError, InvalidNameError, AdapterNotFoundError, RunIdCaseError) as exc:
        fail(str(exc), EXIT_USAGE)
    except (ChecksumError, ManifestError, SchemaVersionError) as exc:
        fail(str(exc), EXIT_FAILURE)
    except (OSError, RuntimeError, ValueError, *remote_failures()) as exc:  # a store or network failure: one line
        fail(f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__, EXIT_FAILURE)


def _registry(run: str, root: str | None, gcs_endpoint: str | None) -> AdapterRegistry:
    store = _open_store(root, gcs_endpoint)
    refuse_case_twin(store, run)
    registry = AdapterRegistry(store, run)
    if not registry.run_exists():
        raise UsageError(f"run {run!r} not found under {store.root}; {runs_there(store)}")
    return registry


def _open_store(root: str | None, gcs_endpoint: str | None) -> ObjectStore:
    if root is None:
        root, recorded_endpoint = _stack_root()
        gcs_endpoint = gcs_endpoint or recorded_endpoint
    if gcs_endpoint:
        _probe_endpoint(gcs_endpoint)
    return ObjectStore(root, gcs_endpoint=gcs_endpoint)


def _stack_root() -> tuple[str, str | None]:
    """The root recorded by `rlpipe up` (a URL, or a config with ``root`` and ``gcs_endpoint``)."""
    try:
        from pipeline.devstack.stack import resolve_store_root
    except ImportError:
        raise UsageError("no --root given and no embedded stack is available; pass --root URL") from None
    try:
        resolved: Any = resolve_store_root()
    except (RuntimeError, OSError) as exc:  # StackError is a RuntimeError; OSError: $RLPIPE_HOME unreadable
        raise UsageError(f"no --root given and {exc}") from None
    if isinstance(resolved, str | Path):
        return str(resolved), None
    return str(resolved.root), getattr(resolved, "gcs_endpoint", None)


def _probe_endpoint(endpoint: str) -> None:
    """Fail in seconds, not after gcsfs's half minute of retries, when the endpoint does not answer."""
    if not endpoint.startswith(("http://", "https://")):
        raise UsageError(f"--gcs-endpoint {endpoint!r} must start with http:// or https://")
    reason = probe_endpoint(endpoint)
    if reason is not None:
        raise RuntimeError(f"cannot reach the GCS endpoint {endpoint}: {reason}; is the emulator running?")


def _parse_version(text: str, registry: AdapterRegistry) -> int:
    cleaned = text.strip().lower()
    if cleaned == "latest":
        latest = registry.latest()
        if latest is None:
            raise UsageError(f"run {registry.run_id!r} has no adapter versions yet")
        return latest.version
    digits = cleaned.removeprefix("v")
    if not digits.isdigit() or int(digits) < 1:
        raise UsageError(f"version {text!r} is not a number >= 1 (e.g. 3 or v000003) or 'latest'")
    return int(digits)


FIRST_METRICS = ("reward_mean", "episode_return_mean", "loss")  # what a reader of the list looks for first


def _short_metrics(metrics: dict[str, float], limit: int = 3) -> str:
    ordered = sorted(metrics.items(), key=lambda item: (item[0] not in FIRST_METRICS,
                                                        FIRST_METRICS.index(item[0]) if item[0] in FIRST_METRICS
                                                        else 0, item[0]))
    shown = [f"{name}={value:.4g}" for name, value in ordered[:limit]]
    return ", ".join(shown) + (" ..." if len(metrics) > limit else "")


def _versions_table(run: str, manifests: list[AdapterManifest], retired: set[int]) -> tuple[Table, list[str]]:
    """The versions, every cell whole (a retired version's bytes: ``retired``); on a narrow terminal without the
    metrics, then the base model."""
    rows = [{"version": str(m.version), "step": str(m.learner_step), "parent": str(m.parent_version),
             "files": str(len(m.files)),
             "bytes": "retired" if m.version in retired else str(sum(f.size for f in m.files.values())),
             "created (UTC)": m.created_at.strftime("%Y-%m-%d %H:%M:%S"), "base model": shown_model(m.base_model),
             "metrics": _short_metrics(m.metrics)} for m in manifests]
    return fitted_table(f"adapters of run {run}", rows, ["metrics", "base model"],
                        right=("version", "step", "parent", "files", "bytes"))


def _manifest_table(manifest: AdapterManifest, digest: str) -> Table:
    table = Table(title=f"run {manifest.run_id}, adapter {version_folder(manifest.version)}", show_header=False)
    table.add_column("field", no_wrap=True)
    table.add_column("value", overflow="fold")
    rows = {
        "version": manifest.version,
        "adapter_sha256": digest,
        "base model": manifest.base_model,
        "parent version": manifest.parent_version,
        "learner step": manifest.learner_step,
        "created (UTC)": manifest.created_at.isoformat(),
        "schema version": manifest.schema_version,
        **{f"metric {name}": f"{value:.6g}" for name, value in sorted(manifest.metrics.items())},
    }
    for field, value in rows.items():
        table.add_row(field, str(value))
    return table


def _files_table(manifest: AdapterManifest) -> Table:
    table = Table(title="files")
    table.add_column("name")
    table.add_column("bytes", justify="right")
    table.add_column("sha256", overflow="fold")
    for name, entry in sorted(manifest.files.items()):
        table.add_row(name, str(entry.size), entry.sha256)
    return table
