"""The gateway without HTTP, on an in-memory store: what it keeps in memory and what it counts per tenant."""

import contextlib
import json
import threading
import time
import uuid

import pytest

from pipeline.api.gateway import Gateway, NotFoundError, ServedModel, SessionEndedError
from pipeline.api.sample_queue import BusyError
from pipeline.api.tenants import TenantLimitError, TenantLimits
from pipeline.io.store import ObjectStore
from schemas.api import ApiError

BASE = "/models/base/tiny"


def cached_entries(gateway: Gateway) -> int:
    """Entries the gateway holds per session or model: its dicts, and its functions' caches."""
    total = 0
    for value in vars(gateway).values():
        if isinstance(value, dict):
            total += len(value)
        elif hasattr(value, "cache_info"):
            total += value.cache_info().currsize
    return total


def test_the_caches_of_sessions_and_models_stay_bounded_and_what_they_drop_is_read_again():
    """A long-running gateway sees every session and training client of every tenant: what it caches of them is
    bounded, and a session or model dropped from the cache is read again from the store, ended, owned and whole."""
    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=60.0,
                      cached_sessions=4, cached_models=4)
    made = []
    for _ in range(30):
        session = gateway.create_session("alice", [], {})
        model_id = gateway.register_model("alice", session, 0, BASE, 4, {}, None)
        assert gateway.get_info("alice", model_id)["lora_rank"] == 4
        made.append((session, model_id))
    gateway.finish("alice", made[0][0], "success")
    for session, model_id in made[1:]:
        gateway.heartbeat("alice", session)
        gateway.submit("alice", "optim_step", model_id, 1, b"{}")
    assert cached_entries(gateway) <= 3 * 4 + len(gateway.models)  # owners, liveness and models: 4 each at most
    ended, model_id = made[0]
    with pytest.raises(SessionEndedError, match="finished: success"):
        gateway.heartbeat("alice", ended)
    with pytest.raises(NotFoundError):
        gateway.heartbeat("bob", made[1][0])
    assert gateway.model("alice", made[1][1])["lora_rank"] == 4
    with pytest.raises(NotFoundError):
        gateway.model("bob", made[2][1])
    assert cached_entries(gateway) <= 3 * 4 + len(gateway.models)


def test_a_tenant_holds_at_most_its_limit_of_sessions_and_training_clients_and_an_end_frees_places():
    """One tenant cannot create sessions or training clients without bound: at its limit a creation is refused
    naming the setting, other tenants are not held by it, a resent creation takes no new place, and a session's end
    frees its place and its training clients'."""
    from pipeline.api.tenants import TenantLimitError, TenantLimits

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                      limits=TenantLimits(max_sessions=2, max_models=3))
    first, second = gateway.create_session("alice", [], {}), gateway.create_session("alice", [], {})
    with pytest.raises(TenantLimitError, match=r"2 sessions that have not ended.*RLPIPE_API_MAX_SESSIONS"):
        gateway.create_session("alice", [], {})
    gateway.create_session("bob", [], {})  # Bob's places are his own
    for session, seq in ((first, 0), (first, 1), (second, 0)):
        gateway.register_model("alice", session, seq, BASE, 4, {}, None)
    with pytest.raises(TenantLimitError, match=r"3 training clients.*RLPIPE_API_MAX_MODELS"):
        gateway.register_model("alice", second, 1, BASE, 4, {}, None)
    assert not store.exists(f"sessions/{second}/models/1.json")
    gateway.register_model("alice", first, 0, BASE, 4, {}, None)  # resent: its own place
    gateway.finish("alice", first, "success")
    third = gateway.create_session("alice", [], {})
    gateway.register_model("alice", second, 1, BASE, 4, {}, None)
    gateway.register_model("alice", third, 0, BASE, 4, {}, None)
    with pytest.raises(TenantLimitError):
        gateway.register_model("alice", third, 1, BASE, 4, {}, None)


