"""A researcher's loop started twice with the same ``--seed`` starts from the same LoRA weights.

The server draws a new adapter's initial weights from ``lora_config.seed`` when the client
sends one and from the (new, random) session otherwise, so the example loops must send theirs.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"{name}_example", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module


class RecordingService:
    """Stands in for ``tinker.ServiceClient``: records what a new training client was asked for."""

    asked: ClassVar[list[dict[str, Any]]] = []

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url

    def create_lora_training_client(self, **kwargs: Any) -> SimpleNamespace:
        RecordingService.asked.append(kwargs)
        return SimpleNamespace(result=lambda: SimpleNamespace())


@pytest.mark.parametrize("name", ["tinker_cartpole", "tinker_text2sql"])
def test_the_loops_ask_for_lora_weights_drawn_from_their_seed(name, monkeypatch):
    module = load(name)
    monkeypatch.setattr(module.tinker, "ServiceClient", RecordingService)
    monkeypatch.setattr(module, "AutoTokenizer", SimpleNamespace(
        from_pretrained=lambda path: SimpleNamespace(eos_token_id=2, chat_template=None)))
    RecordingService.asked = []
    args = argparse.Namespace(base_url="http://127.0.0.1:1", base_model="tiny", rank=4, train_unembed=True,
                              tasks=None, seed=7)
    module.Loop(args)
    module.Loop(argparse.Namespace(**{**vars(args), "seed": 8}))
    assert [asked.get("seed") for asked in RecordingService.asked] == [7, 8]
