"""The ranges of one AdamW step's hyper-parameters (the Tinker SDK's ``AdamParams``), in one place: the gateway answers
an ``optim_step`` outside them 400 at once (SDK -> gateway), and the training engine checks them again before it steps
(``consumers.engine.AdamParams``), so both say the same.  Pure: no I/O, no torch."""

from __future__ import annotations

import math

# the largest finite float32, (2 - 2**-23) * 2**127: the adapters' weights, Adam state and losses compute in float32
FLOAT32_MAX = (2 - 2**-23) * 2.0**127


def adam_params_problem(learning_rate: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                        grad_clip_norm: float) -> str | None:
    """What is wrong with these hyper-parameters, in one line naming the ranges or the fix; None when a step can
    take them (``grad_clip_norm`` 0 = no clipping)."""
    given = {"learning_rate": learning_rate, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "grad_clip_norm": grad_clip_norm}
    in_range = {"learning_rate": learning_rate >= 0, "beta1": 0 <= beta1 < 1, "beta2": 0 <= beta2 < 1,
                "eps": eps > 0, "weight_decay": weight_decay >= 0, "grad_clip_norm": grad_clip_norm >= 0}
    for name, ok in in_range.items():
        if not (ok and math.isfinite(given[name])):
            return (f"adam {name}={given[name]} is out of range (learning_rate, eps, weight_decay, grad_clip_norm >= 0 "
                    "with eps > 0; betas in [0, 1))")
    # AdamW's scalars meet the float32 weights: the first step's size lr / (1 - beta1) (bias correction shrinks the
    # later ones) and the decoupled decay lr * weight_decay; beyond float32, torch fails between two parameters (some
    # stepped, some not) or writes infinite weights
    for what, value in (("a step", learning_rate / (1 - beta1)), ("a weight decay", learning_rate * weight_decay)):
        if value > FLOAT32_MAX:
            return (f"adam learning_rate={learning_rate:g}, beta1={beta1:g} and weight_decay={weight_decay:g} make "
                    f"{what} of {value:g}, beyond float32's {FLOAT32_MAX:g}; use a smaller learning rate or weight "
                    "decay")
    return None
