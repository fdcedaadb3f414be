"""The tiny local model: loads in transformers, builds deterministically, caches by parameters, tokenizes exactly.

Builds here are deliberately small (a few environments, a few steps) to stay fast;
tests/fixtures/vllm.py covers a model pre-trained enough to answer.
"""

from __future__ import annotations

import json
import math
import random
import unicodedata
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from producers import tiny_corpus, tiny_model
from producers.tiny_corpus import collect_corpus, encode_conversation, render_chat
from producers.tiny_model import (
    LOSS_FILE,
    MARKER_FILE,
    TinyModelSpec,
    build_tiny_model,
    default_tiny_dir,
    read_marker,
    resolve_model,
)
from schemas.config import ModelConfig

QUICK: dict[str, Any] = {
    "envs": ("cartpole", "sokoban"),
    "examples_per_env": 6,
    "max_turns_per_episode": 4,
    "steps": 5,
    "batch_size": 2,
    "warmup_steps": 0,
    "max_seq_len": 384,
    "vocab_size": 400,
}


@pytest.fixture(scope="module")
def quick_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("quick") / "model", seed=0, **QUICK)


@pytest.fixture(scope="module")
def tokenizer(quick_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(quick_dir)


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "model.safetensors"))


# ---- loading ------------------------------------------------------------------------


def test_loads_in_transformers_as_a_small_qwen2(quick_dir: Path, tokenizer: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(quick_dir)
    assert model.config.model_type == "qwen2" and model.dtype == torch.float32
    # hidden 128, 4 layers, 4 heads of 32, 2 kv heads, MLP 384, tied embeddings, vocab 400:
    # embeddings 400*128 = 51,200; per layer q 128*128+128, k,v 128*64+64 each, o 128*128 (Qwen2: biases on q,k,v)
    # = 16,512 + 2*8,256 + 16,384 = 49,408; MLP 3*128*384 = 147,456; two RMSNorms 256 -> 197,120 per layer
    expected = 51_200 + 4 * 197_120 + 128
    assert sum(p.numel() for p in model.parameters()) == expected
    assert tokenizer.eos_token == "<|im_end|>" and model.config.eos_token_id == tokenizer.eos_token_id
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    ids = torch.tensor([tokenizer.encode("<answer>left</answer>", add_special_tokens=False)])
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tokenizer)) and torch.isfinite(logits).all()


def test_build_record_and_loss_curve(quick_dir: Path) -> None:
    marker = read_marker(quick_dir)
    assert marker is not None and marker["envs"] == ["cartpole", "sokoban"] and marker["skipped_envs"] == {}
    curve = json.loads((quick_dir / LOSS_FILE).read_text())["curve"]
    assert [p["step"] for p in curve] == [1, 2, 3, 4, 5]
    # at initialisation the model predicts ~uniformly over the vocabulary: loss ~ ln(V)
    assert abs(curve[0]["loss"] - math.log(marker["vocab_size"])) < 0.5
    assert marker["final_loss"] == pytest.approx(sum(p["loss"] for p in curve) / 5)


# ---- tokenizer and chat template ------------------------------------------------


def test_chat_template_is_chatml(tokenizer: Any) -> None:
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    expected = "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    prompted = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompted == expected + "<|im_start|>assistant\n"
    assert render_chat(messages, add_generation_prompt=True) == prompted


