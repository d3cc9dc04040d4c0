"""Engine: continuous-batching generation over a paged, prefix-shared KV cache, serving
one acknowledged weight version at a time.

    engine = Engine(model_config, params, EngineConfig(...), version=0)
    completions = engine.generate(prompts, SamplingParams(temperature=1.0), max_new_tokens=64)
    ack = engine.update_weights(new_params, version=1)

The loop overlaps host and device: `step()` plans and dispatches step n (asynchronously),
then reads back step n-1's sampled tokens, whose device work is already done or nearly so.
Decode inputs of step n come from step n-1's device output, so the host never waits for
a token before dispatching the step that consumes it. A request that stopped at step n-1
has one wasted row in step n, discarded on read-back. A step stays unread until its tokens
are on the host: a read-back interrupted while it waits (Ctrl-C in a notebook, or a raising
`device_get`) loses nothing, and the next `step`/`flush` reads it back first. A step that
raises part-way through its host bookkeeping (planning, recording or releasing finished
requests) or its dispatch (Ctrl-C while a program compiles, or before the donated KV buffers
it returned were stored) re-queues the running requests with the tokens they have, rebuilds
the page bookkeeping and prefix cache empty and, where the buffers were lost, starts from
empty ones (`Engine._step_failed`).

When every running request decodes and nobody waits to be admitted, a step is a call of
`decode_steps_per_call` decode steps (`jrl.rollout.tuning`) run back to back by one device
program (`jrl.rollout.executor`): the host's planning, upload, dispatch and read-back are paid
once per call instead of once per token (on a GPU they cost about as much as a small
batch's device step). Tokens sampled after a request stopped inside a call are discarded.

Weight updates happen only between steps (`update_weights` is called from the thread that
drives the engine; another thread hands weights over with `post_weights`, applied at the
start of the driver's next `step`). The step in flight is read back first and records the
old version, so no forward mixes versions. Requests in flight then finish under the old
weights before the swap, are aborted and restarted under the new ones, or continue under
the new ones with the tokens and KV they have (`EngineConfig.on_weight_update`); every
token records the version of the forward that sampled it (`Completion.versions`).
Prefix-cache entries belong to the version that computed them; on update the entries of
other versions are dropped, and a continued request (whose later KV attends to older KV)
never publishes its pages again.

Given a `mesh` (or a `jrl.parallel.ParallelConfig`), the engine serves tensor-parallel
params: see `jrl.rollout.sharding` for what lives where.

With `fuse_projections` (`jrl.rollout.tuning`; on by default on GPU) the engine serves a
private copy in the fused layout (`jrl.models.fused`), built from the params it is handed at
construction and at each `update_weights`; callers always hand over the separate layout.

A model with LoRA adapters (`model_config.lora.rank > 0`) is served as base + adapters:
`EngineConfig.lora` "merge" folds the adapters into their kernels once per version (the
steps run the plain model, fused on GPU), "unmerged" adds the low-rank products in every
forward. The engine keeps the base it was handed; `update_weights` then takes either the
whole params or the adapters alone (`jrl.models.lora.lora_params`), so a LoRA run moves
only the adapters per version (`Ack.bytes_received`).

With `EngineConfig.weight_dtype="float8_e4m3fn"` that private copy (fused or not) has its
projection kernels in e4m3 with per-column scales (`jrl.models.quantized`), rebuilt likewise.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from jrl.compile_cache import enable_compilation_cache
from jrl.config import ModelConfig, check
from jrl.models.fused import fuse_projections
from jrl.models.lora import base_config, lora_params, merge_lora, with_lora_params
from jrl.models.quantized import quantize_projections, split_layers
from jrl.parallel import ParallelConfig, abstract_params
from jrl.rollout.cache import KVStorage, PagePool, RadixCache, ReqToTokenPool, TaskCacheManager
from jrl.rollout.config import (EngineConfig, bucket, check_backend, check_exact, check_kv_page_size,
                                exact_model_config, pow2_at_least)
from jrl.rollout.executor import INT_ALIGN_UNROLLED, StepLayout, step_function
from jrl.rollout.request import Completion, Request
from jrl.rollout.sampling import SamplingParams, batch_mode, param_columns
from jrl.rollout.scheduler import ScheduledBatch, Scheduler
from jrl.rollout.sharding import EngineSharding, SourceParams, engine_sharding
from jrl.rollout.tuning import Tuning, TuningOverrides, batch_buckets, resolve_tuning
from pallas_kernels.quantized import clear_slots
from pallas_kernels.staged_prefill import pages_read, staged_pages


_MAX_INTERNED = 4096  # distinct sampling params kept by Engine._interned
WARMUP_THREADS = 8  # programs `Engine.warmup` compiles at once (at most the CPU count)


def _one_driver(method):
    """Runs `method` as the engine's driving thread: a call from another thread while one
    is inside a driving method (generate, step, update_weights, ...) raises RuntimeError
    before touching anything, instead of interleaving steps over the donated KV buffers
    (which deleted a buffer under the other call and left the engine unusable). Calls
    nested in the same thread (generate -> step) pass."""
    name = method.__name__

    @functools.wraps(method)
    def driving(self, *args, **kwargs):
        me = threading.get_ident()
        with self._driver_lock:
            if self._driver not in (None, me):
                raise RuntimeError(f"engine.{name}: another thread is driving this engine (an Engine is driven "
                                   "by one thread at a time); to generate from several threads at once, call "
                                   "jrl.rollout.shared.SharedEngine(engine).generate")
            self._driver = me
            self._driver_depth += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            with self._driver_lock:
                self._driver_depth -= 1
                if self._driver_depth == 0:
                    self._driver = None

    return driving


@dataclasses.dataclass(frozen=True)
class Ack:
    """Acknowledgement of `update_weights`: the engine now serves `version`."""

    version: int
    finished_in_flight: int = 0  # requests completed under the old weights first
    restarted: int = 0  # requests aborted and re-queued under the new weights
    bytes_received: int = 0  # bytes of the arrays handed over (adapters alone: their size)
    continued: int = 0  # requests decoding on under the new weights with their tokens and KV


@dataclasses.dataclass
class EngineStats:
    steps: int = 0  # device calls dispatched
    decode_steps: int = 0  # calls in which every row decodes
    decode_device_steps: int = 0  # decode steps with tokens those calls ran (<= decode_steps_per_call each)
    generated_tokens: int = 0
    decode_tokens: int = 0  # of generated_tokens, those sampled by decode calls (not prefill steps)
    failed_requests: int = 0  # finished with "error" (non-finite logits)
    host_s: float = 0.0  # planning + packing + dispatch (host work per call)
    wait_s: float = 0.0  # blocked reading back sampled tokens
    decode_host_s: float = 0.0
    decode_wait_s: float = 0.0


@dataclasses.dataclass
class _InFlight:
    readback: jax.Array  # [steps, 3, max_rows] float32 ([3, max_rows] for one step): token ids
    # (bit-cast), logprobs, model logprobs
    rows: np.ndarray | slice  # the rows that sample, and for each: its request and the request's epoch
    reqs: list[Request]  # at dispatch (a sample whose request's epoch moved on is dropped)
    epochs: list[int]
    version: int
    decode: bool
    counts: list[int] | None = None  # multi-step call: the steps each row computes


class Engine:
    """`mesh`: serve tensor-parallel over its `tensor` axis (`data` and `fsdp` of size 1);
    params are laid out with `jrl.parallel.param_shardings`, re-sharded if they arrive in
    another layout. None: one device, params used as given (or, with `fuse_projections`,
    their fused copy: `self.params` is what the steps read, in the served layout).
    `tuning`: benchmarks' and tests' override of the internal tuning (`jrl.rollout.tuning`;
    None: this backend's defaults); `self.tuning` is what was resolved."""

    def __init__(self, model_config: ModelConfig, params: dict, config: EngineConfig | None = None,
                 version: int = 0, mesh: jax.sharding.Mesh | ParallelConfig | None = None, *,
                 tuning: TuningOverrides | None = None) -> None:
        enable_compilation_cache()  # once per process (jrl.compile_cache)
        # versions are >= 0: drop_prefix_cache keeps the entries of version -1, i.e. none
        if isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer)) or version < 0:
            raise ValueError(f"version: must be an integer >= 0, got {version!r}")
        version = _checked_version(version)  # below 2**63, as update_weights checks
        _check_same_structure(_model_structure(model_config), params, "the model config's", dtypes=False)
        _check_finite(params, "Engine: refusing to serve them")
        self.config = config = config or EngineConfig()
        check_exact(config, model_config, jax.default_backend())
        # exact log-probs: the model runs batch-invariant numerics (as the trainer must),
        # its attention by this engine's implementation
        self.model_config = model_config = (exact_model_config(model_config, config.attention_impl)
                                            if config.exact_logprobs else model_config)
        check_backend(config, jax.default_backend())
        check_kv_page_size(config, model_config, jax.default_backend())
        check(mesh is None or config.weight_dtype is None, "engine.weight_dtype",
              f"{config.weight_dtype!r} weights are served on one device; leave it None with a mesh")
        self._lora = bool(model_config.lora.rank)
        self._merging = self._lora and config.lora == "merge"
        # the model the steps run: without LoRA when the adapters are merged into the kernels
        self.served_config = base_config(model_config) if self._merging else model_config
        self.sharding: EngineSharding | None = None if mesh is None else engine_sharding(self.served_config, mesh)
        # where the handed-over params (base + adapters) are held, on the mesh
        self._holding = self.sharding if not self._merging or mesh is None else engine_sharding(model_config, mesh)
        self.tuning = resolve_tuning(jax.default_backend(), self.served_config, config, tuning,
                                     tensor_parallel=self.sharding is not None)
        # What callers hand over (the separate layout): update_weights checks against it.
        self._source = SourceParams(params)
        self._source_structure = _structure(params)
        self._adapter_structure = _structure(lora_params(params)) if self._lora else None
        self._held, self.params = self._served(params)
        self.version = int(version)
        self.seq_limit = config.seq_len_limit(model_config)
        ps = config.page_size
        self.pool = PagePool(config.n_pages, ps, config.allocation)
        self.radix = RadixCache(ps, self.pool.allocator) if config.prefix_cache else None
        self.req_to_token = ReqToTokenPool(config.max_batch, config.max_pages_per_request(model_config), ps)
        self.cache = TaskCacheManager(self.pool, self.req_to_token, self.radix)
        self.scheduler = Scheduler(config, self.cache, self.tuning.multi_step_max_rows)
        self.kv = KVStorage(model_config, config.n_slots, config.kv_dtype,
                            sharding=None if self.sharding is None else self.sharding.kv, page_size=ps)
        self._token_buckets = config.resolved_token_buckets
        self._batch_buckets = batch_buckets(config, self.tuning)
        self._col_buckets = config.page_col_buckets(model_config)
        self._widest = widest_table(config, self.seq_limit)
        self.max_rows = self._batch_buckets[-1]
        self.step_function = step_function(self.served_config, ps, self.max_rows, config.attention_impl,
                                           None if self.sharding is None else self.sharding.heads,
                                           self.tuning.unroll_layers, self.tuning.cublas_decode_rows,
                                           self.tuning.fuse_projections, config.kv_dtype, config.exact_logprobs)
        self._zero_slots = jax.jit(_zero_slots, donate_argnums=(0, 1), out_shardings=(
            self.kv.k.sharding, None if self.kv.v is None else self.kv.v.sharding))
        self._prev_tokens = self._no_prev_tokens()
        # dispatched steps not yet read back, oldest first: one between steps (overlap), more
        # after a read-back was interrupted (`_read_back_until`)
        self._unread: deque[_InFlight] = deque()
        self._next_id = 0
        self._finished: list[Completion] = []
        self._admit = "all"
        self._sampling_params: dict[SamplingParams, SamplingParams] = {}
        self._posted: tuple[dict, int] | None = None  # post_weights' hand-over, applied by step()
        self._posted_lock = threading.Lock()
        self._driver_lock = threading.Lock()  # `_one_driver`: the thread inside a driving method
        self._driver: int | None = None
        self._driver_depth = 0
        self.stats = EngineStats()

    # ------------------------------------------------------------------ requests
    @_one_driver
    def add_request(self, prompt: Sequence[int] | np.ndarray, sampling: SamplingParams | None = None,
                    max_new_tokens: int = 16, eos_ids: Sequence[int] | None = (),
                    stop_sequences: Sequence[Sequence[int]] | None = ()) -> int:
        """Queues a request; returns its id. Raises ValueError for a request that can
        never run or whose fields are out of range (token ids outside [0, vocab_size),
        an empty prompt or stop sequence, max_new_tokens < 1, longer than max_seq_len,
        more pages than the pool); numpy integers are accepted wherever ints are."""
        eos, stops = self._checked_stops(eos_ids, stop_sequences)
        return self._queue(self._checked_request(prompt, sampling, max_new_tokens, eos, stops))

    def _checked_stops(self, eos_ids, stop_sequences) -> tuple[frozenset, tuple]:
        """(eos ids, stop sequences), validated and normalised: the same for every prompt of
        a call, so checked once (and their errors name no prompt)."""
        vocab = self.model_config.vocab_size
        eos_ids = () if eos_ids is None else eos_ids  # None: none, as Python callers write it
        stop_sequences = () if stop_sequences is None else stop_sequences
        eos = frozenset(check_token_ids("eos_ids", eos_ids, vocab).tolist())
        if isinstance(stop_sequences, (str, bytes)) or not isinstance(stop_sequences, (Sequence, np.ndarray, jax.Array)):
            raise ValueError(f"stop_sequences: must be a sequence of token-id sequences, got {stop_sequences!r}")
        stops = tuple(tuple(check_token_ids(f"stop_sequences[{i}]", seq, vocab).tolist())
                      for i, seq in enumerate(stop_sequences))
        if any(len(seq) == 0 for seq in stops):
            raise ValueError("stop_sequences: every stop sequence must be non-empty")
        return eos, stops

    def _checked_request(self, prompt, sampling, max_new_tokens, eos: frozenset, stops: tuple) -> tuple:
        """The request's fields, validated and normalised (nothing is queued); `eos` and
        `stops` as `_checked_stops` gives them."""
        cfg = self.config
        sampling = SamplingParams() if sampling is None else sampling
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling: must be a SamplingParams, got {type(sampling).__name__}")
        vocab = self.model_config.vocab_size
        prompt = check_token_ids("prompt", prompt, vocab)
        if prompt.size == 0:
            raise ValueError("prompt: must hold at least one token id, got an empty sequence")
        max_new_tokens = check_max_new_tokens(max_new_tokens)
        total = len(prompt) + max_new_tokens
        if len(prompt) >= self.seq_limit:  # longer than the context: no max_new_tokens fits
            raise ValueError(f"prompt: {len(prompt)} tokens leave no room for a new token within max_seq_len "
                             f"({self.seq_limit}); truncate it to at most {self.seq_limit - 1} tokens")
        if total > self.seq_limit:
            raise ValueError(f"max_new_tokens: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) = {total} "
                             f"exceeds max_seq_len ({self.seq_limit})")
        pages = self.pool.pages_for(total)
        if pages > cfg.n_pages:
            raise ValueError(f"request can never fit: prompt + max_new_tokens = {total} tokens need {pages} pages "
                             f"of {cfg.page_size}, the pool has n_pages={cfg.n_pages}")
        if not cfg.chunked_prefill and len(prompt) > cfg.max_tokens_per_step:
            raise ValueError(f"request can never fit: without chunked_prefill its prompt of {len(prompt)} "
                             f"tokens must fit max_tokens_per_step={cfg.max_tokens_per_step}")
        return prompt, sampling, max_new_tokens, eos, stops

    def _queue(self, checked: tuple) -> int:
        prompt, sampling, max_new_tokens, eos, stops = checked
        rid = self._next_id
        self._next_id += 1
        seed = sampling.seed if sampling.seed is not None else (self.config.seed * 1_000_003 + rid) % 2**32
        self.scheduler.add(Request(rid=rid, prompt=prompt, sampling=self._interned(sampling),
                                   max_new_tokens=max_new_tokens, eos_ids=eos, stop_sequences=stops,
                                   seed=int(seed)))
        return rid

    def _interned(self, sampling: SamplingParams) -> SamplingParams:
        """`sampling` without its seed (the request carries it), as the one object the
        engine uses for all equal params: requests that differ only in seed (the usual RL
        batch) then share one object, which the per-step packing recognises without
        looking at each request's params (see `sampling._distinct`). A cache: cleared when
        it grows past `_MAX_INTERNED` distinct params."""
        if sampling.seed is not None:
            sampling = dataclasses.replace(sampling, seed=None)
        if len(self._sampling_params) >= _MAX_INTERNED:
            self._sampling_params.clear()
        return self._sampling_params.setdefault(sampling, sampling)

    @property
    def has_work(self) -> bool:
        """Whether `step()` still has something to return: queued or running requests, steps
        not read back, or completions not yet handed out (those `update_weights` finished
        under the old weights, which a `while engine.has_work: engine.step()` loop would
        otherwise never collect)."""
        return self.scheduler.has_work or bool(self._unread) or bool(self._finished)

    @_one_driver
    def abort(self, request_id: int) -> bool:
        """Cancels a queued or running request (call it between steps, from the thread
        that drives the engine): it leaves without a completion, its pages return to the
        pool (full ones stay in the prefix cache, as after finishing) and samples of it
        still in flight are dropped on read-back. Returns False when no such request is
        queued or running (unknown, finished, or aborted already)."""
        waiting = self.scheduler.waiting
        for req in waiting:
            if req.rid == request_id:
                waiting.remove(req)
                req.epoch += 1
                return True
        for req in self.scheduler.running:
            if req.rid == request_id:
                self.scheduler.finish(req, self.version)
                return True
        return False

    # ------------------------------------------------------------------ the loop
    @_one_driver
    def step(self) -> list[Completion]:
        """Plans and dispatches one step, reads back the previous one; returns the
        requests that finished. Weights handed over by `post_weights` are served first."""
        self.apply_posted_weights()
        return self._step()

    def _step(self) -> list[Completion]:
        """`step` under the weights served now, without applying posted ones."""
        if self.params is None:  # before anything is scheduled: the requests wait as they are
            raise RuntimeError("engine: no weights are served (the last update_weights failed to build them); "
                               "call update_weights again")
        # An interrupted read-back left older steps unread: record them before planning, which
        # (penalty windows, stop conditions) sees every token but the last step's.
        self._read_back_until(1)
        t0 = time.perf_counter()
        launched = None
        try:  # planning updates requests, pages and prefix cache in place: a raise part-way is recovered
            batch = self.scheduler.schedule(self.version, admit=self._admit, steps=self.tuning.decode_steps_per_call)
            if batch is not None:
                launched = self._dispatch(batch)
                self._unread.append(launched)
        except BaseException:
            self._step_failed()
            raise
        host = time.perf_counter() - t0
        if launched is None and not self._unread and self.scheduler.has_work:
            raise RuntimeError("engine: no request could be scheduled and none is running "
                               "(pool too small for the waiting requests?)")
        if launched is not None:
            self.stats.steps += 1
            self.stats.host_s += host
            if launched.decode:
                self.stats.decode_steps += 1
                self.stats.decode_device_steps += 1 if launched.counts is None else max(launched.counts)
                self.stats.decode_host_s += host
        self._read_back_until(1 if launched is not None and self.config.overlap else 0)
        done, self._finished = self._finished, []
        return done

    @_one_driver
    def flush(self) -> list[Completion]:
        """Reads back the steps in flight (no new step is dispatched)."""
        self._read_back_until(0)
        done, self._finished = self._finished, []
        return done

    @_one_driver
    def run(self) -> list[Completion]:
        """Steps until every queued request has finished."""
        done: list[Completion] = []
        while self.has_work:
            done += self.step()
        return done + self.flush()

    @_one_driver
    def add_requests(self, prompts: Sequence[Sequence[int]],
                     sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                     max_new_tokens: int | Sequence[int] = 16, eos_ids: Sequence[int] | None = (),
                     stop_sequences: Sequence[Sequence[int]] | None = ()) -> list[int]:
        """Queues `prompts` (`sampling` and `max_new_tokens`: one for all, or one per
        prompt); returns their ids. Every request is checked before any is queued, so a bad
        one leaves nothing behind (the error names `prompts[k]`)."""
        check_prompt_list(prompts)
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if not isinstance(sampling, Sequence) or isinstance(sampling, str):  # e.g. a dict of settings
            raise ValueError(f"sampling: must be a SamplingParams or a sequence of them (one per prompt), "
                             f"got {type(sampling).__name__}")
        if len(sampling) != len(prompts):
            raise ValueError(f"sampling: {len(sampling)} entries for {len(prompts)} prompts")
        if isinstance(max_new_tokens, Sequence) or np.ndim(max_new_tokens) > 0 and hasattr(max_new_tokens, "dtype"):
            if len(max_new_tokens) != len(prompts):
                raise ValueError(f"max_new_tokens: {len(max_new_tokens)} entries for {len(prompts)} prompts")
            # one host copy of an array (numpy or JAX), not one transfer a prompt; each checked by _checked_request
            news = np.asarray(max_new_tokens).tolist() if hasattr(max_new_tokens, "dtype") else list(max_new_tokens)
        else:
            news = [max_new_tokens] * len(prompts)
        checked = []
        eos, stops = self._checked_stops(eos_ids, stop_sequences) if news else (frozenset(), ())
        for k, (p, s, new) in enumerate(zip(prompts, sampling, news)):
            try:
                checked.append(self._checked_request(p, s, new, eos, stops))
            except ValueError as e:  # "prompt: ..." is about prompts[k] itself
                raise ValueError(f"prompts[{k}]: {str(e).removeprefix('prompt: ')}") from None
        return [self._queue(c) for c in checked]

    @_one_driver
    def generate(self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 max_new_tokens: int | Sequence[int] = 16, eos_ids: Sequence[int] | None = (),
                 stop_sequences: Sequence[Sequence[int]] | None = ()) -> list[Completion]:
        """Runs `prompts` to completion (`add_requests`, then steps); completions in prompt
        order. Completions of other queued requests are kept for `step()`/`flush()`. A call
        that raises (KeyboardInterrupt, a failed step) aborts its unfinished requests: no
        caller is left to collect them, and one whose step was lost in the read-back would
        otherwise hold its row and pages forever."""
        ids = self.add_requests(prompts, sampling, max_new_tokens, eos_ids, stop_sequences)
        wanted = set(ids)
        by_id: dict[int, Completion] = {}
        others: list[Completion] = []  # requests queued by add_request: kept for step()/flush()
        try:
            while wanted - by_id.keys():
                if not self.has_work:
                    raise RuntimeError("engine: requests vanished before finishing")
                for c in self.step():
                    if c.request_id in wanted:
                        by_id[c.request_id] = c
                    else:
                        others.append(c)
        except BaseException:
            for i in wanted - by_id.keys():
                self.abort(i)
            self._finished = [c for c in others + self._finished if c.request_id not in wanted]
            raise
        self._finished = others + self._finished
        return [by_id[i] for i in ids]

    # ------------------------------------------------------------------ warm-up
    def step_layouts(self, sampling: SamplingParams | Sequence[SamplingParams] | None = None) -> list[StepLayout]:
        """Every step layout (one compiled program each) this engine can dispatch for
        requests sampled with `sampling` (the params a run will use; None: the default
        `SamplingParams()`), from its buckets and tuning: see `reachable_layouts`."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()]
        if not sampling or not all(isinstance(p, SamplingParams) for p in sampling):
            raise ValueError(f"sampling: must be a SamplingParams or a non-empty sequence of them, got {sampling!r}")
        return reachable_layouts(self.config, self.seq_limit, self.tuning, self._token_buckets,
                                 self._batch_buckets, self._col_buckets, list(sampling))

    def warmup(self, sampling: SamplingParams | Sequence[SamplingParams] | None = None, *,
               progress: bool = True, threads: int | None = None) -> int:
        """Compiles every step program a run with `sampling` can use (`step_layouts`)
        ahead of time, so that generating compiles nothing later; a tqdm bar on stderr
        counts them (`progress=False`: none). Programs compiled already (by this process,
        or read from the persistent compilation cache, `jrl.compile_cache`) cost little.
        `threads` programs compile at once (default: WARMUP_THREADS, at most the CPU
        count): XLA compiles one program on about one core, and a server's few hundred
        layouts would otherwise take many minutes.
        Not compiled: the zeroing of the pages of a request whose logits turned non-finite
        (a small program, on first use). Returns the number of layouts."""
        if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
            raise ValueError(f"threads: must be a positive integer or None (the default), got {threads!r}")
        layouts = self.step_layouts(sampling)
        k, v = self.kv.buffers()

        # Tracing runs one program at a time: Flax builds its scanned layer class by editing
        # the dataclass fields of shared base classes, which two threads at once corrupt
        # (KeyError 'parent'). Tracing holds the GIL anyway; XLA's compiles run in parallel.
        trace_lock = threading.Lock()

        def compile_one(layout: StepLayout) -> None:
            ints = np.zeros(layout.int_packing.size, np.int32)
            floats = np.zeros(layout.float_packing.size, np.float32)
            with trace_lock:
                lowered = self.step_function.program(layout).lower(self.params, k, v, self._prev_tokens, ints,
                                                                   floats, layout=layout)
            lowered.compile()

        workers = threads or min(WARMUP_THREADS, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers, thread_name_prefix="jrl-warmup") as pool, \
                tqdm(total=len(layouts), desc="engine warmup", unit="program", disable=not progress) as bar:
            for _ in pool.map(compile_one, layouts):
                bar.update()
        return len(layouts)

    # ------------------------------------------------------------------ device side
    def _dispatch(self, batch: ScheduledBatch) -> _InFlight:
        """Packs the plan into the step's two host arrays and launches it (asynchronously)."""
        layout, ints, floats = self._pack(batch)
        self._scrub_freed_pages()
        k, v = self.kv.buffers()
        tok, readback, k, v = self.step_function.fn(self.params, k, v, self._prev_tokens, ints, floats,
                                                    layout=layout)
        self.kv.update(k, v)
        self._prev_tokens = tok
        if all(batch.sample):  # read back with a slice, not a gather
            picked, reqs, rows = range(len(batch)), batch.reqs, slice(0, len(batch))
        else:
            picked = [row for row, sample in enumerate(batch.sample) if sample]
            reqs, rows = [batch.reqs[row] for row in picked], np.asarray(picked, np.intp)
        for row, req in zip(picked, reqs):
            req.device_row = row
        counts = batch.step_counts
        if counts is not None and not isinstance(rows, slice):
            counts = [counts[row] for row in picked]
        return _InFlight(readback, rows, reqs, [r.epoch for r in reqs], self.version, layout.decode, counts)

    def _pack(self, batch: ScheduledBatch) -> tuple[StepLayout, np.ndarray, np.ndarray]:
        """The static layout (bucketed sizes, sampling variant) and the padded int32 /
        float32 inputs of one step. Works by column, writing whole lists and arrays into
        views of the two flat arrays: a step costs a fixed few dozen numpy calls, with
        Python loops only over rows whose input tokens are on the host (prefill chunks) or
        that need a penalty window."""
        reqs, n = batch.reqs, len(batch)
        total, decode = batch.n_tokens, batch.decode
        # Rows that do not sample (a prompt's chunks before its last) keep their request's
        # params: the step's sampling variant is then one the requests' params reach
        # (`sampling_variants`), and its output for them is never read.
        sampling = [r.sampling for r in reqs]
        if decode:
            n_rows = n_tokens = bucket(max(n, self.tuning.min_decode_rows), self._batch_buckets)
        else:
            n_tokens = bucket(total, self._token_buckets)
            n_rows = prefill_rows(n_tokens, self.config.max_batch, self._batch_buckets)
        if batch.step_counts is None:
            bound = self.cache.bind(batch.rows, batch.q_starts, batch.q_lens)
        else:
            bound = self.cache.bind_decode_steps(batch.rows, batch.q_starts, batch.step_counts, batch.steps)
        width = bound.page_table.shape[1]
        penalties, mode = batch_mode(sampling)
        window = self.config.penalty_window - 1 if penalties else 0
        n_page_cols = page_cols(width, decode, self._col_buckets, self._widest, self.tuning.full_width_prefill)
        stage_fp8 = (not decode and self.tuning.stage_fp8_prefill
                     and pages_read(np.diff(bound.cu_q_lens), bound.kv_lens, bound.page_table, self.config.page_size)
                     <= staged_pages(n_tokens, (n_rows, n_page_cols), self.config.page_size))
        layout = StepLayout(decode=decode, n_tokens=n_tokens, n_rows=n_rows, n_page_cols=n_page_cols,
                            window=window, penalties=penalties,
                            mode=mode, int_align=INT_ALIGN_UNROLLED if self.tuning.unroll_layers and decode else 1,
                            steps=batch.steps, stage_fp8=stage_fp8)

        ints = np.zeros(layout.int_packing.size, np.int32)  # fields default to 0 unless set below
        i = layout.int_packing.views(ints)
        starts = bound.cu_q_lens[:-1]
        tok_src = i["tok_src"]  # >= 0: take the previous step's sample at that row
        tok_src[:] = -1
        if all(batch.device_input):
            tok_src[starts] = [r.device_row for r in reqs]
        else:
            for row, (req, on_device) in enumerate(zip(reqs, batch.device_input)):
                start, q_start, q_len = int(starts[row]), batch.q_starts[row], batch.q_lens[row]
                if on_device:
                    tok_src[start] = req.device_row
                else:  # host-known input tokens (prefill chunks, or a token read back already)
                    i["tokens"][start:start + q_len] = req.known_tokens()[q_start:q_start + q_len]
        i["positions"][..., :total] = bound.positions
        i["out_cache_loc"][:] = -1
        i["out_cache_loc"][..., :total] = bound.out_cache_loc
        i["cu_q_lens"][:] = total
        i["cu_q_lens"][:n + 1] = bound.cu_q_lens
        i["kv_lens"][..., :n] = bound.kv_lens
        i["page_table"][:n, :width] = bound.page_table
        if window:  # the window's last token (the row's input) is added on device
            win = i["window"]
            win[:] = -1
            for row, (req, sample) in enumerate(zip(reqs, batch.sample)):
                if sample:
                    last = batch.q_starts[row] + batch.q_lens[row] - 1
                    seen = req.known_tokens()[max(0, last - window):last]
                    win[row, window - len(seen):] = seen
        float_columns, i["top_k"][:] = param_columns(sampling, n_rows)
        i["seed"][:n] = np.array([r.seed for r in reqs], np.uint32).view(np.int32)
        i["index"][:n] = batch.index
        return layout, ints, float_columns.reshape(layout.float_packing.size)

    def _read_back_until(self, keep: int) -> None:
        """Reads back the oldest unread steps until `keep` are left."""
        while len(self._unread) > keep:
            self._read_back(self._unread[0])

    def _read_back(self, step: _InFlight) -> None:
        """Records step's samples in their requests (skipping requests preempted, aborted or
        finished since dispatch) and hands finished requests to the scheduler. `step` is the
        oldest unread one; it leaves `_unread` only once its values are on the host, so a
        wait that raises (KeyboardInterrupt) leaves it to be read back by the next call; a
        raise while its samples are recorded is recovered (`_step_failed`)."""
        t0 = time.perf_counter()
        readback = np.asarray(jax.device_get(step.readback))
        waited = time.perf_counter() - t0
        self.stats.wait_s += waited
        if step.decode:
            self.stats.decode_wait_s += waited
        try:  # from here the step's samples are only on the host: a raise part-way is recovered
            self._unread.popleft()
            self._record(step, readback)
        except BaseException:
            self._step_failed()
            raise

    def _record(self, step: _InFlight, readback: np.ndarray) -> None:
        """Records the read-back samples of `step` (`_read_back`): appends them to their
        requests, finishes those that stop, fails those whose logits turned non-finite."""
        recorded = 0
        counts = step.counts
        everyone = min(counts) if counts is not None else 1  # steps every row computes
        for j, values in enumerate(readback.reshape(-1, *readback.shape[-2:])):  # one step after another
            values, reqs, epochs = values[:, step.rows], step.reqs, step.epochs
            if j >= everyone:  # rows that had fewer tokens left than the call has steps are done
                keep = [r for r, n in enumerate(counts) if n > j]
                values, reqs, epochs = values[:, keep], [reqs[r] for r in keep], [epochs[r] for r in keep]
            tokens, logp, model_logp = values[0].view(np.int32).tolist(), values[1].tolist(), values[2].tolist()
            # Non-finite logits of a row make its model log-probability NaN (NaN or +inf in
            # the log-softmax normaliser); a NaN sampling input makes the other one NaN.
            finite = np.isfinite(values[1:3]).all(axis=0).tolist()
            for req, epoch, token, lp, model_lp, ok in zip(reqs, epochs, tokens, logp, model_logp, finite):
                if req.epoch != epoch:  # preempted, aborted or finished since dispatch: dropped
                    if not ok:  # and the KV it attended to may be non-finite
                        self._discard_released(req, epoch)
                    continue
                req.n_inflight -= 1
                if req.n_inflight == 0:
                    req.device_row = -1
                if not ok:
                    self._fail(req)
                    continue
                req.record(token, lp, model_lp, step.version)
                recorded += 1
                if req.finish_reason is not None:
                    self.scheduler.finish(req, step.version)
                    self._finished.append(req.completion())
        self.stats.generated_tokens += recorded
        if step.decode:
            self.stats.decode_tokens += recorded

    def _fail(self, req: Request) -> None:
        """Finishes `req` with "error" (its logits turned non-finite; the token drawn from
        them is dropped). Its KV pages may hold NaN: they leave the prefix cache and are
        zeroed on the device before the next step (`_dispatch`), so no later request, of
        this version or another, ever attends to them."""
        req.finish_reason = "error"
        self.scheduler.fail(req)
        self.stats.failed_requests += 1
        self._finished.append(req.completion())

    def _discard_released(self, req: Request, epoch: int) -> None:
        """A sample of `req` dispatched in `epoch` is non-finite, read back after `req`
        released its pages (preempted, aborted, or finished with a row still in flight):
        those pages may hold NaN, and they were published to the prefix cache. They leave
        it and are zeroed before reuse, as a failed request's are (`_fail`)."""
        if req.released is not None and req.released[0] == epoch:
            pages, req.released = req.released[1], None
            self.cache.discard_released(pages)

    def _scrub_freed_pages(self) -> None:
        """Zeroes the freed dirty pages (`Allocator.pending_scrub`) in the KV buffers, in
        place (donated), before the step that may reuse them is dispatched. They leave the
        queue once the zeroed buffers are stored (a call that raises leaves them queued)."""
        pages = self.pool.allocator.pending_scrub
        if not pages:
            return
        ps = self.config.page_size
        slots = (np.asarray(pages, np.int64)[:, None] * ps + np.arange(ps)).ravel()
        padded = np.full(pow2_at_least(len(slots)), self.kv.n_slots, np.int32)  # past the end: dropped
        padded[:len(slots)] = slots
        k, v = self.kv.buffers()
        self.kv.update(*self._zero_slots(k, v, padded))
        self.pool.allocator.take_scrub()

    def _step_failed(self) -> None:
        """Makes the engine consistent again after a step raised between planning and the
        stored outputs of its dispatch, or while recording a read-back (KeyboardInterrupt
        anywhere in the host bookkeeping, while a program compiled or once it returned, a
        failed compile, ...). Requests, pages and prefix cache may be half-updated then
        (pages taken but not yet attached to a task, a request admitted part-way, requests
        planned a token further or finished but not released, prefix-cache entries whose
        KV the step never wrote), and the KV buffers and previous tokens may have been
        donated to a call whose outputs were never stored. Rather than unwind each
        update, every running request is re-queued with the tokens it has (recomputed when
        admitted again, as after a preemption; samples still unread are drawn again with
        the same keys), one that had finished is handed out, the page bookkeeping and
        prefix cache are rebuilt empty, and lost buffers are replaced by empty ones."""
        # pages of a request whose logits turned non-finite, its release cut short: zeroed before reuse
        nan_pages = [p for r in self.scheduler.running if r.finish_reason == "error" and r.task is not None
                     for p in r.task.pages]
        self._finished += [r.completion() for r in self.scheduler.recover()]
        self._unread.clear()  # every sample in them belongs to a re-queued request (or a gone one)
        self.cache.reset(nan_pages)
        if self.kv.lost:
            self.kv.reset()
            self.pool.allocator.take_scrub()  # every page is zero now
        if self._prev_tokens.is_deleted():
            self._prev_tokens = self._no_prev_tokens()

    def _no_prev_tokens(self) -> jax.Array:
        """The previous step's samples before any step (`max_rows` zeros, replicated)."""
        return jnp.zeros(self.max_rows, jnp.int32, device=None if self.sharding is None else self.sharding.replicated)

    # ------------------------------------------------------------------ weights
    @_one_driver
    def update_weights(self, params: dict, version: int) -> Ack:
        """Serves `params` as `version` from the next step on. Returns once no request is
        being generated with the old weights: the step in flight is read back (its tokens
        record the old version), then requests in flight finish first, restart, or (with
        on_weight_update="continue") decode on under `version`, attending to the KV they
        computed before; no forward mixes versions, and their pages are never published
        to the prefix cache again (a newer request never reads KV of an older version).
        For a LoRA model `params` may be the adapters alone (`lora_params`): they are served
        over the base handed over before. Raises ValueError for a version going backwards, a version already served with
        other params (the arrays handed over for it, whole or, LoRA, the adapters alone, are
        acknowledged as a no-op), params whose structure,
        shapes or dtypes differ from those handed over before (the separate layout, also
        when the engine serves a fused copy), or params holding NaN or inf (the error names
        the first such leaf); after a refusal the engine still serves the old version. With a mesh, params in the engine's layout
        are used by reference; others are re-sharded (copied) onto it first. With
        `tuning.fuse_projections`, the fused copy is rebuilt (one concatenation of the q/k/v and
        gate/up weights; the previous copy is released first); with `weight_dtype`
        float8_e4m3fn, so is the quantized copy. A build that fails (RuntimeError) or is
        interrupted (the KeyboardInterrupt propagates, with a note) leaves no weights served
        and the old version's params recorded: that version's own params or a newer version
        serve again."""
        version = _checked_version(version)
        if version < self.version:
            raise ValueError(f"version: {version} is older than the served version {self.version}; "
                             "policy versions never go backwards")
        adapters_only = self._checked_update(params)
        if version == self.version:
            served = lora_params(self._held) if adapters_only else self.params
            if not (self._source.same(params) or _same_leaves(served, params)):
                raise ValueError(f"version: {version} is already served with different params (only the "
                                 "served arrays themselves count as the same, not a copy or a fresh load "
                                 "with equal values); publish new weights under a new version")
            if self.params is not None:
                return Ack(version)
            # a later update failed to build its copy: serve this version's own params again
        _check_finite(params, f"update_weights: refusing version {version}; the engine keeps serving "
                              f"version {self.version}")
        with self._posted_lock:  # a posted version this one supersedes is never applied
            if self._posted is not None and self._posted[1] <= version:
                self._posted = None
        finished = restarted = continued = 0
        earlier = self.flush()  # the step in flight ran under the old weights: recorded so
        try:
            if self.config.on_weight_update == "finish":
                drained = self._drain_started()
                finished = len(drained)
                earlier += drained
            elif self.config.on_weight_update == "continue":
                continued = self.scheduler.continue_running()
            else:
                restarted = len(self.scheduler.abort_running())
                for req in self.scheduler.waiting:
                    if req.outputs:  # preempted under the old weights: restart too
                        req.reset_outputs()
                        restarted += 1
        except BaseException:  # (Ctrl-C): not applied; the next step hands out the completions
            self._finished = earlier + self._finished
            if self.config.on_weight_update == "restart":  # requests may be released part-way
                self._step_failed()
            raise
        self._finished = earlier
        received = sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
        full = with_lora_params(self._held, params) if adapters_only else params
        source = self._source.updated(params)
        try:
            self.params = None  # drop the old served copy before building the new one (peak memory)
            held, served = self._served(full)
        except Exception as e:  # e.g. out of memory while fusing or quantizing: the old copy is gone
            raise RuntimeError(f"update_weights: building the served copy of version {version} failed "
                               f"({type(e).__name__}: {e}); the engine serves no weights until an "
                               f"update_weights succeeds") from e
        except BaseException as e:  # Ctrl-C: the same, and it reaches the caller as it is
            e.add_note(f"update_weights: interrupted while building the served copy of version {version}; "
                       f"version {self.version}'s copy was released before the build (peak memory), so the "
                       f"engine serves no weights until an update_weights succeeds (version {version} again, "
                       f"or version {self.version}'s own params)")
            raise
        # Only once built, in one statement: a failed or interrupted build leaves the served
        # version's own params (what `_source` recognises) and held base and adapters.
        self.params, self._held, self._source, self.version = served, held, source, version
        if self.radix is not None:
            self.radix.drop_versions_except(version)
        return Ack(version, finished_in_flight=finished, restarted=restarted, continued=continued,
                   bytes_received=received)

    def post_weights(self, params: dict, version: int) -> None:
        """Hands `params` over as `version` from any thread: the thread that drives the
        engine serves them (`update_weights`, with its checks and its `on_weight_update`)
        at the start of its next `step`, or when it calls `apply_posted_weights`. A later
        post replaces one not yet applied. A `version` that is not an integer, or params whose
        structure, shapes or dtypes `update_weights` would refuse, raise ValueError here, in
        the posting thread (an earlier post stays). With on_weight_update="continue" this is how
        a trainer swaps weights under a generation running in another thread without
        waiting for its longest request."""
        version = _checked_version(version)  # refused here, in the caller's thread
        self._checked_update(params)  # so is a tree the update would refuse (an earlier post stays)
        with self._posted_lock:
            self._posted = (params, version)

    def _checked_update(self, params: dict) -> bool:
        """Whether `params` are the adapters alone (LoRA); raises ValueError naming the first
        leaf whose path, shape or dtype differs from the params handed over before. Reads
        only what the engine fixed when built: safe from any thread."""
        # a tree of LoRA factors alone is meant as the adapters: checked against them, so a
        # part of them is refused naming the first adapter missing, not the embedding
        adapters_only = (self._lora and bool(jax.tree.leaves(params))
                         and jax.tree.structure(lora_params(params)) == jax.tree.structure(params))
        if adapters_only:
            _check_same_structure(self._adapter_structure, params, "the served LoRA")
        else:
            _check_same_structure(self._source_structure, params)
        return adapters_only

    @_one_driver  # from another thread: refused before the post is taken (it stays for the driver)
    def apply_posted_weights(self) -> Ack | None:
        """Serves the weights of the latest `post_weights` not yet applied (from the thread
        that drives the engine); None when there are none, or when the engine already
        serves that version or a newer one."""
        with self._posted_lock:
            posted, self._posted = self._posted, None
        if posted is None or posted[1] <= self.version:  # superseded by a direct update
            return None
        return self.update_weights(*posted)

    def drop_prefix_cache(self) -> int:
        """Forgets every cached prefix, so the next requests are computed as on a new engine
        (pages a request still holds are freed when it releases them). Returns the pages
        dropped."""
        if self.radix is None:
            return 0
        return self.radix.drop_versions_except(-1)  # versions are >= 0: none is kept

    def _served(self, params: dict) -> tuple[dict, dict]:
        """(held, served): the placed params handed over, which the engine keeps as the base
        that adapter-only updates are served over (LoRA; {} without: not kept), and the
        params as the steps read them: placed on the mesh, adapters merged (LoRA,
        `EngineConfig.lora` "merge"), fused, or as given. Neither is stored here, and no
        buffer is donated: a build that raises leaves the caller's params and `self._held`
        as they were."""
        held = params if self._holding is None else self._holding.place(params)
        if self._lora and not self._merging and self._holding is None:
            # unmerged on one device: own copies of the (small) adapters, never the caller's
            # buffers, which a train step may donate
            held = with_lora_params(held, jax.tree.map(jnp.copy, lora_params(held)))
        served = merge_lora(self.model_config, held)[1] if self._merging else held
        held = held if self._lora else {}  # (weights of a model without LoRA: not kept)
        if self.sharding is not None:
            return held, self.sharding.place(served)
        if self.tuning.fuse_projections:
            served = fuse_projections(self.served_config, served)
        if self.config.weight_dtype != "float8_e4m3fn":
            return held, served
        served = quantize_projections(served)
        return held, split_layers(served) if self.tuning.per_layer_weights else served

    def _drain_started(self) -> list[Completion]:
        """Runs the old weights until no started request is left (running, in flight, or
        preempted and waiting); admits nothing new meanwhile. Weights posted meanwhile wait
        for the next `step`: applied inside the drain, they would be served before the update
        draining for them, which then swapped in over them (the version went backwards)."""
        drained: list[Completion] = []
        self._admit = "started"
        try:
            while self.scheduler.running or self._unread \
                    or any(r.outputs for r in self.scheduler.waiting):
                drained += self._step()
        except BaseException:  # a drain cut short keeps what it finished for the next step
            self._finished = drained + self._finished
            raise
        finally:
            self._admit = "all"
        return drained


