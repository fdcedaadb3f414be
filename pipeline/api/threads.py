"""The gateway's worker threads, shared between tenants so that no few tenants' slow calls take every one of them.

The gateway's routes do their store and log I/O in worker threads (``pipeline.api.app``), so that the event loop
every tenant's calls share is never held up.  Those threads are the gateway's own pool (an ``anyio``
``CapacityLimiter`` of ``ThreadLimits.total`` threads, 40 by default, apart from the pool Starlette and anyio use for
everything else), and a call takes a place in it before it is handed a thread, waiting for one on the event loop
(holding no thread).  A place is given by one rule:

- a tenant holding no thread takes one whenever one is free;
- a tenant already holding ``h`` threads takes another only while ``h < per_tenant`` (8) and more than ``reserved``
  threads (10 of 40, a quarter) are free, so the last ``reserved`` threads go only to tenants holding none;
- when a thread comes free, the calls waiting for it are served in order of how many threads their tenant holds,
  fewest first (a tenant holding none first), then in the order they came.

Why that is fair: a tenant's second and later threads are only ever taken while more than ``reserved`` are free, so
together they never number more than ``total - reserved``; every thread is held only when at least ``reserved``
tenants hold one each.  So fewer than ``reserved`` tenants, however many slow calls they send (a slow store, a
large ``forward_backward`` split into many chunks), always leave a thread free for another tenant's heartbeat, poll
or session creation; and beyond that, a tenant holding none is the first to get the next thread that comes free.  A
tenant's calls beyond its share queue behind each other, never in front of another tenant's.  Tenants are told
apart by API key; one person with several keys is several tenants.  Downloads by signed URL, which carry no key, are
one tenant of their own (``pipeline.api.downloads.DOWNLOADS``).

The numbers are set with ``RLPIPE_API_THREADS``, ``RLPIPE_API_THREADS_PER_TENANT`` and
``RLPIPE_API_THREADS_RESERVED`` (``ThreadLimits.from_env``, read by ``rlpipe serve``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Self, TypeVar

from anyio import CapacityLimiter, to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

T = TypeVar("T")
THREADS_ENV = "RLPIPE_API_THREADS"
PER_TENANT_ENV = "RLPIPE_API_THREADS_PER_TENANT"
RESERVED_ENV = "RLPIPE_API_THREADS_RESERVED"
PER_TENANT = 8  # the default most worker threads one tenant's calls hold at once


class ThreadLimits(BaseModel):
    """The gateway's worker threads and how they are shared between tenants (the rule in this module's docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    total: int = Field(40, ge=1, le=10_000, description=(
        f"worker threads the gateway does its tenants' store and log work in ({THREADS_ENV})"))
    per_tenant: int = Field(PER_TENANT, ge=1, le=10_000, description=(
        f"most of them one tenant's calls hold at once ({PER_TENANT_ENV}; default 8, or all when fewer)"))
    reserved: int = Field(10, ge=0, le=9_999, description=(
        f"the last free threads, taken only by a tenant holding none ({RESERVED_ENV}; default a quarter of them)"))

    @model_validator(mode="before")
    @classmethod
    def _defaults_of_total(cls, values: Any) -> Any:
        """A smaller or larger pool scales the defaults with it (40 threads: 8 per tenant, 10 reserved)."""
        if isinstance(values, dict) and isinstance(values.get("total"), int):
            values = {"per_tenant": min(PER_TENANT, values["total"]), "reserved": values["total"] // 4, **values}
        return values

    @model_validator(mode="after")
    def _fits(self) -> Self:
        if self.per_tenant > self.total:
            raise ValueError(f"{PER_TENANT_ENV}={self.per_tenant} is more than {THREADS_ENV}={self.total}; "
                             "set it to at most the threads there are")
        if self.reserved >= self.total:
            raise ValueError(f"{RESERVED_ENV}={self.reserved} leaves no thread to a tenant's second call "
                             f"({THREADS_ENV}={self.total}); set it below {THREADS_ENV}")
        return self

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ThreadLimits:
        """From ``RLPIPE_API_THREADS``, ``RLPIPE_API_THREADS_PER_TENANT`` and ``RLPIPE_API_THREADS_RESERVED`` (unset
        or empty: the defaults)."""
        env = os.environ if environ is None else environ
        variables = {"total": THREADS_ENV, "per_tenant": PER_TENANT_ENV, "reserved": RESERVED_ENV}
        raws = {name: env.get(variable, "").strip() for name, variable in variables.items()}
        values: dict[str, int] = {}
        for name, raw in raws.items():
            if raw:
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"{variables[name]}={raw!r}: set a whole number") from None
        try:
            return cls(**values)
        except ValidationError as exc:
            first = exc.errors()[0]
            reason = str(first["msg"]).removeprefix("Value error, ")
            if not first["loc"]:  # (two settings that do not fit together: the reason names both)
                raise ValueError(reason) from None
            name = str(first["loc"][0])
            raise ValueError(f"{variables[name]}={raws[name]!r}: {reason}") from None


