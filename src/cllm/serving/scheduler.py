"""Continuous batching: one thread decodes every admitted request together, step by step.

Requests (`Job`s: prompt ids + `DecodeParams`) wait in a bounded FIFO queue. Between two steps
the worker admits waiting jobs while the batch has room (`max_batch_size` rows, and at most
`max_tokens_in_flight` prompt + budget tokens in all, which bounds the KV cache), prefills them
in one forward per group, and appends them to the running batch (`cllm.decoding.BatchDecoder`).
Each step is one batched forward per group in which every row advances by its own acceptance
(with recycling, a row's drafts shrink to its share of `forward_width` fed tokens as the batch
grows: speed only);
a row's new final tokens go through its `TextStream` (detokenized, cut at a stop string) to its
`on_event` callback, streamed text at most once per `stream_interval` seconds; a row leaves
the batch when it is done, stopped, cancelled or past its deadline.

Requests that decode with different engine settings (greedy vs sampled, Jacobi vs AR, another
temperature) cannot share a forward: each setting has its own `BatchDecoder` (a *group*), and
every group takes one step per round. A row's output is what it gets decoded alone (greedy:
token for token; sampled: the same draws from its own seeded generator), whatever its batch
mates: `tests/decoding/test_batch_decoder.py` and `tests/serving/test_server.py` check it. In
bfloat16 and float16 a batched forward rounds differently, so a near-tie can go the other way
(docs/serving.md).

Nothing here knows HTTP: `cllm.serving.service` turns events into responses.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cllm.core.errors import first_line
from cllm.core.seeds import seeded_generator
from cllm.decoding import BatchDecoder
from cllm.decoding.inputs import left_pad
from cllm.decoding.stats import DecodeStats
from cllm.runtime import as_runtime
from cllm.serving.completion import Completion, DecodeParams, TextCodec, TextStream, decoder_kwargs
from cllm.serving.logprobs import Trail

log = logging.getLogger(__name__)


class Overloaded(Exception):
    """The waiting queue is full."""


@dataclass(eq=False)
class Job:
    """One request. `on_event(kind, value)` is called from the worker thread with ("text", str)
    for its text as it becomes final (when `stream_text`; at most once per the scheduler's
    `stream_interval`, what is left before the answer), then once ("done", Completion) or
    ("error", reason), reason "timeout", "shutdown", or "failed: <why>" (this request alone
    failed to decode; its batch mates go on); a cancelled job gets no more events. With
    `params.logprobs`, each ("text", str) of a stream follows a ("logprobs", [Entry]) with the
    entries of the tokens whose text it completes (`cllm.serving.logprobs`)."""

    prompt_ids: list[int]
    params: DecodeParams  # params.seed seeds the row's generator (None: 0, as in `complete`)
    on_event: Callable[[str, Any], None]
    stream_text: bool = False
    deadline: float | None = None  # time.monotonic() past which the job is dropped ("timeout")
    cancelled: bool = False
    queued_at: float = field(default_factory=time.monotonic)
    started_at: float = 0.0
    # the worker's, while the job runs
    row: int = -1
    text: TextStream | None = None
    seen: int = 0  # tokens of the row fed to `text` so far
    answered: bool = False  # its "done" or "error" went out (once, from whichever thread)
    unsent: str = ""  # streamed text made final and not sent yet
    trail: Trail | None = None  # with `params.logprobs`: its tokens' log-probabilities against its text
    sent_at: float = -math.inf  # time.monotonic() when text was last sent

    @property
    def tokens_needed(self) -> int:
        """Prompt + budget: the most cache entries it can hold."""
        return len(self.prompt_ids) + self.params.max_new_tokens


@dataclass
class _Group:
    decoder: BatchDecoder
    recycle_budget: int | None  # the requests' own (per row, with recycling; None: no limit)
    method: str  # its requests' `DecodeParams.label`
    jobs: dict[int, Job] = field(default_factory=dict)  # by row id


@dataclass
class SchedulerStats:
    """Counters since start (read by /metrics)."""

    steps: int = 0  # batched forwards after the prefills, over all groups
    rows_stepped: int = 0  # rows in those forwards, summed (/ steps = mean batch size)
    prefills: int = 0
    admitted: int = 0
    cancelled: int = 0
    timed_out: int = 0
    max_batch: int = 0  # most rows decoding at once

    def snapshot(self) -> dict:
        return {"steps": self.steps, "rows_stepped": self.rows_stepped, "prefills": self.prefills,
                "admitted": self.admitted,
                "cancelled": self.cancelled, "timed_out": self.timed_out, "max_batch": self.max_batch,
                "mean_batch": round(self.rows_stepped / self.steps, 3) if self.steps else 0.0}


class Scheduler:
    """The decode thread: admits waiting jobs between steps, steps every group, delivers text."""

    def __init__(self, model, codec: TextCodec, *, draft_table=None, queue_size: int = 256,
                 max_batch_size: int = 32, max_tokens_in_flight: int = 65536,
                 forward_width: int | None = None, stream_interval: float = 0.0,
                 on_step: Callable[[str, int, DecodeStats], None] | None = None) -> None:
        self.model, self.codec, self.draft_table = as_runtime(model), codec, draft_table
        # a streamed job's text is sent at most once per `stream_interval` seconds (0: per step)
        self.stream_interval = stream_interval
        self._sending = threading.Lock()  # a job's unsent text: the worker's, and `stop`'s
        # a runtime with a fixed number of rows (llama.cpp's streams) runs no more at once
        self.queue_size = queue_size
        self.max_batch_size = min(max_batch_size, getattr(self.model, "max_rows", None) or max_batch_size)
        self.max_tokens_in_flight = max_tokens_in_flight
        self.forward_width = forward_width
        self.device = self.model.device  # where its logits, and the draws, are
        self.stats = SchedulerStats()
        # after each group's step, from this thread: (its method, rows stepped (0: none), its decoder's counters)
        self.on_step = on_step
        self.running = 0  # rows decoding (written by the worker only)
        self._waiting: deque[Job] = deque()
        self._live: set[Job] = set()  # submitted and not answered yet: waiting, being admitted, running
        self._groups: dict[tuple, _Group] = {}
        self._cond = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="cllm-decode", daemon=True)
        self._thread.start()

    # -- the event loop's side

    def submit(self, job: Job) -> None:
        with self._cond:
            if self._stopping:
                job.on_event("error", "shutdown")
                return
            if len(self._waiting) >= self.queue_size:
                raise Overloaded
            self._waiting.append(job)
            self._live.add(job)
            self._cond.notify()

    def cancel(self, job: Job) -> None:
        """Stop a job (its client left): it leaves the batch before the next step."""
        job.cancelled = True

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def stop(self, timeout: float = 10.0) -> None:
        """Fail what waits and what runs at once ("shutdown": a client gets its answer even while
        a step is stuck), let the current step end, and join the thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
            jobs = list(self._live)
        for job in jobs:
            if not job.cancelled:
                self._finish(job, "error", "shutdown")
        self._thread.join(timeout)

    # -- the worker thread

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._groups and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    break
                newcomers = self._admit()
            try:
                if newcomers:  # their first token (from the prefill) goes out before the step
                    self._prefill(newcomers)
                    self._deliver()
                self._step()
                self._deliver()
            except Exception as exc:  # noqa: BLE001 - a bug here must not kill the worker: fail what runs
                log.exception("the scheduler failed between steps")
                self._fail_all(f"failed: {first_line(exc)}")
            self.running = sum(len(g.jobs) for g in self._groups.values())
        with self._cond:
            waiting, self._waiting = list(self._waiting), deque()
        for job in waiting:
            self._finish(job, "error", "shutdown")
        self._fail_all("shutdown")

    def _admit(self) -> list[Job]:
        """Waiting jobs that fit now, in arrival order (the first that does not fit waits, and
        the ones behind it too: no request is overtaken forever). Called under the lock."""
        rows = sum(len(g.jobs) for g in self._groups.values())
        tokens = sum(j.tokens_needed for g in self._groups.values() for j in g.jobs.values())
        admitted = []
        now = time.monotonic()
        while self._waiting:
            job = self._waiting[0]
            if job.cancelled or (job.deadline is not None and now > job.deadline):
                self._waiting.popleft()
                if not job.cancelled:
                    self.stats.timed_out += 1
                    self._finish(job, "error", "timeout")
                continue
            fits = rows + 1 <= self.max_batch_size and tokens + job.tokens_needed <= self.max_tokens_in_flight
            if rows and not fits:  # alone, a job always runs (it passed the server's limits)
                break
            admitted.append(self._waiting.popleft())
            rows, tokens = rows + 1, tokens + job.tokens_needed
        return admitted

    def _prefill(self, jobs: list[Job]) -> None:
        """Newcomers join their group's batch: one prefill forward per group."""
        by_key: dict[tuple, list[Job]] = {}
        for job in jobs:
            by_key.setdefault(_group_key(job.params), []).append(job)
        for key, group_jobs in by_key.items():
            group = self._groups.get(key)
            if group is None:
                kwargs = decoder_kwargs(group_jobs[0].params, self.draft_table)
                group = _Group(BatchDecoder(self.model, eos_token_id=self.codec.eos_ids, **kwargs),
                               kwargs["config"].recycle_budget, group_jobs[0].params.label)
            ids, mask = left_pad([j.prompt_ids for j in group_jobs], pad_id=0)
            try:
                generators = [seeded_generator(j.params.seed, self.device) for j in group_jobs]
                rows = group.decoder.add(ids, mask, generator=generators,
                                         max_new_tokens=[j.params.max_new_tokens for j in group_jobs],
                                         logprobs=[j.params.logprobs for j in group_jobs])
            except Exception as exc:  # noqa: BLE001 - these requests fail, the batch goes on
                log.exception("a prefill of %d request(s) failed", len(group_jobs))
                for job in group_jobs:
                    self._finish(job, "error", f"failed: {first_line(exc)}")
                continue
            self._groups[key] = group
            self.stats.prefills += 1
            self.stats.admitted += len(group_jobs)
            for job, row in zip(group_jobs, rows, strict=True):
                job.row, job.started_at = row, time.monotonic()
                on_text = (lambda text, job=job: self._hold(job, text)) if job.stream_text else None
                job.text = TextStream(self.codec, job.params.stop, on_text)
                if job.params.logprobs is not None:
                    job.trail = Trail(self.codec, self.codec.eos_ids)
                group.jobs[row] = job

    def _step(self) -> None:
        self.running = sum(len(g.jobs) for g in self._groups.values())
        self.stats.max_batch = max(self.stats.max_batch, self.running)
        for group in list(self._groups.values()):
            self._drop_gone(group)
            rows = group.decoder.running
            cfg = group.decoder.cfg
            if self.forward_width and cfg.recycle and rows:
                share = _share(group.recycle_budget, self.forward_width, rows, floor=cfg.block_size)
                group.decoder.set_recycle_budget(share)
            try:
                stepped = group.decoder.step()
            except Exception as exc:  # noqa: BLE001 - the forward they share failed: this group alone fails
                log.exception("a batched forward of %d request(s) failed; the other groups go on", rows)
                self._fail_group(group, f"failed: {first_line(exc)}")
                continue
            if stepped:
                self.stats.steps += 1
                self.stats.rows_stepped += rows
            self._hand_on_stats(group, rows if stepped else 0)

    def _hand_on_stats(self, group: _Group, rows: int) -> None:
        """The group's decoder counters since the last call go to `on_step`, not kept (the
        decoder runs for good)."""
        stats = group.decoder.take_stats()
        if self.on_step is not None:
            try:
                self.on_step(group.method, rows, stats)
            except Exception:  # noqa: BLE001 - counting what was served never fails what is served
                log.exception("the step's counters could not be handed on")

    def _drop_gone(self, group: _Group) -> None:
        """Cancelled and timed-out rows leave before the forward they would waste."""
        now = time.monotonic()
        for row, job in list(group.jobs.items()):
            late = job.deadline is not None and now > job.deadline
            if job.cancelled or late:
                group.decoder.remove(row)
                del group.jobs[row]
                if job.cancelled:
                    self.stats.cancelled += 1
                else:
                    self.stats.timed_out += 1
                    self._finish(job, "error", "timeout")

    def _deliver(self) -> None:
        """New final tokens -> text (sent when `stream_interval` has passed since the job's last
        text, whether or not this step made more); finished rows -> their Completion, and they
        leave."""
        now = time.monotonic()
        for key, group in list(self._groups.items()):
            decoder = group.decoder
            for row, job in list(group.jobs.items()):
                try:  # a row that failed, or whose text fails, leaves alone
                    if (error := decoder.error(row)) is not None:
                        raise error
                    result = self._advance(job, decoder, row)
                except Exception as exc:  # noqa: BLE001 - this request fails, its batch mates go on
                    log.warning("a request failed alone, its batch mates go on: %s", first_line(exc))
                    result = f"failed: {first_line(exc)}"
                if result is None:
                    if job.unsent:  # most rows most steps: nothing to send, no lock to take
                        self._send_text(job, now)
                    continue
                decoder.remove(row)
                del group.jobs[row]
                if not job.cancelled:
                    self._finish(job, "done" if isinstance(result, Completion) else "error", result)
            if not group.jobs and not decoder.running:
                self._hand_on_stats(group, 0)  # a prefill that ended its rows counts too
                del self._groups[key]  # its cache went with its last row
        self.running = sum(len(g.jobs) for g in self._groups.values())

    def _advance(self, job: Job, decoder: BatchDecoder, row: int) -> Completion | None:
        """The row's new final tokens -> its text; its Completion once it is done, else None."""
        tokens = decoder.tokens(row)
        if len(tokens) > job.seen:
            if job.trail is not None:  # before the text: what `feed` releases may be sent at once
                job.trail.add(decoder.logprobs(row)[job.seen : len(tokens)])
            job.text.feed(tokens[job.seen :])
            job.seen = len(tokens)
        if not (job.text.stopped or decoder.done(row)):
            return None
        return self._completion(job, tokens, decoder.forward_passes(row))

    def _completion(self, job: Job, tokens: list[int], forwards: int) -> Completion:
        job.text.finish()
        ended = job.text.stopped or (bool(tokens) and tokens[-1] in self.codec.eos_ids)
        return Completion(text=job.text.text, tokens=list(tokens), prompt_tokens=len(job.prompt_ids),
                          forward_passes=forwards, seconds=time.monotonic() - job.started_at,
                          finish_reason="stop" if ended else "length", method=job.params.label,
                          logprobs=None if job.trail is None else job.trail.whole(len(job.text.text)))

    def _hold(self, job: Job, text: str) -> None:
        """The job's text stream made `text` final: it waits for `_send_text`."""
        with self._sending:
            job.unsent += text

    def _send_text(self, job: Job, now: float) -> None:
        """Send the job's unsent text when `stream_interval` has passed since its last."""
        with self._sending:
            self._send_unsent(job, now)

    def _send_unsent(self, job: Job, now: float, last: bool = False) -> None:
        """`_send_text` under the lock (`last`: whatever the interval, before the answer); none
        goes to a job cancelled or answered."""
        if job.cancelled or job.answered or not job.unsent or not (last or now - job.sent_at >= self.stream_interval):
            return
        text, job.unsent, job.sent_at = job.unsent, "", now
        if job.trail is not None:  # the client then holds the whole text released so far
            _emit(job, "logprobs", job.trail.take(len(job.text.text)))
        _emit(job, "text", text)

    def _finish(self, job: Job, kind: str, value: Any) -> None:
        """The job's answer ("done" or "error"), after its unsent text: it is no longer live.
        Text and answer go out under one lock: no text follows the answer (`stop` answers from
        another thread)."""
        with self._cond:
            self._live.discard(job)
        with self._sending:
            self._send_unsent(job, time.monotonic(), last=True)
            _emit(job, kind, value)

    def _fail_group(self, group: _Group, reason: str) -> None:
        """Every request of `group` fails with `reason`; the group (and its cache) goes."""
        self._groups = {k: g for k, g in self._groups.items() if g is not group}
        for job in group.jobs.values():
            if not job.cancelled:
                self._finish(job, "error", reason)

    def _fail_all(self, reason: str) -> None:
        for group in list(self._groups.values()):
            self._fail_group(group, reason)


