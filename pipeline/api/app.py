"""The Tinker-compatible HTTP API (FastAPI): routes that translate between the SDK's wire and ``Gateway``.

Paths, bodies and answers are those of ``tinker==0.38.0`` (TINKER.md sections 3
and 4): JSON everywhere except ``forward_backward`` (protobuf in) and its
result (protobuf out).  Mutating calls answer ``{"request_id"}`` at once; the
client then long-polls ``retrieve_future``, which answers the stored result, a
stored ``{"error", "category"}``, or ``try_again`` before the client's 45 s
timeout.  Synchronous calls that fail answer ``{"error", "category"}`` with
400 (bad input), 401 (key), 404 (not this tenant's or unknown) or 410 (session
ended, which stops the SDK's heartbeat).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from tinker import types

from pipeline.api import checkpoints, downloads, listing
from pipeline.api.body_limit import (
    FORWARD_BACKWARD_PATH,
    MAX_BODY_BYTES,
    MAX_JSON_BODY_BYTES,
    BodyLimit,
    BodyTooLarge,
)
from pipeline.api.clients import check_create_model, check_optim_params
from pipeline.api.direct import DirectSamplers
from pipeline.api.gateway import Gateway, NotFoundError, SessionEndedError
from pipeline.api.results import ResultSignals
from pipeline.api.sample_queue import BusyError
from pipeline.api.samplers import check_sample_request
from pipeline.api.tenants import TenantLimitError, Tenants, UnauthorizedError
from pipeline.api.threads import TenantThreads, ThreadLimits
from pipeline.api.wire import (
    PROTOBUF,
    check_seq,
    checkpoint_name,
    forward_backward_header,
    forward_backward_prefix,
    parse_body,
)
from pipeline.io.store import ChecksumError
from schemas.api import ApiError, ApiOp, BodyFormat
from schemas.names import echoed

log = logging.getLogger(__name__)
POLL_HOLD_S = 25.0  # a retrieve_future is held at most this long, well under the SDK's 45 s timeout
SDK_BYTES_PER_TOKEN = 4  # what the tinker SDK counts a model_input token as, sizing a forward_backward's requests
SDK_CHUNK_BYTES = 5_000_000  # the SDK's own largest request (``fwdbwd_max_chunk_bytes_count``), never raised here
RECHECK_S = 1.0  # with result signals, a held poll still re-reads the store this often


_STATUS = {UnauthorizedError: 401, BodyTooLarge: 413, NotFoundError: 404, checkpoints.NotFound: 404, downloads.UrlRefused: 403,
           SessionEndedError: 410, BusyError: 429, TenantLimitError: 403}


class WeightsInfoRequest(BaseModel):
    """What ``RestClient.get_weights_info_by_tinker_path`` sends (the SDK has no type of its own for it)."""

    tinker_path: str = ""


class FinishRequest(BaseModel):
    """What ``ServiceClient.close`` sends to ``sessions/{id}/finish`` (an empty body is a success)."""

    reason: types.ClientSessionFinishReason = types.ClientSessionFinishSuccess()
    detail: str | None = None


async def _tenant(request: Request, x_api_key: Annotated[str | None, Header()] = None) -> str:
    """The caller's tenant, from its ``X-API-Key`` (on the event loop: a key check takes no worker thread)."""
    return request.app.state.tenants.tenant_of(x_api_key)  # type: ignore[no-any-return]


async def _body(request: Request) -> bytes:
    """The request's body, read on the event loop (within ``BodyLimit``'s limit)."""
    return await request.body()


async def _tenant_with_body(who: Annotated[str, Depends(_tenant)], _: Annotated[bytes, Depends(_body)]) -> str:
    """The caller's tenant, its key checked first, then its body read (FastAPI reads it once per request, for
    ``RawBody`` too): a route ``in_threads`` takes a place in the worker threads only after both, so a slow upload
    holds none while it arrives."""
    return who


# the tenant of a plain ``def`` route run ``in_threads``, in one of its tenant's places (``pipeline.api.threads``)
Tenant = Annotated[str, Depends(_tenant_with_body)]
# the tenant of an ``async def`` route, which takes a place for each piece of work it hands a thread (``threads.run``)
TenantKey = Annotated[str, Depends(_tenant)]


