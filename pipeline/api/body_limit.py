"""The gateway's limit on request bodies: ASGI middleware that refuses a body over its limit (HTTP 413) before it
is read whole, and tells the gateway of each refusal with the body's first bytes, so a refused ``forward_backward``
is logged against its call."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi.responses import JSONResponse

from schemas.api import ApiError

log = logging.getLogger(__name__)
MAX_BODY_BYTES = 64 << 20  # a call's body, held in memory: the SDK's forward_backward chunks are about 5 MB
# a JSON call's body (every route but forward_backward's protobuf), parsed in a worker thread at about 50 ms a MB:
# the largest the SDK sends is a sample's prompt, about a million tokens in 8 MiB.  A thread does not spare the
# event loop every call shares one parse, since pydantic-core holds the GIL while it parses (a million-token prompt
# read by parse_body(json_first=True) stops the loop about 0.1 s), but many at once stop it for a few parses (their
# tenant's places), not for their sum
MAX_JSON_BODY_BYTES = 8 << 20
FORWARD_BACKWARD_PATH = "/api/v1/forward_backward"
HEADER_BYTES = 1024  # of a body refused for its size, read to find its call (a forward_backward names it first)


class BodyTooLarge(ApiError):
    """A request body over the gateway's limit (HTTP 413)."""


class BodyLimit:
    """ASGI middleware refusing a body over ``limit`` bytes (``json_limit`` on every route but forward_backward's): at
    once when its Content-Length says so, else as soon as reading it passes the limit (a chunked body), so the gateway
    never holds more of one call than that.  ``refused(scope, first_bytes, reason)`` is told of each refusal, with the
    body's first ``HEADER_BYTES`` (awaited before the answer; it does its store work in its tenant's worker-thread places)."""

    def __init__(self, app: Any, limit: int, json_limit: int,
                 refused: Callable[[Any, bytes, str], Awaitable[None]] | None = None) -> None:
        self.app, self.limit, self.json_limit, self.refused = app, limit, json_limit, refused

    def _limit(self, scope: Any) -> int:
        return self.limit if scope.get("path") == FORWARD_BACKWARD_PATH else min(self.limit, self.json_limit)

    def _refusal(self, scope: Any) -> BodyTooLarge:
        return BodyTooLarge(f"request body over {self._limit(scope)} bytes; send smaller calls (the tinker SDK splits "
                            "a forward_backward into chunks of about 5 MB), or shorten the datums or the prompt")

    async def _refuse(self, scope: Any, first: bytes) -> BodyTooLarge:
        refusal = self._refusal(scope)
        if self.refused is not None:
            try:
                await self.refused(scope, first, str(refusal))
            except Exception:  # the client still gets its 413
                log.exception("could not log a call refused for its size")
        return refusal

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        first = bytearray()  # the body's first HEADER_BYTES, as read

        def keep(message: Any) -> None:
            if message.get("type") == "http.request" and len(first) < HEADER_BYTES:
                first.extend(message.get("body", b"")[:HEADER_BYTES - len(first)])

        declared = dict(scope.get("headers") or ()).get(b"content-length", b"")
        limit = self._limit(scope)
        if declared.isdigit() and int(declared) > limit:
            message: Any = {"more_body": True}
            while len(first) < HEADER_BYTES and message.get("more_body"):
                message = await receive()
                keep(message)
            refusal = await self._refuse(scope, bytes(first))
            await JSONResponse({"error": str(refusal), "category": refusal.category}, status_code=413)(
                scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Any:
            nonlocal received
            message = await receive()
            keep(message)
            if message.get("type") == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise await self._refuse(scope, bytes(first))  # inside the handler's read: the ApiError handler
            return message

        await self.app(scope, limited_receive, send)
