"""Sampling sessions of the Tinker-compatible API: what a ``SamplingClient`` samples from.

A sampling session is ``<session>:sample:<n>`` (``n`` is the SDK's
``sampling_session_seq_id``) and its record, written create-only, says which
weights it serves:

  sessions/<session>/samplers/<n>.json   {"sampling_session_id", "tenant", "base_model",
                                          "model_path", "run", "version"}

``run``/``version`` name the adapter registry version the trainer published for
a ``tinker://<model_id>/sampler_weights/<name>`` path (or for the ephemeral
``save_weights_and_get_sampling_client``); both are None for the base model.
A session sampling a path is noted under ``VERSION_USERS`` before its record, so
the version is not retired while the session lives after the name is deleted
(``pipeline.api.lifecycle.sweep_unnamed_versions``).

``save_weights_and_get_sampling_client(kind="inflight")`` makes a session with
``"kind": "inflight"``: it samples the weights of its training client's latest
inflight save, never older than its own (``version``).  The trainer points at
that save in ``runs/<run>/inflight.json`` (``{"version"}``, replaced, only ever
forward; written before the new session's record), and the sampler reads it at
most every ``INFLIGHT_CHECK_S`` (``producers.api_sampler``).
The gateway writes records for ``create_sampling_session``, the trainer for the
ephemeral path; the sampler reads them.

A ``sample`` call on a session is stored create-only before it is announced
(``store_sample_call``), as every accepted call is (``pipeline.api.gateway``).
"""

from __future__ import annotations

import json
import math
from typing import Any

from tinker import types

from pipeline.api.sample_queue import SampleQueue
from pipeline.api.wire import INT32_MAX, request_id_for, session_of_request
from pipeline.io.store import ObjectStore
from schemas.api import (
    MAX_TOPK_LOGPROBS,
    MAX_TOPK_SAMPLE_CELLS,
    ApiError,
    ApiRequestAccepted,
    model_id_for,
    model_run_name,
    request_body_path,
    session_path,
)
from schemas.names import InvalidNameError, echoed
from schemas.trajectory import MIN_SAMPLING_TEMPERATURE

SAMPLE_KIND = "sample"
MAX_SAMPLES_PER_CALL = 1024  # num_samples of one sample call: the gateway makes a sequence id for each
MAX_TOKEN_ID = INT32_MAX  # token ids are int32 on the SDK's wire (its protobuf's tokens); vLLM's engine takes 64 bits
# stop strings of one call: the sampler searches every sample's text for each, on the event loop all calls share
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
VERSION_USERS = "api/version-users"  # <run>/<version>/<session>: sessions sampling named sampler weights


def sampler_record_key(sampling_session_id: str) -> str:
    """Store key of one sampling session's record."""
    try:
        session, kind, seq = model_run_name(sampling_session_id).split(".")
    except InvalidNameError:
        kind = ""
    if kind != SAMPLE_KIND:
        raise ApiError(f"{echoed(sampling_session_id)} is not a sampling session id; use the id "
                       "create_sampling_session returned")
    return f"{session_path(session)}/samplers/{seq}.json"


def write_sampler(store: ObjectStore, tenant: str, session_id: str, seq: int, base_model: str,
                  model_path: str | None, run: str | None, version: int | None, inflight: bool = False) -> str:
    """Record a sampling session (create-only; a resent create with the same weights is the same session)."""
    sampling_session_id = model_id_for(session_id, "sample", seq)
    record: dict[str, Any] = {"sampling_session_id": sampling_session_id, "tenant": tenant, "base_model": base_model,
                              "model_path": model_path, "run": run, "version": version}
    if inflight:
        record["kind"] = "inflight"
    key = sampler_record_key(sampling_session_id)
    if model_path is not None and run is not None and version is not None:  # before the record: sweeps see it
        store.put(f"{VERSION_USERS}/{run}/{int(version)}/{session_id}", b"")
    try:
        store.put_create(key, json.dumps(record).encode())
    except FileExistsError:
        existing = json.loads(store.get(key))
        if {k: existing.get(k) for k in record} != record:
            raise ApiError(f"sampling session {sampling_session_id} already exists with other weights; "
                           "use a new sampling_session_seq_id") from None
    return sampling_session_id


def find_sampler(store: ObjectStore, session_id: str, seq: int) -> dict[str, Any] | None:
    """The record of sampling session ``seq`` of ``session_id`` if one was written (no tenant check)."""
    try:
        return dict(json.loads(store.get(sampler_record_key(model_id_for(session_id, "sample", seq)))))
    except FileNotFoundError:
        return None