# A route taking its body as ``RawBody`` is a plain ``def`` run ``in_threads``: in one of the gateway's worker
# threads, so that the store and log writes of one tenant's call (a chunk of up to 64 MiB to a remote store) never
# hold up the event loop that every tenant's calls, heartbeats and polls share; and in one of its tenant's places
# there, so that no few tenants' slow calls hold every worker thread either.
RawBody = Annotated[bytes, Depends(_body)]


def in_threads(threads: TenantThreads) -> Callable[[Callable[..., Any]], Callable[..., Awaitable[Any]]]:
    """Runs a plain ``def`` route (taking its tenant as ``who``) in one of its tenant's places in ``threads``, rather
    than in the thread pool Starlette runs such routes in, which every tenant would share without a rule."""
    def route_in_threads(route: Callable[..., Any]) -> Callable[..., Awaitable[Any]]:
        @functools.wraps(route)  # (FastAPI reads the route's parameters through it)
        async def in_a_place(**values: Any) -> Any:
            return await threads.run(values["who"], functools.partial(route, **values))
        return in_a_place
    return route_in_threads


def _unserved(request: Request) -> str:
    if request.url.path.startswith("/api/v1/api/v1/"):  # the SDK adds the prefix to a base URL that held it already
        return (f"{request.method} {echoed(request.url.path)}: the base URL ends in /api/v1, which the SDK adds "
                "itself; give the server's address alone (http://HOST:PORT, as rlpipe serve prints it)")
    return (f"{request.method} {echoed(request.url.path)} is not served by rlpipe; the calls it serves are listed in "
            "docs/api.md")


