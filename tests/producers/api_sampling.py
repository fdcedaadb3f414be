"""What the API sampler's tests share: the tenant they call as and a sample call as the Tinker SDK sends it."""

from __future__ import annotations

from typing import Any

from tinker import types

TENANT = "t-alice"


def sample_request(stop: str | list[str] | list[int] | None = None, **extra: Any) -> types.SampleRequest:
    """A call for 2 samples (``num_samples``) of 4 tokens after prompt [5, 6, 7]; ``extra`` sets its other fields."""
    params = types.SamplingParams(max_tokens=extra.pop("max_tokens", 4), stop=stop, temperature=1.0, seed=extra.pop("seed", None),
                                  top_k=extra.pop("top_k", -1))
    return types.SampleRequest(num_samples=extra.pop("num_samples", 2), prompt=types.ModelInput.from_ints([5, 6, 7]),
                               sampling_params=params, sampling_session_id="s:sample:0", seq_id=0, **extra)
