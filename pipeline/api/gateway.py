"""The gateway's logic, without HTTP: sessions, models, accepted calls and their results.

Handlers in ``pipeline.api.app`` only translate between HTTP and these methods.
What the gateway keeps is all in the store, so any number of gateways can serve
the same clients and a restarted one carries on:

  sessions/<session>/session.json        owner tenant, tags, creation time (create-only)
  sessions/<session>/heartbeat.json      last heartbeat (replaced)
  sessions/<session>/ended.json          why and when the session ended (create-only: the first end stands)
  sessions/<session>/models/<n>.json     a training client: base model, LoRA rank (create-only)
  sessions/<session>/requests/<id>.<fmt> an accepted call's body (create-only; the log's claim check)
  sessions/<session>/results/<id>.<fmt>  its result, written by an engine (create-only)
  sessions/<session>/samplers/<n>.json   a sampling session: base model or adapter version (create-only)

Every accepted mutating call is written first, then announced as
``ApiRequestAccepted`` on ``<ns>.requests`` keyed by ``model_id``.  Request ids
are derived from ``(model_id, seq_id)`` (``pipeline.api.wire``), so a resent call
gets the same id; it is announced again, which is harmless (engines are
idempotent) and covers a gateway that died between the write and the announce.

A tenant reaches a session only through its own key: every method takes the
tenant and checks it against the session's owner.

A session that ended (finished by its client, or expired after a day
without a heartbeat: ``pipeline.api.lifecycle``) takes no new calls: creating
training or sampling clients, training calls and samples answer 410.  What it
made stays readable: results of calls accepted before, checkpoints, downloads.
Each gateway looks at a live session's heartbeat record at most every
``live_check_s`` seconds, so a call can still be accepted that long after another
gateway recorded the end; nothing a session made is deleted sooner than ten minutes
after its end.
"""

from __future__ import annotations

import functools
import json
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from pipeline.api import checkpoints, downloads
from pipeline.api.clients import check_metadata
from pipeline.api.lifecycle import (
    SESSION_EXPIRY_S,
    files_deleted,
    heartbeat_key,
    mark_open,
    record_end,
    session_end,
)
from pipeline.api.liveness import SessionLiveness
from pipeline.api.quotas import TenantQuota
from pipeline.api.sample_queue import MAX_PENDING_SAMPLES, SampleQueue
from pipeline.api.samplers import check_prompt_fits, find_sampler, read_sampler, store_sample_call, write_sampler
from pipeline.api.tenants import TenantLimitError, TenantLimits
from pipeline.api.wire import (
    TinkerPath,
    check_seq,
    numbered_call,
    parse_tinker_path,
    request_id_for,
    session_of_request,
    training_state_path,
)
from pipeline.io.store import ObjectStore
from pipeline.timefmt import utc_text
from schemas.api import (
    ApiError,
    ApiOp,
    ApiRequestAccepted,
    BodyFormat,
    model_id_for,
    model_run_name,
    request_body_path,
    result_path,
    session_path,
)
from schemas.events import Envelope, make_event
from schemas.names import echoed

Publish = Callable[[Envelope, str], Any]  # (event, key) -> anything; publishes on <ns>.requests
LIVE_CHECK_S = 1.0  # how long a gateway takes a session it saw live as live, before reading its record again
CACHED_SESSIONS = 10_000  # sessions whose owner and state a gateway keeps in memory (the rest are read again)
CACHED_MODELS = 1_000  # training clients' records a gateway keeps in memory (each up to MAX_METADATA_BYTES)


class NotFoundError(ApiError):
    """A session, model or request this tenant does not have (HTTP 404 for synchronous calls)."""


class SessionEndedError(ApiError):
    """The session was finished or expired (HTTP 410 stops the SDK's heartbeat)."""


@dataclass(frozen=True)
class ServedModel:
    """A base model this deployment trains: the name clients pass, and a tokenizer they can load."""

    name: str
    tokenizer_id: str
    max_context_length: int | None = None


def now() -> str:
    return datetime.now(UTC).isoformat()


