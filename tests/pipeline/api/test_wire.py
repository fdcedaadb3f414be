"""The wire codecs against the SDK's own: what the SDK encodes decodes here, what is encoded here the SDK decodes."""

import json
import math

import httpx
import numpy as np
import pytest
from pydantic import BaseModel
from tinker import types
from tinker._compat import model_dump
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from pipeline.api.wire import (
    MAX_SEQ,
    check_seq,
    decode_forward_backward,
    encode_forward_backward_output,
    forward_backward_header,
    numbered_call,
    parse_body,
    parse_tinker_path,
    request_id_for,
    session_of_request,
    training_state_path,
)
from schemas.api import ApiError


def test_forward_backward_request_round_trips_through_the_sdk_encoder():
    datum = types.Datum(
        model_input=types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                             types.EncodedTextChunk(tokens=[3])]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 0.5]},
    )
    sent = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum], loss_fn="ppo",
                                                          loss_fn_config={"clip_low_threshold": 0.7}),
        model_id="sess-a:train:0", seq_id=4)
    body = forward_backward_request_to_proto(sent).SerializeToString()
    received, forward_only = decode_forward_backward(body)
    assert not forward_only
    assert received.model_id == "sess-a:train:0" and received.seq_id == 4
    assert received.forward_backward_input.loss_fn == "ppo"
    assert received.forward_backward_input.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    got = received.forward_backward_input.data[0]
    assert [c.tokens for c in got.model_input.chunks] == [[1, 2], [3]]
    assert got.loss_fn_inputs["target_tokens"].data == [2, 3, 4]
    assert got.loss_fn_inputs["weights"].data == [0.0, 1.0, 0.5]


def test_a_not_finite_loss_fn_config_value_arrives_as_the_sdk_sent_it():
    """The SDK's protobuf carries NaN and infinity as they are (no null, as in its JSON calls): the gateway refuses
    them (below), and the trainer's check of the loss's configuration (``consumers.api.translate``) sees and names
    them in a call logged before."""
    sent = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="ppo", loss_fn_config={
            "clip_low_threshold": math.nan, "clip_high_threshold": math.inf}), model_id="sess-a:train:0", seq_id=1)
    received, _ = decode_forward_backward(forward_backward_request_to_proto(sent).SerializeToString())
    config = received.forward_backward_input.loss_fn_config
    assert math.isnan(config["clip_low_threshold"]) and config["clip_high_threshold"] == math.inf


def _forward_backward_body(loss_fn_config) -> bytes:
    return forward_backward_request_to_proto(types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="ppo", loss_fn_config=loss_fn_config),
        model_id="sess-a:train:0", seq_id=3)).SerializeToString()


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_not_finite_loss_fn_config_value_is_refused_at_the_gateway_in_the_trainers_words(value):
    """The gateway reads the header of every forward_backward: one whose loss_fn_config holds a non-finite number
    is refused there in one line naming the key (the trainer's words), instead of failing its future later; the
    header alone still reads, so the refusal is logged for its seq_id."""
    body = _forward_backward_body({"clip_low_threshold": 0.8, "clip_high_threshold": value})
    with pytest.raises(ApiError) as refused:
        forward_backward_header(body, check_loss_fn_config=True)
    assert str(refused.value) == (f"loss_fn_config clip_high_threshold={value!r} is not a finite number; check the "
                                  "code that computes it")
    assert refused.value.category == "user"
    assert forward_backward_header(body) == ("sess-a:train:0", 3)
    assert numbered_call(body, "pb") == ("sess-a:train:0", 3)


def test_a_finite_or_text_loss_fn_config_passes_the_gateway_and_the_trainer_judges_it():
    """Finite numbers pass; a text value (loss_fn_config_v2) is the trainer's to judge, knowing the loss's keys."""
    for config in (None, {"clip_low_threshold": 0.7, "clip_high_threshold": 1e30}, {"beta": "x"}):
        assert forward_backward_header(_forward_backward_body(config), check_loss_fn_config=True) == (
            "sess-a:train:0", 3)


def test_garbage_body_is_a_user_error():
    with pytest.raises(ApiError, match="protobuf"):
        decode_forward_backward(b"\xff\xff\xff")


def test_forward_backward_output_decodes_with_the_sdk():
    outputs = [{"logprobs": types.TensorData.from_numpy(np.array([-1.0, -2.5], np.float32))},
               {"logprobs": types.TensorData.from_numpy(np.array([-0.25], np.float32))}]
    sent = types.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs,
                                       metrics={"loss:sum": 3.75})
    received = deserialize_forward_backward_output(encode_forward_backward_output(sent))
    assert received.metrics == {"loss:sum": 3.75}
    assert [o["logprobs"].data for o in received.loss_fn_outputs] == [[-1.0, -2.5], [-0.25]]


