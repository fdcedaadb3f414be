"""The rollout worker with a scripted sampler: token-in/token-out rows, groups, batches, staleness admission."""

from __future__ import annotations

import dataclasses
import math
import time

import pyarrow as pa
import pytest

from pipeline.io.archive import TrajectoryArchive
from pipeline.io.store import ObjectStore
from producers.envs.registry import make_env
from producers.episode import prompt_ids
from producers.rollout import RolloutWorker, SamplingStreams, StaleAdapterError
from producers.samplers.base import AdapterHandle, SampleOutput, Sampler, request_seed
from producers.sink import OrphanSweep, StoreThenEventSink, announce_orphans
from schemas.config import ProducerConfig, SamplerConfig
from schemas.trajectory import NO_ADAPTER_SHA, table_to_records


class ScriptedSampler(Sampler):
    """Answers every prompt with the same text (plus the stop token); logprob -0.5 per token."""

    def __init__(self, tokenizer, answer: str = "<answer>Left</answer>") -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.max_model_len = 4096
        self.answer_ids = [*tokenizer.encode(answer, add_special_tokens=False), tokenizer.eos_token_id]
        self.calls: list[tuple[int, int | None]] = []  # (batch size, adapter version)
        self.streams: list[int | None] = []  # the stream of every request, as the seeded backends derive it

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        self.calls.append((len(requests), adapter.version if adapter else None))
        self.streams += [request_seed(seed, i) for i in range(len(requests))]
        return [SampleOutput(list(self.answer_ids), [-0.5] * len(self.answer_ids), "stop") for _ in requests]

    def load_adapter(self, handle):
        pass

    def unload_adapter(self, handle):
        pass

    def close(self):
        pass


class FixedAdapters:
    def __init__(self, current=None, newest=0):
        self._current, self.newest = current, newest

    def current(self):
        return self._current

    def newest_published(self):
        return self.newest

    def refresh(self):
        pass


def make_worker(tokenizer, env_name, announced, *, adapters=None, sampling=None, sampler=None,
                producer_id="prod-1", **producer):
    store = ObjectStore("memory://rollout-test-" + env_name)
    archive = TrajectoryArchive(store)
    sink = StoreThenEventSink(archive, "run1", env_name, producer_id, announced.append)
    cfg = ProducerConfig(producer_id=producer_id, **{"group_size": 2, "groups_per_batch": 2, "concurrent_groups": 2,
                                                  "max_groups": 2, **producer})
    worker = RolloutWorker(
        run_id="run1", producer_id=producer_id, env_name=env_name,
        make_env=lambda: make_env(env_name, {"max_turns": 3} if env_name == "sokoban" else {"max_turns": 4,
                                                                                            "max_actions_total": 4}),
        tokenizer=tokenizer, sampler=sampler or ScriptedSampler(tokenizer), adapters=adapters or FixedAdapters(),
        sink=sink, producer=cfg, sampling=sampling or SamplerConfig(max_new_tokens=16),
    )
    return worker, archive, store


@pytest.fixture(autouse=True)
def _clean_memory():
    yield
    from fsspec.implementations.memory import MemoryFileSystem

    MemoryFileSystem.store.clear()
    MemoryFileSystem.pseudo_dirs.clear()
    MemoryFileSystem.pseudo_dirs.append("")


def left_transcript(tokenizer, env_seed: int, num_turns: int) -> str:
    """The chat transcript of a 3-turn Sokoban episode answered "Left" every turn, as the template renders it."""
    env = make_env("sokoban", {"max_turns": 3})
    observation = env.reset(env_seed)
    messages = [{"role": "system", "content": env.system_prompt()}]
    for _ in range(num_turns):
        messages += [{"role": "user", "content": observation},
                     {"role": "assistant", "content": "<answer>Left</answer>"}]
        observation = env.step("<answer>Left</answer>").observation
    return tokenizer.apply_chat_template(messages, tokenize=False).removesuffix("\n")


