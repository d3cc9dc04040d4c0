"""EngineConfig: the rollout engine's memory, batching and scheduling settings.

Shapes that reach the device (token counts, request rows, page-table width) are padded
to the buckets resolved here, so a long generation compiles a handful of programs.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Literal

import jax

from jrl.config import DEFAULT_EXACT_ROWS, INTERPRET_IN_MODEL, AttentionImpl, ConfigError, ModelConfig, check, from_dict
from pallas_kernels.dispatch import IMPLS, kernel_reads_pages
from pallas_kernels.quantized import KV_DTYPES


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """lo, 2lo, 4lo, ... below hi, then hi itself (so the largest bucket is exactly hi)."""
    out, b = [], lo
    while b < hi:
        out.append(b)
        b *= 2
    out.append(hi)
    return tuple(out)


# The smallest default token bucket. Token buckets size only prefill (mixed) steps (a
# decode step's tokens are its rows): below about this many tokens a forward is bound by
# reading the weights, not by compute, so padding a small prefill up to it costs little,
# and every bucket saved is a program fewer to compile (docs/rollout.md "Step programs").
MIN_TOKEN_BUCKET = 64


# Tokens per KV page: the default, and the default with an fp8 KV cache (a page's float32
# scales are one TMA copy of a multiple of 128 bytes, so the Mosaic GPU kernels read fp8
# buffers only with pages of a multiple of 32 tokens; docs/kernels.md "fp8 KV buffers").
DEFAULT_PAGE_SIZE = 16
FP8_KV_PAGE_SIZE = 32


def bucket(n: int, buckets: tuple[int, ...]) -> int:
    """The smallest bucket >= n (buckets ascending)."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Settings of one `Engine` (see docs/rollout.md for how they interact).

    page_size: tokens per KV page. n_pages: pages in the KV pool (n_slots = n_pages *
    page_size). max_batch: requests running at once (rows of a step). max_tokens_per_step:
    the token budget of one forward (decode tokens + prefill chunks); must be >= max_batch
    so every running request can decode every step. max_seq_len: prompt + new tokens of one
    request (None: the model's max_position_embeddings). token_buckets / batch_buckets:
    padded sizes of a prefill step's token count (empty: powers of two from
    MIN_TOKEN_BUCKET) / of a decode step's request rows (empty: powers of two; a prefill
    step takes the smallest row bucket >= min(its token bucket, max_batch)).
    chunked_prefill: split long prompts over steps (else a prompt must fit the budget).
    allocation: "paged" grows a request page by page (preempting the youngest request when
    pages run out); "contiguous" reserves one region for prompt + max_new_tokens at
    admission. prefix_cache: share full pages of identical prefixes (radix tree, per
    weight version). penalty_window: how many trailing tokens (prompt + output) the
    repetition/frequency/presence penalties see. on_weight_update: what `update_weights`
    does with requests in flight: "finish" them with the old weights first, "restart"
    them (abort, discard their tokens, re-queue) under the new weights, or "continue"
    them: they keep their tokens and KV and decode on under the new weights (each token
    records the version that sampled it; see `Engine.update_weights`). attention_impl:
    `pallas_kernels` implementation (with exact_logprobs also the model's
    `exact_attention_impl`, which the trainer must run: `exact_model_config`). overlap:
    schedule step n+1 while step n runs and read sampled tokens one step late. seed:
    derives the sampling seed of requests without one.
    weight_dtype: None serves the weights in the dtype handed over; "float8_e4m3fn" serves
    the projection kernels in e4m3 with per-output-channel float32 scales, rebuilt from the
    handed-over weights at construction and each `update_weights` (`jrl.models.quantized`;
    embedding and LM head stay as handed over; one device only, no mesh).
    kv_dtype: storage of the KV cache: None (the model's dtype) or "float8_e4m3fn" (fp8
    with a float32 scale per token and KV head: half the bytes of bf16; the Mosaic GPU
    kernels read it when page_size is a multiple of 32, see docs/kernels.md).
    exact_logprobs: every sampled token's model log-prob is bitwise what the trainer's
    log-prob pass computes for it under `exact_model_config` (batch-invariant numerics:
    row tiles of `ModelConfig.exact_rows`, attention through `exact_prefill` in every step,
    unfused projections; docs/rl.md "Exact log-probs"). Needs the model's dtype for
    weights and KV, GQA attention, a dense MLP, and `lora: unmerged` with adapters.
    """

    page_size: int = DEFAULT_PAGE_SIZE
    n_pages: int = 256
    max_batch: int = 32
    max_tokens_per_step: int = 512
    max_seq_len: int | None = None
    token_buckets: tuple[int, ...] = ()
    batch_buckets: tuple[int, ...] = ()
    chunked_prefill: bool = True
    allocation: Literal["paged", "contiguous"] = "paged"
    prefix_cache: bool = True
    penalty_window: int = 64
    on_weight_update: Literal["finish", "restart", "continue"] = "finish"
    attention_impl: AttentionImpl = "auto"
    overlap: bool = True
    seed: int = 0
    lora: Literal["merge", "unmerged"] = "merge"
    weight_dtype: Literal["float8_e4m3fn"] | None = None
    kv_dtype: str | None = None
    exact_logprobs: bool = False

    def __post_init__(self) -> None:
        for name in ("page_size", "n_pages", "max_batch", "max_tokens_per_step", "penalty_window"):
            v = getattr(self, name)
            check(isinstance(v, int) and not isinstance(v, bool) and v > 0, f"engine.{name}",
                   f"must be a positive integer, got {v!r}")
        check(self.max_tokens_per_step >= self.max_batch, "engine.max_tokens_per_step",
               f"must be >= max_batch ({self.max_batch}) so every running request can decode "
               f"each step, got {self.max_tokens_per_step}")
        if self.max_seq_len is not None:
            check(isinstance(self.max_seq_len, int) and not isinstance(self.max_seq_len, bool)
                  and self.max_seq_len > 0, "engine.max_seq_len",
                  f"must be a positive integer or None (the model's max), got {self.max_seq_len!r}")
        check(isinstance(self.seed, int) and not isinstance(self.seed, bool), "engine.seed",
              f"must be an integer, got {self.seed!r}")
        # Built directly (not from YAML) nothing coerces them: a string "false" would be true.
        for name in ("chunked_prefill", "prefix_cache", "overlap"):
            check(isinstance(getattr(self, name), bool), f"engine.{name}",
                  f"must be true or false, got {getattr(self, name)!r}")
        for name, top in (("token_buckets", self.max_tokens_per_step), ("batch_buckets", self.max_batch)):
            b = getattr(self, name)
            if b:
                check(all(isinstance(x, int) and x > 0 for x in b), f"engine.{name}",
                       f"must be positive integers, got {list(b)}")
                check(list(b) == sorted(set(b)), f"engine.{name}", f"must be strictly ascending, got {list(b)}")
                check(b[-1] >= top, f"engine.{name}", f"largest bucket must be >= {top}, got {b[-1]}")
        check(self.allocation in ("paged", "contiguous"), "engine.allocation",
               f"must be 'paged' or 'contiguous', got {self.allocation!r}")
        check(self.on_weight_update in ("finish", "restart", "continue"), "engine.on_weight_update",
               f"must be 'finish', 'restart' or 'continue', got {self.on_weight_update!r}")
        check(self.lora in ("merge", "unmerged"), "engine.lora",
              f"must be 'merge' or 'unmerged', got {self.lora!r}")
        check(self.attention_impl in IMPLS, "engine.attention_impl",
               f"must be one of {'/'.join(IMPLS)}, got {self.attention_impl!r}")
        check(self.attention_impl != "interpret", "engine.attention_impl", INTERPRET_IN_MODEL)
        check(self.weight_dtype in (None, "float8_e4m3fn"), "engine.weight_dtype",
              f"must be None (the weights as handed over) or 'float8_e4m3fn', got {self.weight_dtype!r}")
        check(self.kv_dtype is None or self.kv_dtype in KV_DTYPES, "engine.kv_dtype",
              f"must be null (the model's dtype) or one of {'/'.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        check(isinstance(self.exact_logprobs, bool), "engine.exact_logprobs",
              f"must be true or false, got {self.exact_logprobs!r}")
        check(not self.exact_logprobs or (self.kv_dtype is None and self.weight_dtype is None),
              "engine.exact_logprobs", "needs the model's own dtype for weights and KV (leave kv_dtype and "
              "weight_dtype out): the trainer computes in it")

    @property
    def n_slots(self) -> int:
        return self.n_pages * self.page_size

    @property
    def resolved_token_buckets(self) -> tuple[int, ...]:
        return self.token_buckets or powers_of_two(min(MIN_TOKEN_BUCKET, self.max_tokens_per_step),
                                                   self.max_tokens_per_step)

    @property
    def resolved_batch_buckets(self) -> tuple[int, ...]:
        return self.batch_buckets or powers_of_two(1, self.max_batch)

    def seq_len_limit(self, model: ModelConfig) -> int:
        """Longest prompt + generation a request may have."""
        limit = self.max_seq_len or model.max_position_embeddings
        check(limit <= model.max_position_embeddings, "engine.max_seq_len",
              f"{limit} exceeds the model's max_position_embeddings ({model.max_position_embeddings})")
        return limit

    def pages_for(self, n_tokens: int) -> int:
        """KV pages that hold `n_tokens` tokens."""
        return -(-n_tokens // self.page_size)

    def max_pages_per_request(self, model: ModelConfig) -> int:
        return self.pages_for(self.seq_len_limit(model))

    def page_col_buckets(self, model: ModelConfig) -> tuple[int, ...]:
        """Padded widths of the page table (pages per request row): powers of two from 8
        (fewer programs for short sequences) up to the per-request maximum."""
        top = self.max_pages_per_request(model)
        return powers_of_two(min(8, top), top)


def exact_model_config(model: ModelConfig, attention_impl: AttentionImpl = "auto") -> ModelConfig:
    """`model` with batch-invariant numerics on (`exact_rows`, DEFAULT_EXACT_ROWS unless it
    sets its own) and its attention computed by `attention_impl`, the engine's
    `EngineConfig.attention_impl`: what an `exact_logprobs` engine runs and what the
    trainer's log-prob pass must run to match it bitwise (the kernel and the reference
    each give a token the same bits in any batch, but not each other's). A model already
    on exact numerics with another implementation is refused: its sides would differ."""
    check(attention_impl in IMPLS, "engine.attention_impl",
          f"must be one of {'/'.join(IMPLS)}, got {attention_impl!r}")
    check(not model.exact_rows or model.exact_attention_impl == attention_impl, "engine.attention_impl",
          f"is {attention_impl!r}, but the model's exact attention runs {model.exact_attention_impl!r} "
          f"(model.exact_attention_impl): the engine and the trainer must compute attention alike; set "
          f"model.exact_attention_impl to the same value, or leave model.exact_rows out")
    return dataclasses.replace(model, exact_rows=model.exact_rows or DEFAULT_EXACT_ROWS,
                               exact_attention_impl=attention_impl)


def kernel_runs(config: EngineConfig, backend: str) -> bool:
    """Whether the engine's attention takes the Pallas kernels on `backend`: forced
    ("pallas"), or "auto" on a GPU; elsewhere the reference."""
    return config.attention_impl == "pallas" or (config.attention_impl == "auto" and backend == "gpu")


def check_exact(config: EngineConfig, model: ModelConfig, backend: str) -> None:
    """Refuses `exact_logprobs` where the engine cannot match the trainer bitwise. On a GPU
    `backend` "auto" attention takes the kernel only for pages it reads, while the
    trainer's exact attention (its own pages of 16) takes it whenever it is there: the
    engine's pages must then be readable too, as they must for a forced kernel anywhere."""
    if not config.exact_logprobs:
        return
    check(not kernel_runs(config, backend) or kernel_reads_pages(config.page_size), "engine.page_size",
          f"must be 8, 16, 32, 64 or a multiple of 128 with exact_logprobs where the attention kernel runs (it reads "
          f"no other pages, and the trainer's exact attention must run what the engine runs; attention_impl: "
          f"reference reads any), got {config.page_size}")
    check(model.attention == "gqa" and not model.is_moe and model.matmul_dtype is None, "engine.exact_logprobs",
          "needs GQA attention and a dense MLP without fp8 products (MLA's absorbed attention and MoE "
          "routing have no batch-invariant path)")
    check(not model.lora.rank or config.lora == "unmerged", "engine.lora",
          "must be 'unmerged' with exact_logprobs: a merged kernel rounds differently from the trainer's "
          "base + adapter product")


