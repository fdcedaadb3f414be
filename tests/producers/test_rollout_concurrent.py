"""The rollout worker on a sampler with concurrent requests: every episode's turn is its own request."""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Future

import pytest

from producers.rollout import SamplingStreams
from producers.samplers.base import SampleOutput, request_seed
from schemas.trajectory import table_to_records
from tests.producers.test_rollout import ScriptedSampler, _clean_memory  # noqa: F401 - the store's autouse clean-up
from tests.producers.test_rollout import make_worker as make_sokoban_worker


class ConcurrentSampler(ScriptedSampler):
    """Answers like ``ScriptedSampler``, one request at a time, each after its own delay, in a timer thread."""

    concurrent_requests = True

    def __init__(self, tokenizer, delay_s=lambda index: 0.01) -> None:
        super().__init__(tokenizer)
        self.delay_s = delay_s
        self.log: list[tuple[str, int, float]] = []  # ("start" | "end", request index, monotonic time)
        self.timers: list[threading.Timer] = []
        self.lock = threading.Lock()

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        raise AssertionError("a concurrent sampler is sent one request at a time")

    def submit(self, request, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        future: Future[SampleOutput] = Future()
        with self.lock:
            index = len(self.streams)
            self.streams.append(request_seed(seed, 0))
            self.calls.append((1, adapter.version if adapter else None))
            self.log.append(("start", index, time.monotonic()))

        def answer() -> None:
            with self.lock:
                self.log.append(("end", index, time.monotonic()))
            if future.set_running_or_notify_cancel():
                future.set_result(SampleOutput(list(self.answer_ids), [-0.5] * len(self.answer_ids), "stop"))

        timer = threading.Timer(self.delay_s(index), answer)
        self.timers.append(timer)
        timer.start()
        return future


def make_worker(tokenizer, sampler, **producer):
    announced: list = []
    worker, archive, _ = make_sokoban_worker(tokenizer, "sokoban", announced, sampler=sampler, **producer)
    return worker, archive, announced


def test_every_turn_is_its_own_request_and_the_rows_are_those_of_batched_calls(tiny_tokenizer):
    sampler = ConcurrentSampler(tiny_tokenizer)
    worker, archive, announced = make_worker(tiny_tokenizer, sampler)
    worker.run()
    assert len(announced) == 1 and announced[0].num_rows == 4
    rows = table_to_records(archive.read_batch(announced[0].path, announced[0].sha256))
    for row in rows:  # what the batched path writes (tests/producers/test_rollout.py): the transcript, token for token
        generated = [t for t, m in zip(row.tokens, row.loss_mask, strict=True) if m]
        assert generated == sampler.answer_ids * row.num_turns
        assert [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m] == [-0.5] * len(generated)
    assert sum(r.num_turns for r in rows) == len(sampler.calls)  # one request per turn
    assert None not in sampler.streams and len(set(sampler.streams)) == len(sampler.streams)  # a stream each
    assert worker.stats.generated_tokens == len(sampler.answer_ids) * len(sampler.calls)


def test_a_slow_request_holds_up_no_other_episode(tiny_tokenizer):
    # the first request takes 0.8 s; the other episodes' turns go on meanwhile, each sent when its step returns
    sampler = ConcurrentSampler(tiny_tokenizer, delay_s=lambda index: 0.8 if index == 0 else 0.01)
    worker, _, _ = make_worker(tiny_tokenizer, sampler)
    worker.run()
    slow_end = next(t for what, index, t in sampler.log if what == "end" and index == 0)
    started_meanwhile = [index for what, index, t in sampler.log if what == "start" and index > 0 and t < slow_end]
    # 4 episodes: with batched calls at most the 3 others' first turns could start before it ends
    assert len(started_meanwhile) > 3


def test_the_sampler_counts_busy_while_any_turn_is_out(tiny_tokenizer):
    sampler = ConcurrentSampler(tiny_tokenizer, delay_s=lambda index: 0.05)
    worker, _, _ = make_worker(tiny_tokenizer, sampler)
    started = time.time()
    worker.run()
    intervals = worker.stats.busy_intervals
    assert intervals and all(a <= b for a, b in intervals)
    assert all(b1 <= a2 for (_, b1), (a2, _) in itertools.pairwise(intervals))  # one lane, in order
    assert started <= intervals[0][0] and intervals[-1][1] <= time.time()
    assert worker.stats.generate_s == pytest.approx(sum(b - a for a, b in intervals), abs=0.01)
    assert worker.stats.generate_s >= 0.05 * 3  # at least the turns of the slowest episode, one after another


def test_turns_still_out_when_the_worker_stops_are_cancelled(tiny_tokenizer):
    sampler = ConcurrentSampler(tiny_tokenizer, delay_s=lambda index: 5.0)
    worker, _, announced = make_worker(tiny_tokenizer, sampler, max_groups=None)
    worker.run(should_stop=lambda: len(sampler.calls) >= 4)
    futures = list(worker.pending_generations)
    assert len(futures) == 4 and all(f.cancelled() for f in futures) and not announced
    for timer in sampler.timers:
        timer.cancel()


def test_busy_time_grows_while_turns_are_out_not_only_when_all_are_back(tiny_tokenizer):
    # heartbeats read generate_s between turns; with turns always out it must still grow
    sampler = ConcurrentSampler(tiny_tokenizer, delay_s=lambda index: 0.15 + 0.05 * (index % 4))
    worker, _, _ = make_worker(tiny_tokenizer, sampler)
    seen: list[tuple[float, int, float]] = []  # (seconds since start, turns out, generate_s) at each tick
    started = time.monotonic()
    worker.run(on_tick=lambda: seen.append((time.monotonic() - started, len(worker.pending_generations),
                                            worker.stats.generate_s)))
    while_out = [(t, g) for t, out, g in seen if out and t > 0.5]
    assert while_out and max(g for _, g in while_out) > 0.3
    assert all(g <= t + 0.01 for t, _, g in seen)  # never more than the time elapsed: one lane


def test_each_turn_draws_the_same_stream_however_the_turns_interleave(tiny_tokenizer):
    # the same incarnation, requests answered in opposite orders: every (episode, turn) keeps its seed,
    # so evaluation with a fixed incarnation reproduces its score on the engine too
    def play(delay_s) -> tuple[dict[tuple[int, int, int], int | None], list[tuple[int, int, int]]]:
        sampler = ConcurrentSampler(tiny_tokenizer, delay_s=delay_s)
        worker, _, _ = make_worker(tiny_tokenizer, sampler)
        worker.streams = SamplingStreams(0, "prod-1", incarnation=7)
        seeds: dict[tuple[int, int, int], int | None] = {}
        order: list[tuple[int, int, int]] = []
        next_request, submit = worker.next_request, sampler.submit
        current: list[tuple[int, int, int]] = []

        def recorded_next_request(episode):
            group = next(g for g in worker.active if episode in g.episodes)
            current[:] = [(episode.seed, group.episodes.index(episode), len(episode.turns))]
            return next_request(episode)

        def recorded_submit(request, adapter=None, temperature=1.0, top_p=1.0, seed=None):
            seeds[current[0]] = seed
            order.append(current[0])
            return submit(request, adapter, temperature, top_p, seed)

        worker.next_request = recorded_next_request
        sampler.submit = recorded_submit
        worker.run()
        return seeds, order

    first_back_first, first_order = play(lambda index: 0.005 * (1 + index))
    last_back_first, last_order = play(lambda index: 0.005 * (30 - index))
    assert first_order != last_order  # the turns went out in another order
    assert len(first_back_first) == len(first_order) > 4 and None not in first_back_first.values()
    assert first_back_first == last_back_first
    assert len(set(first_back_first.values())) == len(first_back_first)  # still a fresh stream every turn
