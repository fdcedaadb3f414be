"""The adapter registry: dense, immutable LoRA adapter versions per run, committed by a manifest.

A version is of one artifact kind (``schemas.registry.ArtifactKind``): a LoRA
adapter folder (``publish``) or a value network's weights (``publish_files`` with
``kind="value-network"``: ``value_network.safetensors`` + ``value_config.json``).
Every rule below holds for every kind; ``pull(..., kind=...)`` refuses a version of
another kind, so a producer never loads a Q-network into vLLM or the reverse.

Learner -> ``publish`` -> store -> ``AdapterPublished`` (sent by the caller) ->
producers -> ``pull`` into a local cache -> vLLM.

Layout of one version::

    runs/<run_id>/adapters/v000007/<attempt>/adapter_config.json
    runs/<run_id>/adapters/v000007/<attempt>/adapter_model.safetensors
    runs/<run_id>/adapters/v000007/manifest.json      written LAST, create-only: the commit point

Racing publishers.  A publisher picks the next version (one above the highest
committed manifest), uploads its files under a staging folder unique to this
attempt (``<attempt>`` is a fresh uuid), and then creates ``manifest.json``
create-only.  Exactly one manifest create per version succeeds; the loser deletes
its staging folder (best effort) and tries again one version higher.  A create
conflict counts as lost only after the stored manifest was read back and differs
from ours: a retried GCS create whose first attempt landed reports a conflict for
our own manifest, and deleting the staging folder then would break a committed
version.  Because
every attempt writes only below its own folder, a loser can never overwrite or mix
into the winner's files, and the manifest names the winner's relative paths.  A
publisher that crashes before its manifest leaves an orphan folder that no
manifest names: readers never see it, and the version number stays free for the
next publisher, so versions stay dense (1, 2, 3, ... with no holes).
Why not create-only data files at fixed names: a crashed publisher's leftovers
would then block that version number forever and leave a hole.

Identity.  ``adapter_sha256(version)`` is the sha256 of the stored manifest bytes.
The manifest lists every file's sha256, so this one digest pins the whole adapter
(and its lineage); producers record it in every trajectory row they sample.

Retiring.  ``retire(version, reason)`` deletes a version's files and keeps its
manifest, beside a ``retired.json`` that says why (written first): the number stays
taken, so versions stay dense and a number never names other weights, and a pull
of it is refused with the reason.  The API retires the snapshots of a session
that ended (``pipeline.api.lifecycle``).

Pulls go to ``<cache_dir>/<run_id>/v000007/`` (a flat PEFT folder plus the
manifest).  Every file is verified against the manifest while downloading into a
temporary sibling folder, which is renamed into place only when complete, so a
tampered object leaves no folder behind.  A cached folder is reused when its
manifest matches the store's byte for byte and every file re-hashes correctly.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path

from pipeline.io.store import ObjectStore, sha256_hex
from schemas.events import AdapterPublished
from schemas.names import validate_name
from schemas.registry import REQUIRED_FILES as REQUIRED_FILES_BY_KIND
from schemas.registry import (
    AdapterFile,
    AdapterManifest,
    ArtifactKind,
    ManifestError,
    check_relative_path,
    manifest_from_bytes,
    manifest_to_bytes,
)

MANIFEST_NAME = "manifest.json"
RETIRED_NAME = "retired.json"
REQUIRED_FILES = REQUIRED_FILES_BY_KIND["lora"]
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
_VERSION_RE = re.compile(r"v(\d{6,})")


class RegistryError(RuntimeError):
    """The registry could not do what was asked (a lost race beyond the retry budget, a bad folder)."""


class AdapterNotFoundError(LookupError):
    """No committed adapter version of that number in the run."""


class RetiredAdapterError(AdapterNotFoundError):
    """The version was committed, then retired: its files were deleted (``retire``), for the reason given."""


def version_folder(version: int) -> str:
    """``7`` -> ``"v000007"`` (six digits, wider past 999999; sorted numerically by the registry)."""
    if version < 1:
        raise ValueError(f"adapter versions start at 1, got {version}")
    return f"v{version:06d}"


def run_ids(store: ObjectStore) -> list[str]:
    """Runs that have a folder in ``store`` (for messages such as 'unknown run; runs here: ...')."""
    return [key.rsplit("/", 1)[-1] for key in store.list("runs")]


class AdapterRegistry:
    """Publish, list and pull adapter versions of one run."""

    def __init__(self, store: ObjectStore, run_id: str, max_publish_attempts: int = 100) -> None:
        if max_publish_attempts < 1:
            raise ValueError(f"max_publish_attempts must be at least 1, got {max_publish_attempts}")
        self.store = store
        self.run_id = validate_name(run_id, "run_id")
        self.prefix = f"runs/{self.run_id}/adapters"
        self.max_publish_attempts = max_publish_attempts

    def version_key(self, version: int) -> str:
        """Folder key of ``version``."""
        return f"{self.prefix}/{version_folder(version)}"

    def run_exists(self) -> bool:
        """True if the run has anything in the store."""
        return self.store.exists(f"runs/{self.run_id}")

    # -- reading -----------------------------------------------------------------------------

    def versions(self) -> list[int]:
        """Committed versions (those with a manifest), ascending; one recursive listing."""
        pattern = re.compile(rf"{re.escape(self.prefix)}/v(\d{{6,}})/{re.escape(MANIFEST_NAME)}")
        found = (pattern.fullmatch(key) for key in self.store.list(self.prefix, recursive=True))
        return sorted(int(match.group(1)) for match in found if match)

    def newest_from(self, known: int) -> int:
        """The newest committed version, found from ``known`` (a committed version, or 0 for none known) by
        probing the numbers above it: versions are dense, so one look when nothing is new.  Only with nothing known
        is every version listed (a listing grows with the run; a reader polling for new versions pays it once)."""
        if known < 1:
            versions = self.versions()
            return versions[-1] if versions else 0
        newest = known
        while self.store.exists(self._manifest_key(newest + 1)):
            newest += 1
        return newest

    def list(self) -> list[AdapterManifest]:
        """Manifests of every committed version, ascending."""
        return [self.show(version) for version in self.versions()]

    def show(self, version: int) -> AdapterManifest:
        """The manifest of ``version`` (``AdapterNotFoundError`` if it is not committed)."""
        where = self.store.url(self._manifest_key(version))
        manifest = manifest_from_bytes(self.manifest_bytes(version), where=where)
        if (manifest.run_id, manifest.version) != (self.run_id, version):
            raise ManifestError(
                f"{where} claims run {manifest.run_id!r} version {manifest.version}; it was copied or tampered with"
            )
        return manifest

    def latest(self) -> AdapterManifest | None:
        """The newest committed version's manifest, or None before the first publish."""
        versions = self.versions()
        return self.show(versions[-1]) if versions else None

    def manifest_bytes(self, version: int) -> bytes:
        """The stored manifest, byte for byte."""
        try:
            return self.store.get(self._manifest_key(version))
        except FileNotFoundError:
            raise AdapterNotFoundError(
                f"run {self.run_id!r} has no adapter version {version}; see `rlpipe adapters list --run {self.run_id}`"
            ) from None

    def adapter_sha256(self, version: int) -> str:
        """The digest identifying ``version``: sha256 of its stored manifest (which lists every file's digest)."""
        return sha256_hex(self.manifest_bytes(version))

    # -- publishing --------------------------------------------------------------------------

    def publish(
        self,
        folder: str | os.PathLike[str],
        base_model: str,
        parent_version: int,
        learner_step: int,
        metrics: Mapping[str, float] | None = None,
        ends_with_session: str | None = None,
    ) -> AdapterManifest:
        """Upload a PEFT adapter folder as the next version; return the committed manifest.

        Retries with the next number when another publisher commits the chosen one first.
        ``ends_with_session`` marks a snapshot of the API, retired when that session ends.
        """
        return self.publish_files(read_adapter_folder(folder), base_model, parent_version, learner_step, metrics,
                                  ends_with_session=ends_with_session)

    def publish_files(
        self,
        files: Mapping[str, bytes],
        base_model: str,
        parent_version: int,
        learner_step: int,
        metrics: Mapping[str, float] | None = None,
        kind: ArtifactKind = "lora",
        expected_version: int | None = None,
        ends_with_session: str | None = None,
    ) -> AdapterManifest:
        """Publish ``files`` (relative name -> bytes) as the next version of ``kind``; as ``publish`` otherwise.

        ``base_model`` names what the artifact applies to (a value network: its agent and environment).
        ``expected_version``: the number a publisher that counts its own versions expects to take; it is
        tried first when the version below it is committed (one probe instead of listing every version,
        which grows with the run), and a lost race or a wrong guess falls back to the listing.
        """
        files = check_artifact_files(dict(files), kind)
        lost = 0
        for attempt in range(self.max_publish_attempts):
            if (attempt == 0 and expected_version is not None and expected_version > parent_version
                    and self._follows_a_committed(expected_version)):
                version = expected_version  # another publisher holding it is caught by the create-only manifest
            else:
                version = max(self._next_version(), lost + 1)
            manifest = self._try_publish(
                version, files, base_model, parent_version, learner_step, dict(metrics or {}), kind, ends_with_session
            )
            if manifest is not None:
                return manifest
            lost = version
        raise RegistryError(
            f"could not publish to run {self.run_id!r}: lost the race for a version {self.max_publish_attempts} "
            "times; too many concurrent publishers, raise max_publish_attempts"
        )

    def published_event(self, manifest: AdapterManifest) -> AdapterPublished:
        """The ``AdapterPublished`` payload for a committed manifest (the caller sends it on ``<ns>.adapters``).

        ``manifest_sha256`` is ``adapter_sha256(version)``, the digest of the stored bytes (one small read), not of
        ``manifest`` encoded again: a manifest another rlpipe version wrote (a field this one ignores, a default it
        fills) encodes to other bytes, and its announcement's ``event_id`` (``schemas.events.announcement_id``)
        must be the same whichever version sends it (``consumers.reannounce``).
        """
        return AdapterPublished(
            version=manifest.version,
            path=self.version_key(manifest.version),
            manifest_sha256=self.adapter_sha256(manifest.version),
            base_model=manifest.base_model,
            parent_version=manifest.parent_version,
            learner_step=manifest.learner_step,
            files={name: entry.sha256 for name, entry in manifest.files.items()},
        )

    def next_version(self) -> int:
        """The number the next ``publish`` takes, unless another publisher commits it first."""
        return self._next_version()

    def _follows_a_committed(self, version: int) -> bool:
        """``version`` is 1 or the one above a committed version: taking it leaves no gap."""
        return version == 1 or (version > 1 and self.store.exists(self._manifest_key(version - 1)))

    def _next_version(self) -> int:
        """One above the highest committed version; checks folders from the top, so usually one listing + one probe."""
        folders = (key.rsplit("/", 1)[-1] for key in self.store.list(self.prefix))
        numbers = sorted((int(m.group(1)) for m in map(_VERSION_RE.fullmatch, folders) if m), reverse=True)
        for number in numbers:
            if self.store.exists(self._manifest_key(number)):
                return number + 1
        return 1

    def _try_publish(
        self,
        version: int,
        files: dict[str, bytes],
        base_model: str,
        parent_version: int,
        learner_step: int,
        metrics: dict[str, float],
        kind: ArtifactKind = "lora",
        ends_with_session: str | None = None,
    ) -> AdapterManifest | None:
        """Stage the files, then try to commit the manifest; None if another publisher got ``version``."""
        attempt = uuid.uuid4().hex
        stage_key = f"{self.version_key(version)}/{attempt}"
        # Built (and validated) before any upload, so a bad argument leaves nothing behind.
        manifest = AdapterManifest(
            run_id=self.run_id,
            kind=kind,
            version=version,
            base_model=base_model,
            parent_version=parent_version,
            learner_step=learner_step,
            files={
                name: AdapterFile(path=f"{attempt}/{name}", sha256=sha256_hex(data), size=len(data))
                for name, data in files.items()
            },
            metrics=metrics,
            ends_with_session=ends_with_session,
            created_at=datetime.now(UTC),
        )
        self.store.put_create_many({f"{stage_key}/{name}": data for name, data in files.items()})
        try:
            # A conflict is only a lost race if the stored manifest is not ours byte for byte: a retried
            # create whose first attempt landed also reports one, and then the version is committed.
            self.store.put_create_once(self._manifest_key(version), manifest_to_bytes(manifest))
        except FileExistsError:
            with contextlib.suppress(OSError):  # orphans are harmless: no manifest names them
                self.store.delete(stage_key, recursive=True, missing_ok=True)
            return None
        return manifest

    def _manifest_key(self, version: int) -> str:
        return f"{self.version_key(version)}/{MANIFEST_NAME}"

    # -- retiring ----------------------------------------------------------------------------

    def retire(self, version: int, reason: str) -> bool:
        """Delete the files of committed ``version``, keeping its manifest and, first, why (module docstring);
        whether there was anything to delete (a retire cut short is finished by retiring again)."""
        self.manifest_bytes(version)  # AdapterNotFoundError for a version never committed
        folder = self.version_key(version)
        kept = {f"{folder}/{MANIFEST_NAME}", f"{folder}/{RETIRED_NAME}"}
        files = [key for key in self.store.list(folder) if key not in kept]
        if not files:
            return False
        if self.retired_reason(version) is None:
            self.store.put(f"{folder}/{RETIRED_NAME}", json.dumps({"reason": reason, "time": time.time()}).encode())
        for key in files:
            self.store.delete(key, recursive=True, missing_ok=True)
        return True

    def versions_with_files(self) -> list[int]:
        """Committed versions whose folder holds anything besides its manifest and ``retired.json`` (not retired,
        or a retire cut short), ascending; one recursive listing."""
        pattern = re.compile(rf"{re.escape(self.prefix)}/v(\d{{6,}})/(.+)")
        committed, with_files = set(), set()
        for key in self.store.list(self.prefix, recursive=True):
            match = pattern.fullmatch(key)
            if match is None:
                continue
            version, rest = int(match.group(1)), match.group(2)
            if rest == MANIFEST_NAME:
                committed.add(version)
            elif rest != RETIRED_NAME:
                with_files.add(version)
        return sorted(committed & with_files)

    def retired_reason(self, version: int) -> str | None:
        """Why ``version`` was retired, or None if it was not."""
        try:
            return str(json.loads(self.store.get(f"{self.version_key(version)}/{RETIRED_NAME}"))["reason"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            return None

    # -- pulling -----------------------------------------------------------------------------

    def pull(self, version: int, cache_dir: str | os.PathLike[str], kind: ArtifactKind | None = None) -> Path:
        """A verified local folder of ``version`` under ``cache_dir`` (reused if already there and intact).

        With ``kind``, a version of another kind is refused before anything is downloaded, and so is a version
        whose manifest breaks the rules ``publish`` keeps (a pickled file, a required file missing): peft and vLLM
        fall back to ``torch.load`` on an ``adapter_model.bin`` where no safetensors file is.
        """
        raw = self.manifest_bytes(version)
        manifest = self.show(version)
        if kind is not None and manifest.kind != kind:
            raise RegistryError(
                f"run {self.run_id!r} version {version} is a {manifest.kind}, not a {kind}; "
                "point this reader at a run that publishes that kind"
            )
        try:  # a manifest written past publish (by hand, another tool) is held to publish's rules
            check_artifact_files(dict.fromkeys(manifest.files, b""), manifest.kind)
        except RegistryError as exc:
            raise RegistryError(f"run {self.run_id!r} version {version} was not pulled: {exc}") from None
        target = Path(cache_dir) / self.run_id / version_folder(version)
        if target.exists():
            if cached_folder_matches(target, raw, manifest):
                return target
            shutil.rmtree(target)  # stale or tampered: fetch again
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.parent / f".{target.name}.partial-{uuid.uuid4().hex}"
        try:
            self._download(manifest, staging)
            (staging / MANIFEST_NAME).write_bytes(raw)
            _move_into_place(staging, target, raw, manifest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return target

    def _download(self, manifest: AdapterManifest, folder: Path) -> None:
        for name, entry in manifest.files.items():
            try:
                data = self.store.get(f"{self.version_key(manifest.version)}/{entry.path}", entry.sha256)
            except FileNotFoundError:
                reason = self.retired_reason(manifest.version)
                if reason is None:
                    raise
                raise RetiredAdapterError(f"run {self.run_id!r} version {manifest.version} was deleted: {reason}"
                                          ) from None
            destination = folder / name
            destination.parent.mkdir(parents=True, exist_ok=True)
            destination.write_bytes(data)


def read_adapter_folder(folder: str | os.PathLike[str]) -> dict[str, bytes]:
    """Every file of a PEFT adapter folder (relative name -> bytes); refuses missing or pickled files."""
    root = Path(folder)
    if not root.is_dir():
        raise RegistryError(f"adapter folder {root} does not exist; save the adapter there first (save_pretrained)")
    names = sorted(path.relative_to(root).as_posix() for path in root.rglob("*") if path.is_file())
    for required in REQUIRED_FILES:
        if required not in names:
            raise RegistryError(f"adapter folder {root} lacks {required}; save it with save_pretrained(...)")
    for name in names:
        if name.endswith(PICKLED_SUFFIXES):
            raise RegistryError(f"refusing pickled file {name} in {root}; save the adapter as safetensors only")
        _check_not_the_manifest(name)
        check_relative_path(name, "adapter file name")
    return {name: (root / name).read_bytes() for name in names}


def check_artifact_files(files: dict[str, bytes], kind: str) -> dict[str, bytes]:
    """``files`` if they make a valid artifact of ``kind``: its required files present, nothing pickled, safe names."""
    if kind not in REQUIRED_FILES_BY_KIND:
        raise RegistryError(f"unknown artifact kind {kind!r}; use one of {', '.join(REQUIRED_FILES_BY_KIND)}")
    for name in files:
        if name.endswith(PICKLED_SUFFIXES):
            raise RegistryError(f"refusing pickled file {name}; save tensors as safetensors only")
        _check_not_the_manifest(name)
        check_relative_path(name, "artifact file name")
    for required in REQUIRED_FILES_BY_KIND[kind]:
        if required not in files:
            raise RegistryError(f"{kind} artifact lacks {required}; write it before publishing")
    return files


def _check_not_the_manifest(name: str) -> None:
    """A pull writes the version's manifest beside its files as ``manifest.json``: a file of that name would be
    replaced by it."""
    if name == MANIFEST_NAME:
        raise RegistryError(f"an artifact file may not be named {MANIFEST_NAME}: a pulled version keeps its "
                            "registry manifest under that name; rename it")


def cached_folder_matches(folder: Path, manifest_raw: bytes, manifest: AdapterManifest) -> bool:
    """True if ``folder`` holds exactly the manifest's files with the right digests, and the same manifest."""
    try:
        if (folder / MANIFEST_NAME).read_bytes() != manifest_raw:
            return False
        present = {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}
        if present != {*manifest.files, MANIFEST_NAME}:
            return False
        return all(
            (folder / name).stat().st_size == entry.size and sha256_hex((folder / name).read_bytes()) == entry.sha256
            for name, entry in manifest.files.items()
        )
    except OSError:
        return False


def _move_into_place(staging: Path, target: Path, raw: bytes, manifest: AdapterManifest) -> None:
    """Rename the complete folder to its final name; if a concurrent pull got there first, keep theirs."""
    try:
        os.rename(staging, target)
    except OSError:
        if not cached_folder_matches(target, raw, manifest):
            raise