def sampling_variants(params: Sequence[SamplingParams]) -> set[tuple[bool, str]]:
    """The (penalties, mode) of every batch whose rows sample with some of `params`
    (`sampling.batch_mode` of each non-empty subset)."""
    # one representative per kind (at most 8 kinds: the variant depends on nothing else)
    kinds = list({(p.uses_penalties, p.greedy, p.uses_filters): p for p in params}.values())
    return {batch_mode([p for j, p in enumerate(kinds) if mask >> j & 1]) for mask in range(1, 1 << len(kinds))}


def widest_table(config: EngineConfig, seq_limit: int) -> int:
    """Page-table columns of the longest request: its pages, at most the pool's."""
    return min(-(-seq_limit // config.page_size), config.n_pages)


def prefill_rows(n_tokens: int, max_batch: int, row_buckets: tuple[int, ...]) -> int:
    """Rows of a prefill step padded to `n_tokens` (its token bucket): the row bucket of
    min(n_tokens, max_batch), which holds every row such a step can have (at most
    n_tokens - 1: some row computes several tokens), so each token bucket is one program.
    Padding rows cost a row of LM head and sampling each, little beside the tokens."""
    return bucket(min(n_tokens, max_batch), row_buckets)


def page_cols(width: int, decode: bool, col_buckets: tuple[int, ...], widest: int, full_width_prefill: bool) -> int:
    """Page-table columns of a step whose rows hold at most `width` pages: its column
    bucket, or for a prefill step with `full_width_prefill` (`Tuning`) the bucket of the
    `widest` table (one program per token bucket, not one per width)."""
    return bucket(widest if full_width_prefill and not decode else width, col_buckets)


def reachable_layouts(config: EngineConfig, seq_limit: int, tuning: Tuning, token_buckets: tuple[int, ...],
                      row_buckets: tuple[int, ...], col_buckets: tuple[int, ...],
                      sampling: Sequence[SamplingParams]) -> list[StepLayout]:
    """The step layouts the scheduler and `Engine._pack` can produce with these buckets
    for requests sampled with `sampling`, each once: decode first, then prefill, small
    before large.

    * Decode (every row one query token): n rows in [1, max_batch], padded to at least
      `tuning.min_decode_rows`; any page-table width up to the longest request's pages
      (min(seq_limit / page_size, n_pages)), as long as n - 1 other rows fit the pool.
    * Multi-step decode (`tuning.decode_steps_per_call` > 1): the same for n up to
      `multi_step_max_rows`, variants without penalties only.
    * Prefill (some row computes several tokens): each token bucket t that a step of n
      rows can fill (t > n, t up to `max_tokens_per_step` and n_pages * page_size, t fits
      in n rows of at most the width's pages: t <= n * width * page_size, and the widest
      row leaves a page each for the n - 1 others), with `prefill_rows(t)` rows; per
      reachable column bucket, or only the widest with `tuning.full_width_prefill`; with
      `tuning.stage_fp8_prefill` each through a bf16 copy of the pages it reads and without.
    Sampling variants: those of `sampling` (`sampling_variants`), for every kind of step
    (rows that do not sample keep their request's params, see `Engine._pack`)."""
    ps, n_pages, max_batch = config.page_size, config.n_pages, config.max_batch
    widest = widest_table(config, seq_limit)
    prev = lambda b, buckets: max([x for x in buckets if x < b], default=0)  # noqa: E731
    widths = [w for w in col_buckets if prev(w, col_buckets) < widest]
    variants = sorted(sampling_variants(sampling))
    multi_variants = [v for v in variants if not v[0]]

    def layout(decode, t, r, w, penalties, mode, steps=1):
        return StepLayout(decode=decode, n_tokens=t, n_rows=r, n_page_cols=w,
                          window=config.penalty_window - 1 if penalties else 0, penalties=penalties, mode=mode,
                          int_align=INT_ALIGN_UNROLLED if tuning.unroll_layers and decode else 1, steps=steps)

    def decode_rows(limit):
        """(padded rows, fewest real rows padded to them) for 1..limit real rows."""
        out = {}
        for n in range(1, min(limit, max_batch) + 1):
            out.setdefault(bucket(max(n, tuning.min_decode_rows), row_buckets), n)
        return sorted(out.items())

    out = []
    for r, n in decode_rows(max_batch):
        for w in widths:
            if n - 1 + prev(w, col_buckets) + 1 <= n_pages:
                out += [layout(True, r, r, w, *v) for v in variants]
    if tuning.decode_steps_per_call > 1 and multi_variants:
        for r, n in decode_rows(tuning.multi_step_max_rows):
            for w in widths:
                if n - 1 + prev(w, col_buckets) + 1 <= n_pages:
                    out += [layout(True, r, r, w, *v, steps=tuning.decode_steps_per_call) for v in multi_variants]
    # prefill: (fewest pages of the widest row, padded width) of each program's tables
    spans = [(1, widths[-1])] if tuning.full_width_prefill else [(prev(w, col_buckets) + 1, w) for w in widths]
    max_tokens = min(config.max_tokens_per_step, n_pages * ps)
    for t in token_buckets:
        for w_lo, w in spans:
            w_hi = min(w, widest)
            if any(max(prev(t, token_buckets) + 1, n + 1)
                   <= min(t, max_tokens, n * min(min(w_hi, n_pages - n + 1) * ps, seq_limit))
                   and min(w_hi, n_pages - n + 1) >= w_lo
                   for n in range(1, min(t, max_batch) + 1)):
                out += [dataclasses.replace(layout(False, t, prefill_rows(t, max_batch, row_buckets), w, *v),
                                            stage_fp8=stage)
                        for stage in ((True, False) if tuning.stage_fp8_prefill else (False,)) for v in variants]
    return out


def check_prompt_list(prompts) -> None:
    """Refuses a `prompts` argument that is not a list of prompts: text (its characters
    would be checked as prompts), an iterator or other collection without order or len()
    (a generator, map, set) or one prompt's flat token ids (each id would be named as a
    prompt that is not a sequence)."""
    if isinstance(prompts, (str, bytes)):
        raise ValueError(f"prompts: must be a list of prompts, each a sequence of token ids, got text {prompts!r}")
    if not isinstance(prompts, (Sequence, np.ndarray, jax.Array)):  # a generator, map, set, dict
        raise ValueError(f"prompts: must be a list of prompts, each a sequence of token ids, got "
                         f"{type(prompts).__name__}; pass list(...)")
    flat = (getattr(prompts, "ndim", None) == 1 or isinstance(prompts, Sequence) and len(prompts) > 0
            and isinstance(prompts[0], (int, np.integer)) and not isinstance(prompts[0], (bool, np.bool_)))
    if flat:
        raise ValueError("prompts: must be a list of prompts, each a sequence of token ids, got one flat sequence "
                         "of ids; for a single prompt pass [prompt]")


def check_max_new_tokens(value) -> int:
    """`value` as an int >= 1: a Python or numpy integer, or a 0-d integer numpy or JAX
    array (not a bool)."""
    if hasattr(value, "dtype") and np.ndim(value) == 0 and np.issubdtype(value.dtype, np.integer):
        value = np.asarray(value).item()
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"max_new_tokens: must be an integer >= 1, got {value!r}")
    return int(value)


def check_token_ids(field: str, values, vocab: int) -> np.ndarray:
    """`values` as int32 token ids: a 1-D sequence (or numpy or JAX array) of integers,
    each in [0, vocab). Floats, bools and strings are refused (by the array's dtype), not
    converted."""
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{field}: must be a sequence of token ids, got text {values!r}: encode it first "
                         f"(jrl.tokenizer.load_tokenizer(...).encode)")
    if not isinstance(values, (Sequence, np.ndarray, jax.Array)):
        raise ValueError(f"{field}: must be a sequence of token ids, got {values!r}")
    try:
        ids = np.asarray(values)
    except ValueError:  # ragged nesting
        raise ValueError(f"{field}: must be a 1-D sequence of integer token ids, got {values!r}") from None
    if ids.size == 0:
        return np.zeros(0, np.int32)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"{field}: must be a 1-D sequence of integer token ids, got shape {ids.shape} "
                         f"dtype {ids.dtype}")
    if ids.min() < 0 or ids.max() >= vocab:
        raise ValueError(f"{field}: token ids must be in [0, {vocab}) (the model's vocab_size), got min "
                         f"{ids.min()} max {ids.max()}")
    return ids.astype(np.int32)


