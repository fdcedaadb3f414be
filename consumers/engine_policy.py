"""A run's policy as one LoRA adapter of a shared training engine (``consumers.engine.TrainingEngine``).

``EnginePolicy`` is ``LoraPolicy``'s training code (losses, schedule, KL
reference, checkpoint tensors under the same names) on a model the process
loads once: the packed learner gives each of its runs one (``consumers.packed``),
and the learner under torchrun builds its ``DistributedPolicy`` on it
(``consumers.distributed_learner``).  Checkpoints move freely between a run
trained alone and the same run trained as an engine adapter.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from peft import set_peft_model_state_dict

from consumers.engine import TrainingEngine
from consumers.policy import AdapterSnapshot, LoraPolicy, pick_device
from schemas.config import LearnerConfig

log = logging.getLogger("rlpipe.learner")


class EnginePolicy(LoraPolicy):
    """One run's policy as adapter ``name`` of a shared engine; use it only inside ``engine.holding(name)``."""

    def __init__(self, engine: TrainingEngine, name: str, config: LearnerConfig) -> None:
        if pick_device(config.device) != engine.device:
            raise ValueError(f"run {name}: learner.device={config.device} differs from the packed engine's "
                             f"{engine.device}; pack only runs on the same device")
        self.config, self.engine, self.name = config, engine, name
        self.device = engine.device
        if config.torch_threads and config.torch_threads != torch.get_num_threads():  # the process's, set once
            log.info("run %s: learner.torch_threads=%d left as the packed process set it (%d)", name,
                     config.torch_threads, torch.get_num_threads())
        if config.gradient_checkpointing and not engine.base.is_gradient_checkpointing:  # (every packed run's)
            engine.base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        engine.create_adapter(name, config.lora_rank, config.lora_alpha, list(config.target_modules), config.seed,
                              config.lora_dropout)
        with engine.holding(name) as (model, slot):
            self.model, self.slot = model, slot
            self.params = list(self.lora_parameters().values())
        self.optimizer = torch.optim.AdamW(self.params, lr=config.learning_rate, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self._lr_factor)
        self.autocast = engine.autocast
        self.reference = None

    def lora_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This adapter's parameters under ``LoraPolicy``'s names, so checkpoints move freely between the two."""
        marker = f".{self.slot}."
        return {name.replace(marker, ".default.", 1): p for name, p in self.model.named_parameters() if marker in name}

    def save_adapter(self, folder: str | Path) -> Path:
        """The PEFT folder of this adapter (adapter_config.json + adapter_model.safetensors)."""
        return self.engine.export_for_sampling(self.name, folder)

    def adapter_snapshot(self) -> AdapterSnapshot:
        """This adapter as it is now, to write later (``save_adapter``'s folder)."""
        return self.engine.adapter_snapshot(self.name)

    def load_adapter_folder(self, folder: str | Path) -> None:
        set_peft_model_state_dict(self.model, self.checked_adapter_weights(folder), adapter_name=self.slot)

    def lora_config(self) -> Any:
        return self.model.peft_config[self.slot]