@dataclass
class _Waiting:
    """A call waiting for a place: served fewest-held first, then in arrival order (``order``)."""

    order: int
    tenant: str
    granted: asyncio.Future[None]


class TenantThreads:
    """Places in the gateway's worker threads, given by the rule of this module's docstring.

    Every method runs on the event loop (none is thread-safe): the counts change only between awaits."""

    def __init__(self, limits: ThreadLimits | None = None) -> None:
        self.limits = limits or ThreadLimits()
        self._held: dict[str, int] = {}  # tenant -> threads its calls hold (kept only while above 0)
        self._waiting: list[_Waiting] = []
        self._arrivals = itertools.count()
        # never waited on: places are given only while one of its threads is free
        self._limiter = CapacityLimiter(self.limits.total)

    @property
    def free(self) -> int:
        """Threads no call holds."""
        return self.limits.total - sum(self._held.values())

    def held(self, tenant: str) -> int:
        """Threads ``tenant``'s calls hold now."""
        return self._held.get(tenant, 0)

    def _may_take(self, tenant: str) -> bool:
        held = self.held(tenant)
        if held == 0:
            return self.free > 0
        return held < self.limits.per_tenant and self.free > self.limits.reserved

    def _take(self, tenant: str) -> None:
        self._held[tenant] = self.held(tenant) + 1

    def _give_back(self, tenant: str) -> None:
        if self._held[tenant] == 1:  # kept only while in use, so however many tenants come, few entries stay
            del self._held[tenant]
        else:
            self._held[tenant] -= 1
        self._serve_waiting()

    def _serve_waiting(self) -> None:
        """Gives free places to the waiting calls the rule lets take one, fewest-held first."""
        while True:
            ready = [w for w in self._waiting if not w.granted.done() and self._may_take(w.tenant)]
            if not ready:
                self._waiting = [w for w in self._waiting if not w.granted.done()]
                return
            first = min(ready, key=lambda w: (self.held(w.tenant), w.order))
            self._take(first.tenant)
            first.granted.set_result(None)

    async def _acquire(self, tenant: str) -> None:
        # no call waiting could take a place now (each release serves them), so one that may take one goes first
        if self._may_take(tenant):
            self._take(tenant)
            return
        waiting = _Waiting(next(self._arrivals), tenant, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        try:
            await waiting.granted
        except BaseException:
            if waiting.granted.done() and not waiting.granted.cancelled():
                self._give_back(tenant)  # given a place, then cancelled before it ran
            else:
                waiting.granted.cancel()
                self._waiting.remove(waiting)
            raise

    @contextlib.asynccontextmanager
    async def place(self, tenant: str) -> AsyncIterator[None]:
        """Held while one of ``tenant``'s calls works in a thread (awaited on the event loop, without one)."""
        await self._acquire(tenant)
        try:
            yield
        finally:
            self._give_back(tenant)

    async def run(self, tenant: str, function: Callable[..., T], *args: Any) -> T:
        """``function(*args)`` in one of the gateway's worker threads, in one of ``tenant``'s places."""
        async with self.place(tenant):
            return await to_thread.run_sync(function, *args, limiter=self._limiter)