def _zero_slots(k, v, slots: jax.Array):
    """The KV buffers (plain or fp8) with `slots` zeroed in every layer (slots past the
    end: dropped)."""
    return clear_slots(k, slots), None if v is None else clear_slots(v, slots)


@jax.jit
def _all_finite(x: jax.Array) -> jax.Array:
    return jnp.all(jnp.isfinite(x))


def _check_finite(params: dict, action: str) -> None:
    """Raises ValueError naming the first floating-point leaf of `params` that holds NaN or
    inf. One reduction per leaf, on the devices the leaf lives on (leaves may come in
    different layouts), read back together: one pass over the weights."""
    leaves = [(path, x) for path, x in jax.tree_util.tree_leaves_with_path(params)
              if jnp.issubdtype(np.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype, jnp.inexact)]
    flags = jax.device_get([np.isfinite(x).all() if isinstance(x, np.ndarray) else _all_finite(x)
                            for _, x in leaves])
    for (path, x), ok in zip(leaves, flags):
        if not ok:
            bad = int(np.count_nonzero(~np.isfinite(np.asarray(jax.device_get(x), np.float32))))
            raise ValueError(f"params{jax.tree_util.keystr(path)}: holds {bad} non-finite value(s) (NaN or inf) "
                             f"of {int(np.size(x))}; {action}")


