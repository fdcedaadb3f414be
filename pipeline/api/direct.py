"""The direct path for ``sample`` calls: the gateway hands each accepted call straight to its sampler as well.

A call still goes through the log first (``<ns>.requests``, durable, what a
restarted or additional sampler reads), and its result is still announced on
``<ns>.results``.  On the embedded broker each of those two hops costs a broker
poll (tens of milliseconds on an empty log, hundreds on a long one: Tansu lists
a partition to find new records), which made a turn of a researcher's loop cost
several times what the engine spends on it.  So a gateway that knows where a base
model's sampler listens (``rlpipe serve`` starts both on one machine) also POSTs
the accepted call to it; the sampler answers once the result is stored, and the
gateway wakes the waiting ``retrieve_future`` at once.

Nothing depends on the direct path: a sampler that is down, busy restarting or
slow to answer leaves the call to the log and the results topic, exactly as
without it.  A call that reaches a sampler both ways runs once (the sampler keeps
one task per request id, and results are written create-only).  The sampler's
endpoint trusts what it is sent as the log's readers do, so it listens on the
loopback interface only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator

import httpx
import uvicorn
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from pipeline.api.results import ResultSignals
from schemas.api import ApiRequestAccepted

log = logging.getLogger(__name__)
CALLS_PATH = "/calls"
DIRECT_TIMEOUT_S = 600.0  # a long sample (vLLM, many tokens) still ends well inside it; past it, the log serves


# ---- the sampler's side -------------------------------------------------------------------------------------------


def direct_app(run_call: Callable[[ApiRequestAccepted], Awaitable[None]]) -> Starlette:
    """The sampler's endpoint: ``POST /calls`` with an ``ApiRequestAccepted``; 200 once its result is stored.

    ``run_call`` raises ``ValueError`` for a call this sampler does not serve (answered 400).
    """

    async def calls(request: Request) -> JSONResponse:
        try:
            call = ApiRequestAccepted.model_validate_json(await request.body())
            await run_call(call)
        except (ValidationError, ValueError) as exc:
            return JSONResponse({"error": str(exc).splitlines()[0]}, status_code=400)
        return JSONResponse({"request_id": call.request_id})

    return Starlette(routes=[Route(CALLS_PATH, calls, methods=["POST"])])


class _Server(uvicorn.Server):
    """uvicorn inside another program's event loop: the program keeps its own signal handling."""

    def install_signal_handlers(self) -> None:  # uvicorn < 0.29
        return None

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:  # uvicorn >= 0.29
        yield


async def serve_direct(app: Starlette, port: int, host: str = "127.0.0.1") -> tuple[_Server, asyncio.Task[None]]:
    """Start serving ``app`` on ``host:port`` in the running loop; set ``server.should_exit`` to stop it."""
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if task.done():  # it could not listen (the port is taken): the log still serves every call
        log.warning("the direct endpoint could not listen on %s:%d (%s); calls come through the log only",
                    host, port, task.exception())
    return server, task


# ---- the gateway's side -------------------------------------------------------------------------------------------


class DirectSamplers:
    """Hands accepted ``sample`` calls to the sampler of their base model and wakes their polls when it answers.

    ``urls`` maps a served base model to its sampler's direct endpoint (``http://127.0.0.1:PORT``).
    ``dispatch`` is called on the gateway's event loop; a failed hand-over is logged at debug level and
    left to the log.
    """

    def __init__(self, urls: dict[str, str], signals: ResultSignals, timeout_s: float = DIRECT_TIMEOUT_S) -> None:
        self.urls, self.signals, self.timeout_s = dict(urls), signals, timeout_s
        self._client: httpx.AsyncClient | None = None
        self._sending: set[asyncio.Task[None]] = set()
        self.delivered = 0  # calls whose result the direct path announced

    def dispatch(self, call: ApiRequestAccepted) -> None:
        url = self.urls.get(call.base_model or "")
        if url is None:
            return
        task = asyncio.get_running_loop().create_task(self._send(url, call))
        self._sending.add(task)
        task.add_done_callback(self._sending.discard)

    async def _send(self, url: str, call: ApiRequestAccepted) -> None:
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=httpx.Limits(max_connections=256))
        try:
            response = await self._client.post(url + CALLS_PATH, content=call.model_dump_json(),
                                               headers={"content-type": "application/json"})
        except httpx.HTTPError as exc:
            log.debug("direct hand-over of %s failed (%s); the log delivers it", call.request_id, exc)
            return
        if response.status_code == 200:
            self.delivered += 1
            self.signals.notify(call.request_id)
        else:
            log.warning("the sampler at %s refused %s (%s): %s", url, call.request_id, response.status_code,
                        response.text[:200])

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        if self._client is not None:
            await self._client.aclose()
