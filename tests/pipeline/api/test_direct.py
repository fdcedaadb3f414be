"""The direct path for sample calls: the gateway hands a call to its sampler over HTTP and wakes the poll
when the sampler answers; a sampler that refuses or is not there leaves the call to the log."""

from __future__ import annotations

import asyncio

from pipeline.api.direct import DirectSamplers, direct_app, serve_direct
from pipeline.api.results import ResultSignals
from pipeline.devstack.process import free_port
from schemas.api import ApiRequestAccepted

MODEL = "/models/tiny"


def _call(n: int, op: str = "sample", base_model: str = MODEL) -> ApiRequestAccepted:
    return ApiRequestAccepted(request_id=f"sess-1.sample.{n}", tenant="alice", session_id="sess-1", op=op,
                              model_id="sess-1.sample", seq_id=n, base_model=base_model,
                              body_path=f"sessions/sess-1/requests/{n}.json", body_sha256="0" * 64)


async def _woken(signals: ResultSignals, direct: DirectSamplers, call: ApiRequestAccepted,
                 within_s: float = 2.0) -> bool:
    """Dispatch ``call`` and say whether its poll was woken within ``within_s``."""
    with signals.watch(call.request_id) as announced:
        direct.dispatch(call)
        try:
            await asyncio.wait_for(announced.wait(), within_s)
        except TimeoutError:
            return False
        return True


def test_a_handed_over_call_runs_on_the_sampler_and_wakes_its_poll_when_answered():
    ran: list[str] = []

    async def run_call(call: ApiRequestAccepted) -> None:
        if call.base_model != MODEL:
            raise ValueError(f"this sampler serves {MODEL}")
        await asyncio.sleep(0.05)  # the result is stored before the answer
        ran.append(call.request_id)

    async def scenario() -> tuple[bool, bool, bool, int]:
        port = free_port()
        server, serving = await serve_direct(direct_app(run_call), port)
        signals = ResultSignals()
        direct = DirectSamplers({MODEL: f"http://127.0.0.1:{port}", "/models/other": f"http://127.0.0.1:{port}"},
                                signals)
        try:
            served = await _woken(signals, direct, _call(1))
            refused = await _woken(signals, direct, _call(2, base_model="/models/other"))  # answered 400
            unknown = await _woken(signals, direct, _call(3, base_model="/models/not-served"))  # no sampler: log only
            return served, refused, unknown, direct.delivered
        finally:
            await direct.close()
            server.should_exit = True
            await serving

    served, refused, unknown, delivered = asyncio.run(scenario())
    assert served and ran == ["sess-1.sample.1"]
    assert not refused and not unknown and delivered == 1


def test_a_sampler_that_is_not_listening_leaves_the_call_to_the_log():
    async def scenario() -> tuple[bool, int]:
        signals = ResultSignals()
        direct = DirectSamplers({MODEL: f"http://127.0.0.1:{free_port()}"}, signals)  # nothing listens there
        try:
            return await _woken(signals, direct, _call(1)), direct.delivered
        finally:
            await direct.close()

    woken, delivered = asyncio.run(scenario())
    assert not woken and delivered == 0
