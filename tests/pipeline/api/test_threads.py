"""The rule that shares the gateway's worker threads between tenants (``pipeline.api.threads``), on the event loop
alone: places are taken and given back by hand, and the counts checked after each step."""

import asyncio
import contextlib
import threading

import pytest
from anyio import to_thread

from pipeline.api.threads import TenantThreads, ThreadLimits


async def _hold(threads: TenantThreads, tenant: str, release: asyncio.Event) -> None:
    async with threads.place(tenant):
        await release.wait()


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_few_tenants_with_any_number_of_calls_leave_a_thread_to_another_tenant():
    # 10 threads, 4 a tenant, the last 3 only for a tenant holding none: A takes 4, B 3 (10 - 4 - 3 = 3 left)
    limits = ThreadLimits(total=10, per_tenant=4, reserved=3)

    async def scenario() -> list[tuple[str, int, int]]:
        threads, release, seen = TenantThreads(limits), asyncio.Event(), []
        tasks = [asyncio.create_task(_hold(threads, tenant, release)) for tenant in "AB" for _ in range(10)]
        await _settle()
        seen.append(("AB", threads.held("A") + threads.held("B"), threads.free))
        for tenant in "CDE":  # each takes one thread of the reserve, and no second
            tasks += [asyncio.create_task(_hold(threads, tenant, release)) for _ in range(3)]
            await _settle()
            seen.append((tenant, threads.held(tenant), threads.free))
        release.set()
        await asyncio.gather(*tasks)
        seen.append(("after", sum(threads.held(t) for t in "ABCDE"), threads.free))
        return seen

    assert asyncio.run(scenario()) == [("AB", 4 + 3, 3), ("C", 1, 2), ("D", 1, 1), ("E", 1, 0), ("after", 0, 10)]


def test_a_thread_that_comes_free_goes_first_to_a_tenant_holding_none():
    limits = ThreadLimits(total=4, per_tenant=4, reserved=0)  # (no reserve: only the order of the waiting calls)

    async def scenario() -> tuple[int, int]:
        threads = TenantThreads(limits)
        first_release, rest = asyncio.Event(), asyncio.Event()
        first = asyncio.create_task(_hold(threads, "A", first_release))
        others = [asyncio.create_task(_hold(threads, "A", rest)) for _ in range(5)]  # A holds all 4, 2 calls wait
        await _settle()
        others += [asyncio.create_task(_hold(threads, "B", rest))]  # B waits, after A's waiting calls
        await _settle()
        assert (threads.held("A"), threads.held("B"), threads.free) == (4, 0, 0)
        first_release.set()  # one of A's threads comes free: B's, not A's next call's
        await first
        await _settle()
        held = threads.held("A"), threads.held("B")
        rest.set()
        await asyncio.gather(*others)
        return held

    assert asyncio.run(scenario()) == (3, 1)


def test_a_call_given_up_while_waiting_holds_no_place():
    limits = ThreadLimits(total=1, per_tenant=1, reserved=0)

    async def scenario() -> tuple[int, int]:
        threads, release = TenantThreads(limits), asyncio.Event()
        holding = asyncio.create_task(_hold(threads, "A", release))
        waiting = asyncio.create_task(_hold(threads, "B", release))
        await _settle()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        release.set()
        await holding
        after_cancel = threads.free
        async with threads.place("B"):  # B is not waiting behind its given-up call
            return after_cancel, threads.held("B")

    assert asyncio.run(scenario()) == (1, 1)


def test_calls_run_in_the_gateways_own_threads_not_the_pool_every_other_caller_shares():
    calls = 12
    limits = ThreadLimits(total=calls, per_tenant=calls, reserved=0)
    together = threading.Barrier(calls, timeout=5)  # passes only when all of them run at once

    async def scenario() -> list[int]:
        to_thread.current_default_thread_limiter().total_tokens = 1  # the shared pool, down to one thread
        threads = TenantThreads(limits)
        return await asyncio.gather(*(threads.run("A", together.wait) for _ in range(calls)))

    assert sorted(asyncio.run(scenario())) == list(range(calls))


@pytest.mark.parametrize(("environ", "message"), [
    ({"RLPIPE_API_THREADS": "many"}, "RLPIPE_API_THREADS='many': set a whole number"),
    ({"RLPIPE_API_THREADS": "0"}, "RLPIPE_API_THREADS='0': Input should be greater than or equal to 1"),
    ({"RLPIPE_API_THREADS": "16", "RLPIPE_API_THREADS_PER_TENANT": "20"},
     "RLPIPE_API_THREADS_PER_TENANT=20 is more than RLPIPE_API_THREADS=16; set it to at most the threads there are"),
    ({"RLPIPE_API_THREADS": "16", "RLPIPE_API_THREADS_RESERVED": "16"},
     "RLPIPE_API_THREADS_RESERVED=16 leaves no thread to a tenant's second call (RLPIPE_API_THREADS=16); set it "
     "below RLPIPE_API_THREADS"),
])
def test_thread_settings_that_cannot_be_used_are_refused_in_one_line_naming_the_setting(environ, message):
    with pytest.raises(ValueError) as refused:
        ThreadLimits.from_env(environ)
    assert str(refused.value) == message


def test_thread_settings_scale_the_defaults_with_the_pool():
    assert ThreadLimits.from_env({}) == ThreadLimits(total=40, per_tenant=8, reserved=10)
    assert ThreadLimits.from_env({"RLPIPE_API_THREADS": "100"}) == ThreadLimits(total=100, per_tenant=8, reserved=25)
    assert ThreadLimits.from_env({"RLPIPE_API_THREADS": "4", "RLPIPE_API_THREADS_RESERVED": "0"}) == ThreadLimits(
        total=4, per_tenant=4, reserved=0)