def check_backend(config: EngineConfig, backend: str) -> None:
    """Refuses `attention_impl: pallas` (the Mosaic GPU kernels, forced) off the GPU, where
    it would fail only at the first request."""
    check(config.attention_impl != "pallas" or backend == "gpu", "engine.attention_impl",
          f"'pallas' forces the Mosaic GPU kernels, which need a Hopper GPU; this backend is {backend} "
          f"(use 'auto', which takes them where they run, or 'reference')")


def check_kv_page_size(config: EngineConfig, model: ModelConfig, backend: str) -> None:
    """Refuses an fp8 KV cache whose pages the attention kernels cannot read where they
    would run (`kernel_runs`; the reference reads any page size). MLA caches always
    take the reference, so any page size serves them."""
    if config.kv_dtype is None or model.attention == "mla" or not kernel_runs(config, backend):
        return
    check(config.page_size % FP8_KV_PAGE_SIZE == 0, "engine.page_size",
          f"must be a multiple of {FP8_KV_PAGE_SIZE} with engine.kv_dtype: {config.kv_dtype} (the attention "
          f"kernels read fp8 pages of 32 tokens or more; leave page_size out to get {FP8_KV_PAGE_SIZE}, or "
          f"set attention_impl: reference for the slow path), got {config.page_size}")


