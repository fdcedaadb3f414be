"""The gateway's one event loop is shared by every tenant: a call waiting on the store must not hold up the others.

The app is served in process (httpx's ASGI transport runs requests as tasks on one loop, as uvicorn does) over a
memory store whose write of one call can be held, as a slow remote store holds it."""

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import httpx
import pytest
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from pipeline.api.app import create_app
from pipeline.api.gateway import Gateway, ServedModel
from pipeline.api.tenants import Tenants
from pipeline.api.threads import PER_TENANT, ThreadLimits
from pipeline.io.store import ObjectStore

ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}
HELD_AT_MOST_S = 3.0  # a held write goes on after this, so that a call stuck on the loop fails the test, not hangs it


class HeldStore(ObjectStore):
    """A memory store holding the write of every forward_backward body until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(f"memory://held-{uuid.uuid4().hex}")
        self.holding, self.release = threading.Event(), threading.Event()

    def put_create_once(self, key: str, data: bytes) -> str:
        if "/requests/" in key and key.endswith(".pb"):
            self.holding.set()
            self.release.wait(HELD_AT_MOST_S)
        return super().put_create_once(key, data)


async def _session(client: httpx.AsyncClient, headers: dict[str, str]) -> str:
    answer = await client.post("/api/v1/create_session", headers=headers, json={
        "tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"})
    assert answer.status_code == 200, answer.text
    return str(answer.json()["session_id"])


def _forward_backward(model_id: str) -> bytes:
    datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 3]})
    request = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id=1)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_a_tenants_call_waiting_on_the_store_does_not_hold_up_another_tenants_calls():
    store = HeldStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    app = create_app(gateway, Tenants(), poll_hold_s=0.05)
    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)

    async def calls() -> tuple[list[int], bool, int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice, bob = await _session(client, ALICE), await _session(client, BOB)
            created = await client.post("/api/v1/create_model", headers=ALICE, json={
                "session_id": alice, "model_seq_id": 0, "base_model": "/models/base/tiny",
                "lora_config": {"rank": 4}, "type": "create_model"})
            model_id = created.json()["model_id"]
            held = asyncio.create_task(client.post(
                "/api/v1/forward_backward", content=_forward_backward(model_id),
                headers={**ALICE, "Content-Type": "application/x-protobuf"}))
            while not store.holding.is_set():
                await asyncio.sleep(0.005)
            others = [
                await client.post("/api/v1/session_heartbeat", headers=BOB,
                                  json={"session_id": bob, "type": "session_heartbeat"}),
                await client.get("/api/v1/get_server_capabilities", headers=BOB),
                await client.post("/api/v1/retrieve_future", headers=ALICE,
                                  json={"request_id": created.json()["request_id"]}),
            ]
            answered_while_held = not store.release.is_set()
            store.release.set()
            return [answer.status_code for answer in others], answered_while_held, (await held).status_code

    releaser.start()
    try:
        statuses, answered_while_held, held_status = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert statuses == [200, 200, 200]
    assert answered_while_held, "another tenant's calls waited for one tenant's write to the store"
    assert held_status == 200


class HeldHeartbeatStore(ObjectStore):
    """A memory store holding every heartbeat write of the sessions in ``held`` until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__(f"memory://held-{uuid.uuid4().hex}")
        self.held: set[str] = set()
        self.holding, self.release = 0, threading.Event()
        self._lock = threading.Lock()

    def put(self, key: str, data: bytes) -> str:
        if key.endswith("/heartbeat.json") and key.split("/")[1] in self.held:
            with self._lock:
                self.holding += 1
            self.release.wait(HELD_AT_MOST_S)
        return super().put(key, data)


