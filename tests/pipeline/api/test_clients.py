"""The checks of a training client's creation that the gateway and the trainer both run."""

import pytest
from tinker import types

from pipeline.api.clients import MAX_LORA_RANK, check_create_model
from schemas.api import ApiError


def _request(**lora) -> types.CreateModelRequest:
    return types.CreateModelRequest(session_id="sess-a", model_seq_id=0, base_model="/models/base/tiny",
                                    lora_config=types.LoraConfig(**{"rank": 4, **lora}))


def test_a_rank_vllm_serves_is_made_and_another_refused_by_both():
    assert check_create_model(_request(rank=1)).rank == 1
    assert check_create_model(_request(rank=MAX_LORA_RANK)).rank == MAX_LORA_RANK == 512
    for rank in (0, MAX_LORA_RANK + 1):
        with pytest.raises(ApiError, match=rf"lora_config.rank={rank}: use a rank of at least 1 and at most 512"):
            check_create_model(_request(rank=rank))

