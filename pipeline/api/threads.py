"""Worker threads shared fairly between tenants: one tenant's slow calls hold at most ``per_tenant`` of them.

The gateway's routes do their store and log I/O in worker threads (``pipeline.api.app``), so that the event loop
every tenant's calls share is never held up.  The threads are one pool (Starlette's, 40 by default): a tenant with
more slow calls at once than that (a slow store, many large ``forward_backward`` chunks) would hold every thread, and
another tenant's heartbeat or poll would wait for them.  So each tenant's threaded work first takes one of its own
``per_tenant`` places, waiting for it on the event loop (holding no thread) while all are taken: a tenant's calls
beyond its share queue behind each other, never in front of another tenant's.  Tenants are told apart by API key;
one person with several keys is several tenants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

from anyio import to_thread

T = TypeVar("T")
PER_TENANT = 8  # worker threads one tenant's calls hold at once, of the pool's 40


class TenantThreads:
    """Places in the shared worker-thread pool, at most ``per_tenant`` for each tenant at once."""

    def __init__(self, per_tenant: int = PER_TENANT) -> None:
        if per_tenant < 1:
            raise ValueError(f"per_tenant={per_tenant}: give each tenant at least one worker thread")
        self.per_tenant = per_tenant
        self._places: dict[str, tuple[asyncio.Semaphore, int]] = {}  # tenant -> (its places, calls holding/awaiting)

    @contextlib.asynccontextmanager
    async def place(self, tenant: str) -> AsyncIterator[None]:
        """Held while one of ``tenant``'s calls works in a thread (awaited on the event loop, without one)."""
        places, users = self._places.get(tenant) or (asyncio.Semaphore(self.per_tenant), 0)
        self._places[tenant] = (places, users + 1)
        try:
            async with places:
                yield
        finally:
            places, users = self._places[tenant]
            if users == 1:  # kept only while in use, so however many tenants come, few entries stay
                del self._places[tenant]
            else:
                self._places[tenant] = (places, users - 1)

    async def run(self, tenant: str, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in a worker thread, in one of ``tenant``'s places."""
        async with self.place(tenant):
            return await to_thread.run_sync(function, *args)
