"""The episode's tokenizer calls go straight to the fast tokenizer's backend, with the same results."""

from __future__ import annotations

import copy

import pytest

from producers.episode import DirectTokenizer, direct_tokenizer

TEXTS = [
    "",
    "<answer>Left</answer>",
    "cart position 0.01, velocity -0.2, pole angle 0.03",
    "  leading spaces and a tab\there\n\nand newlines  ",
    "<|im_start|>user\nspecial tokens in the text<|im_end|>\n<|im_start|>assistant\n",
    "unicode: √ é 漢字 \u2063",
]


def test_encode_and_decode_equal_the_tokenizer_s_own(tiny_tokenizer) -> None:
    direct = direct_tokenizer(tiny_tokenizer)
    assert isinstance(direct, DirectTokenizer)
    for text in TEXTS:
        for special in (False, True):
            ids = tiny_tokenizer.encode(text, add_special_tokens=special)
            assert direct.encode(text, add_special_tokens=special) == ids
            for skip in (False, True):
                assert direct.decode(ids, skip_special_tokens=skip) == tiny_tokenizer.decode(
                    ids, skip_special_tokens=skip)
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert direct.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        tiny_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    assert (direct.eos_token, direct.eos_token_id) == (tiny_tokenizer.eos_token, tiny_tokenizer.eos_token_id)


def test_a_tokenizer_the_backend_would_not_reproduce_is_used_as_it_is(tiny_tokenizer) -> None:
    truncating = copy.deepcopy(tiny_tokenizer)
    truncating.backend_tokenizer.enable_truncation(max_length=4)  # the backend alone would truncate
    assert direct_tokenizer(truncating) is truncating
    cleaning = copy.deepcopy(tiny_tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # decode post-processes the backend's text
    assert direct_tokenizer(cleaning) is cleaning
    splitting = copy.deepcopy(tiny_tokenizer)
    splitting.split_special_tokens = True  # encode would switch the backend's setting per call
    assert direct_tokenizer(splitting) is splitting
    plain = object()  # a slow tokenizer or a test double: no backend
    assert direct_tokenizer(plain) is plain  # type: ignore[arg-type]


def test_a_text_encoded_again_is_not_encoded_again_and_its_ids_are_a_new_list(tiny_tokenizer) -> None:
    direct = direct_tokenizer(tiny_tokenizer)
    calls: list[str] = []
    backend_encode = direct.backend.encode

    class Counting:
        def encode(self, text, add_special_tokens=True):
            calls.append(text)
            return backend_encode(text, add_special_tokens=add_special_tokens)

    direct.backend = Counting()
    first = direct.encode("the same first prompt", add_special_tokens=False)
    first.append(0)  # an episode extends its token list in place
    again = direct.encode("the same first prompt", add_special_tokens=False)
    assert again == tiny_tokenizer.encode("the same first prompt", add_special_tokens=False)
    assert calls == ["the same first prompt"]
    direct.encode("the same first prompt", add_special_tokens=True)  # other settings, other ids
    assert len(calls) == 2


def test_wrapping_twice_wraps_once(tiny_tokenizer) -> None:
    direct = direct_tokenizer(tiny_tokenizer)
    assert direct_tokenizer(direct) is direct


@pytest.mark.parametrize("env", ["sokoban", "cartpole"])
def test_the_worker_s_rows_are_the_same_through_either(tiny_tokenizer, env) -> None:
    from producers.envs.registry import make_env
    from producers.episode import ChatFormat, Episode

    def transcript(tokenizer) -> tuple[list[int], list[list[int]], list[str]]:
        environment = make_env(env)
        episode = Episode(env=environment, tokenizer=tokenizer, chat=ChatFormat.from_tokenizer(tokenizer), seed=3,
                          episode_id="e", group_id="g", policy_version=0, adapter_sha256="", per_turn=env == "cartpole")
        episode.start()
        answer = [*tiny_tokenizer.encode("<answer>Left</answer>", add_special_tokens=False),
                  tiny_tokenizer.eos_token_id]
        prompts, texts = [], []
        for _ in range(3):
            prompt = episode.next_prompt()
            prompts.append(prompt)
            texts.append(episode.record_generation(prompt, answer, [-0.5] * len(answer)))
            episode.apply_step(environment.step(texts[-1]))
            if episode.done:
                break
        return episode.tokens, prompts, texts

    assert transcript(direct_tokenizer(tiny_tokenizer)) == transcript(tiny_tokenizer)
