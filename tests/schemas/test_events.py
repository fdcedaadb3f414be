"""Events: envelope round trip, refusal of unknown types, newer majors and bad payloads."""

import json
from datetime import UTC, datetime

import pytest

from schemas.api import ApiRequestAccepted, ApiResultReady
from schemas.events import (
    PAYLOAD_TYPES,
    AdapterPublished,
    ConfigFieldChange,
    DeadLetter,
    EventDecodeError,
    LearnerCheckpointed,
    LearnerLeft,
    LearnerProgress,
    NewerEventError,
    NewerEventTypeError,
    ProducerHeartbeat,
    RunConfigChanged,
    RunStarted,
    RunStopped,
    TrajectoryBatchCommitted,
    decode_event,
    encode_event,
    framed_sha256,
    make_event,
)

SHA = "ab" * 32
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)

EXAMPLES = [
    TrajectoryBatchCommitted(
        batch_id="b-1", path="runs/r/trajectories/date=2026-01-02/b-1.parquet", sha256=SHA, num_rows=4,
        num_tokens=100, num_generated_tokens=20, num_groups=1, env="cartpole", producer_id="p0",
        policy_version_min=1, policy_version_max=2, reward_mean=1.5, reward_min=0.0, reward_max=3.0,
        success_rate=0.25, created_at=NOW,
    ),
    AdapterPublished(version=3, path="runs/r/adapters/v000003", manifest_sha256=SHA, base_model="tiny",
                     parent_version=2, learner_step=30, files={"adapter_model.safetensors": SHA}),
    RunStarted(config_path="runs/r/run.json", config_sha256=SHA, env="cartpole", base_model="tiny"),
    RunConfigChanged(config_path="runs/r/config-changes/000001.json", config_sha256=SHA,
                     changes=[ConfigFieldChange(field="learner.learning_rate", before=1e-3, after=5e-4)]),
    ProducerHeartbeat(producer_id="p0", adapter_version=1, samples_total=10, batches_total=1, tokens_total=500,
                      env_steps_total=40, samples_per_s=2.0, tokens_per_s=100.0, env_steps_per_s=8.0,
                      busy_fraction=0.5, interval_s=5.0),
    LearnerCheckpointed(step=10, version=2, path="runs/r/checkpoints/step-000010",
                        offsets={"rlpipe.trajectories:0": 12}, metrics={"loss": 0.5}),
    LearnerProgress(step=11, version=3, positions={"rlpipe.trajectories:0": 14}),
    LearnerLeft(step=12, version=3),
    RunStopped(reason="budget reached", final_version=4, final_step=40),
    DeadLetter(reason="not JSON", origin_topic="rlpipe.trajectories", origin_partition=0, origin_offset=7,
               key="r", raw="\x00garbage"),
    DeadLetter(reason="not JSON", origin_topic="rlpipe.trajectories", origin_partition=0, origin_offset=8,
               key="r", raw="{" + "x" * 4095, raw_truncated=True, origin_timestamp_ms=1_700_000_000_000,
               record_sha256=SHA),
    ApiRequestAccepted(request_id="req-1", tenant="alice", session_id="sess-1", op="optim_step",
                       model_id="sess-1:train:0", seq_id=3, body_path="sessions/sess-1/requests/req-1.json",
                       body_sha256=SHA),
    ApiResultReady(request_id="req-1", session_id="sess-1", op="optim_step", model_id="sess-1:train:0", seq_id=3,
                   ok=True, result_path="sessions/sess-1/results/req-1.json", result_sha256=SHA),
]


def test_every_event_type_has_an_example():
    assert {type(e).event_type for e in EXAMPLES} == set(PAYLOAD_TYPES)


@pytest.mark.parametrize("payload", EXAMPLES, ids=lambda p: type(p).__name__)
def test_round_trip(payload):
    event = make_event("run-1", payload)
    decoded = decode_event(encode_event(event))
    assert decoded == event
    assert type(decoded.payload) is type(payload)
    assert json.loads(encode_event(event))["type"] == type(payload).event_type