def test_whole_episode_rows_are_token_in_token_out(tiny_tokenizer):
    announced = []
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced)
    worker.run()
    assert len(announced) == 1 and announced[0].num_rows == 4 and announced[0].num_groups == 2
    table = archive.read_batch(announced[0].path, announced[0].sha256)
    rows = table_to_records(table)
    answer_ids = worker.sampler.answer_ids
    for row in rows:
        # the generated tokens appear exactly once per turn, masked 1, with the sampler's logprobs
        generated = [t for t, m in zip(row.tokens, row.loss_mask, strict=True) if m]
        assert generated == answer_ids * row.num_turns
        assert [lp for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if m] == [-0.5] * len(generated)
        assert all(lp == 0.0 for lp, m in zip(row.logprobs, row.loss_mask, strict=True) if not m)
        # the sequence is the chat transcript: system, then user/assistant turns, as the template renders it
        assert row.text == left_transcript(tiny_tokenizer, row.env_seed, row.num_turns)
        assert row.policy_version == 0 and row.adapter_sha256 == NO_ADAPTER_SHA
        assert row.turn_rewards and abs(row.reward - sum(row.turn_rewards)) < 1e-5
    # groups: two episodes per seed, distinct episode ids, one group id per seed
    by_group = {}
    for row in rows:
        by_group.setdefault(row.group_id, set()).add(row.env_seed)
    assert len(by_group) == 2 and all(len(seeds) == 1 for seeds in by_group.values())
    assert len({r.episode_id for r in rows}) == 4
    # batched generation: one call serves every waiting episode
    assert max(size for size, _ in worker.sampler.calls) == 4


def test_long_horizon_rows_are_one_per_turn_with_returns_to_go(tiny_tokenizer):
    announced = []
    worker, archive, _ = make_worker(tiny_tokenizer, "cartpole", announced, max_groups=1, groups_per_batch=1)
    worker.run()
    table = archive.read_batch(announced[0].path)
    rows = sorted(table_to_records(table), key=lambda r: (r.episode_id, r.turn))
    for episode_id in {r.episode_id for r in rows}:
        turns = [r for r in rows if r.episode_id == episode_id]
        rewards = [r.turn_rewards[0] for r in turns]
        assert [r.turn for r in turns] == list(range(len(turns)))
        for t, r in enumerate(turns):
            assert r.return_to_go == pytest.approx(sum(rewards[t:]))
            assert r.reward == pytest.approx(sum(rewards))
            # each row is its own prompt; only this turn's answer is trained
            assert sum(r.loss_mask) == len(worker.sampler.answer_ids)
            assert r.loss_mask[-len(worker.sampler.answer_ids):] == [1] * len(worker.sampler.answer_ids)
        # the state each prompt showed: the episode's start state, then every push "Left" moved it
        env = make_env("cartpole")
        env.reset(turns[0].env_seed)
        for r in turns:
            assert r.state == pytest.approx(env.numeric_state(), abs=1e-6)
            if not env.done:
                env.step("<answer>Left</answer>")


def test_staleness_admission_waits_then_gives_up(tiny_tokenizer):
    announced = []
    v1 = AdapterHandle.for_version(1, "/nonexistent", "a" * 64)
    worker, _, _ = make_worker(tiny_tokenizer, "sokoban", announced,
                               adapters=FixedAdapters(current=v1, newest=4), max_staleness=2, staleness_wait_s=0.2)
    with pytest.raises(StaleAdapterError, match="v4 is published but only v1"):
        worker.run()
    assert worker.groups_started == 0 and not announced


def test_rows_record_the_adapter_they_were_sampled_with(tiny_tokenizer):
    announced = []
    v3 = AdapterHandle.for_version(3, "/nonexistent", "b" * 64)
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced,
                                     adapters=FixedAdapters(current=v3, newest=4), max_staleness=2)
    worker.run()
    rows = table_to_records(archive.read_batch(announced[0].path))
    assert {(r.policy_version, r.adapter_sha256) for r in rows} == {(3, "b" * 64)}
    assert {v for _, v in worker.sampler.calls} == {3}


def test_rows_record_the_sampling_parameters_of_their_logprobs(tiny_tokenizer):
    announced = []
    sampling = SamplerConfig(max_new_tokens=16, temperature=0.7, top_p=0.95)
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced, sampling=sampling)
    worker.run()
    rows = table_to_records(archive.read_batch(announced[0].path))
    assert rows and [(r.temperature, r.top_p, r.top_k) for r in rows] == [(pytest.approx(0.7), pytest.approx(0.95), 0)] * len(rows)


def test_a_producer_id_of_the_longest_allowed_length_still_names_its_batches(tiny_tokenizer):
    """``rlpipe run`` names producers ``<run>-p<i>``: a long run id made every batch id too long to store."""
    announced = []
    producer_id = "sokoban-qwen2.5-0.5b-grpo-lr1e-5-2026-01-15-and-a-longer-tail-p0"[:64]
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced, producer_id=producer_id)
    worker.run()
    assert len(announced) == 1 and announced[0].producer_id == producer_id
    assert announced[0].batch_id.startswith(producer_id[:30]) and len(announced[0].batch_id) <= 64
    assert {r.producer_id for r in table_to_records(archive.read_batch(announced[0].path))} == {producer_id}


