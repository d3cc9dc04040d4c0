"""The paged attention backend: the model's `attend` protocol over the 4D KV buffers.

One packed forward holds T query tokens of R requests (B=1, S=T). For every layer the
backend writes the step's keys/values at `out_cache_loc` (padding rows have slot -1 and
are dropped), then attends through the page table with `pallas_kernels`: `paged_prefill`
(ragged queries, causal bottom-right per request) or, when every request has exactly one
query token, `ragged_decode`; with `exact` every step takes `exact_prefill` (batch-invariant
rows, docs/rl.md "Exact log-probs"). Because the write precedes the read in every layer, a
request may attend to pages another request of the same step is writing (a prefix shared
inside one batch is computed once). MLA runs in the absorbed form against the latent
cache (`v_buf is None`, values = the latent's first `kv_lora_rank` channels). With `heads`
set (tensor parallelism) the write and the kernel run per device on its own heads
(`jrl.rollout.sharding.shard_attention`).
"""

from __future__ import annotations

import functools

import flax.struct
import jax

from jrl.rollout.sharding import HeadSplit, shard_attention

# Imported from the dispatch module directly: it resolves even where an older editable
# install registered `pallas_kernels` as a namespace package (no __init__ executed).
from pallas_kernels import dispatch as kernels


class PagedAttention(flax.struct.PyTreeNode):
    cu_q_lens: jax.Array  # [R + 1] int32, request r owns query rows cu[r]:cu[r+1]
    kv_lens: jax.Array  # [R] int32, keys per request including this step's (0 = padding row)
    page_table: jax.Array  # [R, W] int32 page ids
    out_cache_loc: jax.Array  # [T] int32 slot of each query token's KV (-1 = padding)
    page_size: int = flax.struct.field(pytree_node=False, default=16)
    decode: bool = flax.struct.field(pytree_node=False, default=False)
    absorb_mla: bool = flax.struct.field(pytree_node=False, default=False)
    v_head_dim: int | None = flax.struct.field(pytree_node=False, default=None)
    impl: str = flax.struct.field(pytree_node=False, default="auto")
    # Tensor parallelism: run the write and the kernel per device on its own heads.
    heads: HeadSplit | None = flax.struct.field(pytree_node=False, default=None)
    # Exact log-probs: every step (decode too) attends through `exact_prefill`, whose rows
    # do not depend on the batch (the arithmetic the trainer's `ExactAttention` shares).
    exact: bool = flax.struct.field(pytree_node=False, default=False)
    # fp8 prefill: (source pages, page table) of a bf16 copy of the pages the step reads
    # (`pallas_kernels.staged_prefill.stage_layout`, made once a step); None: no copy.
    stage: tuple[jax.Array, jax.Array] | None = None

    def attend(self, q, k, v, *, layer, cache, scale):
        if q.shape[0] != 1:
            raise ValueError(f"PagedAttention: expects one packed sequence (B=1), got B={q.shape[0]}")
        k_buf, v_buf = cache
        packed = functools.partial(self._attend_packed, scale)
        metadata = (self.out_cache_loc, self.cu_q_lens, self.kv_lens, self.page_table, *(self.stage or ()))
        args = (q[0], k[0], None if v is None else v[0], k_buf, v_buf, layer)
        if self.heads is None:
            out, k_buf, v_buf = packed(*args, *metadata)
        else:
            out, k_buf, v_buf = shard_attention(self.heads, packed, *args, metadata)
        return out[None], (k_buf, v_buf)

    def _attend_packed(self, scale, q, k, v, k_buf, v_buf, layer, out_cache_loc, cu_q_lens, kv_lens,
                       page_table, *stage):
        """Write then attend for packed `q [T, Hq, D]`, `k/v [T, Hkv, D]` (all heads, or one
        device's heads under `shard_attention`); `stage`: this step's (source, table) pair."""
        k_buf, v_buf = kernels.write_kv(k_buf, v_buf, layer, out_cache_loc, k, v)
        kwargs = dict(page_size=self.page_size, sm_scale=scale, v_head_dim=self.v_head_dim, impl=self.impl)
        if self.exact:
            out = kernels.exact_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                                        page_size=self.page_size, sm_scale=scale, impl=self.impl,
                                        one_query_each=self.decode)
        elif self.decode:
            out = kernels.ragged_decode(q, k_buf, v_buf, layer, kv_lens, page_table, **kwargs)
        else:
            out = kernels.paged_prefill(q, k_buf, v_buf, layer, cu_q_lens, kv_lens, page_table,
                                        stage=tuple(stage) or None, **kwargs)
        return out, k_buf, v_buf
