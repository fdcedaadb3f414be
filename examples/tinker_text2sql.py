"""Text-to-SQL through the Tinker API: the recipe to start from for SQL with a real model.

The loop runs on the researcher's machine against ``rlpipe serve``; the
environment is stepped here, client-side.  It uses rlpipe's text-to-SQL
environment for the tasks and the scoring (rlpipe installed beside ``tinker``,
from a checkout: ``pip install -e path/to/rlpipe``; the shipped 44 tasks, or
``--tasks`` with a JSONL file of your own):

1. supervised warm start: ``cross_entropy`` on the gold queries of the training
   tasks, in the answer format the environment parses (skip with ``--sft-steps 0``);
2. on-policy RL: each step plays ``group_size`` episodes of each of ``groups``
   tasks (up to two turns: after a wrong query the model sees its error or first
   rows and may try again), scores each episode by its return minus its group's
   mean, and takes one ``importance_sampling`` step;
3. held-out evaluation on the test tasks (every 5th), greedy, before and after.

Every step prints the reward and its breakdown: the share of queries that ran,
that matched the expected result, that could not be parsed, and the mean
similarity bonus of the wrong ones.  The tiny model of ``rlpipe serve`` does not
learn SQL; on a GPU with a real model:

  rlpipe serve --base-model Qwen/Qwen2.5-1.5B-Instruct
  TINKER_API_KEY=tml-me python examples/tinker_text2sql.py --base-url http://127.0.0.1:8000 \\
      --base-model Qwen/Qwen2.5-1.5B-Instruct --sft-steps 0 --rl-steps 100 --groups 8 --group-size 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from producers.envs.sql import load_tasks
from producers.envs.text2sql import TextToSQL


@dataclass
class Episode:
    """One played episode: its return, each turn's (prompt, tokens, logprobs) and each query's score."""

    total: float = 0.0
    turns: list[tuple[list[int], list[int], list[float]]] = field(default_factory=list)
    scores: list = field(default_factory=list)
    format_errors: int = 0


class Loop:
    def __init__(self, args: argparse.Namespace, service: tinker.ServiceClient) -> None:
        self.args, self.service = args, service
        self.training = self.service.create_lora_training_client(  # the same --seed, the same first LoRA weights
            base_model=args.base_model, rank=args.rank, seed=args.seed).result()
        self.tokenizer = load_tokenizer(args.base_model)
        self.train_tasks, self.test_tasks = count_tasks(args.tasks)
        self.calls = 0  # sample calls so far (seeds never repeat)
        self.evaluations: dict[str, list[float]] = {}  # label -> held-out returns, one per task

    def prompt_tokens(self, env: TextToSQL) -> list[int]:
        messages = [{"role": "system", "content": env.system_prompt()}, {"role": "user", "content": env.observation()}]
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        return self.tokenizer.encode(f"{messages[0]['content']}\n\n{messages[1]['content']}\n\nAnswer: ")

    def datum(self, prompt: list[int], answer: list[int], **per_token: list[float]) -> types.Datum:
        tokens = prompt + answer
        inputs: dict = {"target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)}
        for name, values in per_token.items():
            inputs[name] = [0.0] * (len(prompt) - 1) + values
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)

    # 1. supervised warm start on the gold queries
    def warm_start(self) -> None:
        env = TextToSQL(split="train", tasks_path=self.args.tasks)
        demos = []
        for seed in range(self.train_tasks):
            env.reset(seed)
            answer = self.tokenizer.encode(env.heuristic_answer(), add_special_tokens=False)
            demos.append((self.prompt_tokens(env), answer + [self.tokenizer.eos_token_id]))
        rng = np.random.default_rng(self.args.seed)
        for step in range(self.args.sft_steps):
            batch = [demos[i] for i in rng.choice(len(demos), min(self.args.batch, len(demos)), replace=False)]
            out = self.training.forward_backward([self.datum(p, a) for p, a in batch], "cross_entropy").result()
            self.training.optim_step(types.AdamParams(learning_rate=self.args.sft_lr)).result()
            print(f"sft step {step}: loss/token {out.metrics['loss:sum'] / sum(len(a) for _, a in batch):.3f}",
                  flush=True)

    # 2. playing episodes (all at once, one sample call per live episode and turn)
    async def play(self, sampling, split: str, seeds: list[int], temperature: float) -> list[Episode]:
        envs = [TextToSQL(split=split, tasks_path=self.args.tasks) for _ in seeds]
        for env, seed in zip(envs, seeds, strict=True):
            env.reset(seed)
        episodes = [Episode() for _ in envs]
        while live := [i for i, env in enumerate(envs) if not env.done]:
            prompts = [self.prompt_tokens(envs[i]) for i in live]
            self.calls += 1
            results = await asyncio.gather(*(
                sampling.sample(types.ModelInput.from_ints(p), 1, types.SamplingParams(
                    max_tokens=self.args.max_tokens, temperature=temperature, stop=["</answer>"],
                    seed=self.args.seed * 1_000_003 + self.calls * 10_007 + i))
                for i, p in zip(live, prompts, strict=True)))
            for i, prompt, result in zip(live, prompts, results, strict=True):
                sequence = result.sequences[0]
                attempts_before = len(envs[i].attempts)
                outcome = envs[i].step(self.tokenizer.decode(sequence.tokens, skip_special_tokens=True))
                episodes[i].total += outcome.reward
                episodes[i].turns.append((prompt, list(sequence.tokens), list(sequence.logprobs)))
                episodes[i].scores += [a.score for a in envs[i].attempts[attempts_before:]]
                episodes[i].format_errors += bool(outcome.info["format_error"])
        return episodes

    def breakdown(self, episodes: list[Episode]) -> str:
        scores = [s for e in episodes for s in e.scores]
        turns = sum(len(e.turns) for e in episodes)
        wrong = [s.similarity for s in scores if not s.matches]
        return (f"return {np.mean([e.total for e in episodes]):+.3f}; queries {len(scores)} of {turns} turns: "
                f"ran {sum(s.runs for s in scores) / max(1, len(scores)):.0%}, "
                f"matched {sum(s.matches for s in scores) / max(1, len(scores)):.0%}; "
                f"unparsed answers {sum(e.format_errors for e in episodes) / max(1, turns):.0%}; "
                f"similarity of wrong ones {np.mean(wrong) if wrong else 0.0:.3f}")

    def rl_step(self, step: int) -> None:
        sampling = self.training.save_weights_and_get_sampling_client().result()
        tasks = [(step * self.args.groups + g) % self.train_tasks for g in range(self.args.groups)]
        seeds = [t for t in tasks for _ in range(self.args.group_size)]
        episodes = asyncio.run(self.play(sampling, "train", seeds, self.args.temperature))
        data = []
        for g in range(self.args.groups):
            group = episodes[g * self.args.group_size:(g + 1) * self.args.group_size]
            baseline = float(np.mean([e.total for e in group]))
            for episode in group:
                advantage = episode.total - baseline
                data += [self.datum(prompt, tokens, logprobs=logprobs, advantages=[advantage] * len(tokens))
                         for prompt, tokens, logprobs in episode.turns if tokens and advantage != 0.0]
        if data:
            self.training.forward_backward(data, "importance_sampling").result()
            self.training.optim_step(types.AdamParams(learning_rate=self.args.rl_lr)).result()
        print(f"rl step {step}: {self.breakdown(episodes)}; {len(data)} datums", flush=True)

    # 3. held-out evaluation
    def evaluate(self, sampling, label: str) -> float:
        count = min(self.args.eval_episodes, self.test_tasks)
        episodes = asyncio.run(self.play(sampling, "test", list(range(count)), 0.0))
        returns = np.array([e.total for e in episodes])
        self.evaluations[label] = returns.tolist()
        half = 1.96 * returns.std(ddof=1) / math.sqrt(len(returns)) if len(returns) > 1 else float("nan")
        print(f"held-out {label}: {self.breakdown(episodes)} (+/- {half:.3f} at 95%, {count} tasks)", flush=True)
        return float(returns.mean())


def count_tasks(path: str | None) -> tuple[int, int]:
    """The train and test tasks of ``--tasks`` (None: the shipped set), or one line naming ``--tasks`` saying why
    the loop cannot train on the file: read before the server is asked for anything."""
    if path is not None and not Path(path).is_file():
        raise SystemExit(f"error: --tasks {path}: no such file; give a JSONL file of tasks (one JSON object a line: "
                         "id, db_id, schema_sql, question, gold_sql), or leave --tasks out for the shipped set")
    try:
        tasks = load_tasks(path)
    except ValueError as exc:  # a line that is no task: the message names the line and what it needs
        raise SystemExit(f"error: --tasks {path}: {exc}") from None
    test_every = TextToSQL.Config.model_fields["test_every"].default  # every n-th task is held out for the test
    if len(tasks) < test_every:
        raise SystemExit(f"error: --tasks {path}: {len(tasks)} tasks leave the test split empty (every "
                         f"{test_every}th task is held out); give at least {test_every} tasks")
    test = len(TextToSQL(split="test", tasks_path=path).tasks)
    return len(tasks) - test, test


def load_tokenizer(base_model: str) -> PreTrainedTokenizerBase:
    """``base_model``'s tokenizer, or one line naming ``--base-model``: a name it cannot load (not the path or name
    ``rlpipe serve`` printed, or no network to the hub) ends in a traceback otherwise."""
    try:
        return AutoTokenizer.from_pretrained(base_model)
    except OSError as exc:
        reason = " ".join(str(exc).split())[:300]
        raise SystemExit(f"error: --base-model {base_model}: its tokenizer does not load ({reason}); pass the base "
                         "model rlpipe serve printed") from None


@contextmanager
def session_ended_on_exit(service: tinker.ServiceClient) -> Iterator[None]:
    """Ends the loop's session when the loop stops, as the SDK's ``with ServiceClient()`` does: the server frees its
    clients at once rather than when the session lapses, and a Ctrl-C is one line instead of a traceback.

    Entered as soon as the ``ServiceClient`` exists, so a stop while the training client is created or the
    tokenizer loads ends the session too; the line says whether the server confirmed that it ended."""
    try:
        yield
    except KeyboardInterrupt:
        why = session_not_ended(service, "interrupted")
        ended = ("the session is ended and the server has freed its clients" if why is None
                 else f"the session was not ended ({why}), so the server frees its clients when it lapses")
        raise SystemExit(f"interrupted: {ended}; the states it saved stay (`tinker checkpoint list`)") from None
    except BaseException:  # an error, or a one-line exit: shown as it is, after the session ends as "errored"
        session_not_ended(service, "errored")
        raise
    session_not_ended(service, "success")


def session_not_ended(service: tinker.ServiceClient, status: str) -> str | None:
    """End ``service``'s session as ``status``; None once the server has, else why not (also said on stderr
    unless the loop was interrupted, whose own line says it)."""
    try:
        service.close(status).result()
        return None
    except KeyboardInterrupt:
        why = "interrupted while it ended"
    except Exception as exc:  # the server is gone: it ends the session when it lapses
        why = " ".join(str(exc).split()) or type(exc).__name__
    if status != "interrupted":
        print(f"note: the session was not ended ({why}); the server frees its clients when it lapses",
              file=sys.stderr, flush=True)
    return why


def connect(args: argparse.Namespace) -> tinker.ServiceClient:
    """The session's client of the server at ``--base-url``, or one line saying why not: the SDK retries a refused
    connection without a word.  It asks the server nothing yet (``start_loop`` does, inside the session).

    The same check as ``tinker_cartpole.py``'s: each example is a single file a researcher copies on its own."""
    try:
        urllib.request.urlopen(args.base_url, timeout=10).close()
    except urllib.error.HTTPError:
        pass  # a server answers; the SDK's calls say whether it is rlpipe's
    except (urllib.error.URLError, OSError) as exc:
        port = urllib.parse.urlsplit(args.base_url).port or 8000
        raise SystemExit(f"error: nothing answers at {args.base_url} ({getattr(exc, 'reason', exc)}); start the "
                         f"server with `rlpipe serve --port {port}`, or pass its URL as --base-url") from None
    return tinker.ServiceClient(base_url=args.base_url)