def test_a_group_whose_environment_paid_a_reward_that_is_not_a_number_is_dropped_alone(tiny_tokenizer):
    """Its batch's event would carry a reward mean no reader can decode, and the learner would refuse the whole
    batch: the group is dropped, named in the log, and the other groups are written."""
    announced = []
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced)
    make_env = worker.make_env
    envs = []

    def spoiled_env():
        env = make_env()
        envs.append(env)
        if len(envs) <= worker.cfg.group_size:  # the first group's episodes
            step = env.step
            env.step = lambda answer: dataclasses.replace(step(answer), reward=float("nan"))
        return env

    worker.make_env = spoiled_env
    worker.run()
    assert len(announced) == 1 and announced[0].num_groups == 1 and worker.stats.dropped_groups == 1
    rows = table_to_records(archive.read_batch(announced[0].path, announced[0].sha256))
    assert all(math.isfinite(r.reward) for r in rows)
    with pytest.raises(ValueError, match="not a finite number"):
        archive.write_batch("run1", [dict(rows[0].model_dump(), reward=float("nan"), batch_id="b-nan")])


def test_stop_flushes_finished_groups_only(tiny_tokenizer):
    announced = []
    worker, archive, _store = make_worker(tiny_tokenizer, "sokoban", announced, max_groups=None, groups_per_batch=100)
    ticks = []
    worker.run(should_stop=lambda: worker.stats.groups >= 1 and len(ticks) > 0, on_tick=lambda: ticks.append(1))
    assert len(announced) == 1
    rows = table_to_records(archive.read_batch(announced[0].path))
    assert len(rows) == 2 * len({r.group_id for r in rows})  # only whole groups were written


def test_orphaned_batch_is_announced_once(tiny_tokenizer):
    announced = []
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced)
    worker.run()
    first = announced[0]
    again = []
    assert announce_orphans(archive, "run1", [first.batch_id], again.append) == []
    orphans = announce_orphans(archive, "run1", [], again.append)
    assert orphans == [first.batch_id] and again[0].sha256 == first.sha256 and again[0].num_rows == first.num_rows
    assert isinstance(archive.read_batch(first.path), pa.Table)


def test_batches_older_than_the_logs_retained_history_are_taken_as_announced(tiny_tokenizer):
    """Retention trims a long run's oldest events: the batches they announced are not orphans, and reading and
    announcing them again at every producer start would grow with the run's age."""
    from datetime import UTC, datetime

    from producers.sink import LoggedBatches

    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", [])
    worker.run()
    [recent] = [key.rsplit("/", 1)[-1].removesuffix(".parquet") for key in archive.list_batches("run1")]
    rows = archive.read_batch(archive.list_batches("run1")[0]).to_pylist()
    for batch_id, day in (("old", datetime(2026, 1, 1, 12, tzinfo=UTC)), ("edge", datetime(2026, 3, 9, 23, tzinfo=UTC))):
        archive.write_batch("run1", [{**row, "batch_id": batch_id} for row in rows], batch_id=batch_id, created=day)
    # the log holds every event of the run's partition since 2026-03-10 05:00; "old"'s event aged out before it
    on_log = LoggedBatches(ids=set(), complete_since=datetime(2026, 3, 10, 5, tzinfo=UTC))
    announced = []
    found = announce_orphans(archive, "run1", on_log.ids, announced.append, complete_since=on_log.complete_since)
    assert sorted(found) == sorted(["edge", recent])  # a day's margin for clocks: "edge" is judged
    announced.clear()
    assert sorted(OrphanSweep(archive, "run1", announced.append, 0.0, lambda: on_log).sweep()) == sorted(["edge", recent])
    # a log that lost nothing (complete_since None) judges every stored batch
    assert len(OrphanSweep(archive, "run1", announced.append, 0.0, lambda: LoggedBatches(set())).sweep()) == 3


def test_a_batch_too_young_at_start_is_judged_again_once_old_enough(tiny_tokenizer):
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", [], max_groups=4)
    worker.run()  # two batches stored; their events are not on the log (lost with a crashed writer)
    stored = [key.rsplit("/", 1)[-1].removesuffix(".parquet") for key in archive.list_batches("run1")]
    assert len(stored) == 2
    on_log: set[str] = set()  # the batch ids the trajectories topic names
    announced = []
    sweep = OrphanSweep(archive, "run1", announced.append, min_age_s=3.0, announced=lambda: on_log)
    assert sweep.sweep() == [] and announced == []  # too young: a live producer may be about to announce them
    sweep.maybe_sweep()
    assert announced == []
    on_log.add(stored[0])  # the first one's writer announces it
    time.sleep(max(0.0, sweep.due - time.monotonic()) + 0.1)
    sweep.maybe_sweep()
    assert [payload.batch_id for payload in announced] == [stored[1]]
    sweep.maybe_sweep()
    assert len(announced) == 1  # each judged once