def test_a_tenant_holding_all_its_worker_threads_does_not_hold_up_another_tenants_heartbeat():
    """The routes that write to the store run in worker threads: one tenant with more slow calls at once than the
    gateway has threads (a slow store) holds at most its share of them, so another tenant's heartbeat is answered
    while they wait."""
    store = HeldHeartbeatStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    app = create_app(gateway, Tenants(), poll_hold_s=0.05)
    slow_calls = 60  # more than the gateway's own pool of worker threads (ThreadLimits(): 40, as RLPIPE_API_THREADS unset)

    async def calls() -> tuple[int, int, bool, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice, bob = await _session(client, ALICE), await _session(client, BOB)
            store.held.add(alice)
            held = [asyncio.create_task(client.post("/api/v1/session_heartbeat", headers=ALICE, json={
                "session_id": alice, "type": "session_heartbeat"})) for _ in range(slow_calls)]
            while store.holding == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # (every slow call that can start has started)
            answer = await client.post("/api/v1/session_heartbeat", headers=BOB,
                                       json={"session_id": bob, "type": "session_heartbeat"})
            answered_while_held, holding = not store.release.is_set(), store.holding
            store.release.set()
            return answer.status_code, holding, answered_while_held, [(await call).status_code for call in held]

    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)
    releaser.start()
    try:
        status, holding, answered_while_held, held_statuses = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert status == 200
    assert answered_while_held, f"another tenant's heartbeat waited for one tenant's {holding} slow calls"
    assert holding <= PER_TENANT, holding  # one tenant held its share of the threads, no more
    assert held_statuses == [200] * slow_calls


def test_calls_that_touch_no_store_are_answered_while_their_tenant_holds_all_its_worker_threads():
    """Client start-up and telemetry calls read nothing and write nothing: they are answered on the event loop, not
    queued behind their own tenant's slow calls for one of its worker threads."""
    store = HeldHeartbeatStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    app = create_app(gateway, Tenants(), poll_hold_s=0.05)

    async def calls() -> tuple[list[int], bool]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice = await _session(client, ALICE)
            store.held.add(alice)
            held = [asyncio.create_task(client.post("/api/v1/session_heartbeat", headers=ALICE, json={
                "session_id": alice, "type": "session_heartbeat"})) for _ in range(2 * PER_TENANT)]
            while store.holding < PER_TENANT:
                await asyncio.sleep(0.005)
            answers = [await client.get("/api/v1/healthz"),
                       await client.get("/api/v1/get_server_capabilities", headers=ALICE),
                       await client.post("/api/v1/client/config", headers=ALICE, json={}),
                       await client.post("/api/v1/client/dynamic_config", headers=ALICE, json={}),
                       await client.post("/api/v1/telemetry", headers=ALICE, json={})]
            answered_while_held = not store.release.is_set()
            store.release.set()
            for call in held:
                await call
            return [answer.status_code for answer in answers], answered_while_held

    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)
    releaser.start()
    try:
        statuses, answered_while_held = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert statuses == [200] * 5
    assert answered_while_held, "a call that touches no store waited for its tenant's slow calls"