_ANSWERING = threading.Lock()


def _emit(job: Job, kind: str, value: Any) -> None:
    """Tell a job what happened, its answer ("done" or "error") once only; a callback that
    raises (its client's loop is gone) is logged and harms no other job."""
    if kind in ("done", "error"):
        with _ANSWERING:
            if job.answered:
                return
            job.answered = True
    try:
        job.on_event(kind, value)
    except Exception:  # noqa: BLE001 - one request's delivery must not fail the others
        log.exception("delivering a %s event failed", kind)


def _share(own: int | None, width: int, rows: int, floor: int) -> int:
    """A row's recycling budget in a batch of `rows`: its share of the forward's `width`, at
    least `floor` (a block: between blocks, the next block's drafts still ride along with the
    one token fed), at most its own. Speed only: a narrower budget verifies fewer drafts, the
    tokens are the same. A forward costs a fixed part plus a part per fed token; the fixed part
    is shared by the rows, so the more rows, the less a draft token pays for itself."""
    share = max(floor, width // rows)
    return share if own is None else min(own, share)


def _group_key(params: DecodeParams) -> tuple:
    """Requests with equal keys decode in one batch (the engine's settings hold for a batch)."""
    kwargs = decoder_kwargs(params, None)
    return (params.method, *sorted(kwargs.items()))
