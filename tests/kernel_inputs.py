"""Random inputs of the paged attention kernels, shared by the kernel tests (bf16, fp8, faults)."""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from pallas_kernels.dispatch import run_kernel


def waiting(kernel):
    """`kernel` (a `*_mgpu` entry point) run through `dispatch.run_kernel`, as the dispatch
    runs it: waited for when interpreted (the interpreter can deadlock when the caller
    dispatches more work, such as the reference it is compared with, while a kernel runs)."""
    return functools.partial(run_kernel, kernel)


def lowers_for_hopper(traced) -> bool:
    """Whether a traced kernel call (`jax.jit(f).trace(...)`) runs the whole Mosaic GPU
    lowering for the cuda platform on this CPU (TMA shapes, layouts, barriers, the
    shared-memory budget; only ptxas is left for the GPU) into a Mosaic GPU call."""
    return "mosaic_gpu" in traced.lower(lowering_platforms=("cuda",)).as_text()


def rel_err(out, ref) -> float:
    """Relative L2 error of `out` against `ref`, both read as float32."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def paged_inputs(rng, n_req, max_ctx, hkv, d, ps, dtype=jnp.bfloat16, n_layers=2):
    """Random K/V buffers with shuffled page tables, every request owning pages for
    `max_ctx` keys (a short request's later columns are pages it does not use), plus spare
    pages nobody owns."""
    pages = -(-max_ctx // ps)
    n_pages = n_req * pages + 3
    shape = (n_layers, n_pages * ps, hkv, d)
    kb = jnp.asarray(rng.standard_normal(shape), dtype)
    vb = jnp.asarray(rng.standard_normal(shape), dtype)
    pt = jnp.asarray(rng.permutation(n_pages)[: n_req * pages].reshape(n_req, pages), jnp.int32)
    return kb, vb, pt