def test_many_large_sample_calls_at_once_hold_the_event_loop_for_a_short_time_at_most():
    """A sample call's prompt (up to 8 MiB of JSON) takes pydantic a long time to parse, with the GIL held wherever it
    runs: parsed on the event loop, many such calls at once would hold it for the sum of their parses, and every
    tenant's heartbeats and polls with it.  They are parsed in worker threads, in their tenant's places, so the loop
    waits for a few parses at most; and read as JSON before being validated, a quarter of the time."""
    gateway = Gateway(ObjectStore(f"memory://gw-{uuid.uuid4().hex}"), lambda event, key: None,
                      [ServedModel("/models/base/tiny", "/models/base/tiny")], max_pending_samples=64)
    app = create_app(gateway, Tenants(), poll_hold_s=0.05)
    calls, tokens = 16, 200_000  # each a prompt of 1.4 MB: about 0.1 s of parsing by the SDK's type on the loop

    async def largest_gap() -> tuple[float, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice = await _session(client, ALICE)
            created = await client.post("/api/v1/create_sampling_session", headers=ALICE, json={
                "session_id": alice, "sampling_session_seq_id": 0, "base_model": "/models/base/tiny",
                "type": "create_sampling_session"})
            sampler = created.json()["sampling_session_id"]
            bodies = [json.dumps({"prompt": {"chunks": [{"type": "encoded_text", "tokens": [50_000 + seq] * tokens}]},
                                  "sampling_params": {"max_tokens": 4}, "num_samples": 1, "seq_id": seq,
                                  "sampling_session_id": sampler, "type": "sample"}).encode() for seq in range(calls)]
            gaps, done = [], asyncio.Event()

            async def tick() -> None:
                last = time.perf_counter()
                while not done.is_set():
                    await asyncio.sleep(0.002)
                    gaps.append(time.perf_counter() - last)
                    last = time.perf_counter()

            ticker = asyncio.create_task(tick())
            await asyncio.sleep(0.02)
            answers = await asyncio.gather(*(client.post("/api/v1/asample", headers=ALICE, content=body)
                                             for body in bodies))
            done.set()
            await ticker
            return max(gaps), [answer.status_code for answer in answers]

    gap, statuses = asyncio.run(largest_gap())
    assert statuses == [200] * calls
    assert gap < 0.5, f"the event loop stopped {gap:.2f} s for {calls} sample calls at once"


def test_a_slow_upload_holds_none_of_its_tenants_places_while_its_body_arrives():
    """A call's body (up to 64 MiB) is read on the event loop before the call takes one of its tenant's worker-thread
    places, so a slow upload does not hold a place for its whole transfer: with one place, the tenant's other calls
    run while its upload is still coming."""
    store = ObjectStore(f"memory://held-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    app = create_app(gateway, Tenants(), poll_hold_s=0.05, threads=ThreadLimits(total=2, per_tenant=1, reserved=0))
    body = json.dumps({"tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}).encode()

    async def calls() -> tuple[int, int]:
        reading, rest = asyncio.Event(), asyncio.Event()

        async def slow_body():
            yield body[:10]
            reading.set()
            await asyncio.wait_for(rest.wait(), HELD_AT_MOST_S)
            yield body[10:]

        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            upload = asyncio.create_task(client.post("/api/v1/create_session", headers=ALICE, content=slow_body()))
            await reading.wait()
            try:
                other = await asyncio.wait_for(client.get("/api/v1/get_server_capabilities", headers=ALICE), 2.0)
            finally:
                rest.set()
            return other.status_code, (await upload).status_code

    assert asyncio.run(calls()) == (200, 200)


def test_tenants_holding_their_shares_of_the_worker_threads_leave_threads_for_another_tenant():
    """Five tenants, each with more slow calls at once than its share (a slow store), would hold 5 x 8 = 40 threads,
    every one of the pool's: a sixth tenant's heartbeat, poll and session creation are still answered while they
    wait (``pipeline.api.threads``: the last threads go only to a tenant holding none)."""
    store = HeldHeartbeatStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    app = create_app(gateway, Tenants(), poll_hold_s=0.05)
    busy = [{"X-API-Key": f"tml-busy-{n}"} for n in range(5)]
    carol = {"X-API-Key": "tml-carol"}

    async def calls() -> tuple[list[int], int, bool, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            sessions = [await _session(client, headers) for headers in busy]
            own = await _session(client, carol)
            store.held.update(sessions)
            held = [asyncio.create_task(client.post("/api/v1/session_heartbeat", headers=headers, json={
                "session_id": session, "type": "session_heartbeat"}))
                for headers, session in zip(busy, sessions, strict=True) for _ in range(2 * PER_TENANT)]
            while store.holding == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.3)  # (every slow call that can start has started)
            answers = [
                await client.post("/api/v1/session_heartbeat", headers=carol,
                                  json={"session_id": own, "type": "session_heartbeat"}),
                await client.post("/api/v1/retrieve_future", headers=carol, json={"request_id": f"{own}.train.0.0"}),
                await client.post("/api/v1/create_session", headers=carol, json={
                    "tags": [], "user_metadata": {}, "sdk_version": "0.38.0", "type": "create_session"}),
            ]
            answered_while_held, holding = not store.release.is_set(), store.holding
            store.release.set()
            return [a.status_code for a in answers], holding, answered_while_held, [(await c).status_code for c in held]

    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)
    releaser.start()
    try:
        statuses, holding, answered_while_held, held_statuses = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert answered_while_held, f"another tenant's calls waited for five tenants' {holding} slow calls"
    assert statuses[0] == 200 and statuses[2] == 200, statuses
    assert statuses[1] in (200, 404), statuses  # (a poll of an unknown call answers, at once or when held out)
    assert held_statuses == [200] * 5 * 2 * PER_TENANT


class HeldReader:
    """A file of the store whose reads (those after its first rewind when ``after_rewind``) are held until
    ``release`` is set, counting how many are held at once."""

    def __init__(self, handle: Any, store: "HeldReadStore") -> None:
        self.handle, self.store, self.rewound = handle, store, False

    def read(self, size: int = -1) -> bytes:
        if self.rewound or not self.store.after_rewind:
            self.store.hold()
        return self.handle.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        self.rewound = True
        return self.handle.seek(offset, whence)

    def close(self) -> None:
        self.handle.close()

    def __enter__(self) -> "HeldReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class HeldReadStore(ObjectStore):
    """A local store whose reads of external weights' files are held until ``release`` is set: those that check a
    download's bytes, or (``after_rewind``) those that send them."""

    def __init__(self, root: str, after_rewind: bool) -> None:
        super().__init__(root)
        self.after_rewind, self.release = after_rewind, threading.Event()
        self.holding = self.most = 0
        self._lock = threading.Lock()

    def hold(self) -> None:
        with self._lock:
            self.holding += 1
            self.most = max(self.most, self.holding)
        try:
            self.release.wait(HELD_AT_MOST_S)
        finally:
            with self._lock:
                self.holding -= 1

    def open_input(self, key: str) -> Any:
        handle = super().open_input(key)
        return HeldReader(handle, self) if "/external" in key else handle


class CountingHeldStore(HeldStore):
    """A ``HeldStore`` counting the held forward_backward body writes at once (``most``)."""

    def __init__(self) -> None:
        super().__init__()
        self.now = self.most = 0
        self._lock = threading.Lock()

    def put_create_once(self, key: str, data: bytes) -> str:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return super().put_create_once(key, data)
        finally:
            with self._lock:
                self.now -= 1


def test_forward_backward_calls_refused_for_their_size_hold_one_tenants_share_of_the_worker_threads_at_most():
    """A forward_backward refused for its size is logged as refused (a store write) in the gateway's worker threads,
    in its tenant's places: however many such calls one tenant sends to a slow store, they hold at most its share
    of the threads, and another tenant's calls are answered meanwhile."""
    store = CountingHeldStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    limits = ThreadLimits(total=4, per_tenant=2, reserved=1)
    app = create_app(gateway, Tenants(), poll_hold_s=0.05, threads=limits, max_body_bytes=1024, max_json_body_bytes=1024)
    refused_at_once = 8

    async def calls() -> tuple[int, bool, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice, bob = await _session(client, ALICE), await _session(client, BOB)
            created = await client.post("/api/v1/create_model", headers=ALICE, json={
                "session_id": alice, "model_seq_id": 0, "base_model": "/models/base/tiny",
                "lora_config": {"rank": 4}, "type": "create_model"})
            model_id = created.json()["model_id"]
            datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(1, 2000))),
                                loss_fn_inputs={"target_tokens": list(range(2, 2001))})
            bodies = [forward_backward_request_to_proto(types.ForwardBackwardRequest(
                types.ForwardBackwardInput([datum], "cross_entropy"), model_id, seq_id=seq_id)).SerializeToString()
                for seq_id in range(1, refused_at_once + 1)]
            headers = {**ALICE, "Content-Type": "application/x-protobuf"}
            held = [asyncio.create_task(client.post("/api/v1/forward_backward", headers=headers, content=body))
                    for body in bodies]
            while not store.holding.is_set():
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # (every refusal that can log has started)
            answer = await client.post("/api/v1/session_heartbeat", headers=BOB,
                                       json={"session_id": bob, "type": "session_heartbeat"})
            answered_while_held = not store.release.is_set()
            store.release.set()
            return answer.status_code, answered_while_held, [(await call).status_code for call in held]

    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)
    releaser.start()
    try:
        status, answered_while_held, held_statuses = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert held_statuses == [413] * refused_at_once
    assert status == 200 and answered_while_held, "a tenant's heartbeat waited for another's refused calls"
    assert store.most <= limits.per_tenant, f"{store.most} refused calls wrote to the store at once"