def test_ids_and_paths():
    assert request_id_for("sess-a:train:2", 7) == "sess-a.train.2.7"
    assert request_id_for("sess-a:train:2", None) == "sess-a.train.2.create"
    assert session_of_request("sess-a.train.2.7") == "sess-a"
    path = parse_tinker_path("tinker://sess-a:train:2/weights/step-1")
    assert (path.model_id, path.kind, path.name, path.run) == ("sess-a:train:2", "training", "step-1", "sess-a.train.2")
    assert str(path) == "tinker://sess-a:train:2/weights/step-1"
    for bad in ("tinker://sess-a:train:2/other/x", "s3://x", "tinker://sess-a:train:2/weights/../x"):
        with pytest.raises(ApiError):
            parse_tinker_path(bad)
    with pytest.raises(ApiError):
        request_id_for("sess/a:train:1", 1)


def test_a_training_state_path_is_a_weights_path():
    """What load_weights loads (into a training client or as a new one) is a weights/ path; the gateway and the
    trainer refuse any other with one message naming the fix."""
    path = training_state_path("tinker://sess-a:train:0/weights/w1")
    assert (path.model_id, path.kind, path.name) == ("sess-a:train:0", "training", "w1")
    for other in ("tinker://sess-a:train:0/sampler_weights/s1", "tinker://sess-a:train:0/external_weights/e1"):
        with pytest.raises(ApiError, match=r"is not a training state; .*tinker://\.\.\./weights/<name>.*save_state"):
            training_state_path(other)
    with pytest.raises(ApiError, match="is not a checkpoint path"):
        training_state_path("file:///etc/passwd")


def test_a_sequence_number_is_the_sdks_int32_from_its_first():
    """Every sequence number (model_seq_id, sampling_session_seq_id, a call's seq_id) is refused alike outside
    ``first`` (0, or 1 for a training call) to 2,147,483,647, naming the field and the SDK call that numbers it."""
    assert MAX_SEQ == 2**31 - 1
    assert check_seq("model_seq_id", 0, 0, "create_lora_training_client") == 0
    assert check_seq("seq_id", MAX_SEQ, 1, "the TrainingClient") == MAX_SEQ
    for field, value, first in (("seq_id", 0, 1), ("seq_id", None, 1), ("model_seq_id", -1, 0),
                                ("sampling_session_seq_id", MAX_SEQ + 1, 0)):
        with pytest.raises(ApiError, match=rf"^{field}={value}: the tinker SDK numbers it from {first} to "
                                           rf"2147483647; use create_x$"):
            check_seq(field, value, first, "create_x")
    body = b'{"model_id": "sess-a:train:0", "seq_id": %d}'
    assert numbered_call(body % MAX_SEQ, "json") == ("sess-a:train:0", MAX_SEQ)
    assert numbered_call(body % (MAX_SEQ + 1), "json") is None and numbered_call(body % 0, "json") is None


def test_every_reader_of_the_log_knows_the_api_events():
    """``rlpipe topics tail requests`` imports only ``schemas.events``; the API's events must decode there."""
    import subprocess
    import sys

    code = "from schemas.events import PAYLOAD_TYPES; assert {'ApiRequestAccepted', 'ApiResultReady'} <= set(PAYLOAD_TYPES)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_tensor_and_token_bytes_of_a_length_no_dtype_divides_are_the_users_error():
    """Such a body is the client's fault: answered as a user error naming the input, not a server fault."""
    from tinker.proto import tinker_public_pb2 as public_pb

    def body(tokens: bytes, weights: bytes) -> bytes:
        msg = public_pb.ForwardBackwardRequest(model_id="sess-a:train:0", seq_id=1, loss_fn="cross_entropy")
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = tokens
        datum.loss_fn_inputs["target_tokens"].CopyFrom(public_pb.Tensor(dense=np.arange(2, dtype=np.int64).tobytes(),
                                                                         dtype=public_pb.DTYPE_INT64))
        datum.loss_fn_inputs["weights"].CopyFrom(public_pb.Tensor(dense=weights, dtype=public_pb.DTYPE_FLOAT32))
        return msg.SerializeToString()

    good_tokens, good_weights = np.arange(2, dtype=np.int32).tobytes(), np.ones(2, np.float32).tobytes()
    assert decode_forward_backward(body(good_tokens, good_weights))[0].model_id == "sess-a:train:0"
    for tokens, weights, names in ((good_tokens, good_weights[:7], "weights"), (good_tokens[:5], good_weights,
                                                                              "tokens")):
        with pytest.raises(ApiError, match=names) as refused:
            decode_forward_backward(body(tokens, weights))
        assert refused.value.category == "user"


