"""Tensors to safetensors bytes: safetensors' own serialiser, fed each tensor's memory directly.

safetensors' torch writer spends about 70 microseconds of Python per tensor (a numpy view of each
tensor's memory through ctypes, a shared-memory search).  A learner checkpoint holds a few hundred
small tensors (AdamW keeps two moments and a step counter per LoRA matrix), so that writer costs
several milliseconds a step, holding the interpreter lock while the next step trains beside it.  Here
each tensor becomes a ``safetensors.TensorSpec`` (dtype, shape, address and length of its memory) for
``safetensors.serialize``, the call the torch writer ends in: the same file, byte for byte
(``tests/pipeline/io/test_tensors.py``), in about a twentieth of the time.  Tensors that share memory
and sparse ones go through the torch writer, which refuses them as it always has.
"""

from __future__ import annotations

import sys
from functools import cache

import safetensors.torch
import torch
from safetensors import TensorSpec, serialize


@cache
def _dtype_name(dtype: torch.dtype) -> str:
    """torch.float32 -> "float32", as safetensors' torch writer names dtypes."""
    return str(dtype).rpartition(".")[2]


def save_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors file of ``tensors`` (``safetensors.torch.save``'s bytes), non-contiguous ones by value."""
    if sys.byteorder != "little":
        return safetensors.torch.save(tensors, metadata=metadata)  # that writer byte-swaps
    specs: dict[str, TensorSpec] = {}
    alive: list[torch.Tensor] = []  # copies made here must outlive serialize()
    addresses: set[tuple[torch.device, int]] = set()
    for name, tensor in tensors.items():
        if tensor.layout != torch.strided:
            return safetensors.torch.save(tensors, metadata=metadata)  # refuses sparse tensors, naming them
        storage = tensor.untyped_storage()
        if storage.nbytes():
            key = (tensor.device, storage.data_ptr())
            if key in addresses:
                return safetensors.torch.save(tensors, metadata=metadata)  # refuses shared memory, naming it
            addresses.add(key)
        if tensor.device.type != "cpu" or not tensor.is_contiguous():
            tensor = tensor.detach().to("cpu").contiguous()
            alive.append(tensor)
        specs[name] = TensorSpec(dtype=_dtype_name(tensor.dtype), shape=tensor.shape, data_ptr=tensor.data_ptr(),
                                 data_len=tensor.nbytes)
    return bytes(serialize(specs, metadata=metadata))  # ``alive`` holds the copies until here