@pytest.mark.parametrize("held", ["checking", "sending"])
def test_downloads_by_signed_url_hold_one_tenants_share_of_the_worker_threads_at_most(tmp_path, held):
    """A signed download URL needs no API key: its reads of the store (checking a file's bytes, then sending them)
    are done in the gateway's worker threads as one tenant's, so that however many downloads wait on a slow store
    they hold at most one tenant's share of the threads (``RLPIPE_API_THREADS`` bounds them too) and the tenants'
    calls are answered meanwhile."""
    from pipeline.api import checkpoints
    from pipeline.api.wire import parse_tinker_path

    store = HeldReadStore(tmp_path.as_uri(), after_rewind=held == "sending")
    gateway = Gateway(store, lambda event, key: None, [ServedModel("/models/base/tiny", "/models/base/tiny")])
    limits = ThreadLimits(total=4, per_tenant=2, reserved=1)
    app = create_app(gateway, Tenants(), poll_hold_s=0.05, threads=limits)
    downloads_at_once = 8

    async def calls() -> tuple[int, int, bool, list[int]]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gateway") as client:
            alice, bob = await _session(client, ALICE), await _session(client, BOB)
            created = await client.post("/api/v1/create_model", headers=ALICE, json={
                "session_id": alice, "model_seq_id": 0, "base_model": "/models/base/tiny",
                "lora_config": {"rank": 4}, "type": "create_model"})
            model_id = created.json()["model_id"]
            path = parse_tinker_path(f"tinker://{model_id}/external_weights/final")
            checkpoints.write_external(store, path, {"adapter_config.json": b'{"r": 4}'}, None, request_id="r")
            urls = await client.get(f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/final/"
                                    "external_weights_urls", headers=ALICE)
            url = urls.json()["urls"]["adapter_config.json"]
            held_calls = [asyncio.create_task(client.get(url)) for _ in range(downloads_at_once)]
            while store.holding == 0:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # (every download that can start has started)
            answer = await client.post("/api/v1/session_heartbeat", headers=BOB,
                                       json={"session_id": bob, "type": "session_heartbeat"})
            answered_while_held = not store.release.is_set()
            store.release.set()
            return answer.status_code, store.most, answered_while_held, [(await c).status_code for c in held_calls]

    releaser = threading.Timer(HELD_AT_MOST_S, store.release.set)
    releaser.start()
    try:
        status, most, answered_while_held, held_statuses = asyncio.run(calls())
    finally:
        releaser.cancel()
    assert status == 200 and answered_while_held, "a tenant's heartbeat waited for downloads"
    assert most <= limits.per_tenant, f"{most} downloads read the store at once, beyond one tenant's share"
    assert held_statuses == [200] * downloads_at_once