def start_loop(args: argparse.Namespace, service: tinker.ServiceClient) -> Loop:
    """The loop's clients, or one line saying why not: a refusal at the start (no API key, a base model the server
    does not serve) ends in a traceback otherwise."""
    try:
        return Loop(args, service)
    except tinker.TinkerError as exc:
        raise SystemExit(f"error: {' '.join(str(exc).split())}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--base-model", required=True, help="the base model name rlpipe serve printed")
    parser.add_argument("--tasks", default=None, help="a JSONL task file (default: rlpipe's shipped set)")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128, help="tokens per answer")
    parser.add_argument("--sft-steps", type=int, default=10)
    parser.add_argument("--sft-lr", type=float, default=1e-3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rl-steps", type=int, default=10)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--eval-episodes", type=int, default=9, help="held-out tasks played (at most the test split)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None,
                        help="write the held-out returns as JSON (what rlpipe sweep reads)")
    args = parser.parse_args()
    if args.result_file is not None and not args.result_file.parent.is_dir():  # written only when the loop ends
        parser.error(f"--result-file {args.result_file}: there is no folder {args.result_file.parent}; create it "
                     "or choose another path")
    started = time.monotonic()
    count_tasks(args.tasks)
    service = connect(args)
    with session_ended_on_exit(service):  # from here on, however the loop stops, its session ends
        loop = start_loop(args, service)
        base = loop.evaluate(loop.service.create_sampling_client(base_model=args.base_model).result(), "base model")
        loop.warm_start()
        for step in range(args.rl_steps):
            loop.rl_step(step)
        last = loop.evaluate(loop.training.save_weights_and_get_sampling_client().result(), "last version")
        print(f"base {base:+.3f} -> last {last:+.3f} in {time.monotonic() - started:.0f} s", flush=True)
        if args.result_file is not None:
            args.result_file.write_text(json.dumps({"metric": "held-out return", "samples": loop.evaluations["last version"],
                                                    "evaluations": {"base model": loop.evaluations["base model"]}}))


if __name__ == "__main__":
    main()