def _no_session(session_id: str) -> str:
    """The same answer for a session that does not exist and one of another key (which is not told apart)."""
    return f"no session {echoed(session_id)} for this API key; use one created with this key (ServiceClient())"


class Gateway:
    """Sessions, models and calls of every tenant, kept in ``store``; calls announced through ``publish``."""

    def __init__(self, store: ObjectStore, publish: Publish, models: list[ServedModel],
                 max_pending_samples: int = MAX_PENDING_SAMPLES, live_check_s: float = LIVE_CHECK_S,
                 session_expiry_s: float = SESSION_EXPIRY_S, cached_sessions: int = CACHED_SESSIONS,
                 cached_models: int = CACHED_MODELS, limits: TenantLimits | None = None) -> None:
        if not models:
            raise ValueError("a gateway needs at least one served base model")
        if cached_sessions < 1 or cached_models < 1:
            raise ValueError(f"cached_sessions={cached_sessions}, cached_models={cached_models}: cache at least one")
        self.store = store
        self.publish = publish
        self.models = {model.name: model for model in models}
        # what a gateway keeps of sessions and models, each bounded (least recently used dropped): all of it is
        # in the store, records are create-only and an end is final, so a dropped entry is only read again
        self._owner = functools.lru_cache(maxsize=cached_sessions)(self._read_owner)
        self._model_records = functools.lru_cache(maxsize=cached_models)(self._read_model_record)
        self.liveness = SessionLiveness(store, live_check_s, session_expiry_s, cached_sessions)
        self.samples = SampleQueue(store, max_pending_samples)  # sample calls without a result: backpressure
        self.limits = limits or TenantLimits()  # what each tenant holds (``quota``) and sends in one request
        self.quota = TenantQuota(store, self.limits,  # what each tenant holds
                                 lambda session: session_end(store, session, expiry_s=session_expiry_s) is not None)

    # ---- sessions ---------------------------------------------------------------------------
    def create_session(self, tenant: str, tags: list[str], user_metadata: dict[str, Any]) -> str:
        check_metadata("tags", tags)
        check_metadata("user_metadata", user_metadata)
        with self.quota.creating(tenant):
            self.quota.admit_session(tenant)
            session_id = f"sess-{uuid.uuid4().hex[:16]}"
            record = {"session_id": session_id, "tenant": tenant, "created_at": now(), "tags": tags,
                      "user_metadata": user_metadata}
            mark_open(self.store, session_id)  # first, so that no session's files escape the sweeps
            # once: the id is new, so a conflict with these bytes is a retried create (gs://) whose first attempt
            # landed
            self.store.put_create_once(f"{session_path(session_id)}/session.json", json.dumps(record).encode())
            self.heartbeat(tenant, session_id)
            # counted once it can end (a session without a heartbeat never expires, so a count noted before it
            # would hold its tenant's place for good if the store failed or the gateway died in between)
            self.quota.note_session(tenant, session_id)
            try:
                self.quota.confirm_session(tenant, session_id)
            except TenantLimitError:  # another gateway took the last place meanwhile: this session never served
                record_end(self.store, session_id, "refused: its API key was at its limit of sessions")
                raise
        return session_id

    def session(self, tenant: str, session_id: str) -> dict[str, Any]:
        """The session's record, if it is this tenant's; ``NotFoundError`` otherwise (also for other tenants')."""
        try:
            record = json.loads(self.store.get(f"{session_path(session_id)}/session.json"))
        except (FileNotFoundError, ValueError):
            raise NotFoundError(_no_session(session_id)) from None
        if record["tenant"] != tenant:
            raise NotFoundError(_no_session(session_id))
        return dict(record)

    def _read_owner(self, session_id: str) -> str:
        """The tenant owning the session (cached in ``_owner``); ``NotFoundError`` (not cached) without a record."""
        try:
            return str(json.loads(self.store.get(f"{session_path(session_id)}/session.json"))["tenant"])
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            raise NotFoundError(_no_session(session_id)) from None

    def check_owner(self, tenant: str, session_id: str) -> None:
        if self._owner(session_id) != tenant:
            raise NotFoundError(_no_session(session_id))

    def heartbeat(self, tenant: str, session_id: str) -> None:
        self.check_owner(tenant, session_id)
        self.liveness.note(session_id, None, 0.0)  # a heartbeat always reads the record afresh
        self.check_live(session_id)
        self.store.put(heartbeat_key(session_id), json.dumps({"time": time.time()}).encode())

    def finish(self, tenant: str, session_id: str, reason: str) -> None:
        """End the session (the first end recorded stands): it takes no new calls, and engines unload its adapters."""
        self.check_owner(tenant, session_id)
        self.liveness.note(session_id, record_end(self.store, session_id, f"finished: {reason}")[0], math.inf)

    def live_session(self, tenant: str, session_id: str) -> None:
        """This tenant's session, taking calls: ``NotFoundError`` for another's, ``SessionEndedError`` if it ended."""
        self.check_owner(tenant, session_id)
        self.check_live(session_id)

    def check_live(self, session_id: str) -> None:
        """``SessionEndedError`` (410) for a session that ended; a live one is looked at again after ``live_check_s``
        (``pipeline.api.liveness``)."""
        ended = self.liveness.ended(session_id)
        if ended is not None:
            raise SessionEndedError(f"session {session_id} has ended ({ended}); create a new ServiceClient")

    # ---- models -------------------------------------------------------------------------------
    def served(self, base_model: str | None) -> ServedModel:
        if base_model not in self.models:
            raise ApiError(f"base model {echoed(base_model)} is not served here; choose one of {', '.join(self.models)}")
        return self.models[base_model]

    def _model_key(self, model_id: str) -> str:
        session, kind, seq = model_run_name(model_id).split(".")
        if kind != "train":  # <session>:sample:<n> names a sampling client, never a training one
            raise ValueError(f"{echoed(model_id)} is not a training client's model_id")
        return f"{session_path(session)}/models/{seq}.json"

    def model(self, tenant: str, model_id: str) -> dict[str, Any]:
        """The model's record if it belongs to one of this tenant's sessions."""
        try:
            key = self._model_key(model_id)
        except ValueError:
            raise NotFoundError(f"unknown model {echoed(model_id)}; use the model_id create_model returned") from None
        self.check_owner(tenant, model_run_name(model_id).split(".")[0])
        return self._model_record(key, model_id)

    def _model_record(self, key: str, model_id: str) -> dict[str, Any]:
        try:
            return dict(self._model_records(key))  # records are create-only, so a cached one never goes stale
        except FileNotFoundError:
            raise NotFoundError(f"unknown model {echoed(model_id)}; create it with create_lora_training_client") from None

    def _read_model_record(self, key: str) -> dict[str, Any]:
        return json.loads(self.store.get(key))  # type: ignore[no-any-return]

    def register_model(self, tenant: str, session_id: str, model_seq_id: int, base_model: str, lora_rank: int,
                       lora: dict[str, Any], user_metadata: dict[str, Any] | None) -> str:
        """Record a new training client (create-only; a resent create finds its own record) of a checked creation
        (``pipeline.api.clients.check_create_model``, or the record of the state it loads)."""
        self.live_session(tenant, session_id)
        self.served(base_model)
        check_metadata("user_metadata", user_metadata or {})
        check_seq("model_seq_id", model_seq_id, 0, "the tinker SDK's create_lora_training_client")
        model_id = model_id_for(session_id, "train", model_seq_id)
        record = {"model_id": model_id, "tenant": tenant, "base_model": base_model, "lora_rank": lora_rank,
                  "lora": lora, "user_metadata": user_metadata or {}, "created_at": now()}
        try:
            with self.quota.creating(tenant):  # (a resent create at the same time then finds the record)
                fresh = not self.store.exists(self._model_key(model_id))  # a resent create takes no new place
                if fresh:
                    self.quota.admit_model(tenant)
                self.quota.note_model(tenant, model_id)
                if fresh:
                    self.quota.confirm_model(tenant, model_id)
                self.store.put_create(self._model_key(model_id), json.dumps(record).encode())
        except FileExistsError:
            existing = self.model(tenant, model_id)
            if existing["base_model"] != base_model or existing["lora_rank"] != lora_rank:
                raise ApiError(f"model {model_id} already exists with another base model or rank; "
                               "use a new model_seq_id") from None
        return model_id

    def get_info(self, tenant: str, model_id: str) -> dict[str, Any]:
        record = self.model(tenant, model_id)
        served = self.served(record["base_model"])
        return {"type": "get_info", "model_id": model_id, "is_lora": True, "lora_rank": record["lora_rank"],
                "model_name": served.name,
                "model_data": {"arch": "lora", "model_name": served.name, "tokenizer_id": served.tokenizer_id}}

    def readable_path(self, tenant: str, path: str) -> tuple[TinkerPath, dict[str, Any]]:
        """A ``tinker://`` path this tenant may read, and its model's record: a path of its own models, or a
        published checkpoint of anyone's (another tenant's unpublished path is not found, as a missing one)."""
        parsed = parse_tinker_path(path)
        try:
            return parsed, self.model(tenant, parsed.model_id)
        except NotFoundError:
            record = checkpoints.read_record(self.store, parsed)
            if record is None or not record.get("public"):
                raise
        try:
            key = self._model_key(parsed.model_id)
        except ValueError:
            raise NotFoundError(f"unknown model {echoed(parsed.model_id)}; use the model_id create_model returned") from None
        return parsed, self._model_record(key, parsed.model_id)

    def saved_state(self, tenant: str, path: str, base_model: str | None) -> tuple[TinkerPath, dict[str, Any]]:
        """A ``tinker://.../weights/<name>`` path this tenant may read that ``save_state`` wrote (what a new training
        client loads), and its model's record; ``ApiError`` for other kinds, a name never saved, or a ``base_model``
        asked for that is not the state's."""
        training_state_path(path)
        parsed, record = self.readable_path(tenant, path)
        if checkpoints.read_record(self.store, parsed) is None:
            raise ApiError(f"no saved weights at {path} (never saved, deleted or expired); see list_checkpoints")
        if base_model is not None:
            checkpoints.check_base_model(path, record["base_model"], base_model)
        return parsed, record

    def check_load_into(self, tenant: str, model_id: str, path: str) -> None:
        """Refuse a ``load_state`` of what is no training state, or of one of another base model; a path not
        readable here (another tenant's unpublished, say) is the trainer's to refuse."""
        training_state_path(path)
        base_model = self.model(tenant, model_id)["base_model"]
        try:
            _, source = self.readable_path(tenant, path)
        except ApiError:
            return
        checkpoints.check_base_model(path, source["base_model"], base_model)

    # ---- calls --------------------------------------------------------------------------------
    def submit(self, tenant: str, op: ApiOp, model_id: str, seq_id: int | None, body: bytes,
               fmt: BodyFormat = "json") -> str:
        """Accept a call on one of the tenant's models: body to the store, event on the log; its request id."""
        record = self.model(tenant, model_id)
        self.check_live(model_run_name(model_id).split(".")[0])
        ordered = op not in ("create_model", "load_weights")  # (a call making a training client has no seq_id)
        if ordered or seq_id is not None:
            check_seq(f"{op} seq_id", seq_id, 1 if ordered else 0, "the tinker SDK's TrainingClient (each call "
                      "takes its training client's next seq_id)")
        request_id = self._log_call(tenant, op, record, model_id, seq_id, body, fmt)
        if request_id is None:
            raise ApiError(f"seq_id {seq_id} of {model_id} was already used for another call; "
                           "each call takes the next seq_id")
        return request_id

    def refuse(self, tenant: str, op: ApiOp, body: bytes, fmt: BodyFormat, reason: str) -> None:
        """Log a numbered training call refused here as one that fails with ``reason``.

        The SDK numbers a call before sending it, and the trainer runs a model's calls in ``seq_id`` order: a
        refused call never logged would leave a gap that every later call of its training client waits on.
        Nothing is logged for a body naming no model of this tenant or no ``seq_id``, or a ``seq_id`` taken.
        """
        numbered = numbered_call(body, fmt)
        if numbered is None:
            return
        model_id, seq_id = numbered
        try:
            record = self.model(tenant, model_id)
            self.check_live(model_run_name(model_id).split(".")[0])
        except ApiError:
            return  # not this tenant's model (or its session ended): no training client of theirs waits
        self._log_call(tenant, op, record, model_id, seq_id, body, fmt, refused=reason)

    def _log_call(self, tenant: str, op: ApiOp, record: dict[str, Any], model_id: str, seq_id: int | None,
                  body: bytes, fmt: BodyFormat, refused: str | None = None) -> str | None:
        """The body create-only, then its ``ApiRequestAccepted``; the request id, None when the id was taken."""
        request_id = request_id_for(model_id, seq_id)
        session_id = session_of_request(request_id)
        key = request_body_path(session_id, request_id, fmt)
        try:
            digest = self.store.put_create_once(key, body)
        except FileExistsError:
            return None
        event = ApiRequestAccepted(request_id=request_id, tenant=tenant, session_id=session_id, op=op,
                                   model_id=model_id, seq_id=seq_id or None, base_model=record["base_model"],
                                   body_path=key, body_format=fmt, body_sha256=digest, refused=refused)
        self.publish_call(event)
        return request_id

    def result(self, tenant: str, request_id: str) -> tuple[bytes, BodyFormat] | None:
        """The stored result of a call (protobuf or JSON), or None while it runs."""
        session_id = session_of_request(request_id)
        self.check_owner(tenant, session_id)
        for fmt in ("pb", "json"):
            key = result_path(session_id, request_id, fmt)  # type: ignore[arg-type]
            try:
                found = self.store.get(key), fmt
            except FileNotFoundError:
                continue
            self.samples.answered(request_id)
            return found  # type: ignore[return-value]
        if not self.store.exists(request_body_path(session_id, request_id, "json")) and not self.store.exists(
                request_body_path(session_id, request_id, "pb")):
            deleted = files_deleted(self.store, session_id)
            if deleted is not None:
                on = utc_text(float(deleted.get("time") or 0))
                raise NotFoundError(f"request {echoed(request_id)} is of session {session_id}, which ended "
                                    f"({deleted.get('end')}); its calls' bodies and results were deleted on {on} "
                                    f"({deleted.get('reason')})")
            raise NotFoundError(f"no request {echoed(request_id)}; poll with the request_id the call returned")
        return None

    # ---- sampling -------------------------------------------------------------------------------------
    def create_sampling_session(self, tenant: str, session_id: str, seq: int, base_model: str | None,
                                model_path: str | None) -> str:
        """A sampling session on the base model, or on the sampler weights a ``tinker://`` path names (with a
        ``base_model`` too, as the SDK sends when given both: it must be the one the weights were trained on)."""
        self.live_session(tenant, session_id)
        check_seq("sampling_session_seq_id", seq, 0, "the tinker SDK's create_sampling_client")
        weights: tuple[str, str | None, str | None, int | None]
        if model_path is None:
            weights = (self.served(base_model).name, None, None, None)
        else:
            path, record = self.readable_path(tenant, model_path)
            if path.kind != "sampler":
                raise ApiError(f"{model_path} is not sampler weights; sample from a "
                               "tinker://.../sampler_weights/<name> path (save_weights_for_sampler)")
            meta = checkpoints.read_record(self.store, path)
            if meta is None:
                raise ApiError(f"no sampler weights at {model_path} (never saved, deleted or expired); see "
                               "list_checkpoints")
            if base_model is not None and base_model != record["base_model"]:
                raise ApiError(f"{model_path} holds sampler weights trained on {record['base_model']}, not on "
                               f"{echoed(base_model)}; pass base_model={record['base_model']!r} or leave it out")
            weights = (record["base_model"], model_path, path.run, int(meta["version"]))
        sampling_session_id = model_id_for(session_id, "sample", seq)
        with self.quota.creating(tenant):
            fresh = find_sampler(self.store, session_id, seq) is None  # a resent create takes no new place
            if fresh:
                self.quota.admit_sampler(tenant)
            self.quota.note_sampler(tenant, sampling_session_id)
            if fresh:
                self.quota.confirm_sampler(tenant, sampling_session_id)
            return write_sampler(self.store, tenant, session_id, seq, *weights)

    def sampler(self, tenant: str, sampling_session_id: str) -> dict[str, Any]:
        """A sampling session's record (``NotFoundError`` for one that is not this tenant's)."""
        try:
            return read_sampler(self.store, tenant, sampling_session_id)
        except ApiError as exc:
            raise NotFoundError(str(exc)) from None

    def submit_sample(self, tenant: str, sampling_session_id: str, seq_id: int | None, body: bytes,
                      num_samples: int, prompt_tokens: int) -> tuple[str, list[str]]:
        """Accept a ``sample`` call: its request id and one sequence id per sample; ``BusyError`` when full."""
        call = self.prepare_sample(tenant, sampling_session_id, seq_id, body, prompt_tokens)
        self.publish_call(call)
        return call.request_id, [f"{call.request_id}.{j}" for j in range(num_samples)]

    def publish_call(self, call: ApiRequestAccepted) -> None:
        """Put an accepted call on a model on the log (the durable queue every engine reads), keyed by the model."""
        model_id = call.model_id or ""
        self.publish(make_event(model_run_name(model_id), call), model_id)

    def prepare_sample(self, tenant: str, sampling_session_id: str, seq_id: int | None,
                       body: bytes, prompt_tokens: int) -> ApiRequestAccepted:
        """The checks and the stored body of a ``sample`` call: its event, not yet on the log.

        ``BusyError`` when the base model's sampler queue is full, or the tenant holds its share of it
        (``pipeline.api.sample_queue``); ``ApiError`` for a base model not served here (the session was made
        before a redeployment without it) and for a prompt of ``prompt_tokens`` that leaves no room to sample in
        the context the base model is served with (``max_context_length``, the samplers' own).
        """
        record = self.sampler(tenant, sampling_session_id)
        self.check_live(model_run_name(sampling_session_id).split(".")[0])
        if seq_id is not None:
            check_seq("seq_id", seq_id, 0, "the tinker SDK's SamplingClient")
        base_model = record["base_model"]
        # served() refuses a base model no longer served here: no sampler would ever read the call
        check_prompt_fits(base_model, self.served(base_model).max_context_length, prompt_tokens)
        return store_sample_call(self.store, self.samples, tenant, sampling_session_id, seq_id, base_model, body)

    # ---- checkpoints (RestClient; ``pipeline.api.checkpoints``) ---------------------------------------------
    def checkpoints(self, tenant: str, model_id: str) -> list[dict[str, Any]]:
        """The live training states, sampler weights and external weights of one model, as the SDK's
        ``Checkpoint``."""
        self.model(tenant, model_id)
        return checkpoints.list_checkpoints(self.store, model_id)

    def _checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> TinkerPath:
        self.model(tenant, model_id)
        return checkpoints.path_of(model_id, checkpoint_id)

    def delete_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str) -> None:
        path = self._checkpoint(tenant, model_id, checkpoint_id)
        if not self.store.exists(checkpoints.record_key(path)):
            raise NotFoundError(f"no checkpoint {checkpoint_id} of {model_id}; see list_checkpoints")
        checkpoints.delete(self.store, path)  # a delete cut short leaves the record: deleting again finishes it

    def publish_checkpoint(self, tenant: str, model_id: str, checkpoint_id: str, public: bool) -> None:
        """Let every tenant read the checkpoint (``public``), or only its owner again."""
        checkpoints.set_public(self.store, self._checkpoint(tenant, model_id, checkpoint_id), public)

    def set_checkpoint_ttl(self, tenant: str, model_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        checkpoints.set_ttl(self.store, self._checkpoint(tenant, model_id, checkpoint_id), ttl_seconds)

    def external_weights_urls(self, tenant: str, model_id: str, checkpoint_id: str,
                              base_url: str) -> tuple[dict[str, str], int]:
        """Signed download URLs of external weights this tenant may read (its own, or published), and their expiry."""
        path = checkpoints.path_of(model_id, checkpoint_id)
        try:
            self.model(tenant, model_id)
            published = False
        except NotFoundError:
            self.readable_path(tenant, str(path))  # another tenant's: published, or the same "not found"
            published = True
        return downloads.download_urls(self.store, path, base_url, published)