def test_chat_tokens_are_single_ids_and_tags_survive_decoding(tokenizer: Any) -> None:
    for token in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<answer>", "</answer>"):
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    ids = tokenizer.encode("<think>hm</think><answer>left</answer><|im_end|>", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "<think>hm</think><answer>left</answer>"
    assert tokenizer.encode("abc", add_special_tokens=True) == tokenizer.encode("abc", add_special_tokens=False)


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200))
def test_tokenizer_round_trips_any_text(tokenizer: Any, text: str) -> None:
    """Byte level: nothing is unknown.  Like Qwen2 the tokenizer NFC-normalises first."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == unicodedata.normalize("NFC", text)


def test_transformers_tokenizes_like_tokenizer_json(quick_dir: Path, tokenizer: Any) -> None:
    """transformers rebuilds Qwen2's pre-tokenizer on load; the trained file must agree with it."""
    from tokenizers import Tokenizer

    raw = Tokenizer.from_file(str(quick_dir / "tokenizer.json"))
    corpus = collect_corpus(TinyModelSpec(**{**QUICK, "examples_per_env": 3}))
    samples = [render_chat(c) for c in corpus.conversations] + ["I'll go 12345 ünïcode\r\n\t tabs", "x" * 50]
    for text in samples:
        assert tokenizer.encode(text, add_special_tokens=False) == raw.encode(text, add_special_tokens=False).ids


def test_encoded_conversation_masks_exactly_the_answers(tokenizer: Any) -> None:
    from tokenizers import Tokenizer

    raw = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
    messages = [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "obs 1"},
        {"role": "assistant", "content": "<answer>left</answer>"},
        {"role": "user", "content": "obs 2"},
        {"role": "assistant", "content": "<answer>right</answer>"},
    ]
    ids, mask = encode_conversation(raw, messages, max_len=10_000)
    trained = [t for t, m in zip(ids, mask, strict=True) if m]
    assert tokenizer.decode(trained) == "<answer>left</answer><|im_end|><answer>right</answer><|im_end|>"
    # segment-wise encoding equals encoding the whole rendered chat (minus its final newline)
    assert ids == tokenizer.encode(render_chat(messages)[:-1], add_special_tokens=False)


# ---- determinism and caching ----------------------------------------------------


def test_same_parameters_same_weights(quick_dir: Path, tmp_path: Path) -> None:
    again = build_tiny_model(tmp_path / "again", seed=0, **QUICK)
    first, second = weights(quick_dir), weights(again)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert (quick_dir / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert read_marker(again)["spec_hash"] == read_marker(quick_dir)["spec_hash"]


def test_other_seed_other_weights(quick_dir: Path, tmp_path: Path) -> None:
    other = build_tiny_model(tmp_path / "other", seed=1, **{**QUICK, "steps": 0})
    assert not torch.equal(weights(quick_dir)["model.embed_tokens.weight"], weights(other)["model.embed_tokens.weight"])
    assert read_marker(other)["final_loss"] is None and not (other / LOSS_FILE).read_text().count('"loss"')
    assert [p.name for p in tmp_path.iterdir()] == ["other"]  # the temporary build folder was renamed


def test_matching_folder_is_reused_not_rebuilt(quick_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_build(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("rebuilt a cached model")

    monkeypatch.setattr(tiny_model, "_build_into", no_build)
    assert build_tiny_model(quick_dir, seed=0, **QUICK) == quick_dir


def test_folder_with_other_contents_needs_force(quick_dir: Path, tmp_path: Path) -> None:
    target = tmp_path / "busy"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="--force"):
        build_tiny_model(target, seed=0, **{**QUICK, "steps": 0})
    built = build_tiny_model(target, seed=0, force=True, **{**QUICK, "steps": 0})
    assert not (built / "notes.txt").exists() and (built / MARKER_FILE).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]  # no temporary or old folders left


def test_default_dir_lives_under_rlpipe_home_and_names_the_parameters(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path))
    default = default_tiny_dir()
    assert default.parent == tmp_path / "models" and default.name.startswith("tiny-")
    assert default_tiny_dir(TinyModelSpec(seed=1)) != default
    assert default_tiny_dir(TinyModelSpec()) == default