def test_a_tenant_holds_at_most_its_limit_of_sampling_sessions_and_an_end_frees_places():
    """``create_sampling_session`` is a record in the store per call: one tenant holds at most its limit of them in
    sessions not ended, refused naming the setting; a resent creation takes no new place, another tenant's places
    are its own, and a session's end frees its sampling sessions' places."""
    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                      limits=TenantLimits(max_sampling_sessions=3))
    first, second = gateway.create_session("alice", [], {}), gateway.create_session("alice", [], {})
    for session, seq in ((first, 0), (first, 1), (second, 0)):
        gateway.create_sampling_session("alice", session, seq, BASE, None)
    with pytest.raises(TenantLimitError, match=r"3 sampling sessions.*RLPIPE_API_MAX_SAMPLING_SESSIONS"):
        gateway.create_sampling_session("alice", second, 1, BASE, None)
    assert not store.exists(f"sessions/{second}/samplers/1.json")
    gateway.create_sampling_session("alice", first, 0, BASE, None)  # resent: its own place
    bob = gateway.create_session("bob", [], {})
    gateway.create_sampling_session("bob", bob, 0, BASE, None)
    gateway.finish("alice", first, "success")  # frees two places
    gateway.create_sampling_session("alice", second, 1, BASE, None)
    gateway.create_sampling_session("alice", second, 2, BASE, None)
    with pytest.raises(TenantLimitError):
        gateway.create_sampling_session("alice", second, 3, BASE, None)


def test_a_refusal_at_a_limit_of_one_counts_in_the_singular():
    """"holds 1 sampling session", "1 training client", "1 session that has not ended": the count agrees."""
    from pipeline.api.tenants import TenantLimitError, TenantLimits

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                      limits=TenantLimits(max_sessions=1, max_models=1, max_sampling_sessions=1))
    session = gateway.create_session("alice", [], {})
    with pytest.raises(TenantLimitError, match=r"holds 1 session that has not ended, its limit"):
        gateway.create_session("alice", [], {})
    gateway.register_model("alice", session, 0, BASE, 4, {}, None)
    with pytest.raises(TenantLimitError, match=r"holds 1 training client in sessions that have not ended, its"):
        gateway.register_model("alice", session, 1, BASE, 4, {}, None)
    gateway.create_sampling_session("alice", session, 0, BASE, None)
    with pytest.raises(TenantLimitError, match=r"holds 1 sampling session in sessions that have not ended, its"):
        gateway.create_sampling_session("alice", session, 1, BASE, None)


def test_a_finished_sessions_sampling_sessions_leave_the_count_so_a_creation_lists_only_live_ones():
    """The count of sampling sessions is a folder a creation lists twice: a session's end removes its entries, so a
    tenant that made many sampling sessions in sessions that ended lists only its live ones'."""
    from pipeline.api import quotas

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0)
    for _ in range(20):
        session = gateway.create_session("alice", [], {})
        for seq in range(3):
            gateway.create_sampling_session("alice", session, seq, BASE, None)
        gateway.finish("alice", session, "success")
        assert store.list(f"{quotas.SAMPLERS}/alice") == []
    live = gateway.create_session("alice", [], {})
    listed: list[int] = []
    list_keys = store.list

    def counting_list(prefix, **options):
        keys = list_keys(prefix, **options)
        if prefix.startswith(quotas.SAMPLERS):
            listed.append(len(keys))
        return keys

    store.list = counting_list
    gateway.create_sampling_session("alice", live, 0, BASE, None)
    assert listed and max(listed) <= 1, listed  # (its own entry, once noted)


def test_sessions_and_training_clients_made_before_the_count_existed_are_counted_from_their_records():
    """A store from a gateway that kept no count (one older than the limits) holds live sessions no entry names:
    the first creation counts every session record once (live sessions with a heartbeat, and their training
    clients), so a tenant's sessions from before the upgrade hold their places."""
    from pipeline.api import lifecycle, quotas
    from pipeline.api.tenants import TenantLimitError, TenantLimits

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    older = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0)
    first, second, ended, cut = (older.create_session("alice", [], {}) for _ in range(4))
    store.delete(lifecycle.heartbeat_key(cut))  # its creation cut short: it never ends, and holds no place
    older.register_model("alice", first, 0, BASE, 4, {}, None)
    older.register_model("alice", second, 0, BASE, 4, {}, None)
    older.finish("alice", ended, "success")
    older.create_session("bob", [], {})
    for key in store.list(quotas.TENANTS, recursive=True):  # what that gateway never wrote
        store.delete(key)
    store.delete(quotas.COUNTED, missing_ok=True)
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                      limits=TenantLimits(max_sessions=2, max_models=2))
    with pytest.raises(TenantLimitError, match=r"2 sessions that have not ended"):
        gateway.create_session("alice", [], {})
    with pytest.raises(TenantLimitError, match=r"2 training clients"):
        gateway.register_model("alice", first, 1, BASE, 4, {}, None)
    gateway.create_session("bob", [], {})  # Bob held one
    with pytest.raises(TenantLimitError):
        gateway.create_session("bob", [], {})
    gateway.finish("alice", second, "success")
    gateway.register_model("alice", first, 1, BASE, 4, {}, None)  # the end freed its places
    gateway.create_session("alice", [], {})