def _checked_version(version) -> int:
    """`version` as an int: a Python or numpy integer below 2**63; bools, floats and strings
    are refused (a float would otherwise be truncated to another version), and so is a
    larger one, which every completion's int64 `versions` would fail to hold (each step
    that finished a request raised)."""
    if not isinstance(version, (int, np.integer)) or isinstance(version, bool):
        raise ValueError(f"version: must be an integer, got {version!r}")
    if int(version) >= 2**63:
        raise ValueError(f"version: must be below 2**63 (completions record versions as int64), got {version}")
    return int(version)


def _structure(params: dict) -> dict:
    """The params' tree of shapes and dtypes (what a later update must match)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)


def _same_leaves(a: dict, b: dict) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return len(la) == len(lb) and all(x is y for x, y in zip(la, lb))


@functools.cache
def _model_structure(model_config: ModelConfig) -> dict:
    """The params tree (shapes, dtypes) of `model_config`, traced once per config: what
    `Engine` checks the params it is given against, so that params of another model fail
    when it is built, naming the leaf, not as a flax error inside the first step's trace."""
    return abstract_params(model_config)


def _check_same_structure(old: dict, new: dict, against: str = "the served", dtypes: bool = True) -> None:
    """Raises ValueError naming the first leaf of `new` whose path or shape (and with
    `dtypes`, dtype; without, whether it is floating) differs from `old`'s (`against`
    names whose params `old` are)."""
    old_leaves, old_def = jax.tree.flatten_with_path(old)
    new_leaves, new_def = jax.tree.flatten_with_path(new)
    if old_def != new_def:
        old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
        new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
        old_set, new_set = set(old_paths), set(new_paths)
        missing = [p for p in old_paths if p not in new_set]
        extra = [p for p in new_paths if p not in old_set]
        where = "".join([f"; missing params{missing[0]}" if missing else "",
                         f"; unexpected params{extra[0]}" if extra else ""])  # the first of each
        raise ValueError(f"params: tree structure differs from {against} params "
                         f"({len(new_leaves)} leaves vs {len(old_leaves)}){where}")
    for (path, a), (_, b) in zip(old_leaves, new_leaves):
        # a leaf that is no array (a Python number) has the shape and dtype numpy gives it
        shape, dtype = np.shape(b), b.dtype if hasattr(b, "dtype") else np.asarray(b).dtype
        if not dtypes:  # any floating dtype (the engine casts); integers are no weights
            if tuple(a.shape) != shape:
                raise ValueError(f"params{jax.tree_util.keystr(path)}: shape {shape} differs from "
                                 f"{against} {tuple(a.shape)}")
            if jnp.issubdtype(a.dtype, jnp.floating) and not jnp.issubdtype(dtype, jnp.floating):
                raise ValueError(f"params{jax.tree_util.keystr(path)}: dtype {dtype}; the engine serves "
                                 f"floating-point weights")
        elif tuple(a.shape) != shape or a.dtype != dtype:
            raise ValueError(f"params{jax.tree_util.keystr(path)}: {dtype}{shape} differs from "
                             f"{against} {a.dtype}{tuple(a.shape)}")