def read_sampler(store: ObjectStore, tenant: str, sampling_session_id: str) -> dict[str, Any]:
    """The record of one of this tenant's sampling sessions (another tenant's is not found)."""
    try:
        record = json.loads(store.get(sampler_record_key(sampling_session_id)))
    except FileNotFoundError:
        record = None
    if record is None or record["tenant"] != tenant:
        raise ApiError(f"no sampling session {echoed(sampling_session_id)} for this API key; "
                       "create one with create_sampling_client")
    return dict(record)


def inflight_key(run: str) -> str:
    return f"runs/{run}/inflight.json"


def point_inflight(store: ObjectStore, run: str, version: int) -> None:
    """Make ``version`` the weights of the training client's inflight sampling sessions (the trainer, in call
    order); a pointer already at a newer save stays (a replayed or raced older save never moves it back)."""
    current = inflight_version(store, run)
    if current is None or version > current:
        store.put(inflight_key(run), json.dumps({"version": version}).encode())


def inflight_version(store: ObjectStore, run: str) -> int | None:
    """The training client's latest inflight save, or None before its first."""
    try:
        latest = json.loads(store.get(inflight_key(run)))["version"]
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        return None
    return latest if isinstance(latest, int) and not isinstance(latest, bool) else None


def sampled_version(record: dict[str, Any], latest_inflight: int | None) -> int:
    """The registry version a sampling session on adapter weights samples now: its own, or for an inflight session
    its training client's latest inflight save (``inflight_version``) when that is newer."""
    version = int(record["version"])
    if record.get("kind") == "inflight" and latest_inflight is not None and latest_inflight > version:
        return latest_inflight
    return version


def check_topk_sample_cells(request: types.SampleRequest, max_tokens: int) -> None:
    """Refuse sampled tokens' top-k rows that would make one call's answer larger than ``MAX_TOPK_SAMPLE_CELLS``."""
    k = request.topk_sample_logprobs
    cells = request.num_samples * max_tokens * k
    if cells > MAX_TOPK_SAMPLE_CELLS:
        raise ApiError(f"topk_sample_logprobs={k} for {request.num_samples} samples of up to {max_tokens} tokens is "
                       f"{cells:,} rows' entries, over the {MAX_TOPK_SAMPLE_CELLS:,} one call may answer; ask for "
                       "fewer samples, a smaller max_tokens or a smaller k per call")


