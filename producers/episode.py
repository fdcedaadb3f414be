"""One episode as a token stream: token-in / token-out bookkeeping.

The learner must train on exactly the tokens the sampler consumed and produced.
So the sequence is built incrementally: the first prompt comes from the chat
template, every generated token id is appended as produced (mask 1, with the
sampler's logprob), and each later observation is appended as the chat
template's *continuation* tokens (mask 0).  Earlier turns are never
re-tokenized, and a template that rewrites history (stripping earlier thinking,
say) cannot change what was trained on.

Long-horizon environments (CartPole's 200 steps, a building's days) cannot fit
one context: there every turn is a fresh prompt (system prompt, at most
``history_turns`` recent turns, the current observation) and its own row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from tokenizers import Tokenizer

from producers.envs.base import StepResult, TextEnv


class ChatTokenizer(Protocol):
    """The part of a Hugging Face tokenizer the episode needs."""

    eos_token: str
    eos_token_id: int

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class DirectTokenizer:
    """A Hugging Face fast tokenizer whose ``encode`` and ``decode`` call its Rust backend (``tokenizers``) directly.

    The same ids and text as the tokenizer's own methods, which reach the same backend call through
    argument checks, batching of a single text and result conversion: two thirds to four fifths of their time
    for a turn's short prompt or answer, and a rollout worker calls them every turn.  Built by
    ``direct_tokenizer`` only where the backend alone reproduces the tokenizer: no truncation or padding set,
    special tokens not split, no clean-up of decoded text.  The chat template is the tokenizer's.

    The last ``ENCODED_KEPT`` texts' ids are kept: the episodes of a group start from the same first prompt
    (one seed), which with a long system prompt is the longest text a worker encodes.
    """

    ENCODED_KEPT = 256

    def __init__(self, tokenizer: Any) -> None:
        self.inner, self.backend = tokenizer, tokenizer.backend_tokenizer
        self.eos_token, self.eos_token_id = tokenizer.eos_token, tokenizer.eos_token_id
        self._encoded = lru_cache(maxsize=self.ENCODED_KEPT)(self._encode)

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any:
        return self.inner.apply_chat_template(conversation, **kwargs)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._encoded(text, add_special_tokens))  # a list of its own: callers extend it

    def _encode(self, text: str, add_special_tokens: bool) -> tuple[int, ...]:
        return tuple(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def direct_tokenizer(tokenizer: ChatTokenizer) -> ChatTokenizer:
    """``tokenizer`` as a ``DirectTokenizer`` where its backend alone gives the same results, else unchanged."""
    if isinstance(tokenizer, DirectTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer):
        return tokenizer  # a slow (Python) tokenizer, or a test's own
    same = (backend.truncation is None and backend.padding is None
            and not getattr(tokenizer, "split_special_tokens", False) and not backend.encode_special_tokens
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False))
    return DirectTokenizer(tokenizer) if same else tokenizer


_PROBE = "\u2063PROBE\u2063"  # a marker no observation contains


@dataclass(frozen=True)
class ChatFormat:
    """What the chat template puts between turns, learned once from the template itself.

    ``closing_token_id`` is the special token that opens ``after_assistant`` (``<|im_end|>``), None when the
    closing text does not start with one.  A turn stops there as well as at eos: a base model's eos
    (Qwen2.5 base: ``<|endoftext|>``) is not its template's closing token, and without it a turn runs on into a
    user turn of the model's own, trained and read by the environment as its answer.
    """

    after_assistant: str  # text closing an assistant turn, e.g. "<|im_end|>\n"
    user_prefix: str  # text opening a user turn, before its content
    user_suffix_and_prompt: str  # text after a user's content through the assistant generation prompt
    closing_token_id: int | None = None

    @classmethod
    def from_tokenizer(cls, tokenizer: ChatTokenizer) -> ChatFormat:
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        closed = _render(tokenizer, [*base, {"role": "assistant", "content": _PROBE}], False)
        extended = _render(
            tokenizer, [*base, {"role": "assistant", "content": _PROBE}, {"role": "user", "content": _PROBE}], True
        )
        if not extended.startswith(closed):
            raise ValueError("the chat template rewrites earlier turns; multi-turn token-in/token-out needs one that doesn't")
        after_assistant = closed[closed.index(_PROBE) + len(_PROBE):]
        tail = extended[len(closed):]
        user_prefix, _, rest = tail.partition(_PROBE)
        return cls(after_assistant=after_assistant, user_prefix=user_prefix, user_suffix_and_prompt=rest,
                   closing_token_id=_closing_token_id(tokenizer, after_assistant))

    @property
    def turn_stop_ids(self) -> tuple[int, ...]:
        """The ids a turn stops at besides the model's eos ids (``SampleRequest.extra_stop_ids``)."""
        return () if self.closing_token_id is None else (self.closing_token_id,)

    def answer_end_id(self, tokenizer: ChatTokenizer) -> int:
        """The id that ends an answer written for the model (a demonstration): the template's closing token where it
        has one, as sampling stops a turn there, else eos."""
        return tokenizer.eos_token_id if self.closing_token_id is None else self.closing_token_id


def _closing_token_id(tokenizer: ChatTokenizer, after_assistant: str) -> int | None:
    """The first token of ``after_assistant`` when it is one special token (dropped by ``skip_special_tokens``)."""
    ids = tokenizer.encode(after_assistant, add_special_tokens=False)
    if not ids:
        return None
    text = tokenizer.decode(ids[:1], skip_special_tokens=False)
    special = bool(text) and not tokenizer.decode(ids[:1], skip_special_tokens=True)
    return ids[0] if special and after_assistant.startswith(text) else None