def test_a_session_whose_creation_failed_takes_no_place_of_its_tenant(monkeypatch):
    """A session whose record or first heartbeat was never written (the store failed, or the gateway died) never
    ends: counted, it would hold its tenant's place for good, with no id the tenant could end."""
    from pipeline.api.tenants import TenantLimits

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                      limits=TenantLimits(max_sessions=1, max_models=1))
    put_create = store.put_create

    def failing(key: str, data: bytes) -> None:
        if key.endswith("/session.json"):
            raise OSError("the store is down")
        put_create(key, data)

    monkeypatch.setattr(store, "put_create", failing)
    with pytest.raises(OSError, match="the store is down"):
        gateway.create_session("alice", [], {})
    monkeypatch.setattr(store, "put_create", put_create)
    session = gateway.create_session("alice", [], {})  # the failed one held no place
    assert gateway.session("alice", session)["tenant"] == "alice"


class RetriedCreateStore(ObjectStore):
    """A gs:// create of a session record whose answer was lost: the client retries it, and the retry reports
    ``FileExistsError`` for the object the first attempt wrote."""

    def put_create(self, key: str, data: bytes) -> str:
        digest = super().put_create(key, data)
        if key.endswith("/session.json"):
            raise FileExistsError(f"{self.url(key)} already exists")
        return digest


def test_a_retried_create_of_a_session_record_that_landed_creates_the_session():
    store = RetriedCreateStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0)
    session = gateway.create_session("alice", ["t"], {})
    gateway.heartbeat("alice", session)
    assert gateway.session("alice", session)["tags"] == ["t"]


class MeetingStore(ObjectStore):
    """A memory store whose listings of a tenant's count wait (at most ``MEET_S``) for a second one to meet them,
    as two calls' requests to a remote store overlap."""

    MEET_S = 0.5

    def __init__(self) -> None:
        super().__init__(f"memory://gw-{uuid.uuid4().hex}")
        self.meeting: threading.Barrier | None = None

    def list(self, prefix: str = "", recursive: bool = False) -> list[str]:
        found = super().list(prefix, recursive)
        if self.meeting is not None and prefix.startswith("api/tenants/"):
            with contextlib.suppress(threading.BrokenBarrierError):  # the other listing waits on a lock
                self.meeting.wait(self.MEET_S)
        return found


def _at_once(*creations) -> list[str]:
    """Run the creations in threads at the same time; what each gave, or the name of its error."""
    outcomes: list[str] = []

    def run(create) -> None:
        try:
            outcomes.append(create())
        except (TenantLimitError, BusyError) as exc:
            outcomes.append(type(exc).__name__)

    threads = [threading.Thread(target=run, args=(create,)) for create in creations]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes


def test_creations_of_one_tenant_in_threads_at_once_stay_within_its_limits():
    """The gateway's routes run in worker threads: two creations of one tenant that each count its places before
    either notes its own are admitted one at a time, so one gateway keeps the limits exactly."""
    store = MeetingStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)],
                      limits=TenantLimits(max_sessions=1, max_models=1))
    store.meeting = threading.Barrier(2)
    sessions = _at_once(*[lambda: gateway.create_session("alice", [], {})] * 2)
    assert sessions.count("TenantLimitError") == 1, sessions  # and the other session was made
    session = next(made for made in sessions if made != "TenantLimitError")
    store.meeting = threading.Barrier(2)
    models = _at_once(*[lambda seq=seq: gateway.register_model("alice", session, seq, BASE, 4, {}, None)
                        for seq in (0, 1)])
    assert models.count("TenantLimitError") == 1, models
    assert len(store.list(f"sessions/{session}/models")) == 1


