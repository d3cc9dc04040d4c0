"""`jrl bench <stage>`: jrl's benchmarks behind one command, results as JSON rows.

Stages (one module each) share the helpers of this package: `timing` (device-synchronised
timers, medians), `floors` (the bytes and FLOPs a step must move, the device ceilings they
are divided by), `results` (the JSON row writer and the table printed last), `torch_ref`
(the transformers / PyTorch comparison, `torch_worker` run in a subprocess), `shapes` (the
benchmark models), `decode_program` (the engine's decode program on a synthetic batch), `generate_worker`
(one fresh process of the `generate` stage) and
`trace` (profiler summaries). Only the `jrl` console script (jrl/cli.py) imports it.
"""

# name -> one line for `jrl bench --help`; UNAVAILABLE: listed, with why it cannot run.
STAGES = {
    "train": "trainer step throughput: tokens/s, MFU, memory, meshes; --torch: transformers beside it",
    "decode": "engine decode throughput; --step-only, --ab (variants), --host, --gemms, --drift, --trace-dir",
    "prefill": "engine prefill throughput: prompt tokens/s against the compute floor",
    "exact": "batch invariance of the exact log-prob numerics, op by op (linear .. attention, model, engine)",
    "kernels": "Pallas decode / prefill kernels vs stock Pallas, cuDNN, XLA; --check, --write",
    "grpo": "one GRPO step (sync, overlapped or interruptible), phase by phase (generation .. weight sync)",
    "grpo_lora": "GRPO with LoRA at the 8B shape on one GPU: tokens/s/GPU, phases, memory, compile",
    "placement": "GRPO step and weight-sync time per GB: colocated vs split engines (--layouts, --replicas)",
    "bandwidth": "device ceilings the floors use: HBM stream rates, the bf16 matmul rate",
    "generate": "first generate() call of a fresh process (cold / warm cache), default vs tuned config",
    "serve": "jrl serve under load: requests/s, output tok/s over HTTP vs the in-process engine",
}
UNAVAILABLE: dict[str, str] = {}