def test_every_draw_gets_a_fresh_stream_across_turns_and_restarts(tiny_tokenizer):
    announced = []
    worker, _, _ = make_worker(tiny_tokenizer, "sokoban", announced)  # one batch at the end: no flush between turns
    worker.run()
    first = worker.sampler.streams
    assert len(worker.sampler.calls) >= 2  # several turns of the same episodes before the batch is written
    assert None not in first and len(set(first)) == len(first)
    # A restart keeps the producer id (the launcher's and a StatefulSet's ids are stable) and the config.
    restarted, _, _ = make_worker(tiny_tokenizer, "sokoban", announced)
    restarted.run()
    again = restarted.sampler.streams
    assert len(set(again)) == len(again) and not set(first) & set(again)


def test_environment_seeds_come_from_the_given_range_and_wrap_around(tiny_tokenizer):
    worker, _, _ = make_worker(tiny_tokenizer, "sokoban", [], max_groups=5, groups_per_batch=5)
    worker.env_seeds = range(10, 12)
    worker.next_seed = 10
    assert [worker.new_group(None).seed for _ in range(5)] == [10, 11, 10, 11, 10]


def test_an_engine_wide_stream_is_new_per_process_and_reproducible_from_the_logged_nonce():
    # vLLM on the CPU samples from one engine-wide stream: its seed must change with the incarnation too.
    first, restarted = SamplingStreams(0, "run-p0"), SamplingStreams(0, "run-p0")
    assert first.incarnation != restarted.incarnation and first.engine_seed() != restarted.engine_seed()
    again = SamplingStreams(0, "run-p0", incarnation=first.incarnation)
    assert again.engine_seed() == first.engine_seed() < 2**31
    assert [again.next_call_seed() for _ in range(3)] == [first.next_call_seed() for _ in range(3)]


class ShortContextSampler(ScriptedSampler):
    """A scripted sampler whose context is shorter than the run's ``sampler.max_model_len``, refusing what does not
    fit as every real backend does (the transformers sampler caps its context at the model's position count)."""

    def __init__(self, tokenizer, max_model_len: int) -> None:
        super().__init__(tokenizer)
        self.max_model_len = max_model_len
        self.prompt_lengths: list[int] = []

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        self.check_requests(requests)
        self.prompt_lengths += [len(r.prompt_token_ids) for r in requests]
        return [SampleOutput(o.token_ids[:self.new_token_budget(r)], o.logprobs[:self.new_token_budget(r)],
                             o.finish_reason)
                for r, o in zip(requests, super().generate(requests, adapter, temperature, top_p, seed), strict=True)]


def test_a_first_prompt_longer_than_the_context_is_named_in_one_warning(tiny_tokenizer, caplog):
    """Such an episode ends before its first turn: a setting to fix (the context, or the environment's prompt),
    said once, not an episode that silently never plays.  And the worker goes on: with no environment step out,
    a group whose every episode ended so was never moved on, and the loop spun for ever.  Its group writes no
    row: a return of 0 that nothing played would count in the learner's baselines."""
    import logging

    env = make_env("sokoban", {"max_turns": 3})
    first_prompt = len(prompt_ids(tiny_tokenizer, [{"role": "system", "content": env.system_prompt()},
                                                   {"role": "user", "content": env.reset(0)}]))
    sampler = ShortContextSampler(tiny_tokenizer, first_prompt - 5)
    announced: list = []
    worker, _, _ = make_worker(tiny_tokenizer, "sokoban", announced, sampler=sampler,
                               sampling=SamplerConfig(max_new_tokens=16, max_model_len=2048))
    deadline = time.monotonic() + 60.0
    with caplog.at_level(logging.WARNING, logger="rlpipe.producer"):
        worker.run(should_stop=lambda: time.monotonic() > deadline)
    assert worker.exhausted and time.monotonic() < deadline  # it finished its groups, not stopped by the deadline
    warnings = [r.getMessage() for r in caplog.records if "does not fit the context" in r.getMessage()]
    assert len(warnings) == 1 and "sampler.max_model_len" in warnings[0], caplog.text
    assert not sampler.prompt_lengths  # nothing was sent to the sampler
    assert announced == [] and worker.stats.rows == 0 and worker.stats.unplayable_groups == 2


