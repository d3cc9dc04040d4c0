"""Continuous batching: which requests compute which tokens in the next forward.

Every step, in this order:

1. Decode: each running request past its prefill gets one token (oldest first). When its
   next position needs a page and none is free or evictable, the youngest running request
   is preempted (pages released, full pages kept in the prefix cache, re-queued at the
   front with its prompt + tokens so far) and the allocation retried.
2. Prefill: requests in the middle of a chunked prefill continue, then waiting requests
   are admitted in arrival order while rows (`max_batch`), the token budget
   (`max_tokens_per_step`) and pages allow. An admission first looks the request's tokens
   up in the prefix cache; every full page whose KV is scheduled is published at once, so
   identical prompts admitted in the same step share one prefill. No admission happens in
   a step that preempted.
3. Multi-step decode: when every running request decodes and nobody could be admitted
   (no one waiting, no free row, or admission closed), no more than `multi_step_max_rows`
   decode, none samples with penalties, and the pages for the whole call can be had
   without preempting anyone, the step becomes a call of `steps` decode steps (each
   request computes min(steps, tokens it has left) of them). Penalties need the window
   of a request's latest tokens, built on the host from tokens read back; with the
   previous call still in flight that window would miss all but the last token of a
   multi-step call, so penalised batches keep one step per call.

The scheduler only plans; the engine runs the plan and feeds results back
(`finish`, `fail`, `preempt`, `abort_running`, `recover`).
"""

from __future__ import annotations

import dataclasses
from collections import deque

from jrl.rollout.cache.page_pool import OutOfPages
from jrl.rollout.cache.task_cache import TaskCacheManager
from jrl.rollout.config import EngineConfig
from jrl.rollout.request import Request


@dataclasses.dataclass
class Entry:
    req: Request
    q_start: int  # first position computed
    q_len: int  # positions computed
    sample: bool  # the row's sample is the request's next token
    device_input: bool  # the input token is the previous step's sample (still on device)


class ScheduledBatch:
    """One step's plan, stored by column (row i: `reqs[i]` computes positions `q_starts[i] :
    q_starts[i] + q_lens[i]`): the executor turns whole columns into arrays, so a decode
    step of hundreds of rows builds no per-row objects. `entries` gives the rows as `Entry`s."""

    def __init__(self) -> None:
        self.reqs: list[Request] = []
        self.rows: list[int] = []  # the request's req_to_token row
        self.q_starts: list[int] = []
        self.q_lens: list[int] = []
        self.sample: list[bool] = []
        self.device_input: list[bool] = []
        self.index: list[int] = []  # output index of the row's sample (0 for rows that don't sample)
        self.steps = 1  # decode steps of the call (> 1: multi-step decode)
        self.step_counts: list[int] | None = None  # steps each row computes (multi-step only)

    def add(self, req: Request, q_start: int, q_len: int, sample: bool, device_input: bool) -> None:
        """Appends a row; a sampling row puts one more sample of `req` in flight."""
        self.reqs.append(req)
        self.rows.append(req.task.row)
        self.q_starts.append(q_start)
        self.q_lens.append(q_len)
        self.sample.append(sample)
        self.device_input.append(device_input)
        if sample:
            self.index.append(req.n_scheduled_samples)
            req.n_inflight += 1
        else:
            self.index.append(0)

    def add_decode(self, reqs: list[Request], counts: list[int] | None = None, steps: int = 1) -> None:
        """Appends one decode row per request (its next position; it samples; its input is
        the previous step's sample when one is still in flight): `add` by whole columns.
        With `counts`, the batch is a multi-step call of `steps` decode steps in which
        request i computes (and samples) `counts[i]` positions; it must be the only call
        of `add_decode` and no `add` may follow."""
        self.reqs += reqs
        self.rows += [r.task.row for r in reqs]
        self.q_starts += [r.task.kv_len for r in reqs]
        self.q_lens += [1] * len(reqs)
        self.sample += [True] * len(reqs)
        self.device_input += [r.n_inflight > 0 for r in reqs]
        self.index += [r.n_scheduled_samples for r in reqs]
        if counts is None:
            for r in reqs:
                r.n_inflight += 1
                r.task.kv_len += 1
            return
        self.steps, self.step_counts = steps, counts
        for r, n in zip(reqs, counts):
            r.n_inflight += n
            r.task.kv_len += n

    def __len__(self) -> int:
        return len(self.reqs)

    @property
    def entries(self) -> list[Entry]:
        return [Entry(*row) for row in zip(self.reqs, self.q_starts, self.q_lens, self.sample, self.device_input)]

    @property
    def n_tokens(self) -> int:
        return sum(self.q_lens)

    @property
    def decode(self) -> bool:
        """Every request has exactly one query token (the decode kernel applies)."""
        return self.n_tokens == len(self.q_lens)


@dataclasses.dataclass
class SchedulerStats:
    prefill_tokens: int = 0  # prompt/prefix tokens computed (not served from cache)
    cached_tokens: int = 0  # tokens served from the prefix cache at admission (outputs re-admitted too)
    preemptions: int = 0


