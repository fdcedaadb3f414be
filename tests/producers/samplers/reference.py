"""The independent reference the sampler tests check against, and the checks they share.

Teacher-forced logprobs: one forward pass of the whole (prompt + generated)
sequence through transformers (plus peft for an adapter), ``log_softmax`` of the
logits at position t-1, divided by the temperature and renormalised over the
top-p nucleus, read at token t.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from producers.samplers import AdapterHandle, SampleOutput

LOGPROB_TOL = 1e-4  # NOTES.md: ~2e-7 seen for vLLM in float32; anything near 1e-2 means a dtype or policy mismatch
LEARNER_TOL = 1e-5  # sampler vs learner in float32: the importance ratio must start at 1

class Reference:
    """Teacher-forced logprobs from transformers (+ peft), one model per adapter name."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self._models: dict[str | None, Any] = {}

    def model(self, adapter: AdapterHandle | None) -> Any:
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        key = adapter.name if adapter else None
        if key not in self._models:
            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapter.path)
            self._models[key] = model.eval()
        return self._models[key]

    def logprobs(
        self, adapter: AdapterHandle | None, prompt: list[int], generated: list[int], temperature: float = 1.0,
        top_p: float = 1.0,
    ) -> list[float]:
        """Logprobs of the distribution each token was drawn from (greedy, temperature 0: temperature 1)."""
        ids = torch.tensor([prompt + generated])
        with torch.no_grad():
            logits_TV = self.model(adapter)(ids).logits[0].float() / (temperature or 1.0)
        if temperature and top_p < 1.0:  # vLLM's rule: drop the least likely tokens holding at most 1 - top_p
            ascending_TV, order_TV = logits_TV.sort(dim=-1)
            dropped_TV = ascending_TV.softmax(-1).cumsum(-1) <= 1.0 - top_p
            dropped_TV[:, -1] = False
            logits_TV = logits_TV.scatter(-1, order_TV, ascending_TV.masked_fill(dropped_TV, -torch.inf))
        logprobs_TV = torch.log_softmax(logits_TV, dim=-1)
        # the token at position p is predicted by the logits at position p - 1
        return [float(logprobs_TV[len(prompt) - 1 + i, token]) for i, token in enumerate(generated)]

    def greedy_next(self, adapter: AdapterHandle | None, prompt: list[int]) -> int:
        with torch.no_grad():
            return int(self.model(adapter)(torch.tensor([prompt])).logits[0, -1].argmax())


def max_gap(
    reference: Reference, adapter: AdapterHandle | None, prompt: list[int], out: SampleOutput,
    temperature: float = 1.0, top_p: float = 1.0,
) -> float:
    expected = reference.logprobs(adapter, prompt, out.token_ids, temperature, top_p)
    return max(abs(a - b) for a, b in zip(expected, out.logprobs, strict=True))


def learner_gap(policy: Any, prompts: list[list[int]], outs: list[SampleOutput], temperature: float) -> float:
    """Largest |learner logprob - sampler logprob| over every generated token, rows at ``temperature``."""
    from consumers.batching import pad_rows

    tokens = [p + o.token_ids for p, o in zip(prompts, outs, strict=True)]
    masks = [[0] * len(p) + [1] * len(o.token_ids) for p, o in zip(prompts, outs, strict=True)]
    logprobs = [[0.0] * len(p) + o.logprobs for p, o in zip(prompts, outs, strict=True)]
    batch = pad_rows(tokens, masks, logprobs, [0.0] * len(tokens), temperatures_R=[temperature] * len(tokens))
    with torch.no_grad():
        learner_BT = policy.generated_logprobs(batch.tokens_BT, batch.loss_mask_BT, batch.temperatures_B)
    return float((learner_BT - batch.sampler_logprobs_BT).abs().max())


def check_contract(out: SampleOutput, budget: int, eos: int) -> None:
    """Stopped on eos: eos is the last token; otherwise the whole budget was used."""
    assert len(out.token_ids) == len(out.logprobs) >= 1
    assert all(lp <= 0.0 for lp in out.logprobs)
    if out.finish_reason == "stop":
        assert out.token_ids[-1] == eos and eos not in out.token_ids[:-1]
    else:
        assert out.finish_reason == "length" and len(out.token_ids) == budget and eos not in out.token_ids