def _raw(**changes):
    data = json.loads(encode_event(make_event("run-1", EXAMPLES[0])))
    data.update(changes)
    return json.dumps(data).encode()


def test_unknown_type_refused():
    with pytest.raises(EventDecodeError, match="unknown event type 'Nope'"):
        decode_event(_raw(type="Nope"))


def test_an_event_type_a_newer_minor_added_is_told_apart_from_an_unknown_one():
    """A newer minor of this major may add event types (schemas.versions): readers skip those, counted, while an
    unknown type of this version (or of no version) is invalid and goes to the dead-letter topic."""
    with pytest.raises(NewerEventTypeError, match=r"'Nope'.*1\.7.*skipped") as info:
        decode_event(_raw(type="Nope", schema_version="1.7"))
    assert info.value.event_type == "Nope"
    for version in ("1.0", "0.9", "x"):
        with pytest.raises(EventDecodeError) as info:
            decode_event(_raw(type="Nope", schema_version=version))
        assert not isinstance(info.value, NewerEventTypeError), version
    with pytest.raises(NewerEventError):  # a newer major: not readable at all, whatever its type
        decode_event(_raw(type="Nope", schema_version="2.0"))


def test_newer_major_refused_but_newer_minor_read():
    with pytest.raises(EventDecodeError, match="newer than this rlpipe reads"):
        decode_event(_raw(schema_version="2.0"))
    assert decode_event(_raw(schema_version="1.7")).payload == EXAMPLES[0]


def test_negative_version_refused():
    data = json.loads(_raw())
    data["payload"]["policy_version_min"] = -1
    with pytest.raises(EventDecodeError, match="policy_version_min"):
        decode_event(json.dumps(data))


def test_version_range_must_be_ordered():
    data = json.loads(_raw())
    data["payload"]["policy_version_min"] = 5
    with pytest.raises(EventDecodeError, match="policy_version_max"):
        decode_event(json.dumps(data))


@pytest.mark.parametrize("garbage", [b"\xff\xfe", b"not json", b"[1,2]", b'{"type": 3}'])
def test_garbage_is_a_decode_error(garbage):
    with pytest.raises(EventDecodeError):
        decode_event(garbage)


@pytest.mark.parametrize("garbage", [
    b"[" * 100_000,  # nested deeper than the JSON parser recurses
    b'{"type": "RunStopped", "payload": {"final_step": ' + b"9" * 5_000 + b"}}",  # more digits than int() takes
], ids=["deeply nested", "huge integer"])
def test_json_the_parser_gives_up_on_is_a_decode_error(garbage):
    # any other error would escape the readers' dead-letter path and stop them at this message for good
    with pytest.raises(EventDecodeError, match="not JSON"):
        decode_event(garbage)


def _with_payload(payload: dict) -> str:
    data = json.loads(encode_event(make_event("run-a", EXAMPLES[3])))  # a RunConfigChanged: free JSON values
    return json.dumps({**data, "payload": {**data["payload"], **payload}})


@pytest.mark.parametrize("payload", [
    {"changes": [{"field": "f", "before": json.loads("[" * 400 + "]" * 400)}]},  # deeper than JSON output goes
    {"config_path": "runs/r/\ud800.json"},  # a lone surrogate: no UTF-8 for it
], ids=["deeply nested value", "lone surrogate"])
def test_an_event_that_cannot_be_encoded_again_is_a_decode_error(payload):
    # read as valid, it would fail whatever shows or forwards it (``rlpipe topics tail``) on every read
    with pytest.raises(EventDecodeError, match="cannot be encoded again"):
        decode_event(_with_payload(payload))


def test_run_id_with_path_refused():
    with pytest.raises(ValueError, match="run_id"):
        make_event("../etc", EXAMPLES[2])