class Scheduler:
    def __init__(self, config: EngineConfig, cache: TaskCacheManager, multi_step_max_rows: int | None = None) -> None:
        self.config = config
        self.cache = cache
        self.multi_step_max_rows = config.max_batch if multi_step_max_rows is None else multi_step_max_rows
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is the youngest
        self.stats = SchedulerStats()

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ planning
    def schedule(self, version: int, admit: str = "all", steps: int = 1) -> ScheduledBatch | None:
        """Plans the next step under weight `version`. `admit`: "all" waiting requests,
        only "started" ones (re-queued with tokens already generated), or "none".
        `steps` > 1: plan a multi-step decode call when nothing else is waiting to run."""
        batch = ScheduledBatch()
        budget = self.config.max_tokens_per_step
        page_size = self.cache.page_size
        preempted = False
        decoding, prefilling = [], []
        for req in list(self.running):
            task = req.task
            if task is None:
                continue  # preempted earlier in this loop
            if req.in_prefill:
                prefilling.append(req)
                continue
            if req.n_scheduled_samples >= req.max_new_tokens:
                continue
            # Growing is needed only when the next position starts a new page. Only requests
            # younger than req are preempted, so none of `decoding` is.
            if task.kv_len >= len(task.pages) * page_size:
                grown, evicted_someone = self._grow_for_decode(req, version)
                preempted |= evicted_someone
                if not grown:
                    continue  # req itself was preempted
            decoding.append(req)
        counts = None
        if steps > 1 and 0 < len(decoding) <= self.multi_step_max_rows and not prefilling and not preempted \
                and not self._can_admit(admit) and not any(r.sampling.uses_penalties for r in decoding):
            counts = self._reserve_steps(decoding, steps)
        batch.add_decode(decoding, counts, steps)
        if counts is not None:
            return batch
        budget -= len(batch)
        for req in prefilling:
            if budget <= 0:
                break
            if req.task is None:
                continue  # preempted by a decode above
            budget -= self._prefill_chunk(req, budget, version, batch)
        while admit != "none" and not preempted and budget > 0 and self.waiting \
                and len(self.running) < self.config.max_batch \
                and (admit == "all" or self.waiting[0].outputs):
            chunk = self._admit(self.waiting[0], budget, version, batch)
            if not chunk:
                break
            self.waiting.popleft()
            budget -= chunk
        if not len(batch) and self.running and not any(r.n_inflight for r in self.running):
            # Running requests hold pages yet none can progress (partial prefills short of
            # pages): free the youngest and plan again without admitting anyone.
            self.preempt(self.running[-1], version)
            return self.schedule(version, admit="none")
        return batch if len(batch) else None

    def _can_admit(self, admit: str) -> bool:
        """Whether the admission loop of `schedule` could take a waiting request now."""
        return admit != "none" and bool(self.waiting) and len(self.running) < self.config.max_batch \
            and (admit == "all" or bool(self.waiting[0].outputs))

    def _reserve_steps(self, decoding: list[Request], steps: int) -> list[int] | None:
        """Pages for a multi-step decode call: each request's positions for min(steps, the
        tokens it has left). Returns the per-request counts, or None (nothing changed)
        when the pool cannot cover them all without preempting."""
        cache = self.cache
        counts = [min(steps, r.max_new_tokens - r.n_scheduled_samples) for r in decoding]
        need = sum(cache.pages_needed(r.task, r.task.kv_len + n) for r, n in zip(decoding, counts))
        if need > cache.pool.allocator.n_available:
            return None
        for r, n in zip(decoding, counts):
            cache.extend(r.task, r.task.kv_len + n)
        return counts

    def _grow_for_decode(self, req: Request, version: int) -> tuple[bool, bool]:
        """Makes room for one more position of `req`, preempting the youngest running
        requests while pages are short. Returns (req still running, anyone preempted)."""
        preempted = False
        while True:
            try:
                self.cache.extend(req.task, req.task.kv_len + 1)
                return True, preempted
            except OutOfPages:
                victim = self.running[-1]
                self.preempt(victim, version)
                preempted = True
                if victim is req:
                    return False, True

    def _fit_chunk(self, req: Request, want: int, whole: bool) -> int:
        """Largest chunk <= want whose pages can be allocated now (all or nothing if `whole`)."""
        task = req.task
        if self.config.allocation == "contiguous":
            return want  # the region was reserved at admission
        room = (len(task.pages) + self.cache.pool.allocator.n_available) * self.cache.page_size - task.kv_len
        if whole and room < want:
            return 0
        return max(0, min(want, room))

    def _prefill_chunk(self, req: Request, budget: int, version: int, batch: ScheduledBatch) -> int:
        """Adds the next prefill chunk of `req` to `batch`; returns its length (0: none fits)."""
        task = req.task
        remaining = req.prefill_target - task.kv_len
        want = min(remaining, budget)
        whole = not self.config.chunked_prefill and not req.outputs  # re-prefills may be chunked
        if whole and want < remaining:
            return 0
        chunk = self._fit_chunk(req, want, whole)
        if chunk <= 0:
            return 0
        self.cache.extend(task, task.kv_len + chunk)
        batch.add(req, task.kv_len, chunk, task.kv_len + chunk == req.prefill_target, False)
        task.kv_len += chunk
        self.stats.prefill_tokens += chunk
        self.cache.record_hashes(task, req.known_tokens(), version)
        return chunk

    def _admit(self, req: Request, budget: int, version: int, batch: ScheduledBatch) -> int:
        """Admits `req` with its first prefill chunk in `batch`; returns the chunk's length
        (0: it does not fit now, nothing changed)."""
        cache = self.cache
        task = cache.alloc()
        tokens = req.known_tokens()
        target = len(tokens)
        matched = cache.cached(task, tokens, version, max_tokens=target - 1)
        req.task, req.prefill_target = task, target
        if self.config.allocation == "contiguous":
            region = target + (req.max_new_tokens - len(req.outputs))
            try:
                cache.reserve(task, region)
            except OutOfPages:
                cache.free(task)
                req.task = None
                if not matched:
                    return 0
                # the shared prefix's pages, held, may split the pool where the region needs
                # a run: reserve the whole region without them (they become evictable)
                task = req.task = cache.alloc()
                matched = 0
                try:
                    cache.reserve(task, region)
                except OutOfPages:
                    cache.free(task)
                    req.task = None
                    return 0
        chunk = self._prefill_chunk(req, budget, version, batch)
        if not chunk:
            cache.free(task)
            req.task = None
            return 0
        # prompt tokens no admission computed: a re-admission's hit may cover the request's
        # outputs and its own pages, which count as computed (at most the prompt, as OpenAI's)
        prompt_hit = min(matched, len(req.prompt))
        req.cached_tokens = prompt_hit if req.epoch == 0 else min(req.cached_tokens, prompt_hit)
        self.stats.cached_tokens += matched
        self.running.append(req)
        return chunk

    # ------------------------------------------------------------------ feedback
    def _release(self, req: Request, version: int | None, discard: bool = False) -> None:
        if req.task is not None:
            if req.n_inflight and not discard:  # judged when those samples are read back
                req.released = (req.epoch, list(req.task.pages))
            if discard:
                self.cache.discard(req.task)
            else:
                self.cache.free(req.task, req.known_tokens() if version is not None else None, version)
            req.task = None
        self.running.remove(req)
        req.epoch += 1
        req.n_inflight = 0
        req.device_row = -1

    def finish(self, req: Request, version: int) -> None:
        """A finished request leaves; its full pages stay in the prefix cache."""
        self._release(req, version)

    def fail(self, req: Request) -> None:
        """A request whose logits turned non-finite leaves; its pages are discarded (out
        of the prefix cache, zeroed before reuse), not published."""
        self._release(req, None, discard=True)

    def preempt(self, req: Request, version: int) -> None:
        """Frees `req` and re-queues it at the front with the tokens known so far (a
        sample still in flight is dropped and drawn again, with the same key)."""
        self._release(req, version)
        req.n_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def continue_running(self) -> int:
        """Running requests keep their pages across a weight update: what they compute from
        now on attends to KV of the old version, so none of their pages is published to the
        prefix cache again (`TaskCache.publish`). Returns how many there are."""
        for req in self.running:
            if req.task is not None:
                req.task.publish = False
        return len(self.running)

    def recover(self) -> list[Request]:
        """Puts every request back in one place after a step raised part-way through its
        planning, dispatch or read-back (`Engine._step_failed`), without trusting the task
        and page bookkeeping, which may be half-updated (the caller rebuilds it empty:
        `TaskCacheManager.reset`). Every running request loses its task and samples in
        flight; one that finished (its release cut short) leaves and is returned; the
        others are re-queued at the front in admission order with the tokens they have, as
        after a preemption. A request admitted part-way (holding a task while still
        waiting, or listed as running too) waits as before."""
        running = self.running
        finished = [r for r in running if r.finish_reason is not None]
        requeued = [r for r in running if r.finish_reason is None]
        held = {id(r) for r in running}
        others = [r for r in self.waiting if id(r) not in held]
        for req in running:
            req.epoch += 1
        for req in requeued:
            req.n_preemptions += 1
            self.stats.preemptions += 1
        for req in running + others:
            req.task, req.n_inflight, req.device_row = None, 0, -1
        self.running = []
        self.waiting = deque(requeued + others)
        return finished

    def abort_running(self) -> list[Request]:
        """Aborts every running request (their outputs are discarded) and re-queues them
        at the front in admission order; their pages are not published. Re-queued first,
        so one cut short (Ctrl-C) leaves each request waiting, running too at worst (`recover`)."""
        aborted = list(self.running)
        self.waiting.extendleft(reversed(aborted))
        for req in aborted:
            self._release(req, None)
            req.reset_outputs()
        return aborted