def test_two_gateways_on_one_store_creating_for_one_tenant_at_once_never_pass_its_limits():
    """Gateways replicated on one store each count a tenant's places in the store: two creations that both count
    before either notes its place would both see room for one.  Each re-counts after noting its own, and one that
    finds the tenant over its limit takes its place back and is refused, so the limits hold across gateways (at
    the limit both may be refused: the tenant's client sends again)."""
    store = MeetingStore()
    limits = TenantLimits(max_sessions=2, max_models=1, max_sampling_sessions=1)
    first, second = (Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0,
                             limits=limits) for _ in range(2))
    held = first.create_session("alice", [], {})
    store.meeting = threading.Barrier(2)
    sessions = _at_once(lambda: first.create_session("alice", [], {}), lambda: second.create_session("alice", [], {}))
    assert sessions.count("TenantLimitError") >= 1, sessions
    live = [key.rsplit("/", 1)[-1] for key in store.list("sessions")]
    assert len([session for session in live if not first.quota.has_ended(session)]) <= 2, live  # (refused: ended)
    store.meeting = threading.Barrier(2)
    models = _at_once(lambda: first.register_model("alice", held, 0, BASE, 4, {}, None),
                      lambda: second.register_model("alice", held, 1, BASE, 4, {}, None))
    assert models.count("TenantLimitError") >= 1, models
    assert len(store.list(f"sessions/{held}/models")) <= 1
    store.meeting = threading.Barrier(2)
    samplers = _at_once(lambda: first.create_sampling_session("alice", held, 0, BASE, None),
                        lambda: second.create_sampling_session("alice", held, 1, BASE, None))
    assert samplers.count("TenantLimitError") >= 1, samplers
    assert len(store.list(f"sessions/{held}/samplers")) <= 1


class MeetingBodyStore(ObjectStore):
    """A memory store whose writes of a call's body wait (at most ``MEET_S``) for a second one to meet them."""

    MEET_S = 0.5

    def __init__(self) -> None:
        super().__init__(f"memory://gw-{uuid.uuid4().hex}")
        self.meeting: threading.Barrier | None = None

    def put_create(self, key: str, data: bytes) -> str:
        if self.meeting is not None and "/requests/" in key:
            with contextlib.suppress(threading.BrokenBarrierError):  # the other write waits on a lock
                self.meeting.wait(self.MEET_S)
        return super().put_create(key, data)


def test_sample_calls_in_threads_at_once_stay_within_the_queues_places():
    """Two sample calls whose bodies are written at the same time each take a place before either is queued: with
    one place, one of them is answered 429 and the queue holds one call."""
    store = MeetingBodyStore()
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], max_pending_samples=1)
    session = gateway.create_session("alice", [], {})
    sampler = gateway.create_sampling_session("alice", session, 0, BASE, None)
    store.meeting = threading.Barrier(2)
    calls = _at_once(*[lambda seq=seq: gateway.submit_sample("alice", sampler, seq, b"{}", 1, 1)[0] for seq in (0, 1)])
    assert calls.count("BusyError") == 1, calls
    assert gateway.samples.queued(BASE) == 1


def test_a_sample_call_refused_after_it_took_a_place_gives_it_back():
    """A sample call whose seq_id was used for another body is refused, and frees the place it took; the call that
    used it first keeps its own."""
    gateway = Gateway(ObjectStore(f"memory://gw-{uuid.uuid4().hex}"), lambda event, key: None,
                      [ServedModel(BASE, BASE)], max_pending_samples=4)
    session = gateway.create_session("alice", [], {})
    sampler = gateway.create_sampling_session("alice", session, 0, BASE, None)
    gateway.submit_sample("alice", sampler, 0, b"{}", 1, 1)
    gateway.submit_sample("alice", sampler, 0, b"{}", 1, 1)  # resent: the same call, one place
    with pytest.raises(ApiError, match="already used"):
        gateway.submit_sample("alice", sampler, 0, b'{"other": 1}', 1, 1)
    assert gateway.samples.queued(BASE) == 1
    gateway.samples.answered(f"{sampler.replace(':', '.')}.1")
    with pytest.raises(ApiError, match="already used"):
        gateway.submit_sample("alice", sampler, 0, b'{"other": 1}', 1, 1)
    assert gateway.samples.queued(BASE) == 0


