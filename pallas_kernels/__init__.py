"""Paged attention over the 4D KV buffer: Pallas GPU kernels, pure-jnp references, dispatch.

`paged_prefill` and `ragged_decode` take the same arguments whatever runs them; `impl`
picks the implementation: "auto" (the Pallas kernel on GPU, the reference elsewhere),
"reference", "pallas" or "interpret" (the Pallas kernel in interpret mode, for CPU tests).
`write_kv` is one XLA scatter in every case. See `pallas_kernels.reference` for the exact
semantics; the kernels' launch options are `pallas_kernels.tuning`.
"""

from pallas_kernels.dispatch import paged_prefill, ragged_decode, write_kv

__all__ = ["paged_prefill", "ragged_decode", "write_kv"]