def test_a_tensor_whose_shape_does_not_hold_its_values_is_the_users_error():
    """A dense tensor's shape that its values do not fill (3 values, shape [5]) is the client's fault, answered as a
    user error naming the input, not a server fault."""
    from tinker.proto import tinker_public_pb2 as public_pb

    msg = public_pb.ForwardBackwardRequest(model_id="sess-a:train:0", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(3, dtype=np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(public_pb.Tensor(
        dense=np.arange(3, dtype=np.int64).tobytes(), dtype=public_pb.DTYPE_INT64, shape=[5]))
    with pytest.raises(ApiError, match=r"loss_fn_inputs\['target_tokens'\] holds 3 values, not its shape \[5\]"
                       ) as refused:
        decode_forward_backward(msg.SerializeToString())
    assert refused.value.category == "user"
    del datum.loss_fn_inputs["target_tokens"].shape[:]
    datum.loss_fn_inputs["target_tokens"].shape.extend([-1, -3])  # numpy would take neither
    with pytest.raises(ApiError, match=r"holds 3 values, not its shape \[-1, -3\]"):
        decode_forward_backward(msg.SerializeToString())


def test_a_forward_backward_too_large_to_read_is_numbered_from_its_first_bytes():
    """The SDK's encoder writes ``model_id`` and ``seq_id`` before the datums: the first bytes of a body name its call
    without the rest; bytes that stop inside those fields, or a body of another shape, name none."""
    from pipeline.api.wire import forward_backward_prefix, numbered_call

    datum = types.Datum(model_input=types.ModelInput.from_ints(list(range(2000))),
                        loss_fn_inputs={"target_tokens": list(range(2000))})
    sent = types.ForwardBackwardRequest(types.ForwardBackwardInput([datum] * 4, "cross_entropy"), "sess-a:train:3",
                                        seq_id=300)
    body = forward_backward_request_to_proto(sent).SerializeToString()
    header = forward_backward_prefix(body[:1024])
    assert header is not None and len(header) < 40  # 2 + 14 bytes of model_id, 1 + 2 of seq_id
    assert numbered_call(header, "pb") == ("sess-a:train:3", 300)
    assert forward_backward_prefix(body[:10]) is None  # inside model_id
    assert forward_backward_prefix(body[:17]) is None  # inside seq_id's varint
    assert forward_backward_prefix(b'{"model_id": "sess-a:train:3", "seq_id": 1}') is None
    assert forward_backward_prefix(b"") is None
    assert numbered_call(b'{"model_id": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "json") is None


def _sdk_json(request) -> bytes:
    """The body the SDK sends for a JSON call: its resources dump the request so, and httpx encodes the dump."""
    dumped = model_dump(request, exclude_unset=False, exclude_none=True, mode="json")
    return httpx.Request("POST", "http://sdk", json=dumped).content


@pytest.mark.parametrize("params, field", [
    (types.AdamParams(learning_rate=math.nan), "adam_params.learning_rate"),
    (types.AdamParams(learning_rate=math.inf), "adam_params.learning_rate"),
    (types.AdamParams(learning_rate=-math.inf), "adam_params.learning_rate"),
    (types.AdamParams(beta1=math.nan), "adam_params.beta1"),
    (types.AdamParams(eps=math.inf, weight_decay=math.nan), "adam_params.eps"),
])
def test_a_number_the_sdk_sent_as_not_finite_is_named_with_its_fix(params, field):
    """The SDK sends NaN and infinity in its JSON calls as null (pydantic's JSON dump): the error names the field and
    what to check, not a client that is not the SDK."""
    body = _sdk_json(types.OptimStepRequest(adam_params=params, model_id="s:train:0", seq_id=2))
    assert b"null" in body  # what the SDK puts on the wire for them
    with pytest.raises(ApiError) as refused:
        parse_body(types.OptimStepRequest, body)
    error = str(refused.value)
    assert error.startswith(f"OptimStepRequest: {field} must be a finite number (got null: ")
    assert "check" in error and "send what the tinker SDK sends" not in error and "\n" not in error


@pytest.mark.parametrize("json_first", [False, True])
def test_a_null_or_not_finite_float_field_of_any_request_is_named_as_not_finite(json_first):
    """The wording is general: any float field, either validation path; a non-finite number where a field refuses
    one (pydantic's ``allow_inf_nan=False``) reads the same, with the value."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1]}]}
    for field in ("temperature", "top_p"):
        body = f'{{"prompt": {json.dumps(prompt)}, "sampling_params": {{"{field}": null}}}}'.encode()
        with pytest.raises(ApiError, match=rf"^SampleRequest: sampling_params\.{field} must be a finite number "):
            parse_body(types.SampleRequest, body, json_first=json_first)

    class Strict(BaseModel, allow_inf_nan=False):
        rate: float

    with pytest.raises(ApiError, match=r"^Strict: rate must be a finite number \(got inf\); check "):
        parse_body(Strict, b'{"rate": Infinity}', json_first=json_first)


def test_what_only_a_client_other_than_the_sdk_sends_still_says_to_send_what_it_sends():
    for body in (b'{"model_id": "s:train:0", "adam_params": {"learning_rate": "fast"}}',
                 b'{"model_id": "s:train:0", "adam_params": {"learning_rate": 0.1}, "extra": 1}', b"{"):
        with pytest.raises(ApiError, match=r"send what the tinker SDK sends$"):
            parse_body(types.OptimStepRequest, body)
