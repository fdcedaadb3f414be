"""safetensors bytes from each tensor's memory through safetensors' serialiser: the same file as its torch writer."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load as torch_load
from safetensors.torch import save as torch_save

from pipeline.io.tensors import save_tensors


def optimizer_like() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    for index in range(20):
        tensors[f"state.{index}.exp_avg"] = torch.randn(8, 16, generator=generator)
        tensors[f"state.{index}.exp_avg_sq"] = torch.rand(16, 8, generator=generator)
        tensors[f"state.{index}.step"] = torch.tensor(float(index))  # 0-dim, as torch's Adam keeps it
    tensors["rng.torch"] = torch.randint(0, 255, (5056,), dtype=torch.uint8, generator=generator)
    tensors["ids"] = torch.arange(7, dtype=torch.int64)
    tensors["flags"] = torch.tensor([True, False])
    return tensors


def test_the_bytes_are_those_of_the_torch_writer() -> None:
    tensors = optimizer_like()
    assert save_tensors(tensors) == torch_save(tensors)
    metadata = {"rlpipe": '{"step": 3}'}  # one key: safetensors orders several keys differently in each process
    assert save_tensors(tensors, metadata=metadata) == torch_save(tensors, metadata=metadata)
    metadata = {"format": "pt", "rlpipe": '{"step": 3}'}
    assert header(save_tensors(tensors, metadata=metadata)) == header(torch_save(tensors, metadata=metadata))


def header(blob: bytes) -> dict:
    """The file's JSON header (tensor names, dtypes, shapes, offsets; the metadata)."""
    length = int.from_bytes(blob[:8], "little")
    return json.loads(blob[8:8 + length])


def test_every_dtype_and_empty_tensors_are_written_as_the_torch_writer_writes_them() -> None:
    tensors = {"w": torch.randn(4, 4).to(torch.bfloat16), "b": torch.zeros(4), "h": torch.ones(3, dtype=torch.float16),
               "f8": torch.ones(2).to(torch.float8_e4m3fn), "empty": torch.zeros(0, 5), "i8": torch.ones(2, dtype=torch.int8)}
    blob = save_tensors(tensors)
    assert blob == torch_save(tensors)
    loaded = torch_load(blob)
    assert loaded["w"].dtype == torch.bfloat16 and torch.equal(loaded["w"], tensors["w"])
    assert loaded["empty"].shape == (0, 5)


def test_tensors_that_need_grad_or_are_views_are_written_as_their_values() -> None:
    weight = torch.randn(6, 4, requires_grad=True)
    transposed = torch.randn(4, 6).t()  # a strided view, which safetensors' torch writer refuses
    loaded = torch_load(save_tensors({"weight": weight, "transposed": transposed}))
    assert torch.equal(loaded["weight"], weight.detach()) and not loaded["weight"].requires_grad
    assert torch.equal(loaded["transposed"], transposed)


def test_tensors_sharing_memory_are_refused_as_the_torch_writer_refuses_them() -> None:
    base = torch.zeros(8)
    with pytest.raises(RuntimeError, match="share memory"):
        torch_save({"a": base, "b": base})
    with pytest.raises(RuntimeError, match="share memory"):
        save_tensors({"a": base, "b": base})


def test_sparse_tensors_are_refused_as_the_torch_writer_refuses_them() -> None:
    with pytest.raises(ValueError, match="sparse"):
        save_tensors({"s": torch.zeros(3, 3).to_sparse()})
