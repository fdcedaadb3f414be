"""The trainer's calls that write or read saved weights: ``save_weights`` (``save_state``), ``save_weights_external``,
``save_weights_for_sampler`` and ``load_weights``.

Each takes the store and the training engine, the call as logged and its parsed request, and returns the JSON
result's bytes; a refusal raises ``ApiError`` with the fix in its message.  A save writes its bytes under the
name first and its record (naming the call that wrote it) last, so a trainer killed between the two and
re-executing the call replaces its own half-done save, and a name another call recorded is refused unless
``overwrite``.  ``save_weights_for_sampler`` re-executed after such a kill reuses the registry version its first
run published.  ``consumers.api.worker`` decides when each runs.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from tinker import types

from consumers.api import ops
from consumers.engine import TrainingEngine
from pipeline.api import checkpoints, lifecycle
from pipeline.api.checkpoints import weights_key
from pipeline.api.samplers import find_sampler, point_inflight, write_sampler
from pipeline.api.wire import TinkerPath, training_state_path
from pipeline.io.registry import AdapterRegistry
from pipeline.io.store import ChecksumError, ObjectStore
from schemas.api import ApiError, ApiRequestAccepted, model_run_name, result_path, session_path
from schemas.registry import AdapterManifest


def check_tenant(store: ObjectStore, tenant: str, session_id: str) -> None:
    """Refuse a session (or a path in one) that is not the caller's."""
    try:
        owner = json.loads(store.get(f"{session_path(session_id)}/session.json"))["tenant"]
    except FileNotFoundError:
        owner = None
    if owner != tenant:
        raise ApiError(f"no session {session_id!r} for this API key; use your own session's models and paths")


def save_weights(store: ObjectStore, engine: TrainingEngine, model_id: str, call: ApiRequestAccepted,
                 request: types.SaveWeightsRequest) -> bytes:
    """The state under its name, then its record (naming this call; ``ttl_seconds`` sets when it expires)."""
    path = TinkerPath(model_id, "training", request.path or "")
    _claim_name(store, path, call, request.overwrite)
    state = ops.save_state(engine, model_id, True)
    sha256 = store.put(weights_key(path), state)
    checkpoints.write_record(store, path, len(state), checkpoints.expiry(request.ttl_seconds),
                             request_id=call.request_id, base_model=call.base_model, sha256=sha256)
    return _json({"type": "save_weights", "path": str(path)})


def save_external(store: ObjectStore, engine: TrainingEngine, model_id: str, call: ApiRequestAccepted,
                  request: types.SaveWeightsExternalRequest) -> bytes:
    """The adapter as a PEFT folder (what peft and vLLM load) under its name, for download by signed URLs."""
    path = TinkerPath(model_id, "external", request.path)
    _claim_name(store, path, call, overwrite=False)
    files = engine.adapter_snapshot(ops.adapter_name(model_id)).files()
    size = checkpoints.write_external(store, path, files, checkpoints.expiry(request.ttl_seconds),
                                      request_id=call.request_id)
    return _json({"type": "save_weights_external", "path": str(path), "size_bytes": size})


def _claim_name(store: ObjectStore, path: TinkerPath, call: ApiRequestAccepted, overwrite: bool) -> None:
    """Refuse a name another save recorded, unless ``overwrite``; this call's own earlier attempt (killed before
    its result) is replaced, since a replay need not write the same bytes."""
    record = checkpoints.read_record(store, path)
    owner = call.request_id if record is None else record.get("request_id")
    if owner != call.request_id and not overwrite:
        again = ", pass overwrite=True," if path.kind == "training" else ""
        raise ApiError(f"{path} already exists; save under another name{again} or delete it first "
                       "(delete_checkpoint)")


