"""The Tinker wire format on rlpipe's side: protobuf bodies and results, ids and ``tinker://`` paths.

SDK 0.38.0 sends ``forward_backward`` as the protobuf ``ForwardBackwardRequest``
and accepts ``ForwardBackwardOutput`` only as protobuf (TINKER.md section 7).
The SDK ships the encoder for the first and the decoder for the second; this
module is their inverse, built on the SDK's own protobuf module and types
(``tinker.proto.tinker_public_pb2``, ``tinker.types``), so the SDK stays the
contract and nothing of it is copied.

Ids are deterministic, so that a resent call maps onto the same request:
``request_id`` of an ordered call is ``<session>.<kind>.<n>.<seq_id>`` (the
model's run name plus its sequence number), of a model-creating call
``<session>.<kind>.<n>.create``.  The session is the part before the first
dot, which is how ``retrieve_future`` finds a result's folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pydantic_core
from pydantic import BaseModel, ValidationError
from tinker import types
from tinker.proto import tinker_public_pb2 as public_pb

from pipeline.api.tenants import MAX_CALL_TOKENS_ENV
from schemas.api import ApiError, model_run_name
from schemas.names import MAX_ECHOED, InvalidNameError, echoed, validate_name

PROTOBUF = "application/x-protobuf"
_DTYPES: dict[int, tuple[np.dtype, str]] = {
    public_pb.DTYPE_FLOAT32: (np.dtype(np.float32), "float32"),
    public_pb.DTYPE_INT64: (np.dtype(np.int64), "int64"),
    public_pb.DTYPE_INT32: (np.dtype(np.int32), "int64"),
}
INT32_MAX = 2**31 - 1  # the largest int32, the type of the SDK's protobuf seq_id and token ids
MAX_SEQ = INT32_MAX  # the largest sequence number (seq_id, model_seq_id, sampling_session_seq_id)
PATH_FOLDERS = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}  # kind -> folder
_PATH_KINDS = {folder: kind for kind, folder in PATH_FOLDERS.items()}


def check_seq(field: str, value: int | None, first: int, numbered_by: str) -> int:
    """``value`` if the SDK could have sent it as ``field``: a sequence number from ``first`` (0, or 1 for a training
    call's ``seq_id``) to ``MAX_SEQ``; else ``ApiError`` naming the field and ``numbered_by``, what numbers it."""
    if value is None or not first <= value <= MAX_SEQ:
        raise ApiError(f"{field}={echoed(value)}: the tinker SDK numbers it from {first} to {MAX_SEQ}; use "
                       f"{numbered_by}")
    return value


def request_id_for(model_id: str, seq_id: int | None) -> str:
    """The id of ``model_id``'s call ``seq_id`` (None or 0: the call that creates the model)."""
    try:
        run = model_run_name(model_id)
    except InvalidNameError as exc:
        raise ApiError(f"{exc}; use the model_id that create_model returned") from None
    return f"{run}.{seq_id}" if seq_id else f"{run}.create"


def session_of_request(request_id: str) -> str:
    """The session a request id belongs to (see the module docstring)."""
    try:
        validate_name(request_id, "request_id")
    except InvalidNameError as exc:
        raise ApiError(f"{exc}; poll with the request_id the call returned") from None
    return request_id.split(".", 1)[0]


@dataclass(frozen=True)
class TinkerPath:
    """A parsed ``tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>``."""

    model_id: str
    kind: str  # "training", "sampler" or "external" (the SDK's CheckpointType)
    name: str

    @property
    def run(self) -> str:
        return model_run_name(self.model_id)

    def __str__(self) -> str:
        return f"tinker://{self.model_id}/{PATH_FOLDERS[self.kind]}/{self.name}"


def parse_tinker_path(path: str) -> TinkerPath:
    """Parse and validate a ``tinker://`` checkpoint path (names must obey the name rule)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in _PATH_KINDS:
        raise ApiError(f"{echoed(path)} is not a checkpoint path; use tinker://<model_id>/weights/<name>, "
                       "tinker://<model_id>/sampler_weights/<name> or tinker://<model_id>/external_weights/<name>")
    try:
        model_run_name(parts[0])
        validate_name(parts[2], "checkpoint name")
    except InvalidNameError as exc:
        raise ApiError(f"checkpoint path {echoed(path)}: {exc}") from None
    return TinkerPath(parts[0], _PATH_KINDS[parts[1]], parts[2])


def training_state_path(path: str) -> TinkerPath:
    """A parsed ``tinker://.../weights/<name>`` path, what ``load_weights`` loads (into a training client or as a new
    one); ``ApiError`` naming the fix for another kind (the gateway and the trainer both check)."""
    parsed = parse_tinker_path(path)
    if parsed.kind != "training":
        raise ApiError(f"{echoed(path)} is not a training state; load_weights takes a tinker://.../weights/<name> "
                       "path (save_state)")
    return parsed


def checkpoint_name(name: str | None) -> str:
    """A checkpoint name given by the client, validated (it becomes a store path)."""
    try:
        return validate_name(name or "", "checkpoint name")
    except InvalidNameError as exc:
        rule = "" if "use letters" in str(exc) else "; name checkpoints with letters, digits, '.', '_' and '-'"
        raise ApiError(f"{exc}{rule}") from None


# ---- forward_backward: protobuf request -> SDK type --------------------------------------------------------------


def _array(data: bytes, dtype: np.dtype, what: str) -> np.ndarray:
    """``data`` as a 1-D array of ``dtype``; a length that is no multiple of its size is the client's error."""
    if len(data) % dtype.itemsize:
        raise ApiError(f"{what} holds {len(data)} bytes, not a whole number of {dtype} values "
                       f"({dtype.itemsize} bytes each); send what the tinker SDK encodes")
    return np.frombuffer(data, dtype)