def pow2_at_least(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, int(n) - 1).bit_length()


# The token budget of one step (`max_tokens_per_step`), docs/rollout.md "Sizing":
# enough for every prompt of the workload at once (a big batch prefills in few large
# packed steps), at most TOKEN_BUDGET_CAP; without a device memory figure (the CPU) at most
# CPU_TOKEN_BUDGET_CAP, so CPU programs stay small; and at most what STEP_MEMORY_FRACTION
# of the device's free memory holds of one step's activations (`step_bytes_per_token`).
TOKEN_BUDGET_CAP = 32768  # the fastest prefill budget measured on the H200 (bench/results/prefill.jsonl)
CPU_TOKEN_BUDGET_CAP = 1024
STEP_MEMORY_FRACTION = 1 / 8


def pow2_at_most(n: int) -> int:
    """The largest power of two <= n (1 for n <= 1)."""
    return 1 << max(0, int(n).bit_length() - 1)


def step_bytes_per_token(model: ModelConfig) -> int:
    """Upper estimate of the device memory one token of a step's forward holds at once (one
    layer's activations, float32 worst case): residual, norm and attention output (3 x
    hidden), q / k / v, and the MLP's gate, up and product (3 x its width). The logits are
    per request row, not per token, so they do not count here."""
    mlp = model.intermediate_size
    if model.is_moe:
        shared = model.shared_expert_intermediate_size or model.n_shared_experts * model.moe_intermediate_size
        mlp = max(mlp, model.n_experts_per_tok * model.moe_intermediate_size + shared)
    qkv = (model.n_heads + 2 * model.n_kv_heads) * model.qk_head_dim
    return 4 * (3 * model.hidden_size + qkv + 3 * mlp)


