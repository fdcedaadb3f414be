"""A researcher's loop started twice with the same ``--seed`` starts from the same LoRA weights.

The server draws a new adapter's initial weights from ``lora_config.seed`` when the client
sends one and from the (new, random) session otherwise, so the example loops must send theirs.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest

from tests.examples import example_module


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
    RecordingService.asked = []
    with example_module(name) as module:
        monkeypatch.setattr(module, "AutoTokenizer", SimpleNamespace(
            from_pretrained=lambda path: SimpleNamespace(eos_token_id=2, chat_template=None)))
        args = argparse.Namespace(base_url="http://127.0.0.1:1", base_model="tiny", rank=4, train_unembed=True,
                                  tasks=None, seed=7)
        module.Loop(args, RecordingService(args.base_url))
        module.Loop(argparse.Namespace(**{**vars(args), "seed": 8}), RecordingService(args.base_url))
    assert [asked.get("seed") for asked in RecordingService.asked] == [7, 8]