def save_for_sampler(store: ObjectStore, engine: TrainingEngine, base_model: str, model_id: str, learner_step: int,
                     call: ApiRequestAccepted, request: types.SaveWeightsForSamplerRequest) -> bytes:
    """Publish the adapter as a registry version; a named save records a ``sampler_weights`` checkpoint,
    an unnamed one (``save_weights_and_get_sampling_client``) a sampling session on that version.
    ``learner_step`` is the call's ``seq_id``, which the version records: a call run again after its trainer
    died between the publish and its answer finds its version and publishes no second one."""
    if request.path is None and request.sampling_session_seq_id is None:
        raise ApiError("save_weights_for_sampler needs a path or a sampling_session_seq_id; use the tinker SDK")
    run = model_run_name(model_id)
    path = TinkerPath(model_id, "sampler", request.path or "")
    if request.path is None:  # re-executed after a crash before its result was written: the same session
        known = find_sampler(store, call.session_id, int(request.sampling_session_seq_id or 0))
        if known is not None and known.get("run") == run:
            if known.get("kind") == "inflight":  # (killed before the pointer moved? it moves now)
                point_inflight(store, run, int(known["version"]))
            return _json({"type": "save_weights_for_sampler", "sampling_session_id": known["sampling_session_id"]})
    snapshot_of = call.session_id if request.path is None else None  # retired when the session ends
    registry = AdapterRegistry(store, run)
    manifest = _published_by_this_call(registry, learner_step, snapshot_of)
    if manifest is None:
        if snapshot_of is not None:  # indexed first, so the sweep after the session's end finds it
            lifecycle.mark_snapshots(store, model_id)
        with tempfile.TemporaryDirectory() as folder:
            ops.export_for_sampling(engine, model_id, Path(folder) / "adapter")
            manifest = registry.publish(Path(folder) / "adapter", base_model, parent_version=0,
                                        learner_step=learner_step, ends_with_session=snapshot_of)
    if request.path is None:
        inflight = request.kind == "inflight"
        if inflight:  # every inflight session of this client samples this save from now on
            point_inflight(store, run, manifest.version)
        sampling_session_id = write_sampler(store, call.tenant, call.session_id,
                                            int(request.sampling_session_seq_id or 0), base_model, None,
                                            run, manifest.version, inflight=inflight)
        return _json({"type": "save_weights_for_sampler", "sampling_session_id": sampling_session_id})
    size = sum(entry.size for entry in manifest.files.values())
    checkpoints.name_sampler_version(store, path, manifest.version, size, checkpoints.expiry(request.ttl_seconds))
    return _json({"type": "save_weights_for_sampler", "path": str(path)})


def _published_by_this_call(registry: AdapterRegistry, seq_id: int, snapshot_of: str | None
                            ) -> AdapterManifest | None:
    """The version an earlier run of this call published before its trainer died (before the name or sampling
    session that answers it was written), or None.  A training client's calls run one at a time in ``seq_id``
    order and each of its versions records the ``seq_id`` of the call that published it (``learner_step``), so
    only the client's newest version can be one, and it is when it records this call's ``seq_id``."""
    newest = registry.next_version() - 1
    if newest < 1:
        return None
    manifest = registry.show(newest)
    return manifest if (manifest.learner_step, manifest.ends_with_session) == (seq_id, snapshot_of) else None


def load_weights(store: ObjectStore, engine: TrainingEngine, model_id: str, call: ApiRequestAccepted,
                 request: types.LoadWeightsRequest, replaying: bool) -> bytes:
    """A saved training state into the model (its optimizer's too when asked), if it was trained on the model's base
    model; ``replaying``: this call loaded once before (a restart's replay), and only the very save it loaded then
    may be loaded again."""
    path = training_state_path(request.path)
    record = checkpoints.read_record(store, path, expired=replaying)
    source = None if record is None else {"request_id": record.get("request_id"), "time": record["time"]}
    first = stored_answer(store, call) if replaying else {}
    if "source" in first:
        if first["source"] != source:
            raise ApiError(f"{request.path} was saved again, deleted or expired since this training client "
                           "started from it, so its weights cannot be restored; start a new training client")
    elif record is None or not record.get("public"):  # (an answer without its source: checked as new)
        check_tenant(store, call.tenant, path.run.split(".")[0])  # a published state is anyone's to load
    try:
        if record is None:
            raise FileNotFoundError(request.path)
        state = store.get(weights_key(path), record.get("sha256"))  # a record from before digests checks nothing
    except FileNotFoundError:
        raise ApiError(f"no saved weights at {request.path} (never saved, deleted or expired); see "
                       "list_checkpoints") from None
    except ChecksumError:
        raise ApiError(f"the weights at {request.path} do not match the sha256 its save recorded: they are corrupt "
                       "or were replaced, so they were not loaded; save the state again, or load another checkpoint "
                       "(list_checkpoints)") from None
    checkpoints.check_base_model(request.path, checkpoints.saved_base_model(store, path, record), call.base_model)
    ops.load_state(engine, model_id, state, request.optimizer, source=request.path)
    return _json({"type": "load_weights", "model_id": model_id, "path": request.path, "source": source})


def stored_answer(store: ObjectStore, call: ApiRequestAccepted) -> dict[str, Any]:
    """The JSON result stored for a call ({} when there is none, or it is not JSON)."""
    try:
        answer = json.loads(store.get(result_path(call.session_id, call.request_id, "json")))
    except (FileNotFoundError, ValueError):
        return {}
    return answer if isinstance(answer, dict) else {}


def _json(value: Any) -> bytes:
    return json.dumps(value).encode()