def _tensor(msg: public_pb.Tensor, name: str) -> types.TensorData:
    if msg.dtype not in _DTYPES:
        raise ApiError(f"loss_fn_inputs[{echoed(name)}] has dtype {msg.dtype}; send float32 or int64 tensors")
    np_dtype, dtype = _DTYPES[msg.dtype]
    shape = list(msg.shape) or None
    what = f"loss_fn_inputs[{echoed(name)}]"
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        int64 = np.dtype(np.int64)
        return types.TensorData(_array(csr.values, np_dtype, what).astype(dtype), dtype, shape,
                                _array(csr.crow_indices, int64, f"{what} crow_indices").tolist(),
                                _array(csr.col_indices, int64, f"{what} col_indices").tolist())
    values = _array(msg.dense, np_dtype, what)
    if shape is not None and (min(shape) < 0 or math.prod(shape) != values.size):
        raise ApiError(f"{what} holds {values.size} values, not its shape {echoed(shape)}; send what the tinker SDK "
                       "encodes")
    return types.TensorData(values.astype(dtype), dtype, shape)


def _chunk(msg: public_pb.Chunk) -> types.EncodedTextChunk:
    if msg.WhichOneof("chunk") != "encoded_text":
        raise ApiError(f"model_input chunk of kind {msg.WhichOneof('chunk')!r} is not supported; send token chunks")
    return types.EncodedTextChunk(tokens=_array(msg.encoded_text.tokens, np.dtype(np.int32),
                                                "model_input tokens").tolist())


