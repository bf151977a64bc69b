"""The continuous-batching scheduler (`cllm.serving.scheduler`) on a tiny random model: concurrent jobs
decode in one batch and each gets its single-request output (greedy: `greedy_decode`'s text;
seeded sampling: what `complete` samples alone); the batch respects its size and token bounds;
cancelled and timed-out jobs leave it; stopping fails what is left. A gated runtime (`Gate`)
holds the decode thread at a chosen forward so that what happens between steps is exact."""

import gc
import threading
import time

import pytest

from cllm.decoding import BatchDecoder, JacobiConfig
from cllm.models import load_model
from cllm.runtime import as_runtime
from cllm.runtime.lean.kv import LeanKV
from cllm.serving.completion import DecodeParams, TextCodec, complete
from cllm.serving.scheduler import Job, Overloaded, Scheduler
from tests.commands.test_generate import PROMPTS, Oracle, save_tiny_model

ENGINE = dict(engine=JacobiConfig(block_size=4, recycle=8, recycle_budget=24), seed=0)
WAIT = 60  # seconds: a bound against hangs, never a speed requirement


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("batching") / "model")


@pytest.fixture(scope="module")
def oracle(model_dir):
    return Oracle(model_dir)


@pytest.fixture
def model(model_dir):
    return load_model(model_dir)  # its own copy: the tests gate its runtime


class Collector:
    """A job's `on_event`: the text chunks, then the result or the error."""

    def __init__(self) -> None:
        self.chunks: list[str] = []
        self.result = self.error = None
        self.finished = threading.Event()

    def __call__(self, kind, value) -> None:
        if kind == "text":
            self.chunks.append(value)
            return
        self.result, self.error = (value, None) if kind == "done" else (None, value)
        self.finished.set()

    def wait(self):
        assert self.finished.wait(WAIT), "the job never finished"
        return self


class Gate:
    """A model's "auto" runtime whose forwards (every session's `open` and `feed`) are counted;
    from forward `hold_at` on, each waits until `opened`. Decoders take it as the runtime."""

    def __init__(self, model, hold_at: int) -> None:
        self.runtime = as_runtime(model)
        self.count, self.hold_at = 0, hold_at
        self.opened, self.reached = threading.Event(), threading.Event()

    def __getattr__(self, name: str):
        return getattr(self.runtime, name)

    def session(self):
        session = self.runtime.session()

        def gated(call):
            def forward(*args, **kwargs):
                self.count += 1
                if self.count >= self.hold_at and not self.opened.is_set():
                    self.reached.set()
                    self.opened.wait(WAIT)
                return call(*args, **kwargs)
            return forward

        session.open, session.feed = gated(session.open), gated(session.feed)
        return session


def job(prompt_ids, max_new_tokens=24, *, stream=False, **params) -> tuple[Job, Collector]:
    events = Collector()
    params = DecodeParams(max_new_tokens=max_new_tokens, **{**ENGINE, **params})
    return Job(list(prompt_ids), params, events, stream_text=stream), events


def submit_together(scheduler: Scheduler, jobs) -> None:
    """Queue every job before the worker can admit any: they start in one batch."""
    with scheduler._cond:
        for j, _ in jobs:
            scheduler.submit(j)


def test_a_job_without_a_seed_decodes_as_seed_0_beside_a_running_one(model, oracle):
    """`DecodeParams.seed` None means 0 (as in `complete`): such a job joining the batch neither
    fails the jobs running nor waits forever itself."""
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer))
    try:
        first, first_events = job(oracle.ids(PROMPTS[0]), 24)
        scheduler.submit(first)
        events = Collector()
        scheduler.submit(Job(list(oracle.ids(PROMPTS[1])), DecodeParams(max_new_tokens=24, engine=ENGINE["engine"]),
                             events))
        assert events.wait().result.text == oracle.text(PROMPTS[1], max_new_tokens=24)
        assert first_events.wait().result.text == oracle.text(PROMPTS[0], max_new_tokens=24)
    finally:
        scheduler.stop()