def test_expected_type_mismatch():
    with pytest.raises(EventDecodeError, match="expected a AdapterPublished"):
        decode_event(_raw(), expected_type="AdapterPublished")


def test_newer_minor_with_new_optional_fields_is_read_and_they_are_ignored():
    # a newer minor version adds optional fields (schemas.versions): to the envelope, the payload or a nested record
    data = json.loads(_raw(schema_version="1.7", trace_id="abc"))
    data["payload"]["compression"] = "zstd"
    decoded = decode_event(json.dumps(data))
    assert decoded.payload == EXAMPLES[0]
    changed = json.loads(encode_event(make_event("run-1", RunConfigChanged(
        config_path="runs/run-1/config-changes/1.json", config_sha256="c" * 64,
        changes=[ConfigFieldChange(field="learner.learning_rate", before=0.1, after=0.2)]))))
    changed["schema_version"] = "1.3"
    changed["payload"]["changes"][0]["reason"] = "restart"
    assert decode_event(json.dumps(changed)).payload.changes[0].after == 0.2


def test_unknown_field_of_this_version_still_refused():
    data = json.loads(_raw())
    data["payload"]["compression"] = "zstd"
    with pytest.raises(EventDecodeError, match="compression"):
        decode_event(json.dumps(data))
    with pytest.raises(EventDecodeError, match="trace_id"):
        decode_event(_raw(trace_id="abc"))


def test_a_version_or_checkpoint_has_one_event_id_however_often_it_is_announced() -> None:
    """Learners announce a version or checkpoint again at each start (``consumers.reannounce``): every sending of
    one carries the id derived from what it names, so readers that dedupe by ``event_id`` count it once."""
    from schemas.events import AdapterPublished, LearnerCheckpointed, RunStopped, announcement_id, make_event

    def published(version: int, digest: str = "a") -> AdapterPublished:
        return AdapterPublished(version=version, path=f"runs/r/adapters/v{version:06d}", manifest_sha256=digest * 64,
                                base_model="m", parent_version=version - 1, learner_step=version, files={})

    def checkpointed(path: str, metrics: dict[str, float] | None = None) -> LearnerCheckpointed:
        return LearnerCheckpointed(step=2, version=2, path=path, offsets={"t:0": 4}, metrics=metrics or {})

    assert make_event("r", published(3)).event_id == make_event("r", published(3)).event_id
    assert make_event("r", published(3)).event_id == announcement_id("r", published(3))
    # its checkpoint folder names a checkpoint (the metrics of a sending again may be read back differently)
    assert make_event("r", checkpointed("c/step-2-a")).event_id == make_event(
        "r", checkpointed("c/step-2-a", {"loss": 1.0})).event_id
    distinct = [announcement_id("r", published(3)), announcement_id("r", published(4)),
                announcement_id("r", published(3, "b")), announcement_id("s", published(3)),
                announcement_id("r", checkpointed("c/step-2-a")), announcement_id("r", checkpointed("c/step-2-b"))]
    assert len(set(distinct)) == len(distinct)
    stop = RunStopped(reason="done")
    assert announcement_id("r", stop) is None
    assert make_event("r", stop).event_id != make_event("r", stop).event_id  # other events: a fresh id each


def test_a_dead_letter_has_one_event_id_however_often_its_record_is_dead_lettered() -> None:
    """A reader restarted before it committed past a record it dead-lettered reads the record again and sends its
    letter again: every sending carries the id derived from the record (run, origin and the bytes kept of it), so
    readers that dedupe by ``event_id`` count one letter per record.  The reason is no part of it (a restart may
    word the same failure differently)."""
    from schemas.events import announcement_id

    def letter(reason: str = "not JSON", *, topic: str = "ns.trajectories", partition: int = 0, offset: int = 7,
               key: str | None = "r", raw: str = "{garbage") -> DeadLetter:
        return DeadLetter(reason=reason, origin_topic=topic, origin_partition=partition, origin_offset=offset,
                          key=key, raw=raw)

    first, again = make_event("r", letter("not JSON: line 1")), make_event("r", letter("not JSON: line 1, column 2"))
    assert first.event_id == again.event_id == announcement_id("r", letter())
    # another record (another origin, or other bytes at one origin: a topic created again numbers from 0 again)
    # or another run's reader: another letter
    others = [letter(topic="ns.control"), letter(partition=1), letter(offset=8), letter(key="s"), letter(key=None),
              letter(raw="{other")]
    distinct = [announcement_id("r", letter()), announcement_id("s", letter()),
                *(announcement_id("r", other) for other in others)]
    assert len(set(distinct)) == len(distinct)


