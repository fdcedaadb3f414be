"""The tiny model's pre-training corpus and tokenizer: environment transcripts in ChatML, and a BPE trained on them.

``producers.tiny_model`` builds the model from what this module makes:

1. transcripts of every registered environment (system prompt, observation as
   the user message, a heuristic or a random answer as the assistant message);
2. a byte-level BPE tokenizer trained on those transcripts (small vocabulary,
   so prompts are a few hundred tokens), with ChatML special tokens and a
   ChatML chat template, eos = ``<|im_end|>``;
3. each conversation as token ids and a loss mask on the assistant tokens, built
   as the producer builds a multi-turn sequence.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from producers.tiny_model import TinyModelSpec

log = logging.getLogger(__name__)

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Added (not special) tokens: one id each, and kept when decoding with skip_special_tokens.
TAG_TOKENS = ("<think>", "</think>", "<answer>", "</answer>")

# ChatML as Qwen writes it, without Qwen's default system message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# transformers' Qwen2Tokenizer pre-tokenizer, copied so training tokenizes as loading does.
QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

Message = dict[str, str]


@dataclass(frozen=True)
class Corpus:
    """Conversations to learn from, and which environments produced them."""

    conversations: list[list[Message]]
    envs: list[str]
    skipped: dict[str, str]  # env name -> why it was left out


def env_list(spec: TinyModelSpec) -> list[str]:
    """The environments ``spec`` learns from: its own list, or every registered one."""
    from producers.envs.registry import env_names

    return list(spec.envs) if spec.envs else env_names()


# ---- transcripts ----------------------------------------------------------------


def render_chat(messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
    """The ChatML text of ``messages``; identical to what the saved chat template renders."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def collect_corpus(spec: TinyModelSpec) -> Corpus:
    """Conversations from every environment that imports and runs; broken ones are skipped with a warning."""
    conversations: list[list[Message]] = []
    used: list[str] = []
    skipped: dict[str, str] = {}
    for name in env_list(spec):
        try:
            env_convs = env_conversations(name, spec, seed=_env_seed(spec.seed, name))
        except (ImportError, AttributeError, ValueError, NotImplementedError) as exc:
            # not registered, not importable, invalid defaults or no scripted policy: left out, named in the marker
            skipped[name] = f"{type(exc).__name__}: {exc}"
            continue
        conversations.extend(env_convs)
        used.append(name)
    for name, why in skipped.items():
        log.warning("tiny model: skipping environment %s (%s)", name, why)
        warnings.warn(f"tiny model: environment {name} left out of pre-training: {why}", stacklevel=2)
    if not conversations:
        raise RuntimeError("no environment produced transcripts; check `rlpipe envs list` for import errors")
    return Corpus(conversations, used, skipped)


def _env_seed(seed: int, name: str) -> int:
    """A seed per environment that does not shift when other environments are added."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:4], "little")


def env_conversations(name: str, spec: TinyModelSpec, seed: int) -> list[list[Message]]:
    """``spec.examples_per_env`` conversations of environment ``name`` under a heuristic/random policy mix.

    Short multi-turn environments (``history_turns == 0``) give whole episodes as
    one conversation, as the producer samples them.  Long-horizon ones give one
    conversation per turn holding up to ``history_turns`` earlier turns.
    """
    from producers.envs.registry import make_env

    env = make_env(name)
    rng = random.Random(seed)
    window = env.config.history_turns
    conversations: list[list[Message]] = []
    episode = 0
    while len(conversations) < spec.examples_per_env:
        turns = _play_episode(env, rng, seed * 7919 + episode, spec)
        system = {"role": "system", "content": env.system_prompt()}
        if window == 0:
            conversations.append([system, *_turn_messages(turns)])
        else:
            for end in range(1, len(turns) + 1):
                conversations.append([system, *_turn_messages(turns[max(0, end - window - 1):end])])
        episode += 1
    return conversations[: spec.examples_per_env]


def _play_episode(env: Any, rng: random.Random, episode_seed: int, spec: TinyModelSpec) -> list[tuple[str, str]]:
    """(observation, answer) pairs of one episode, each answer heuristic or random by ``noisy_fraction``."""
    observation = env.reset(episode_seed)
    turns: list[tuple[str, str]] = []
    for _ in range(spec.max_turns_per_episode):
        answer = _choose_answer(env, rng, spec.noisy_fraction)
        turns.append((observation, answer))
        result = env.step(answer)
        observation = result.observation
        if result.terminated or result.truncated:
            break
    return turns


def _choose_answer(env: Any, rng: random.Random, noisy_fraction: float) -> str:
    if rng.random() < noisy_fraction:
        try:
            return env.random_answer(rng)
        except NotImplementedError:
            pass
    try:
        return env.heuristic_answer()
    except NotImplementedError:
        return env.random_answer(rng)


def _turn_messages(turns: Sequence[tuple[str, str]]) -> list[Message]:
    messages: list[Message] = []
    for observation, answer in turns:
        messages += [{"role": "user", "content": observation}, {"role": "assistant", "content": answer}]
    return messages


# ---- tokenizer ----------------------------------------------------------------


def train_tokenizer(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE (any text encodes, no unknown token) trained on ``texts``, plus the chat tokens.

    The normalizer and pre-tokenizer are exactly Qwen2's (NFC, Qwen's split regex,
    byte level): transformers loads every ``qwen2`` folder with its own
    ``Qwen2Tokenizer``, which rebuilds those parts, and vLLM does the same; any
    other choice would make them tokenize differently from ``tokenizer.json``.
    Special tokens take ids 0-2 and the tag tokens 3-6; the BPE fills the rest.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[*SPECIAL_TOKENS, *TAG_TOKENS],  # reserved ids; split off before BPE sees the text
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(list(texts), trainer=trainer)
    return _unspecial_tags(tokenizer)


def _unspecial_tags(tokenizer: Any) -> Any:
    """Mark the tag tokens non-special, so ``skip_special_tokens`` decoding keeps them (as Qwen3 does)."""
    from tokenizers import Tokenizer

    data = json.loads(tokenizer.to_str())
    for added in data["added_tokens"]:
        if added["content"] in TAG_TOKENS:
            added["special"] = False
    return Tokenizer.from_str(json.dumps(data))


def wrap_tokenizer(tokenizer: Any) -> Any:
    """The transformers tokenizer around a trained ``tokenizers.Tokenizer``, with ChatML settings."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # keep the byte-level round trip exact
        model_max_length=2048,
    )


def encode_conversation(tokenizer: Any, messages: Sequence[Message], max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and a loss mask (1 on assistant content and its ``<|im_end|>``) for one conversation.

    Built segment by segment, as the producer builds a multi-turn sequence from the
    prompt ids and the generated ids, so training sees exactly what sampling sees.
    """
    ids: list[int] = []
    mask: list[int] = []
    pending: list[Message] = []
    rendered = 0
    for message in messages:
        if message["role"] != "assistant":
            pending.append(message)
            continue
        prompt = render_chat(pending, add_generation_prompt=True)
        context = tokenizer.encode(("\n" if rendered else "") + prompt, add_special_tokens=False).ids
        answer = tokenizer.encode(message["content"] + IM_END, add_special_tokens=False).ids
        ids += context + answer
        mask += [0] * len(context) + [1] * len(answer)
        pending, rendered = [], rendered + 1
    return ids[:max_len], mask[:max_len]