def test_a_producer_whose_first_prompts_never_fit_stops_with_one_line_naming_the_fix(tiny_tokenizer):
    """Without a group limit such a producer dropped groups for ever and its learner waited for ever."""
    from producers.rollout import UNPLAYABLE_GROUPS_LIMIT

    env = make_env("sokoban", {"max_turns": 3})
    first_prompt = len(prompt_ids(tiny_tokenizer, [{"role": "system", "content": env.system_prompt()},
                                                   {"role": "user", "content": env.reset(0)}]))
    sampler = ShortContextSampler(tiny_tokenizer, first_prompt - 5)
    worker, _, _ = make_worker(tiny_tokenizer, "sokoban", [], sampler=sampler, max_groups=None,
                               sampling=SamplerConfig(max_new_tokens=16, max_model_len=2048))
    deadline = time.monotonic() + 60.0
    with pytest.raises(ValueError, match=r"no episode.*first prompt.*fit.*sampler\.max_model_len") as info:
        worker.run(should_stop=lambda: time.monotonic() > deadline)
    assert "\n" not in str(info.value) and worker.stats.unplayable_groups == UNPLAYABLE_GROUPS_LIMIT


def test_episodes_end_at_the_samplers_context_when_it_is_shorter_than_configured(tiny_tokenizer):
    """The sampler's context, not the configuration's, bounds an episode: a sampler capped below
    ``sampler.max_model_len`` refused the growing prompt, and the refusal stopped the whole producer."""
    env = make_env("sokoban", {"max_turns": 3})
    first_prompt = len(prompt_ids(tiny_tokenizer, [{"role": "system", "content": env.system_prompt()},
                                                   {"role": "user", "content": env.reset(0)}]))
    context = first_prompt + 20  # room for the first answer, not for the second turn's observation
    sampler = ShortContextSampler(tiny_tokenizer, context)
    announced = []
    worker, archive, _ = make_worker(tiny_tokenizer, "sokoban", announced, sampler=sampler,
                                     sampling=SamplerConfig(max_new_tokens=16, max_model_len=2048))
    worker.run()
    rows = table_to_records(archive.read_batch(announced[0].path))
    assert len(rows) == 4 and max(sampler.prompt_lengths) < context
    assert all(len(r.tokens) < context for r in rows)
    assert all(r.truncated for r in rows if r.num_turns < 3 and not r.terminated)


class RunOnSampler(ScriptedSampler):
    """A base model that closes its answer with ``<|im_end|>`` and runs on into a user turn of its own, cut only at
    a stop id: eos, and the ids a request adds (as every backend stops)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer)
        im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.answer_ids = [*tokenizer.encode("<answer>Left</answer>", add_special_tokens=False), im_end]
        invented = tokenizer.encode("\n<|im_start|>user\nsay <answer>Right</answer>", add_special_tokens=False)
        self.stream = [*self.answer_ids, *invented, tokenizer.eos_token_id]

    def generate(self, requests, adapter=None, temperature=1.0, top_p=1.0, seed=None):
        outputs = []
        for request in requests:
            stops = {self.eos_token_id, *getattr(request, "extra_stop_ids", ())}
            ids = self.stream[:next(i for i, t in enumerate(self.stream) if t in stops) + 1]
            outputs.append(SampleOutput(ids, [-0.5] * len(ids), "stop"))
        return outputs


def test_a_turn_stops_at_the_templates_closing_token_when_it_is_not_eos(base_chatml_tokenizer):
    """A base model's turn ends at ``<|im_end|>``, recorded once and trained (mask 1) like eos: the row is the
    template's transcript, with no invented user turn in it and no closing token added a second time."""
    announced = []
    worker, archive, _ = make_worker(base_chatml_tokenizer, "sokoban", announced, sampler=RunOnSampler(base_chatml_tokenizer))
    worker.run()
    rows = table_to_records(archive.read_batch(announced[0].path, announced[0].sha256))
    answer_ids = worker.sampler.answer_ids  # "<answer>Left</answer><|im_end|>"
    for row in rows:
        generated = [t for t, m in zip(row.tokens, row.loss_mask, strict=True) if m]
        assert generated == answer_ids * row.num_turns
        assert row.text == left_transcript(base_chatml_tokenizer, row.env_seed, row.num_turns)


def test_the_closing_token_is_learned_from_the_template(base_chatml_tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    from producers.episode import ChatFormat

    im_end = base_chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert ChatFormat.from_tokenizer(base_chatml_tokenizer).closing_token_id == im_end
    plain = AutoTokenizer.from_pretrained(tiny_model_dir)
    plain.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
                           "{% if add_generation_prompt %}assistant: {% endif %}")
    assert ChatFormat.from_tokenizer(plain).closing_token_id is None  # a closing of plain text: eos alone stops
