"""Packed sampling: each run's view of the shared engine names the run in every adapter handle."""

from __future__ import annotations

import pytest

from producers.packed import RunSampler, check_packable
from producers.samplers.base import AdapterHandle, SampleRequest
from schemas.config import RunConfig


class Recorder:
    """Stands in for the shared engine (``SyncSampler``): records the handles it is given."""

    eos_token_id, max_model_len = 2, 64

    def __init__(self) -> None:
        self.handles: list[tuple[str, AdapterHandle | None]] = []

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        self.handles.append(("generate", adapter))
        return []

    def load_adapter(self, handle):
        self.handles.append(("load", handle))

    def unload_adapter(self, handle):
        self.handles.append(("unload", handle))


def test_equal_versions_of_two_runs_reach_the_engine_as_two_adapters():
    shared = Recorder()
    a, b = RunSampler(shared, "run-a"), RunSampler(shared, "run.b")
    handle = AdapterHandle.for_version(3, "/cache/v3", "0" * 64)
    a.load_adapter(handle)
    b.load_adapter(handle)
    a.generate([SampleRequest([1, 2], 4)], handle, seed=1)
    b.generate([SampleRequest([1, 2], 4)], None)
    b.unload_adapter(handle)
    (_, loaded_a), (_, loaded_b), (_, sampled_a), (_, sampled_b), (_, unloaded_b) = shared.handles
    assert (loaded_a.run, loaded_a.version, loaded_a.name) == ("run-a", 3, "run-a-v3")
    assert (loaded_b.run, loaded_b.name) == ("run.b", "run_b-v3")  # a name peft and vLLM take as an adapter name
    assert sampled_a == loaded_a and sampled_b is None and unloaded_b == loaded_b
    assert (a.eos_token_id, a.max_model_len) == (2, 64)


def test_runs_that_cannot_share_an_engine_are_refused_in_one_line():
    first = RunConfig(run_id="a")
    with pytest.raises(ValueError, match="name a run twice"):
        check_packable([first, first])
    other = RunConfig(run_id="b", sampler={"backend": "transformers"})
    with pytest.raises(ValueError, match=r"differ in sampler\.backend"):
        check_packable([first, other])