def create_app(gateway: Gateway, tenants: Tenants, poll_hold_s: float = POLL_HOLD_S,
               signals: ResultSignals | None = None, direct: DirectSamplers | None = None,
               public_url: str | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_json_body_bytes: int = MAX_JSON_BODY_BYTES, threads: ThreadLimits | None = None) -> FastAPI:
    """The ASGI app serving ``gateway`` to the tenants ``tenants`` admits; ``signals`` (following
    ``<ns>.results``) wakes long polls, without it they re-read the store every 20 ms; ``direct`` also hands
    sample calls straight to their sampler (``pipeline.api.direct``), waking polls through ``signals``;
    ``public_url``: the gateway's address as clients reach it (behind a proxy), for the download URLs it signs
    (default: the address each request came to); ``max_body_bytes``: the largest request body taken (413 above),
    ``max_json_body_bytes`` that of every route but forward_backward's; ``threads``: the gateway's worker threads
    and how they are shared between tenants (``pipeline.api.threads``; default ``ThreadLimits()``)."""
    if signals is None and direct is not None:
        signals = direct.signals
    app = FastAPI(title="rlpipe Tinker-compatible API", docs_url=None, redoc_url=None)
    app.state.gateway, app.state.tenants = gateway, tenants
    places = app.state.threads = TenantThreads(threads)
    threaded = in_threads(places)

    async def refused_for_size(scope: Any, first: bytes, reason: str) -> None:
        """A ``forward_backward`` refused for its size is logged as refused (``Gateway.refuse``) when its first bytes
        name the call (in its tenant's worker-thread places), so its training client's later calls do not wait on its
        seq_id; the SDK's JSON training calls are a few hundred bytes, so a refused one is no call of the SDK's and is
        not looked into."""
        header = forward_backward_prefix(first) if scope.get("path") == FORWARD_BACKWARD_PATH else None
        if header is None:
            return
        try:
            who = tenants.tenant_of(Headers(scope=scope).get("x-api-key"))
        except UnauthorizedError:
            return
        await places.run(who, gateway.refuse, who, "forward_backward", header, "pb", reason)

    app.add_middleware(BodyLimit, limit=max_body_bytes, json_limit=max_json_body_bytes, refused=refused_for_size)

    @app.exception_handler(ApiError)
    async def api_error(_: Request, exc: ApiError) -> JSONResponse:
        status = next((code for cls, code in _STATUS.items() if isinstance(exc, cls)), 400)
        return JSONResponse({"error": str(exc), "category": exc.category}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "request"
        return JSONResponse({"error": f"{echoed(request.url.path)}: {where}: {first.get('msg')}; send what the tinker "
                                      "SDK sends (a download URL is used whole, as get_external_weights_urls gave it)",
                             "category": "user"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def unserved(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code in (404, 405):  # no such route (or not with this method): a call rlpipe does not serve
            return JSONResponse({"error": _unserved(request), "category": "user"}, status_code=404)
        return JSONResponse({"error": str(exc.detail), "category": "user"}, status_code=exc.status_code)

    # ---- client start-up, sessions, telemetry ------------------------------------------------------
    # calls that read and write nothing are answered on the event loop: never queued behind their tenant's slow calls
    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config(who: TenantKey) -> dict[str, Any]:
        # a split forward_backward's requests sent at once, the first last: how the trainer tells them apart from
        # calls of their own, to undo the whole call if one request fails (consumers.api.worker)
        # and how large one request may be: the SDK counts 4 bytes a token (and its loss inputs' bytes), so a request
        # it builds of several datums holds at most the cap's tokens (``RLPIPE_API_MAX_CALL_TOKENS``)
        return {"pjwt_auth_enabled": False, "parallel_fwdbwd_chunks": True,
                "fwdbwd_max_chunk_bytes_count": min(SDK_CHUNK_BYTES, SDK_BYTES_PER_TOKEN * gateway.limits.max_call_tokens)}

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config(who: TenantKey) -> dict[str, Any]:
        # no cancel_future: the SDK sends one only for a sample future its caller cancelled, and such a call of a
        # live session runs every round; the sampler stops only the calls of a session that ended or whose
        # heartbeats lapsed (producers.api_sampler), a dead process's
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False, "sample_cancel_max_batch_size": 64}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities(who: TenantKey) -> dict[str, Any]:
        return {"supported_models": [
            {"model_name": m.name, "max_context_length": m.max_context_length, "trainable": True, "sampleable": True}
            for m in gateway.models.values()]}

    @app.post("/api/v1/create_session")
    @threaded
    def create_session(who: Tenant, raw: RawBody) -> dict[str, Any]:
        body = parse_body(types.CreateSessionRequest, raw)
        session_id = gateway.create_session(who, list(body.tags), dict(body.user_metadata or {}))
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    @threaded
    def heartbeat(who: Tenant, raw: RawBody) -> dict[str, str]:
        body = parse_body(types.SessionHeartbeatRequest, raw)
        gateway.heartbeat(who, body.session_id)
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    @threaded
    def finish(session_id: str, who: Tenant, raw: RawBody) -> dict[str, str]:
        body = parse_body(FinishRequest, raw)
        gateway.finish(who, session_id, body.reason.type)
        return {"status": "ok"}

    @app.post("/api/v1/telemetry")
    async def telemetry(who: TenantKey) -> dict[str, str]:
        return {"status": "accepted"}

    # ---- training calls (futures) -------------------------------------------------------------------
    @contextlib.contextmanager
    def numbered(who: str, op: ApiOp, raw: bytes, fmt: BodyFormat = "json") -> Iterator[None]:
        """A numbered training call (in a worker thread): refused here, it is still logged as failing
        (``Gateway.refuse``), so the training client's later calls do not wait on its seq_id."""
        try:
            yield
        except ApiError as exc:
            try:
                gateway.refuse(who, op, raw, fmt, str(exc))
            except Exception:  # the client still gets its own error; the call's gap is then its training client's
                log.exception("could not log the refused %s call", op)
            raise

    @app.post("/api/v1/create_model")
    @threaded
    def create_model(who: Tenant, raw: RawBody) -> dict[str, Any]:
        body = parse_body(types.CreateModelRequest, raw)
        lora = check_create_model(body)
        model_id = gateway.register_model(who, body.session_id, body.model_seq_id, body.base_model, lora.rank,
                                          lora.model_dump(), body.user_metadata)
        return {"request_id": gateway.submit(who, "create_model", model_id, None, raw), "model_id": model_id}

    @app.post("/api/v1/get_info")
    @threaded
    def get_info(who: Tenant, raw: RawBody) -> dict[str, Any]:
        body = parse_body(types.GetInfoRequest, raw)
        return gateway.get_info(who, body.model_id)

    @app.post(FORWARD_BACKWARD_PATH)
    @threaded
    def forward_backward(request: Request, who: Tenant, raw: RawBody) -> dict[str, Any]:
        if PROTOBUF not in request.headers.get("content-type", ""):
            raise ApiError("forward_backward takes a protobuf body; use the tinker SDK >= 0.25")
        with numbered(who, "forward_backward", raw, "pb"):
            model_id, seq_id = forward_backward_header(raw, check_loss_fn_config=True,
                                                       max_tokens=gateway.limits.max_call_tokens)
            return {"request_id": gateway.submit(who, "forward_backward", model_id, seq_id, raw, "pb"),
                    "model_id": model_id}

    @app.post("/api/v1/optim_step")
    @threaded
    def optim_step(who: Tenant, raw: RawBody) -> dict[str, Any]:
        with numbered(who, "optim_step", raw):
            body = parse_body(types.OptimStepRequest, raw)
            check_optim_params(body.optim_params)
            return {"request_id": gateway.submit(who, "optim_step", body.model_id, body.seq_id, raw)}

    @app.post("/api/v1/save_weights")
    @threaded
    def save_weights(who: Tenant, raw: RawBody) -> dict[str, Any]:
        with numbered(who, "save_weights", raw):
            body = parse_body(types.SaveWeightsRequest, raw)
            checkpoint_name(body.path)
            checkpoints.expiry(body.ttl_seconds)
            return {"request_id": gateway.submit(who, "save_weights", body.model_id, body.seq_id, raw)}

    @app.post("/api/v1/save_weights_external")
    @threaded
    def save_weights_external(who: Tenant, raw: RawBody) -> dict[str, Any]:
        with numbered(who, "save_weights_external", raw):
            body = parse_body(types.SaveWeightsExternalRequest, raw)
            checkpoint_name(body.path)
            checkpoints.expiry(body.ttl_seconds)
            if body.age_encryption_recipients:
                raise ApiError("age encryption of external weights is not served by rlpipe; leave out "
                               "age_encryption_recipients (the files are served only through signed URLs)")
            return {"request_id": gateway.submit(who, "save_weights_external", body.model_id, body.seq_id, raw)}

    @app.post("/api/v1/save_weights_for_sampler")
    @threaded
    def save_weights_for_sampler(who: Tenant, raw: RawBody) -> dict[str, Any]:
        with numbered(who, "save_weights_for_sampler", raw):
            body = parse_body(types.SaveWeightsForSamplerRequest, raw)
            if body.path is None and body.sampling_session_seq_id is None:
                raise ApiError("save_weights_for_sampler needs a path or a sampling_session_seq_id; use the tinker "
                               "SDK")
            if body.path is not None:
                checkpoint_name(body.path)
            if body.sampling_session_seq_id is not None:
                check_seq("sampling_session_seq_id", body.sampling_session_seq_id, 0,
                          "the tinker SDK's create_sampling_client")
            checkpoints.expiry(body.ttl_seconds)
            return {"request_id": gateway.submit(who, "save_weights_for_sampler", body.model_id, body.seq_id, raw)}

    @app.post("/api/v1/load_weights")
    @threaded
    def load_weights(who: Tenant, raw: RawBody) -> dict[str, Any]:
        with numbered(who, "load_weights", raw):
            body = parse_body(types.LoadWeightsRequest, raw)
            if body.model_id is not None:  # into an existing training client, in its seq_id order
                gateway.check_load_into(who, body.model_id, body.path)  # (whether it is saved is the trainer's)
                return {"request_id": gateway.submit(who, "load_weights", body.model_id, body.seq_id, raw)}
        if body.session_id is None or body.model_seq_id is None:
            raise ApiError("load_weights needs model_id and seq_id, or session_id and model_seq_id")
        gateway.live_session(who, body.session_id)
        _, source = gateway.saved_state(who, body.path, body.base_model)
        model_id = gateway.register_model(who, body.session_id, body.model_seq_id, source["base_model"],
                                          source["lora_rank"], source["lora"], body.user_metadata)
        return {"request_id": gateway.submit(who, "load_weights", model_id, None, raw), "model_id": model_id}

    # ---- sampling ----------------------------------------------------------------------------------------
    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request, who: TenantKey) -> dict[str, Any]:
        body = await places.run(who, parse_body, types.CreateSamplingSessionRequest, await request.body())
        if body.base_model is None and body.model_path is None:
            raise ApiError("create_sampling_session needs a base_model or a model_path (tinker://.../sampler_weights/"
                           "<name>); use the tinker SDK's create_sampling_client")
        sampling_session_id = await places.run(who, gateway.create_sampling_session, who, body.session_id,
                                                      body.sampling_session_seq_id, body.base_model, body.model_path)
        return {"type": "create_sampling_session", "sampling_session_id": sampling_session_id}

    @app.get("/api/v1/samplers/{sampling_session_id}")
    @threaded
    def sampler(sampling_session_id: str, who: Tenant) -> dict[str, Any]:
        record = gateway.sampler(who, sampling_session_id)
        return {"sampler_id": sampling_session_id, "base_model": record["base_model"],
                "model_path": record["model_path"]}

    def read_sample(raw: bytes) -> types.SampleRequest:
        """A sample call's body, checked: in a worker thread, so that many large prompts at once hold the event loop
        for a few parses at most (their tenant's places), not for all of them (``MAX_JSON_BODY_BYTES``)."""
        body: types.SampleRequest = parse_body(types.SampleRequest, raw, json_first=True)
        if body.sampling_session_id is None:
            raise ApiError("asample needs a sampling_session_id; create a SamplingClient first")
        check_sample_request(body)
        return body

    @app.post("/api/v1/asample")
    async def asample(request: Request, who: TenantKey) -> dict[str, Any]:
        raw = await request.body()
        body = await places.run(who, read_sample, raw)
        call = await places.run(who, gateway.prepare_sample, who, body.sampling_session_id, body.seq_id, raw,
                                 body.prompt.length)
        if direct is not None:  # the sampler starts while the log takes the call; the answer still waits for the log
            direct.dispatch(call)
        await places.run(who, gateway.publish_call, call)
        return {"request_id": call.request_id,
                "sample_sequence_ids": [f"{call.request_id}.{j}" for j in range(body.num_samples)]}

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request, who: TenantKey) -> Response:
        body = await places.run(who, parse_body, types.FutureRetrieveRequest, await request.body())
        deadline = time.monotonic() + poll_hold_s
        with (signals or ResultSignals()).watch(body.request_id) as announced:
            while True:
                found = await places.run(who, gateway.result, who, body.request_id)
                if found is not None:
                    data, fmt = found
                    return Response(data, media_type=PROTOBUF if fmt == "pb" else "application/json")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return JSONResponse({"type": "try_again", "request_id": body.request_id,
                                         "queue_state": "active"})
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(announced.wait(), min(remaining, RECHECK_S if signals else 0.02))
                announced.clear()

    # ---- management (RestClient) ----------------------------------------------------------------
    @app.get("/api/v1/training_runs")
    @threaded
    def training_runs(who: Tenant, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return listing.training_runs(gateway, who, limit, offset)

    @app.get("/api/v1/training_runs/{model_id}")
    @threaded
    def training_run(model_id: str, who: Tenant) -> dict[str, Any]:
        return listing.training_run(gateway, who, model_id)

    @app.get("/api/v1/checkpoints")
    @threaded
    def user_checkpoints(who: Tenant, limit: int = 100, offset: int = 0) -> dict[str, Any]:
        return listing.user_checkpoints(gateway, who, limit, offset)

    @app.get("/api/v1/sessions")
    @threaded
    def sessions(who: Tenant, limit: int = 20, offset: int = 0) -> dict[str, Any]:
        return listing.sessions(gateway, who, limit, offset)

    @app.get("/api/v1/sessions/{session_id}")
    @threaded
    def session(session_id: str, who: Tenant) -> dict[str, Any]:
        return listing.session_info(gateway, who, session_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    @threaded
    def list_checkpoints(model_id: str, who: Tenant) -> dict[str, Any]:
        return {"checkpoints": gateway.checkpoints(who, model_id)}

    def named_like_a_route(who: str, model_id: str, checkpoint_id: str, route: str) -> Response | None:
        """``DELETE .../checkpoints/weights/ttl`` deletes the checkpoint named ``ttl``, not a TTL."""
        if "/" in checkpoint_id:
            return None
        gateway.delete_checkpoint(who, model_id, f"{checkpoint_id}/{route}")
        return Response(status_code=204)

    @app.put("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    async def set_checkpoint_ttl(model_id: str, checkpoint_id: str, request: Request, who: TenantKey) -> dict[str, Any]:
        try:
            raw = await places.run(who, json.loads, await request.body())
        except (ValueError, RecursionError):  # (nested deeper than Python's reader goes)
            raise ApiError("set_checkpoint_ttl takes a JSON body {\"ttl_seconds\": seconds or null}; use the "
                           "tinker SDK's RestClient") from None
        if not isinstance(raw, dict) or "ttl_seconds" not in raw:
            raise ApiError("set_checkpoint_ttl needs ttl_seconds: a number of seconds, or null to remove the TTL")
        ttl = raw["ttl_seconds"]
        if ttl is not None and (not isinstance(ttl, int) or isinstance(ttl, bool)):
            raise ApiError(f"ttl_seconds={ttl!r}: send a whole number of seconds, or null to remove the TTL")
        await places.run(who, gateway.set_checkpoint_ttl, who, model_id, checkpoint_id, ttl)
        return {}

    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request,
                                    who: TenantKey) -> dict[str, Any]:
        urls, expires = await places.run(who, gateway.external_weights_urls, who, model_id, checkpoint_id,
                                                public_url or str(request.base_url))
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, UTC).isoformat()}

    @app.get(downloads.DOWNLOAD_PATH + "/{model_id}/{name}/{file:path}")
    async def download_external_file(model_id: str, name: str, file: str, expires: int, signature: str, v: str = "",
                                     p: str = "0") -> Response:
        """A file of external weights, for whoever holds its signed URL (no API key, as with a bucket's URL)."""
        try:
            found = await places.run(downloads.DOWNLOADS, downloads.check_download, gateway.store, model_id, name,
                                     file, expires, signature, v, p)
        except ChecksumError as exc:
            log.error("refused a corrupt download: %s", exc)
            return JSONResponse({"error": str(exc), "category": "server"}, status_code=500)
        return StreamingResponse(downloads.send_in_places(found, places), media_type="application/octet-stream",
                                 headers={"Content-Length": str(found.size)})

    @app.api_route("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish",
                   methods=["POST", "DELETE"])
    async def publish_checkpoint(model_id: str, checkpoint_id: str, request: Request, who: TenantKey) -> Response:
        if request.method == "DELETE" and (deleted := await places.run(
                who, named_like_a_route, who, model_id, checkpoint_id, "publish")):
            return deleted
        await places.run(who, gateway.publish_checkpoint, who, model_id, checkpoint_id, request.method == "POST")
        return JSONResponse({})

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
    @threaded
    def delete_a_checkpoint_named_ttl(model_id: str, checkpoint_id: str, request: Request, who: Tenant) -> Response:
        return named_like_a_route(who, model_id, checkpoint_id, "ttl") or unserved_checkpoint_call(request)

    @app.api_route("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/publish", methods=["PUT"])
    @app.api_route("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl", methods=["POST"])
    def unserved_checkpoint_call(request: Request) -> JSONResponse:
        return JSONResponse({"error": _unserved(request), "category": "user"}, status_code=404)

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    @threaded
    def delete_checkpoint(model_id: str, checkpoint_id: str, who: Tenant) -> Response:
        gateway.delete_checkpoint(who, model_id, checkpoint_id)
        return Response(status_code=204)

    @app.post("/api/v1/weights_info")
    @threaded
    def weights_info(who: Tenant, raw: RawBody) -> dict[str, Any]:
        body = parse_body(WeightsInfoRequest, raw)
        path, record = gateway.readable_path(who, body.tinker_path)
        if checkpoints.read_record(gateway.store, path) is None:
            raise NotFoundError(f"no checkpoint at {path} (never saved, deleted or expired); see list_checkpoints")
        lora = record["lora"]
        return {"base_model": record["base_model"], "is_lora": True, "lora_rank": record["lora_rank"],
                "train_unembed": lora.get("train_unembed"), "train_mlp": lora.get("train_mlp"),
                "train_attn": lora.get("train_attn")}

    return app