@pytest.mark.parametrize("forward_width", [None, 12])  # 12: one token of drafts per row or none
def test_concurrent_jobs_share_the_batch_and_each_gets_its_greedy_text(model, oracle, forward_width):
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer), forward_width=forward_width)
    prompts = [PROMPTS[i % 4] + " " * (i // 4) for i in range(12)]
    jobs = [job(oracle.ids(p), 24 - i, method="ar" if i % 3 == 0 else "jacobi", stream=i % 2 == 0)
            for i, p in enumerate(prompts)]
    submit_together(scheduler, jobs)
    for i, (j, events) in enumerate(jobs):
        result = events.wait().result
        assert result.text == oracle.text(prompts[i], max_new_tokens=24 - i), i
        assert result.tokens == oracle.tokens(oracle.ids(prompts[i]), 24 - i)
        if j.stream_text:
            assert "".join(events.chunks) == result.text
        assert 1 <= result.forward_passes <= len(result.tokens)
    assert scheduler.stats.max_batch == 12 and scheduler.stats.prefills == 2  # one per group
    assert scheduler.stats.steps < sum(len(e.result.tokens) for _, e in jobs)
    scheduler.stop()



def test_counters_that_fail_to_be_handed_on_fail_no_request(model, oracle):
    """`on_step` (the server's metrics) raising after a step: the jobs still get their greedy text."""
    calls = []

    def broken(method, rows, stats):
        calls.append(method)
        raise RuntimeError("a metrics bug")

    scheduler = Scheduler(model, TextCodec(oracle.tokenizer), on_step=broken)
    try:
        jobs = [job(oracle.ids(p), 16) for p in PROMPTS[:2]]
        submit_together(scheduler, jobs)
        for p, (_, events) in zip(PROMPTS[:2], jobs, strict=True):
            assert events.wait().result.text == oracle.text(p, max_new_tokens=16)
        assert calls
    finally:
        scheduler.stop()

def test_seeded_sampled_jobs_draw_what_they_draw_alone_whatever_runs_beside_them(model, oracle):
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer))
    sampled = dict(temperature=0.9, top_p=0.95)
    jobs = [job(oracle.ids(p), **sampled, seed=100 + i) for i, p in enumerate(PROMPTS)]
    jobs += [job(oracle.ids(p)) for p in PROMPTS]  # greedy neighbours (another group)
    submit_together(scheduler, jobs)
    codec = TextCodec(oracle.tokenizer)
    for i, p in enumerate(PROMPTS):
        alone = complete(oracle.model, codec, oracle.ids(p), DecodeParams(max_new_tokens=24, **{**ENGINE, **sampled,
                                                                                              "seed": 100 + i}))
        assert jobs[i][1].wait().result.text == alone.text
        assert jobs[4 + i][1].wait().result.text == oracle.text(p)
    scheduler.stop()


@pytest.mark.parametrize("bound", [dict(max_batch_size=3), dict(max_tokens_in_flight=70)])
def test_the_batch_respects_its_size_and_token_bounds_and_serves_in_order(model, oracle, bound):
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer), **bound)
    jobs = [job(oracle.ids(PROMPTS[i % 4]), 20) for i in range(8)]  # 3-5 prompt tokens + 20 each
    submit_together(scheduler, jobs)
    for i, (_, events) in enumerate(jobs):
        assert events.wait().result.text == oracle.text(PROMPTS[i % 4], max_new_tokens=20)
    assert 2 <= scheduler.stats.max_batch <= 3
    started = [j.started_at for j, _ in jobs]
    assert started == sorted(started)  # first come, first admitted
    scheduler.stop()


def test_a_cancelled_job_leaves_the_batch_before_the_next_forward(model, oracle):
    gate = Gate(model, hold_at=4)  # the prefill, two steps, then the decode thread waits
    scheduler = Scheduler(gate, TextCodec(oracle.tokenizer))
    gone, stays = job(oracle.ids("def f(x):"), 60), job(oracle.ids("class A:"), 60)
    submit_together(scheduler, [gone, stays])
    assert gate.reached.wait(WAIT)
    scheduler.cancel(gone[0])
    gate.opened.set()
    assert stays[1].wait().result.text == oracle.text("class A:", max_new_tokens=60)
    assert not gone[1].finished.is_set() and scheduler.stats.cancelled == 1
    assert len(stays[1].result.tokens) == 60 and stays[1].result.forward_passes < 60
    scheduler.stop()


def test_an_abandoned_job_alone_stops_decoding_at_once(model, oracle):
    gate = Gate(model, hold_at=3)
    scheduler = Scheduler(gate, TextCodec(oracle.tokenizer))
    gone = job(oracle.ids("def f(x):"), 100, method="ar")
    scheduler.submit(gone[0])
    assert gate.reached.wait(WAIT)
    scheduler.cancel(gone[0])
    gate.opened.set()
    deadline = time.monotonic() + WAIT
    while scheduler.stats.cancelled == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.stats.cancelled == 1 and gate.count == 3  # the forward it was in, no more
    assert scheduler.running == 0 and not scheduler._groups  # its cache is gone too
    scheduler.stop()