def _render(tokenizer: ChatTokenizer, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_ids(tokenizer: ChatTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt (no extra special tokens)."""
    return tokenizer.encode(_render(tokenizer, messages, True), add_special_tokens=False)


@dataclass
class TurnRecord:
    """One turn: the tokens the model saw and produced, and what the environment said."""

    prompt_ids: list[int]
    generated_ids: list[int]
    generated_logprobs: list[float]
    answer_text: str
    reward: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)
    state: list[float] | None = None  # the environment's numeric state the prompt showed (per-turn episodes)


@dataclass
class Episode:
    """An environment episode driven by a sampler, turn by turn."""

    env: TextEnv
    tokenizer: ChatTokenizer
    chat: ChatFormat
    seed: int
    episode_id: str
    group_id: str
    policy_version: int
    adapter_sha256: str
    per_turn: bool
    history_turns: int = 0
    max_model_len: int = 2048
    temperature: float = 1.0  # how the sampler shaped the distribution its logprobs are of (the rows record it)
    top_p: float = 1.0
    place: str = ""  # the episode's place in its run ("<group number>.<index in group>"): names its sampling streams
    observation: str = ""
    turns: list[TurnRecord] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # whole-episode sequence (per_turn False)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    done: bool = False
    terminated: bool = False
    truncated: bool = False
    success: bool = False
    overflow: bool = False  # the context filled up before the episode ended
    history: list[tuple[str, TurnRecord]] = field(default_factory=list)  # (observation, turn), per_turn only

    def start(self) -> None:
        """Reset the environment and lay down the first prompt."""
        self.observation = self.env.reset(self.seed)
        if not self.per_turn:
            self.tokens = prompt_ids(self.tokenizer, self._messages([]))
            self.loss_mask = [0] * len(self.tokens)
            self.logprobs = [0.0] * len(self.tokens)

    def _messages(self, history: list[tuple[str, TurnRecord]]) -> list[dict[str, str]]:
        messages = [{"role": "system", "content": self.env.system_prompt()}]
        for past_obs, turn in history:
            messages += [{"role": "user", "content": past_obs}, {"role": "assistant", "content": turn.answer_text}]
        messages.append({"role": "user", "content": self.observation})
        return messages

    def next_prompt(self) -> list[int]:
        """The token ids the sampler continues from for the next turn."""
        if not self.per_turn:
            return list(self.tokens)
        history = self.history[-self.history_turns:] if self.history_turns else []
        return prompt_ids(self.tokenizer, self._messages(history))

    def room_left(self, prompt_len: int) -> int:
        """Tokens the next generation may add without overflowing the context."""
        return self.max_model_len - prompt_len - 1

    def record_generation(self, prompt: list[int], generated_ids: list[int], logprobs: list[float]) -> str:
        """Append the sampler's output exactly as produced; return the answer text for the environment."""
        if len(generated_ids) != len(logprobs):
            raise ValueError(f"sampler returned {len(generated_ids)} tokens but {len(logprobs)} logprobs")
        text = self.tokenizer.decode(generated_ids, skip_special_tokens=True)
        state = [float(x) for x in self.env.numeric_state()] if self.per_turn else []  # before the env steps
        self.turns.append(TurnRecord(prompt, list(generated_ids), list(logprobs), text, state=state or None))
        if not self.per_turn:
            self.tokens += generated_ids
            self.loss_mask += [1] * len(generated_ids)
            self.logprobs += [float(x) for x in logprobs]
        return text

    def apply_step(self, result: StepResult) -> None:
        """Record the environment's answer to the last turn and extend the sequence with the next observation."""
        turn = self.turns[-1]
        turn.reward, turn.info = float(result.reward), dict(result.info)
        if self.per_turn:
            self.history = [*self.history, (self.observation, turn)][-max(self.history_turns, 1):]
        self.observation = result.observation
        self.terminated, self.truncated = result.terminated, result.truncated
        self.success = bool(result.info.get("success", False))
        if result.terminated or result.truncated:
            self.done = True
            return
        if not self.per_turn:
            continuation = self._continuation_ids(turn.generated_ids, result.observation)
            if len(self.tokens) + len(continuation) + 8 >= self.max_model_len:
                self.done = self.truncated = self.overflow = True
                return
            self.tokens += continuation
            self.loss_mask += [0] * len(continuation)
            self.logprobs += [0.0] * len(continuation)

    def _continuation_ids(self, generated_ids: list[int], observation: str) -> list[int]:
        """The tokens after a turn through the next generation prompt: the template's closing text (less the stop
        token the turn ended with, eos or the closing token, already in the sequence), the observation."""
        closing = self.chat.after_assistant
        if generated_ids and generated_ids[-1] in (self.tokenizer.eos_token_id, self.chat.closing_token_id):
            stop = self.tokenizer.decode(generated_ids[-1:], skip_special_tokens=False)
            closing = closing.removeprefix(stop)
        text = closing + self.chat.user_prefix + observation + self.chat.user_suffix_and_prompt
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def turn_rewards(self) -> list[float]:
        return [t.reward for t in self.turns]

    @property
    def episode_return(self) -> float:
        return float(sum(self.turn_rewards))