def _loss_fn_config(msg: public_pb.ForwardBackwardRequest) -> dict[str, float | str] | None:
    config: dict[str, float | str] = {key: float(value) for key, value in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # v2 wins: it also carries text values
        config[key] = value.text if value.WhichOneof("value") == "text" else float(value.number)
    return config or None


def not_finite_loss_config(key: str, value: object) -> str:
    """The one line refusing ``loss_fn_config`` value ``value`` of ``key``: the gateway's (a NaN or infinity, which
    the SDK's protobuf carries as it is) and the trainer's (any value that is no finite number) words."""
    shown = key if len(key) <= MAX_ECHOED else key[:MAX_ECHOED] + "…"  # the client's, of any length
    return f"loss_fn_config {shown}={echoed(value)} is not a finite number; check the code that computes it"


def forward_backward_header(body: bytes, check_loss_fn_config: bool = False,
                            max_tokens: int | None = None) -> tuple[str, int | None]:
    """Only ``(model_id, seq_id)`` of a protobuf ``ForwardBackwardRequest`` (the gateway needs no more).

    ``check_loss_fn_config``: first refuse a ``loss_fn_config`` number that is not finite (``ApiError`` naming the
    key), so the gateway answers it at once rather than the trainer failing the call's future; the body is parsed
    whole here anyway.  Text values and the loss's keys are the trainer's to judge (``consumers.api.translate``).
    ``max_tokens``: refuse a request whose datums' ``model_input`` holds more tokens (``ApiError`` naming its size,
    the cap and the setting that raises it, ``RLPIPE_API_MAX_CALL_TOKENS``)."""
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # protobuf's DecodeError
        raise ApiError("forward_backward body is not a protobuf ForwardBackwardRequest; use the tinker SDK "
                       ">= 0.25 (Content-Type: application/x-protobuf)") from None
    if check_loss_fn_config:
        for key, value in (_loss_fn_config(msg) or {}).items():
            if isinstance(value, float) and not math.isfinite(value):
                raise ApiError(not_finite_loss_config(key, value))
    if max_tokens is not None and (tokens := _input_tokens(msg)) > max_tokens:
        op = "forward" if msg.forward_only else "forward_backward"
        datums = f"{len(msg.data):,} datum{'' if len(msg.data) == 1 else 's'}"
        adding = "gradients add up until optim_step; " if not msg.forward_only else ""
        advice = ("shorten it" if len(msg.data) == 1 else
                  f"send the batch as several smaller calls ({adding}the tinker SDK splits it so by itself)")
        raise ApiError(f"{op} of {tokens:,} tokens (model_input of {datums}) is over this server's cap of "
                       f"{max_tokens:,} tokens per request; {advice}, or ask the operator to raise {MAX_CALL_TOKENS_ENV}")
    return msg.model_id, msg.seq_id or None


def _input_tokens(msg: public_pb.ForwardBackwardRequest) -> int:
    """Tokens of the request's datums' ``model_input`` (int32 each; other chunk kinds the trainer refuses)."""
    return sum(len(chunk.encoded_text.tokens) // 4 for datum in msg.data for chunk in datum.model_input)


def _varint(data: bytes, pos: int) -> tuple[int, int] | None:
    """The protobuf varint at ``pos`` and the position after it; None when ``data`` stops inside it."""
    value = 0
    for shift, at in zip(range(0, 70, 7), range(pos, len(data)), strict=False):
        value |= (data[at] & 0x7F) << shift
        if data[at] < 0x80:
            return value, at + 1
    return None


_HEADER_TAGS = (0x0A, 0x10)  # ForwardBackwardRequest's model_id (field 1, length-delimited), seq_id (field 2, varint)


def forward_backward_prefix(first: bytes) -> bytes | None:
    """The ``model_id`` and ``seq_id`` fields that start a protobuf ``ForwardBackwardRequest``, cut from the first
    bytes of a body too large to read whole, as a message of their own; None when ``first`` stops inside them (or
    right after them: more of them may follow) or holds another message.

    Protobuf's serializers, the SDK's among them, write fields in the order of their numbers, so these two come
    before the datums (field 3).  Protobuf parses only whole messages, hence the walk over the wire format here:
    a tag, then a length and that many bytes (``model_id``) or a varint (``seq_id``)."""
    pos = 0
    while (tag := _varint(first, pos)) is not None:
        if tag[0] not in _HEADER_TAGS:
            return first[:pos] or None
        value = _varint(first, tag[1])
        if value is None:
            return None
        pos = value[1] + (value[0] if tag[0] == _HEADER_TAGS[0] else 0)
        if pos > len(first):
            return None
    return None


def numbered_call(body: bytes, fmt: str) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` read leniently from a training call's body that may be invalid otherwise (a
    protobuf ``forward_backward``, else JSON, where Python's reader takes the NaN a strict one refuses); None
    when it names no model or no seq_id."""
    try:
        if fmt == "pb":
            model_id, seq_id = forward_backward_header(body)
        else:
            data = json.loads(body)
            model_id, seq_id = data.get("model_id"), data.get("seq_id")
        if type(seq_id) is int:
            check_seq("seq_id", seq_id, 1, "the tinker SDK's TrainingClient")
    except (ApiError, ValueError, AttributeError, RecursionError):
        return None
    if not isinstance(model_id, str) or not model_id or type(seq_id) is not int:
        return None
    return model_id, seq_id


def decode_forward_backward(body: bytes) -> tuple[types.ForwardBackwardRequest, bool]:
    """The SDK's ``ForwardBackwardRequest`` and the ``forward_only`` flag from a protobuf body."""
    msg = public_pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception:  # protobuf's DecodeError
        raise ApiError("forward_backward body is not a protobuf ForwardBackwardRequest; use the tinker SDK "
                       ">= 0.25 (Content-Type: application/x-protobuf)") from None
    data = [
        types.Datum(
            model_input=types.ModelInput(chunks=[_chunk(chunk) for chunk in datum.model_input]),
            loss_fn_inputs={name: _tensor(tensor, name) for name, tensor in datum.loss_fn_inputs.items()},
        )
        for datum in msg.data
    ]
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=msg.loss_fn,
                                                          loss_fn_config=_loss_fn_config(msg)),
        model_id=msg.model_id,
        seq_id=msg.seq_id or None,
    )
    return request, msg.forward_only


# ---- forward_backward: SDK result -> protobuf ---------------------------------------------------------------------


def encode_forward_backward_output(output: types.ForwardBackwardOutput) -> bytes:
    """``ForwardBackwardOutput`` as the protobuf the SDK decodes: one ArrayRecord, one BatchedTensor per field."""
    msg = public_pb.ForwardBackwardOutput(loss_fn_output_type=output.loss_fn_output_type or "ArrayRecord")
    msg.metrics.update({key: float(value) for key, value in output.metrics.items()})
    record = msg.loss_fn_outputs.add(type_tag=msg.loss_fn_output_type, num_datums=len(output.loss_fn_outputs))
    names = sorted({name for datum in output.loss_fn_outputs for name in datum})
    for name in names:
        arrays = [datum[name]._numpy for datum in output.loss_fn_outputs]
        dtype = arrays[0].dtype
        proto_dtype = public_pb.DTYPE_INT64 if dtype.kind in "iu" else public_pb.DTYPE_FLOAT32
        np_dtype = np.dtype(np.int64 if proto_dtype == public_pb.DTYPE_INT64 else np.float32)
        flat = [np.ascontiguousarray(array, np_dtype) for array in arrays]
        offsets = np.cumsum([0] + [array.nbytes for array in flat], dtype=np.int64)
        field = record.fields[name]
        field.data = b"".join(array.tobytes() for array in flat)
        field.offsets = offsets.tobytes()
        field.dtype = proto_dtype
        field.trailing_shape.extend(list(arrays[0].shape[1:]))
    return msg.SerializeToString()


# what to check when a field is not a finite number; any other field: the code that computes it
_NON_FINITE_CAUSES = {"learning_rate": "the learning-rate schedule"}


def _non_finite(error: Any) -> str | None:
    """What a validation error says when it is a float field given no finite number, in words naming the field and
    what to check; None for any other error.  The SDK sends NaN and infinity in its JSON calls as null (its requests
    are dumped by pydantic, whose JSON has neither), so a null float is what a NaN learning rate looks like here;
    a field that refuses NaN itself (``allow_inf_nan=False``) says ``finite_number``."""
    if not ((error["type"] == "float_type" and error["input"] is None) or error["type"] == "finite_number"):
        return None
    # a field of a union of models (``adam_params``) is located through the member's class name; the SDK's field
    # names are snake_case, so a capitalised part is such a name and no field
    fields = [str(part) for part in error["loc"] if not (isinstance(part, str) and part[:1].isupper())]
    got = "null: NaN or infinity as the tinker SDK sends them" if error["input"] is None else echoed(error["input"])
    cause = _NON_FINITE_CAUSES.get(fields[-1] if fields else "", "the code that computes it")
    return f"{'.'.join(fields) or 'body'} must be a finite number (got {got}); check {cause}"


def parse_body(model: type[BaseModel], body: bytes, json_first: bool = False) -> Any:
    """Validate a JSON body as the SDK's request type, or a one-line user error: a float field that holds no finite
    number named with what to check, anything else the SDK would not have sent with its location.  ``json_first``:
    read the JSON, then validate it as Python data, for bodies of many values (a sample's prompt): pydantic's JSON
    path takes four times as long over the SDK's token lists (``Sequence[int]``), with the GIL held."""
    try:
        if json_first:
            return model.model_validate(pydantic_core.from_json(body or b"{}"))
        return model.model_validate_json(body or b"{}")
    except ValidationError as exc:
        errors = exc.errors()
        non_finite = next(filter(None, map(_non_finite, errors)), None)
        if non_finite is not None:
            raise ApiError(f"{model.__name__}: {non_finite}") from None
        where = ".".join(str(part) for part in errors[0]["loc"]) or "body"
        raise ApiError(f"{model.__name__}: {where}: {errors[0]['msg']}; send what the tinker SDK sends") from None
    except ValueError as exc:  # (not JSON, read by from_json: as model_validate_json words it)
        raise ApiError(f"{model.__name__}: body: Invalid JSON: {exc}; send what the tinker SDK sends") from None