def test_a_batchs_cache_is_freed_when_it_leaves_not_at_the_next_cycle_collection(model, oracle):
    """Jobs of many settings (a group, a cache each), streamed or not, one cancelled: once they
    have left, no KV cache is left, with Python's cycle collector off. A cache in a reference
    cycle outlives its batch until a full collection, which a server holding many objects runs
    seldom: under a mixed load (a group per setting, each freeing its cache as it empties) the
    freed caches piled up and the server's memory grew without levelling off."""
    gc.collect()
    gc.disable()
    try:
        scheduler = Scheduler(model, TextCodec(oracle.tokenizer))
        settings = [dict(), dict(method="ar"), *(dict(temperature=t, top_p=0.9, seed=i)
                                                  for i, t in enumerate((0.5, 0.7, 0.9, 1.1)))]
        jobs = [job(oracle.ids(PROMPTS[i % 4]), 16 + i, stream=i % 2 == 1, **kw) for i, kw in enumerate(settings * 2)]
        submit_together(scheduler, jobs)
        scheduler.cancel(jobs[-1][0])
        for _, events in jobs[:-1]:
            assert events.wait().error is None
        scheduler.stop()  # the decode thread holds nothing more
        assert scheduler.stats.prefills == len(settings)
        assert not scheduler._groups
        assert not [o for o in gc.get_objects() if type(o) is LeanKV]
    finally:
        gc.enable()


def test_a_job_past_its_deadline_gets_a_timeout_waiting_or_running(model, oracle):
    gate = Gate(model, hold_at=2)
    scheduler = Scheduler(gate, TextCodec(oracle.tokenizer))
    running, waiting = job(oracle.ids("def f(x):"), 60), job(oracle.ids("class A:"), 10)
    scheduler.submit(running[0])
    assert gate.reached.wait(WAIT)
    waiting[0].deadline = time.monotonic() - 1
    scheduler.submit(waiting[0])
    running[0].deadline = time.monotonic() - 1
    gate.opened.set()
    assert running[1].wait().error == "timeout" and waiting[1].wait().error == "timeout"
    assert scheduler.stats.timed_out == 2
    scheduler.stop()


def test_a_full_queue_refuses_and_stopping_fails_what_is_left(model, oracle):
    gate = Gate(model, hold_at=2)
    scheduler = Scheduler(gate, TextCodec(oracle.tokenizer), queue_size=2, max_batch_size=1)
    first = job(oracle.ids("def f(x):"), 60)
    scheduler.submit(first[0])
    assert gate.reached.wait(WAIT)
    queued = [job(oracle.ids("class A:"), 5) for _ in range(2)]
    for j, _ in queued:
        scheduler.submit(j)
    with pytest.raises(Overloaded):
        scheduler.submit(job(oracle.ids("import re"), 5)[0])
    threading.Timer(0.2, gate.opened.set).start()
    scheduler.stop()
    assert [e.wait().error for _, e in [first, *queued]] == ["shutdown"] * 3
    late = job(oracle.ids("import re"), 5)
    scheduler.submit(late[0])
    assert late[1].wait().error == "shutdown"


SERVED = {  # every decoding method the server offers, as requests ask for it
    "jacobi, recycling": dict(method="jacobi"),
    "jacobi, plain": dict(method="jacobi", engine=JacobiConfig(block_size=4)),
    "ar": dict(method="ar"),
    "jacobi, sampled": dict(method="jacobi", temperature=0.9, top_p=0.95),
    "ar, sampled": dict(method="ar", temperature=0.9),
}


@pytest.mark.parametrize("where", ["tail", "advance"])
@pytest.mark.parametrize("name", list(SERVED))
def test_a_request_that_fails_mid_batch_fails_alone(model, oracle, monkeypatch, name, where):
    from tests.decoding.test_batch_decoder import poison_row

    scheduler = Scheduler(model, TextCodec(oracle.tokenizer))
    codec = TextCodec(oracle.tokenizer)
    params = SERVED[name]
    jobs = [job(oracle.ids(p), 24, seed=7 + i, stream=i % 2 == 0, **params) for i, p in enumerate(PROMPTS)]
    neighbours = [PROMPTS[0], PROMPTS[2]]  # in another group (greedy, recycling), not poisoned
    jobs += [job(oracle.ids(p), 24) for p in neighbours]
    poison_row(monkeypatch, where, oracle.ids(PROMPTS[1]), after=3)
    submit_together(scheduler, jobs)
    poisoned = jobs[1][1].wait()
    assert poisoned.result is None and poisoned.error.startswith("failed: ") and "boom" in poisoned.error
    monkeypatch.undo()
    for i, (j, events) in enumerate(jobs):
        if i == 1:
            continue
        prompt = PROMPTS[i] if i < len(PROMPTS) else neighbours[i - len(PROMPTS)]
        alone = complete(oracle.model, codec, oracle.ids(prompt), j.params)
        assert events.wait().error is None and events.result.text == alone.text, (name, i)
        if j.stream_text:
            assert "".join(events.chunks) == events.result.text
    deadline = time.monotonic() + WAIT
    while scheduler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.running == 0 and not scheduler._groups  # no phantom rows for /health
    scheduler.stop()