def test_a_body_read_as_json_first_is_validated_as_the_sdks_json_path_validates_it():
    """``parse_body(json_first=True)`` (a sample's prompt: a quarter of the time) takes what the SDK type's own JSON
    path takes, as the same request, and refuses what it refuses, naming the same field."""
    from tinker import types

    from pipeline.api.wire import parse_body

    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    bodies = [{"prompt": prompt, "sampling_params": {"max_tokens": 4, "temperature": 0.7, "stop": ["\n"]},
               "num_samples": 2, "sampling_session_id": "s:sample:0", "seq_id": 3, "type": "sample"},
              {"prompt": prompt, "sampling_params": {"seed": "5"}, "num_samples": 1.0},
              {"prompt": prompt, "sampling_params": {}, "num_samples": 1.5},
              {"prompt": {"chunks": [{"type": "encoded_text", "tokens": "123"}]}, "sampling_params": {}},
              {"prompt": prompt, "sampling_params": {}, "unknown": 1},
              {"sampling_params": {}}]
    raws = [json.dumps(body).encode() for body in bodies] + [b"", b"{", b"[1]", b'{"prompt": NaN}',
                                                             b'{"prompt": {"chunks": []}, "sampling_params": '
                                                             b'{"temperature": NaN}}']

    def outcome(raw: bytes, json_first: bool) -> object:
        try:
            return parse_body(types.SampleRequest, raw, json_first=json_first)
        except ApiError as exc:
            return str(exc)

    for raw in raws:
        first, validated = outcome(raw, True), outcome(raw, False)
        if isinstance(validated, str):
            assert isinstance(first, str) and first.split(": ")[:2] == validated.split(": ")[:2], (first, validated)
        else:
            assert first.model_dump_json() == validated.model_dump_json(), raw  # (NaN is no NaN's equal)


def test_a_session_an_operator_ends_or_a_reader_finds_expired_leaves_the_sampling_session_count_at_once():
    """Every end recorded frees the session's sampling-session places, not only a client's finish: an operator's
    ``rlpipe sessions end`` and an expiry a gateway finds, and a place that cannot be freed never fails the end."""
    from pipeline.api import lifecycle, quotas

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0)
    ended, expired, broken = (gateway.create_session("alice", [], {}) for _ in range(3))
    for session in (ended, expired, broken):
        gateway.create_sampling_session("alice", session, 0, BASE, None)
    assert len(store.list(f"{quotas.SAMPLERS}/alice")) == 3
    lifecycle.record_end(store, ended, "ended by an operator: test")
    assert len(store.list(f"{quotas.SAMPLERS}/alice")) == 2
    lifecycle.session_end(store, expired, now=time.time() + 2 * lifecycle.SESSION_EXPIRY_S)
    assert len(store.list(f"{quotas.SAMPLERS}/alice")) == 1
    delete = store.delete

    def failing_delete(key, **options):
        raise OSError("the store is down")

    store.delete = failing_delete
    assert lifecycle.record_end(store, broken, "ended by an operator: test")[0] == "ended by an operator: test"
    store.delete = delete


def test_an_end_frees_the_sessions_and_its_training_clients_places_at_once():
    """A session's entry and its training clients' entries leave the tenant's count as its end is recorded, so the
    folder every creation lists twice holds the live sessions' entries, not every session that ever ended."""
    from pipeline.api import lifecycle, quotas

    store = ObjectStore(f"memory://gw-{uuid.uuid4().hex}")
    gateway = Gateway(store, lambda event, key: None, [ServedModel(BASE, BASE)], live_check_s=0.0)
    live = gateway.create_session("alice", [], {})
    for _ in range(5):
        session = gateway.create_session("alice", [], {})
        for seq in range(2):
            gateway.register_model("alice", session, seq, BASE, 8, {}, None)
        lifecycle.record_end(store, session, "ended by an operator: test")
    names = sorted(key.rsplit("/", 1)[-1] for key in store.list(f"{quotas.TENANTS}/alice"))
    assert names == [live], names


def test_a_sample_call_whose_prompt_fills_the_context_is_refused_before_it_takes_a_place():
    """submit_sample checks the prompt's length as the HTTP handler's call does: a prompt of 8 tokens in a context of
    8 leaves no room to sample one, and is refused without a place; one of 7 is queued."""
    gateway = Gateway(ObjectStore(f"memory://gw-{uuid.uuid4().hex}"), lambda event, key: None,
                      [ServedModel(BASE, BASE, max_context_length=8)], max_pending_samples=4)
    session = gateway.create_session("alice", [], {})
    sampler = gateway.create_sampling_session("alice", session, 0, BASE, None)
    with pytest.raises(ApiError, match="prompt of 8 tokens leaves no room to sample"):
        gateway.submit_sample("alice", sampler, 0, b"{}", 1, prompt_tokens=8)
    assert gateway.samples.queued(BASE) == 0
    gateway.submit_sample("alice", sampler, 0, b"{}", 1, prompt_tokens=7)
    assert gateway.samples.queued(BASE) == 1