def test_resolve_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLPIPE_HOME", str(tmp_path / "home"))
    calls: list[Any] = []
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out=None: calls.append(out) or Path(out or "/d"))
    assert resolve_model(ModelConfig(base_model="Qwen/Qwen2.5-0.5B")) == "Qwen/Qwen2.5-0.5B"
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "config.json").write_text("{}")
    assert resolve_model(ModelConfig(base_model=str(tmp_path / "x"))) == str(tmp_path / "x")
    with pytest.raises(ValueError, match="no such folder"):
        resolve_model(ModelConfig(base_model="/models/x"))
    assert resolve_model(ModelConfig(base_model="tiny", tiny_dir=str(tmp_path))) == str(tmp_path)
    assert resolve_model(ModelConfig()) == "/d"
    assert calls == [str(tmp_path), None]


# ---- corpus ---------------------------------------------------------------------


def test_broken_environment_is_skipped_with_a_warning() -> None:
    spec = TinyModelSpec(**{**QUICK, "envs": ("cartpole", "no-such-env")})
    with pytest.warns(UserWarning, match="no-such-env"):
        corpus = collect_corpus(spec)
    assert corpus.envs == ["cartpole"] and "no-such-env" in corpus.skipped
    assert len(corpus.conversations) == QUICK["examples_per_env"]


def test_an_error_inside_an_environment_is_not_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    """Environments that are unknown or do not import are left out; a bug in one that runs is raised."""
    real = tiny_corpus.env_conversations

    def conversations(name: str, spec: TinyModelSpec, seed: int) -> list:
        if name == "sokoban":
            raise TypeError("'NoneType' object is not subscriptable")
        return real(name, spec, seed)

    monkeypatch.setattr(tiny_corpus, "env_conversations", conversations)
    with pytest.raises(TypeError, match="not subscriptable"):
        collect_corpus(TinyModelSpec(**{**QUICK, "envs": ("cartpole", "sokoban")}))


def test_corpus_conversations_alternate_and_end_with_valid_answers() -> None:
    from producers.envs.parsing import parse_answer

    spec = TinyModelSpec(**{**QUICK, "examples_per_env": 10})
    corpus = collect_corpus(spec)
    assert len(corpus.conversations) == 20
    for conversation in corpus.conversations:
        roles = [m["role"] for m in conversation]
        assert roles[0] == "system" and roles[1:] == ["user", "assistant"] * ((len(roles) - 1) // 2)
        assert all(parse_answer(m["content"], 5).ok for m in conversation if m["role"] == "assistant")


class _FakeEnv:
    def __init__(self, has_heuristic: bool = True) -> None:
        self.has_heuristic = has_heuristic

    def heuristic_answer(self) -> str:
        if not self.has_heuristic:
            raise NotImplementedError
        return "H"

    def random_answer(self, rng: random.Random) -> str:
        return "R"


@pytest.mark.parametrize(("noisy_fraction", "low", "high"), [(0.0, 0.0, 0.0), (0.5, 0.45, 0.55), (1.0, 1.0, 1.0)])
def test_answer_mix_follows_noisy_fraction(noisy_fraction: float, low: float, high: float) -> None:
    rng = random.Random(0)
    draws = [tiny_corpus._choose_answer(_FakeEnv(), rng, noisy_fraction) for _ in range(2000)]
    assert low <= draws.count("R") / 2000 <= high
    assert tiny_corpus._choose_answer(_FakeEnv(has_heuristic=False), rng, 0.0) == "R"


def test_spec_rejects_shapes_vllm_cannot_serve() -> None:
    with pytest.raises(ValueError, match="head size"):
        TinyModelSpec(hidden_size=96, num_heads=4)  # head size 24
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        TinyModelSpec(num_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="extra"):
        TinyModelSpec(hidden=3)  # type: ignore[call-arg]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nobody may make a folder")
def test_a_folder_that_cannot_be_made_fails_before_the_build_starts() -> None:
    """Minutes of pre-training are not spent on a model that could not be saved."""

    def started(done: int, total: int, loss: float) -> None:
        raise AssertionError("the build started before its folder was made")

    with pytest.raises(OSError):
        build_tiny_model(Path("/proc/rlpipe-tiny"), steps=1, progress=started)