def test_a_forward_that_fails_fails_its_group_alone(model, oracle, monkeypatch):
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer))
    sampled = [job(oracle.ids(p), 24, temperature=0.9, seed=i) for i, p in enumerate(PROMPTS[:2])]
    greedy = [job(oracle.ids(p), 24) for p in PROMPTS[:2]]
    real = BatchDecoder.step

    def step(self):  # the sampled group's batched forward fails once it runs
        if self.cfg.sampling is not None and self.running:
            raise RuntimeError("device lost")
        return real(self)

    monkeypatch.setattr(BatchDecoder, "step", step)
    submit_together(scheduler, sampled + greedy)
    assert all(e.wait().error == "failed: device lost" for _, e in sampled)
    for (_, events), p in zip(greedy, PROMPTS[:2]):
        assert events.wait().result.text == oracle.text(p)
    scheduler.stop()


def test_the_decode_threads_events_wake_the_loop_once_per_batch_in_each_requests_order():
    import asyncio

    from cllm.serving.service import _Mailbox

    loop = asyncio.new_event_loop()
    wakeups = []
    real = loop.call_soon_threadsafe
    loop.call_soon_threadsafe = lambda callback, *args: (wakeups.append(callback), real(callback, *args))[1]
    mailbox = _Mailbox(loop)
    a, b = asyncio.Queue(), asyncio.Queue()
    poster = threading.Thread(target=lambda: [mailbox.post(a, 1), mailbox.post(b, "x"), mailbox.post(a, 2)])
    poster.start()
    poster.join()

    async def read(queue, n):
        return [await queue.get() for _ in range(n)]

    async def both():
        return [await read(a, 2), await read(b, 1)]

    try:
        assert loop.run_until_complete(both()) == [[1, 2], ["x"]]
        assert len(wakeups) == 1
        mailbox.post(a, 3)  # the loop drained: the next event wakes it again
        assert loop.run_until_complete(read(a, 1)) == [3] and len(wakeups) == 2
    finally:
        loop.close()
    with pytest.raises(RuntimeError):  # a closed loop: the poster hears of it, nothing is kept
        mailbox.post(a, 4)
    with pytest.raises(RuntimeError):
        mailbox.post(a, 5)


@pytest.mark.parametrize("interval", [0, 3600])
def test_a_streamed_jobs_text_goes_out_per_step_or_paced_and_all_of_it(model, oracle, interval):
    """stream_interval 0: a chunk per step that makes text; one longer than the decode: the
    first text at once, the rest in one chunk before the answer."""
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer), stream_interval=interval)
    try:
        streamed, events = job(oracle.ids("def f(x):"), 24, stream=True)
        scheduler.submit(streamed)
        result = events.wait().result
        assert "".join(events.chunks) == result.text == oracle.text("def f(x):", max_new_tokens=24)
        assert len(events.chunks) > 2 if interval == 0 else len(events.chunks) == 2
    finally:
        scheduler.stop()


def test_held_text_goes_out_once_its_interval_has_passed_without_new_text_and_never_after_the_answer(model, oracle):
    scheduler = Scheduler(model, TextCodec(oracle.tokenizer), stream_interval=0.05)
    try:
        paced, events = job(oracle.ids("x"), stream=True)
        scheduler._hold(paced, "a")
        scheduler._send_text(paced, 100.0)  # the first text: at once
        scheduler._hold(paced, "b")
        scheduler._hold(paced, "c")
        scheduler._send_text(paced, 100.03)  # held
        assert events.chunks == ["a"]
        scheduler._send_text(paced, 100.06)  # what `_deliver` does each step for every row
        assert events.chunks == ["a", "bc"]
        scheduler._hold(paced, "d")
        scheduler._finish(paced, "done", "the result")  # the rest goes before the answer
        assert events.chunks == ["a", "bc", "d"] and events.result == "the result"
        scheduler._hold(paced, "e")
        scheduler._send_text(paced, 200.0)  # answered: no more text
        assert events.chunks == ["a", "bc", "d"]
    finally:
        scheduler.stop()