def test_a_letter_about_a_broker_record_is_named_by_the_record_timestamp_and_whole_bytes() -> None:
    """A reader's letter keeps only the start of a record, undecodable bytes replaced, and carries the record's
    timestamp and the digest of its whole bytes: records at one origin (a topic created again numbers from 0
    again) whose letters keep the same ``key`` and ``raw`` get ids of their own, while every sending of one
    record's letter, whatever its reason, carries one id."""
    from schemas.events import announcement_id

    def letter(reason: str = "not JSON", *, timestamp: int | None = 1_000, value: bytes = b"\xff") -> DeadLetter:
        return DeadLetter(reason=reason, origin_topic="ns.trajectories", origin_partition=0, origin_offset=0,
                          key="r", raw="\ufffd", origin_timestamp_ms=timestamp,
                          record_sha256=framed_sha256((b"r", value)))

    assert announcement_id("r", letter("not JSON")) == announcement_id("r", letter("not JSON: worded otherwise"))
    same_kept = [letter(), letter(value=b"\xfe"), letter(timestamp=9_000), letter(timestamp=None),
                 letter(timestamp=0), DeadLetter(**letter().model_dump(exclude={"origin_timestamp_ms",
                                                                                "record_sha256"}))]
    ids = [announcement_id("r", each) for each in same_kept]
    assert len(set(ids)) == len(ids)


def test_framed_sha256_tells_apart_what_plain_concatenation_does_not() -> None:
    assert framed_sha256((b"ab", b"c")) != framed_sha256((b"a", b"bc"))
    assert framed_sha256((None, b"")) != framed_sha256((b"", None)) != framed_sha256((b"", b""))
    assert framed_sha256((b"k", b"v")) == framed_sha256([b"k", b"v"])


def test_a_dead_letter_of_schema_1_0_decodes_and_keeps_its_id() -> None:
    """Letters sent before 1.1 carry neither the record's timestamp nor its digest: they still decode, and their
    id is still the one derived from their ``key`` and ``raw``, so a letter sent again keeps the id of its copies
    already on the topic (the value below is the id such letters were sent with)."""
    older = {"type": "DeadLetter", "schema_version": "1.0", "event_id": "17486d2b-a5b3-5f60-92f1-ddeaa5ec1304",
             "run_id": "r", "time": NOW.isoformat(),
             "payload": {"reason": "not JSON", "origin_topic": "ns.trajectories", "origin_partition": 0,
                         "origin_offset": 7, "key": "r", "raw": "{garbage", "raw_truncated": False}}
    letter = decode_event(json.dumps(older)).payload
    assert (letter.origin_timestamp_ms, letter.record_sha256) == (None, None)
    assert str(make_event("r", letter).event_id) == older["event_id"]


@pytest.mark.parametrize("field", [{"record_sha256": "not hex"}, {"origin_timestamp_ms": -1}])
def test_a_dead_letter_with_a_bad_record_digest_or_timestamp_is_refused(field: dict) -> None:
    about_a_record = next(e for e in EXAMPLES if isinstance(e, DeadLetter) and e.record_sha256 is not None)
    data = json.loads(encode_event(make_event("r", about_a_record)))
    with pytest.raises(EventDecodeError, match=next(iter(field))):
        decode_event(json.dumps({**data, "payload": {**data["payload"], **field}}))