def token_budget(max_batch: int, prompt_tokens: int, free_memory: int | None = None,
                 bytes_per_token: int | None = None) -> int:
    """`max_tokens_per_step` for a workload of `prompt_tokens` prompt tokens in all (every
    request's prompt, summed) run `max_batch` at a time: those tokens (at least
    MIN_TOKEN_BUCKET) rounded up to a power of two (so the whole workload prefills in one step), capped at TOKEN_BUDGET_CAP,
    or CPU_TOKEN_BUDGET_CAP when `free_memory` (bytes free on the device) is None, and at
    the largest power of two whose `bytes_per_token` fit STEP_MEMORY_FRACTION of
    `free_memory`; never below max_batch (every running request decodes each step)."""
    want = pow2_at_least(max(prompt_tokens, MIN_TOKEN_BUCKET))
    if free_memory is None:
        cap = CPU_TOKEN_BUDGET_CAP
    else:
        if not bytes_per_token or bytes_per_token < 1:
            raise ValueError(f"bytes_per_token: must be a positive integer with free_memory, got {bytes_per_token!r}")
        cap = min(TOKEN_BUDGET_CAP, pow2_at_most(int(free_memory * STEP_MEMORY_FRACTION) // bytes_per_token))
    return max(max_batch, min(want, cap))


def device_free_memory(device: jax.Device | None = None) -> int | None:
    """Bytes the allocator of `device` (default: this process's first; another process's
    devices cannot be asked) can still hand out, from its `memory_stats()`; None where the
    backend reports none (the CPU)."""
    stats = (device or jax.local_devices()[0]).memory_stats()
    if not stats or "bytes_limit" not in stats:
        return None
    return max(0, int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))


def engine_config_for_workload(max_seq_len: int, n_requests: int, *, page_size: int | None = None, seed: int = 0,
                               prompt_tokens: int | None = None, free_memory: int | None = None,
                               model: ModelConfig | None = None, **overrides: Any) -> EngineConfig:
    """The one sizing rule: settings for up to `n_requests` requests at once, each of up to
    `max_seq_len` tokens (prompt + new). `max_batch` is `n_requests` rounded up to a power
    of two (at most 256); the pool lets every running request reach `max_seq_len` (plus 8
    spare pages, rounded up to a power of two); the token budget is `token_budget` of
    `prompt_tokens` (the workload's prompt tokens in all; None: max_batch x max_seq_len)
    and `free_memory` (bytes free on the device, `device_free_memory()`; None: the CPU's
    small cap), which needs `model` for the bytes a token of a step holds. `page_size`
    None: FP8_KV_PAGE_SIZE with an fp8 `kv_dtype` among the overrides (the kernels read
    fp8 pages only in multiples of 32 tokens), else DEFAULT_PAGE_SIZE.
    `overrides`: EngineConfig fields the user set (YAML data included); they win over the
    derived sizes and are coerced and checked like any config (errors name `engine.<field>`).
    """
    if not (isinstance(n_requests, int) and not isinstance(n_requests, bool) and n_requests >= 1):
        raise ValueError(f"n_requests: must be an integer >= 1, got {n_requests!r}")
    check(isinstance(max_seq_len, int) and not isinstance(max_seq_len, bool) and max_seq_len >= 1,
          "engine.max_seq_len", f"must be a positive integer, got {max_seq_len!r}")
    if page_size is None:
        page_size = FP8_KV_PAGE_SIZE if overrides.get("kv_dtype") in KV_DTYPES else DEFAULT_PAGE_SIZE
    check(isinstance(page_size, int) and not isinstance(page_size, bool) and page_size >= 1,
          "engine.page_size", f"must be a positive integer, got {page_size!r}")
    if prompt_tokens is not None and not (isinstance(prompt_tokens, int) and not isinstance(prompt_tokens, bool)
                                          and prompt_tokens >= 1):
        raise ValueError(f"prompt_tokens: must be an integer >= 1, got {prompt_tokens!r}")
    if free_memory is not None and model is None:
        raise ValueError("model: needed with free_memory (the bytes one token of a step holds)")
    max_batch = min(pow2_at_least(n_requests), 256)
    pages_per_request = -(-max_seq_len // page_size)
    batch = overrides.get("max_batch", max_batch)
    budget = token_budget(batch if isinstance(batch, int) else max_batch,
                          max_batch * max_seq_len if prompt_tokens is None else prompt_tokens, free_memory,
                          None if model is None else step_bytes_per_token(model))
    derived = {"page_size": page_size, "max_batch": max_batch,
               "n_pages": pow2_at_least(max_batch * pages_per_request + 8),
               "max_tokens_per_step": budget, "max_seq_len": max_seq_len, "seed": seed}
    return from_dict(EngineConfig, {**derived, **overrides}, prefix="engine.")


# `engine.<field>` in an EngineConfig error, not within a longer dotted name
_ENGINE_FIELD = re.compile(r"(^|[\s(\[,;'\"`])engine\.(\w+)")


def renamed_engine_fields(error: ConfigError, name: Callable[[str], str]) -> ConfigError:
    """`error` (an EngineConfig's, naming its fields `engine.<field>`) with each field named
    `name(field)`: as the caller's user set it (a run's `strategy.options.engine.<field>`,
    a server's flag)."""
    return ConfigError(_ENGINE_FIELD.sub(lambda m: m.group(1) + name(m.group(2)), str(error)))
