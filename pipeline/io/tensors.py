"""Tensors to safetensors bytes, through safetensors' numpy writer where numpy has the dtype.

safetensors' torch writer spends about 20 microseconds of Python per tensor (a ctypes view of each
tensor's memory); its numpy writer takes the arrays as they are.  A learner checkpoint holds a few
hundred small tensors (AdamW keeps two moments and a step counter per LoRA matrix), so the torch
writer costs several milliseconds a step, holding the interpreter lock while the next step trains
beside it.  Both writers produce the same file, byte for byte (``tests/pipeline/io/test_tensors.py``);
a dtype numpy lacks (bfloat16, float8) and tensors that share memory go through the torch writer,
which writes the one and refuses the other as it always has.
"""

from __future__ import annotations

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

_NUMPY_DTYPES = frozenset({torch.float64, torch.float32, torch.float16, torch.int64, torch.int32, torch.int16,
                           torch.int8, torch.uint8, torch.bool})


def _as_arrays(tensors: dict[str, torch.Tensor]) -> dict[str, np.ndarray] | None:
    """The tensors' values as contiguous CPU arrays; None when the numpy writer cannot write them alike."""
    arrays: dict[str, np.ndarray] = {}
    storages: set[tuple[torch.device, int]] = set()
    for name, tensor in tensors.items():
        if tensor.dtype not in _NUMPY_DTYPES or tensor.layout != torch.strided:
            return None
        storage = tensor.untyped_storage()
        if storage.nbytes():
            key = (tensor.device, storage.data_ptr())
            if key in storages:
                return None  # shared memory: the torch writer refuses it, naming the tensors
            storages.add(key)
        if tensor.requires_grad:
            tensor = tensor.detach()
        if tensor.device.type != "cpu":
            tensor = tensor.cpu()
        arrays[name] = (tensor if tensor.is_contiguous() else tensor.contiguous()).numpy()
    return arrays


def save_tensors(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors file of ``tensors`` (``safetensors.torch.save``'s bytes), non-contiguous ones by value."""
    arrays = _as_arrays(tensors)
    if arrays is None:
        return safetensors.torch.save(tensors, metadata=metadata)
    return safetensors.numpy.save(arrays, metadata=metadata)

