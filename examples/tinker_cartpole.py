"""CartPole through the Tinker API: a researcher's loop that runs on a laptop against ``rlpipe serve``.

It imports only the ``tinker`` SDK, numpy and transformers' tokenizer, as a
script outside rlpipe would.  The environment (Gym's CartPole-v0 physics, shown
to the model as text through its chat template, one prompt per turn) is stepped
here, client-side; the server only trains and samples.  The recipe is the one
``make demo`` runs inside rlpipe (docs/demo.md), written against the SDK:

1. supervised warm start: ``cross_entropy`` on demonstrations of a noisy teacher
   (the heuristic "push towards where the pole is falling" with probability 0.24,
   a random push otherwise) on training seeds; every turn gives both answers,
   weighted by how often the teacher gives each (0.62 / 0.38);
2. on-policy RL: each step plays ``group_size`` episodes from each of ``groups``
   start states with ``save_weights_and_get_sampling_client``; one
   ``importance_sampling`` step with the sampled tokens' logprobs as ``q``.  A turn's
   advantage (``--advantage``) is either its return-to-go discounted at 0.9
   (``return``), or a generalised advantage estimate (``gae``) against a value
   baseline the loop fits itself: a ridge regression of the discounted return-to-go
   on quadratic features of the cart's state over the last few steps' turns, so
   that a push is judged by the state it leads to rather than by the whole rest
   of its episode.  Either is then centred and scaled over the step.  Each step is bounded
   (``--max-step-kl``): its KL from the policy before it, estimated on the sampled answers with a
   ``forward``; a step above the bound is taken again, shorter, from the state saved before it;
3. held-out evaluation: the base model, the warm start and the last weights on
   unseen seeds (sampled at temperature 1, as trained), mean return with a 95% interval.

An answer that holds no action costs 0.1 and shows the same state again, as rlpipe's
environments do (``format_penalty``); an episode has at most ``--max-steps`` turns.

  rlpipe serve                                 # prints the base URL and the base model path
  TINKER_API_KEY=tml-me python examples/tinker_cartpole.py --base-url http://127.0.0.1:8000 \\
      --base-model <the path serve printed>
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
from statistics import NormalDist

import numpy as np
import tinker
from tinker import types
from transformers import AutoTokenizer, PreTrainedTokenizerBase

ACTIONS = ("left", "right")
MAX_RETRIES = 4  # --max-step-kl: how many times a step above the bound is taken again, shorter
FORMAT_PENALTY = -0.1  # the reward of an answer that holds no action (rlpipe's environments: format_penalty)
SYSTEM = (
    "CartPole: keep a pole balanced upright on a moving cart by pushing the cart left or right. +1 per step until "
    "the pole falls past 12 degrees or the cart leaves the track (|x| > 2.4).\n"
    "Each turn you see the cart position and velocity and the pole angle and angular velocity. Answer with one "
    "action: left or right (or 0 / 1). Pushing the cart towards the side the pole leans to brings it back up.\n"
    "You may think inside <think>...</think>. Give your answer inside <answer>...</answer>; separate several "
    "actions with ||."
)


# ---- the environment (client-side) -------------------------------------------------------------------------------


class CartPole:
    """Gym's CartPole-v0: Euler steps, +1 per step until |angle| > 12 degrees or |x| > 2.4, 200 steps at most.

    As in rlpipe's environment, a turn whose answer holds no action costs ``FORMAT_PENALTY`` and leaves the cart
    as it was; an episode has at most ``max_steps`` turns, such turns included."""

    def __init__(self, seed: int, max_steps: int) -> None:
        self.state = np.random.default_rng(seed).uniform(-0.05, 0.05, 4)
        self.max_steps, self.steps, self.turns, self.done, self.fell = max_steps, 0, 0, False, False

    def skip(self) -> float:
        """A turn without an action: the penalty, the cart unchanged."""
        self.turns += 1
        self.done = self.turns >= self.max_steps
        return FORMAT_PENALTY

    def step(self, action: int) -> float:
        x, x_dot, theta, theta_dot = self.state
        force = 10.0 if action == 1 else -10.0
        cos, sin = math.cos(theta), math.sin(theta)
        temp = (force + 0.05 * theta_dot**2 * sin) / 1.1
        theta_acc = (9.8 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / 1.1))
        x_acc = temp - 0.05 * theta_acc * cos / 1.1
        self.state = np.array([x + 0.02 * x_dot, x_dot + 0.02 * x_acc, theta + 0.02 * theta_dot,
                               theta_dot + 0.02 * theta_acc])
        self.steps += 1
        self.turns += 1
        self.fell = abs(self.state[0]) > 2.4 or abs(self.state[2]) > 12 * 2 * math.pi / 360
        self.done = self.fell or self.turns >= self.max_steps
        return 1.0

    def observation(self) -> str:
        x, x_dot, theta, theta_dot = self.state
        return (f"Step {self.steps} of {self.max_steps}.\n"
                f"Cart position: {x:+.3f} (track ends at +/-2.4)\n"
                f"Cart velocity: {x_dot:+.3f}\n"
                f"Pole angle: {theta:+.3f} rad ({math.degrees(theta):+.1f} degrees; falls beyond +/-12; "
                "positive leans right)\n"
                f"Pole angular velocity: {theta_dot:+.3f} rad/s\n"
                "Actions: left (push the cart left) or right (push the cart right).")

    def heuristic(self) -> int:
        """Push towards where the pole is falling."""
        x, x_dot, theta, theta_dot = self.state
        return 1 if theta + 0.5 * theta_dot + 0.02 * x + 0.1 * x_dot > 0 else 0


# ---- a value baseline of the cart's state (for --advantage gae) ----------------------------------------------------

STATE_SCALE = np.array([2.4, 2.0, 12 * 2 * math.pi / 360, 2.0])  # the track, the pole's limit, typical speeds


def features(states: np.ndarray) -> np.ndarray:
    """1, the scaled state and the products of its pairs: a quadratic function of cart and pole, per row."""
    scaled = np.atleast_2d(states) / STATE_SCALE
    i, j = np.triu_indices(scaled.shape[1])
    return np.hstack([np.ones((len(scaled), 1)), scaled, scaled[:, i] * scaled[:, j]])


def fit_value(states: np.ndarray, targets: np.ndarray, ridge: float = 1e-2) -> np.ndarray:
    """Weights of the ridge regression of ``targets`` on ``features(states)``."""
    x = features(states)
    return np.linalg.solve(x.T @ x + ridge * np.eye(x.shape[1]), x.T @ targets)


def gae(rewards: list[float], values: list[float], last_value: float, discount: float, lam: float) -> list[float]:
    """Generalised advantage estimates of one episode's turns.

    ``values[t]`` is the baseline of the state turn ``t`` saw; ``last_value`` that of the state after the
    last turn (0 when the episode ended there, the baseline when it was cut at the step limit).
    """
    advantages, running = [0.0] * len(rewards), 0.0
    for t in reversed(range(len(rewards))):
        following = values[t + 1] if t + 1 < len(rewards) else last_value
        running = rewards[t] + discount * following - values[t] + discount * lam * running
        advantages[t] = running
    return advantages


def train_subset(turns: int, limit: int, rng: np.random.Generator) -> np.ndarray:
    """Indices of the turns a step trains on: all of them, or ``limit`` drawn uniformly (sorted).

    Late in a run a step's 8 episodes are ~1,500 turns; training on a uniform share of
    them, after the advantages are formed over all of them, is the same gradient in
    expectation at a third of the cost."""
    if turns <= limit:
        return np.arange(turns)
    return np.sort(rng.choice(turns, limit, replace=False))


def sampled_kl(before: list[list[float]], after: list[list[float]]) -> float:
    """KL(before || after) per answer, estimated from answers sampled from ``before``.

    Each answer's logprobs under the policy it was sampled from and under another; per token
    ``r - 1 - log r`` with ``r = p_after / p_before`` (an unbiased, never negative estimate of that
    token's KL), summed over the answer's tokens and averaged over the answers."""
    totals = []
    for old, new in zip(before, after, strict=True):
        log_r = np.asarray(new, dtype=np.float64) - np.asarray(old, dtype=np.float64)
        totals.append(float(np.sum(np.expm1(log_r) - log_r)))
    return float(np.mean(totals)) if totals else 0.0


def parse_action(text: str) -> int | None:
    """The action in the last ``<answer>...</answer>``; None when there is none."""
    start, end = text.rfind("<answer>"), text.rfind("</answer>")
    if start < 0 or end < start:
        return None
    word = text[start + len("<answer>"):end].strip().lower()
    return {"left": 0, "0": 0, "right": 1, "1": 1}.get(word)


@dataclass
class Turn:
    prompt: list[int]
    tokens: list[int]  # the sampled answer
    logprobs: list[float]  # the sampler's, one per answer token
    reward: float
    state: np.ndarray  # the cart's state the prompt showed


@dataclass
class Episode:
    turns: list[Turn] = field(default_factory=list)
    cut: bool = False  # ended by the turn limit rather than a fall
    no_action: int = 0  # turns whose answer held no action
    last_state: np.ndarray = field(default_factory=lambda: np.zeros(4))

    @property
    def total(self) -> float:
        return sum(t.reward for t in self.turns)

    def returns_to_go(self, discount: float) -> list[float]:
        to_go, result = 0.0, []
        for turn in reversed(self.turns):
            to_go = turn.reward + discount * to_go
            result.append(to_go)
        return result[::-1]


# ---- the loop ------------------------------------------------------------------------------------------------------


class Loop:
    def __init__(self, args: argparse.Namespace, service: tinker.ServiceClient) -> None:
        self.args, self.service = args, service
        self.training = self.service.create_lora_training_client(
            base_model=args.base_model, rank=args.rank, train_unembed=args.train_unembed,
            seed=args.seed).result()  # the same --seed starts from the same LoRA weights
        self.tokenizer = load_tokenizer(args.base_model)
        self.eos = self.tokenizer.eos_token_id
        self.sampled = 0  # sample calls so far (each its own seed)
        self.tokens = {"sampled": 0, "trained": 0}  # sampled tokens, and tokens in forward_backward calls
        self.evaluations: dict[str, list[float]] = {}  # label -> held-out returns, one per episode
        self.history: list[tuple[np.ndarray, np.ndarray]] = []  # (states, returns-to-go) of the last RL steps

    def prompt_tokens(self, env: CartPole) -> list[int]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": env.observation()}]
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def answer_tokens(self, action: int) -> list[int]:
        return self.tokenizer.encode(f"<answer>{ACTIONS[action]}</answer>", add_special_tokens=False) + [self.eos]

    def datum(self, prompt: list[int], answer: list[int], weight: float = 1.0, **per_token: list[float]) -> types.Datum:
        tokens = prompt + answer
        inputs: dict = {"target_tokens": tokens[1:], "weights": [0.0] * (len(prompt) - 1) + [weight] * len(answer)}
        for name, values in per_token.items():
            inputs[name] = [0.0] * (len(prompt) - 1) + values
        return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs=inputs)

    def ratio_mask(self, answer: list[int]) -> dict[str, list[float]]:
        """gspo's sequence_ratio_mask: the answer's sampled tokens form the sequence ratio (other losses: none)."""
        return {"sequence_ratio_mask": [1.0] * len(answer)} if self.args.loss == "gspo" else {}

    def adam(self, learning_rate: float) -> types.AdamParams:
        return types.AdamParams(learning_rate=learning_rate, beta2=self.args.beta2)

    def train(self, data: list[types.Datum], loss: str) -> types.ForwardBackwardOutput:
        self.tokens["trained"] += sum(d.model_input.length for d in data)
        return self.training.forward_backward(data, loss).result()

    # 1. supervised warm start
    def warm_start(self) -> None:
        rng = np.random.default_rng(self.args.seed)
        agree = 1.0 - self.args.noise / 2  # how often the noisy teacher gives the heuristic's answer
        rows = []
        for seed in range(self.args.demo_episodes):
            env = CartPole(10_000 + seed, self.args.max_steps)
            while not env.done:
                best, prompt = env.heuristic(), self.prompt_tokens(env)
                rows.append((prompt, self.answer_tokens(best), agree))
                rows.append((prompt, self.answer_tokens(1 - best), 1.0 - agree))
                env.step(best if rng.random() > self.args.noise else int(rng.integers(2)))
        for step in range(self.args.sft_steps):
            batch = [rows[i] for i in rng.choice(len(rows), min(self.args.batch, len(rows)), replace=False)]
            out = self.train([self.datum(p, a, w) for p, a, w in batch], "cross_entropy")
            self.training.optim_step(self.adam(self.args.sft_lr)).result()
            weight = sum(w * len(a) for _, a, w in batch)
            print(f"sft step {step}: loss/token {out.metrics['loss:sum'] / weight:.3f}", flush=True)

    # 2. on-policy RL
    async def episodes(self, sampling, seeds: list[int], temperature: float) -> list[Episode]:
        """Run one episode per seed at once."""
        envs = [CartPole(seed, self.args.max_steps) for seed in seeds]
        episodes = [Episode() for _ in envs]
        while not all(env.done for env in envs):
            live = [i for i, env in enumerate(envs) if not env.done]
            prompts = [self.prompt_tokens(envs[i]) for i in live]
            results = await asyncio.gather(*(  # each call its own seed, so a group's episodes differ
                sampling.sample(types.ModelInput.from_ints(p), 1, types.SamplingParams(
                    max_tokens=self.args.max_tokens, temperature=temperature,
                    seed=self.args.seed * 1_000_003 + self.sampled + n))
                for n, p in enumerate(prompts)))
            self.sampled += len(live)
            for i, prompt, result in zip(live, prompts, results, strict=True):
                sequence = result.sequences[0]
                self.tokens["sampled"] += len(sequence.tokens)
                state = envs[i].state.copy()
                action = parse_action(self.tokenizer.decode(sequence.tokens, skip_special_tokens=True))
                if action is None:  # an answer that holds no action: the penalty, and the same state again
                    reward = envs[i].skip()
                    episodes[i].no_action += 1
                else:
                    reward = envs[i].step(action)
                episode = episodes[i]
                episode.turns.append(Turn(prompt, list(sequence.tokens), list(sequence.logprobs), reward, state))
                if envs[i].done:  # cut at the turn limit: the state it was cut in still had a future
                    episode.cut = not envs[i].fell
                    episode.last_state = envs[i].state.copy()
        return episodes

    def advantages(self, episodes: list[Episode]) -> list[list[float]]:
        """Each turn's advantage before the step's centring and scaling (``--advantage``)."""
        to_go = [e.returns_to_go(self.args.discount) for e in episodes]
        if self.args.advantage == "return":
            return to_go
        self.history.append((np.array([t.state for e in episodes for t in e.turns]), np.concatenate(to_go)))
        del self.history[:-self.args.value_steps]  # the baseline follows the policy: only the last few steps
        weights = fit_value(np.concatenate([s for s, _ in self.history]), np.concatenate([g for _, g in self.history]))
        result = []
        for e in episodes:
            values = (features(np.array([t.state for t in e.turns])) @ weights).tolist()
            last = float((features(e.last_state) @ weights)[0]) if e.cut else 0.0
            result.append(gae([t.reward for t in e.turns], values, last, self.args.discount, self.args.gae_lambda))
        return result

    def step_kl(self, data: list[types.Datum], turns: list[Turn]) -> float:
        """How far the last step moved the policy on the answers of ``turns`` (``sampled_kl``), measured with a
        ``forward`` of at most ``--kl-rows`` of them (``data``, one datum per turn, spread evenly) against the
        logprobs they were sampled with."""
        stride = -(-len(data) // self.args.kl_rows)
        probe, probed = data[::stride], turns[::stride]
        out = self.training.forward(probe, self.args.loss).result()
        after = [result["logprobs"].tolist()[-len(turn.tokens):]
                 for turn, result in zip(probed, out.loss_fn_outputs, strict=True)]
        return sampled_kl([turn.logprobs for turn in probed], after)

    def bounded_update(self, data: list[types.Datum], turns: list[Turn]) -> str:
        """One RL update on ``data`` whose move is within ``--max-step-kl``; what it took, for the step's line.

        The step is taken at ``--rl-lr`` and measured (``step_kl``). Above the bound the loop goes on from the
        state before it (saved with ``save_state``, loaded with its optimizer into a new training client) and takes
        it again, shorter: Adam's move is proportional to the learning rate and the KL of a small move to its
        square, so the rate is scaled by ``0.9 * sqrt(bound / KL)``, and at least halved; at most
        ``MAX_RETRIES`` times. (rlpipe's own learner bounds its steps too, ``learner.max_step_kl``, by a line
        search on the step's parameters, which an API client cannot reach.) The SDK unloads nothing: a client
        left behind keeps its adapter on the server until the session ends."""
        self.train(data, self.args.loss)
        bound = self.args.max_step_kl
        if bound is None:
            self.training.optim_step(self.adam(self.args.rl_lr)).result()
            return ""
        saved = self.training.save_state("before-rl-step", overwrite=True).result().path
        scale = 1.0
        for retry in range(MAX_RETRIES + 1):
            self.training.optim_step(self.adam(self.args.rl_lr * scale)).result()
            kl = self.step_kl(data, turns)
            if kl <= bound or retry == MAX_RETRIES:
                break
            scale *= min(0.5, 0.9 * math.sqrt(bound / kl))
            self.training = self.service.create_training_client_from_state_with_optimizer(saved).result()
            self.train(data, self.args.loss)  # the new client has no gradients
        return f", step KL {kl:.3f}" + (f" at {scale:.2g} x --rl-lr" if scale < 1 else "")

    def rl_step(self, step: int) -> None:
        started = time.monotonic()
        sampling = self.training.save_weights_and_get_sampling_client().result()
        seeds = [20_000 + step * self.args.groups + g for g in range(self.args.groups)]
        runs = asyncio.run(self.episodes(sampling, [s for s in seeds for _ in range(self.args.group_size)], 1.0))
        turns = [t for e in runs for t in e.turns]
        values = np.concatenate(self.advantages(runs)) if turns else np.zeros(0)
        spread = values.std() if len(values) > 1 else 0.0
        picked = train_subset(len(turns), self.args.train_turns, np.random.default_rng([self.args.seed, step]))
        chosen = [i for i in picked if turns[i].tokens and spread > 0]
        data = [self.datum(turns[i].prompt, turns[i].tokens, logprobs=turns[i].logprobs,
                           advantages=[float((values[i] - values.mean()) / spread)] * len(turns[i].tokens),
                           **self.ratio_mask(turns[i].tokens))
                for i in chosen]
        moved = self.bounded_update(data, [turns[i] for i in chosen]) if data else ""
        returns = [e.total for e in runs]
        print(f"rl step {step}: mean return {np.mean(returns):.1f} over {len(returns)} episodes "
              f"({answers_without_action(runs)}), "
              f"{len(data)} datums{moved} ({time.monotonic() - started:.1f} s)", flush=True)

    # 3. held-out evaluation
    def evaluate(self, sampling, label: str) -> tuple[float, float]:
        seeds = list(range(90_000, 90_000 + self.args.eval_episodes))
        played = asyncio.run(self.episodes(sampling, seeds, 1.0))
        returns = np.array([e.total for e in played])
        self.evaluations[label] = returns.tolist()
        half = t_95(len(returns) - 1) * returns.std(ddof=1) / math.sqrt(len(returns)) if len(returns) > 1 \
            else float("nan")
        print(f"held-out {label}: return {returns.mean():.1f} +/- {half:.1f} (95%, {len(returns)} episodes; "
              f"{answers_without_action(played)})", flush=True)
        return float(returns.mean()), float(half)


def t_95(dof: int) -> float:
    """Two-sided 95% quantile of Student's t: exact for 1 and 2 degrees of freedom, then the expansion in 1/dof
    around the normal quantile (Abramowitz & Stegun 26.7.5), within 0.2% from 3 on (a normal 1.96 is 4% narrow
    over 32 episodes)."""
    if dof <= 2:
        return (12.706205, 4.302653)[dof - 1]
    z = NormalDist().inv_cdf(0.975)
    terms = ((z**3 + z) / 4, (5 * z**5 + 16 * z**3 + 3 * z) / 96, (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
             (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160)
    return z + sum(g / dof ** (k + 1) for k, g in enumerate(terms))


def answers_without_action(episodes: list[Episode]) -> str:
    """``N of M answers held no action`` over ``episodes``' turns."""
    return f"{sum(e.no_action for e in episodes)} of {sum(len(e.turns) for e in episodes)} answers held no action"


def ratio(last: tuple[float, float], before: tuple[float, float], what: str) -> str:
    """``x2.31 over WHAT`` (95% intervals separated) or ``x1.10 over WHAT (intervals overlap)``."""
    separated = last[0] - last[1] > before[0] + before[1]
    times = f"x{last[0] / before[0]:.2f} over {what}" if before[0] > 0 else f"above {what}"
    return f"{times}{'' if separated else ' (intervals overlap)'}"


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
    connection without a word.  It asks the server nothing yet (``start_loop`` does, inside the session)."""
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
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--train-unembed", action=argparse.BooleanOptionalAction, default=False,
                        help="a LoRA on the output head too (a server sampling with vLLM cannot load it)")
    parser.add_argument("--max-steps", type=int, default=200, help="episode length limit")
    parser.add_argument("--max-tokens", type=int, default=12, help="tokens per answer")
    parser.add_argument("--demo-episodes", type=int, default=250)
    parser.add_argument("--noise", type=float, default=0.76, help="how often the teacher pushes at random")
    parser.add_argument("--sft-steps", type=int, default=180)
    parser.add_argument("--sft-lr", type=float, default=2e-3)
    parser.add_argument("--batch", type=int, default=128, help="rows per warm-start step")
    parser.add_argument("--rl-steps", type=int, default=12)
    parser.add_argument("--rl-lr", type=float, default=1e-3)
    parser.add_argument("--beta2", type=float, default=0.999,
                        help="Adam's second-moment decay (the SDK's default, 0.95, kept the warm start from learning)")
    parser.add_argument("--max-step-kl", type=float, default=0.05,
                        help="bound on each RL step's KL from the policy before it, per answer (0: no bound)")
    parser.add_argument("--kl-rows", type=int, default=128, help="answers each step's KL is measured on")
    parser.add_argument("--train-turns", type=int, default=512,
                        help="turns an RL step trains on at most (drawn uniformly once its episodes are longer)")
    parser.add_argument("--loss", default="importance_sampling", choices=["importance_sampling", "ppo", "cispo", "gspo"],
                        help="the RL loss")
    parser.add_argument("--discount", type=float, default=0.9, help="of the return-to-go")
    parser.add_argument("--advantage", default="return", choices=["return", "gae"],
                        help="a turn's advantage: its discounted return-to-go, or GAE against a fitted value baseline")
    parser.add_argument("--gae-lambda", type=float, default=0.5, help="gae: how far the estimate looks ahead")
    parser.add_argument("--value-steps", type=int, default=3, help="gae: RL steps of turns the baseline is fitted on")
    parser.add_argument("--groups", type=int, default=1, help="start states per RL step")
    parser.add_argument("--group-size", type=int, default=8, help="episodes per start state")
    parser.add_argument("--eval-episodes", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--result-file", type=Path, default=None,
                        help="write the held-out returns and token counts here as JSON (what rlpipe sweep reads)")
    args = parser.parse_args()
    if args.result_file is not None and not args.result_file.parent.is_dir():  # written only when the loop ends
        parser.error(f"--result-file {args.result_file}: there is no folder {args.result_file.parent}; create it "
                     "or choose another path")
    if args.kl_rows < 1:
        parser.error(f"--kl-rows must be at least 1, got {args.kl_rows}")
    if args.max_step_kl <= 0:
        args.max_step_kl = None  # no bound
    started = time.monotonic()
    phases: dict[str, float] = {}

    def timed(name: str, run):
        begun = time.monotonic()
        result = run()
        phases[name] = time.monotonic() - begun
        return result

    service = connect(args)
    with session_ended_on_exit(service):  # from here on, however the loop stops, its session ends
        loop = start_loop(args, service)
        base = timed("base evaluation", lambda: loop.evaluate(
            loop.service.create_sampling_client(base_model=args.base_model).result(), "base model"))
        timed("warm start", loop.warm_start)
        warm = timed("warm-start evaluation", lambda: loop.evaluate(
            loop.training.save_weights_and_get_sampling_client().result(), "warm start"))
        timed("RL", lambda: [loop.rl_step(step) for step in range(args.rl_steps)])
        last = timed("last evaluation", lambda: loop.evaluate(
            loop.training.save_weights_and_get_sampling_client().result(), "last version"))
        final = loop.training.save_state("final").result().path  # kept on the server until deleted
        print(f"final state: {final}  (take it home: tinker checkpoint download {final})", flush=True)
        print("phases: " + ", ".join(f"{name} {seconds:.0f} s" for name, seconds in phases.items()), flush=True)
        print(f"base {base[0]:.1f}, warm start {warm[0]:.1f} -> last {last[0]:.1f} "
              f"({ratio(last, base, 'the base model')}, {ratio(last, warm, 'the warm start')}) "
              f"in {time.monotonic() - started:.0f} s", flush=True)
        if args.result_file is not None:  # the held-out returns of the last version are the score
            args.result_file.write_text(json.dumps({
                "metric": "held-out return", "samples": loop.evaluations["last version"],
                "evaluations": {"base model": loop.evaluations["base model"], "warm start": loop.evaluations["warm start"]},
                "tokens": loop.tokens, "seconds": time.monotonic() - started, "phases": phases}))


if __name__ == "__main__":
    main()