def check_sample_request(request: types.SampleRequest) -> None:
    """Refuse a ``sample`` call rlpipe cannot serve as asked (``ApiError`` naming the field and the fix); the gateway
    answers it 400 at submit, and the sampler checks again what it reads from the log.  What needs the engine (the
    prompt's length against its context) is the sampler's to check."""
    given = request.sampling_params
    if not 1 <= request.num_samples <= MAX_SAMPLES_PER_CALL:
        raise ApiError(f"num_samples={request.num_samples}: ask for 1 to {MAX_SAMPLES_PER_CALL} samples a call "
                       "(send more calls for more)")
    for chunk in request.prompt.chunks:
        if not isinstance(chunk, types.EncodedTextChunk):
            kind = getattr(chunk, "type", type(chunk).__name__)
            raise ApiError(f"prompt chunk of kind {echoed(kind)} is not supported; send token chunks")
    if request.prompt.length < 1:
        raise ApiError("prompt is empty; send at least one token (render the prompt with the model's chat template)")
    tokens = request.prompt.to_ints()
    low, high = min(tokens), max(tokens)
    if low < 0 or high > MAX_TOKEN_ID:  # an id past one model's vocabulary is its sampler's to refuse (it knows it)
        raise ApiError(f"prompt holds {echoed(low if low < 0 else high)}, which is no token id; send ids from 0 to "
                       f"the vocabulary's size - 1 (encode the prompt with the model's tokenizer)")
    if request.prompt_alt_tokens_k or request.target_prompt_logprobs is not None:
        raise ApiError("prompt_alt_tokens and target_prompt_logprobs are not served; ask for prompt_logprobs, "
                       "sampled-token logprobs and top-k logprobs only")
    for field in ("topk_prompt_logprobs", "topk_sample_logprobs"):
        k = getattr(request, field)
        if not 0 <= k <= MAX_TOPK_LOGPROBS:
            raise ApiError(f"{field}={echoed(k)}: ask for 0 to {MAX_TOPK_LOGPROBS} most likely tokens a position "
                           f"(MAX_TOPK_LOGPROBS, which bounds one call's answer)")
    if given.max_tokens is not None:
        check_topk_sample_cells(request, given.max_tokens)
    if request.record_stability_info:
        raise ApiError("record_stability_info (StableReinforce) is not served; leave it unset and train with "
                       "another loss (e.g. importance_sampling)")
    last_n = request.prompt_logprobs_last_n
    if last_n is not None and not (request.prompt_logprobs and 1 <= last_n <= request.prompt.length - 1):
        raise ApiError(f"prompt_logprobs_last_n={last_n}: it needs prompt_logprobs=True and a value from 1 to the "
                       f"prompt's length - 1 ({request.prompt.length - 1})")
    if given.max_tokens is not None and given.max_tokens < 1:
        raise ApiError(f"sampling_params.max_tokens={given.max_tokens}: ask for at least 1 token, or leave it "
                       "unset for up to the context length")
    if not -1 <= given.top_k <= MAX_TOKEN_ID:
        raise ApiError(f"sampling_params.top_k={echoed(given.top_k)}: use -1 (no cut) or a number of tokens from 1 to "
                       f"{MAX_TOKEN_ID}")
    stop = [] if given.stop is None else [given.stop] if isinstance(given.stop, str) else list(given.stop)
    strings = [item for item in stop if isinstance(item, str)]
    if len(strings) > MAX_STOP_STRINGS or any(len(item) > MAX_STOP_CHARS for item in strings):
        raise ApiError(f"sampling_params.stop holds {len(strings)} strings of up to "
                       f"{max(len(item) for item in strings)} characters; send at most {MAX_STOP_STRINGS} of at most "
                       f"{MAX_STOP_CHARS} characters each")
    bad = next((item for item in stop if isinstance(item, int) and not 0 <= item <= MAX_TOKEN_ID), None)
    if bad is not None:
        raise ApiError(f"sampling_params.stop holds {echoed(bad)}, which is no token id; send ids from 0 to "
                       f"{MAX_TOKEN_ID} (the model's tokenizer's), or stop strings")
    if not (math.isfinite(given.temperature) and given.temperature >= 0):
        raise ApiError(f"sampling_params.temperature={given.temperature}: use 0 (greedy) or a positive number")
    if 0 < given.temperature < MIN_SAMPLING_TEMPERATURE:
        # vLLM samples at MIN_SAMPLING_TEMPERATURE below it: samples and logprobs of another temperature than asked
        raise ApiError(f"sampling_params.temperature={given.temperature:g}: use 0 (greedy) or at least "
                       f"{MIN_SAMPLING_TEMPERATURE:g}, the lowest temperature rlpipe's samplers sample at as asked")
    if not 0 < given.top_p <= 1:  # (False for NaN too)
        raise ApiError(f"sampling_params.top_p={given.top_p}: use a probability in (0, 1] (1 = no cut)")


def check_prompt_fits(base_model: str, context: int | None, prompt_tokens: int) -> None:
    """``ApiError`` when a prompt of ``prompt_tokens`` leaves no room to sample one token in the ``context`` the base
    model is served with (None: not known here, the sampler checks)."""
    if context is not None and prompt_tokens >= context:
        raise ApiError(f"prompt of {prompt_tokens} tokens leaves no room to sample: {base_model} is served with a "
                       f"context of {context} tokens (max_context_length in get_server_capabilities); shorten it")


def store_sample_call(store: ObjectStore, samples: SampleQueue, tenant: str, sampling_session_id: str,
                      seq_id: int | None, base_model: str, body: bytes) -> ApiRequestAccepted:
    """A checked ``sample`` call's place in ``samples`` and its body, stored create-only; its event, not yet on the
    log.  ``BusyError`` when the queue has no place for it; ``ApiError`` when its ``seq_id`` was used for another
    body (the place it took is free again; a resent call keeps its first's)."""
    # numbered seq_id + 1 (a request id numbered 0 is a creation's): the largest is 2**31, past int32, which is
    # fine, since this number stays in rlpipe's request ids and events and never goes back to the SDK
    request_id = request_id_for(sampling_session_id, (seq_id or 0) + 1)
    taken = samples.take(base_model, request_id, tenant)  # (its place, before it is stored)
    session_id = session_of_request(request_id)
    key = request_body_path(session_id, request_id, "json")
    try:
        digest = store.put_create_once(key, body)
    except Exception as exc:
        if taken:
            samples.answered(request_id)
        if isinstance(exc, FileExistsError):
            raise ApiError(f"seq_id {seq_id} of sampling session {sampling_session_id} was already used for "
                           "another call; each call takes the next seq_id") from None
        raise
    return ApiRequestAccepted(request_id=request_id, tenant=tenant, session_id=session_id, op="sample",
                              model_id=sampling_session_id, seq_id=(seq_id or 0) + 1, base_model=base_model,
                              body_path=key, body_format="json", body_sha256=digest)
