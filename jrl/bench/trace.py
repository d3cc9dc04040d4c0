"""Profiler traces, summarised: kernels per step, GPU busy time, the top kernels by class."""

from __future__ import annotations

import collections
import json
import os
from collections.abc import Callable

import jax
from jax._src.lib import _profiler
from jax.profiler import ProfileData, ProfileOptions

KERNEL_CLASSES = (  # first match wins; names as the CUDA profiler reports them
    ("collective", ("nccl", "allreduce", "all_reduce", "reducescatter", "reduce_scatter", "allgather", "all_gather")),
    ("attention", ("cudnn", "fmha", "flash", "sdpa", "mosaic", "paged", "ragged")),
    ("matmul", ("gemm", "cutlass", "nvjet", "xmma", "cublas", "dot", "matmul")),
    ("copy", ("memcpy", "memset", "copy")),
)


def kernel_class(name: str) -> str:
    """Coarse class of a GPU kernel by name: collective, attention, matmul, copy or other."""
    low = name.lower()
    return next((cls for cls, keys in KERNEL_CLASSES if any(k in low for k in keys)), "other")


def start_session(python_tracer: bool = True):
    """A running profiler session (`session.stop()` returns the serialized XSpace)."""
    options = ProfileOptions()
    if not python_tracer:
        options.python_tracer_level = 0  # Python tracing would slow a host loop itself
    return _profiler.ProfilerSession(options)


def trace_summary(xspace: bytes, n_steps: int) -> dict:
    """Kernels per step, GPU busy time per step (union of kernel intervals), the span from
    first to last kernel, the longest idle gaps, top kernels, time by kernel class, the last
    step's kernels (`kernel_summary`) and top host events, from a serialized XSpace of
    `n_steps` steps."""
    data = ProfileData.from_serialized_xspace(xspace)
    out = {"n_steps": n_steps, "gpu_lines": {}, "top_kernels": [], "top_host": []}
    kernels, host = [], collections.defaultdict(lambda: [0, 0])
    for plane in data.planes:
        if plane.name.startswith("/device:GPU"):
            for line in plane.lines:
                evs = list(line.events)
                out["gpu_lines"][line.name] = {"events": len(evs), "sum_us": sum(e.duration_ns for e in evs) / 1e3}
                if "stream" in line.name.lower() and "xla" not in line.name.lower():
                    kernels += [(e.start_ns, e.end_ns, e.name) for e in evs]
        elif plane.name.startswith("/host"):
            for line in plane.lines:
                if line.name == "python":
                    continue
                for e in line.events:
                    h = host[e.name[:90]]
                    h[0] += 1
                    h[1] += e.duration_ns
    out.update(kernel_summary(kernels, n_steps))
    out["top_host"] = [{"name": k, "per_step": c / n_steps, "us_per_step": d / 1e3 / n_steps}
                       for k, (c, d) in sorted(host.items(), key=lambda kv: -kv[1][1])[:30]]
    return out


def kernel_summary(kernels: list[tuple[int, int, str]], n_steps: int) -> dict:
    """The GPU side of `trace_summary` from `(start_ns, end_ns, name)` kernel intervals of
    `n_steps` steps (any order): kernels per step, busy time (the union of the intervals),
    span, the longest idle gaps, top kernels, time by class and `step_kernels`, the last
    step's share of kernels in launch order with their µs (which fusions a step runs, and
    what each costs). Empty for no kernels."""
    if not kernels:
        return {}
    out = {}
    kernels = sorted(kernels)
    busy, cur_s, cur_e, gaps = 0, kernels[0][0], kernels[0][1], []
    before = kernels[0][2]
    for s, e, name in kernels[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((s - cur_e, cur_e - kernels[0][0], before, name))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
        if e >= cur_e:
            before = name
    busy += cur_e - cur_s
    out["idle_gaps"] = [{"us": g / 1e3, "at_us": at / 1e3, "after": a[:60], "before": b[:60]}
                        for g, at, a, b in sorted(gaps, reverse=True)[:40]]
    out["idle_us_over_20us"] = sum(g for g, *_ in gaps if g > 20_000) / 1e3
    span = max(e for _, e, _ in kernels) - kernels[0][0]
    out.update(kernels_per_step=len(kernels) / n_steps, gpu_busy_us_per_step=busy / 1e3 / n_steps,
               gpu_span_us_per_step=span / 1e3 / n_steps)
    by = collections.defaultdict(lambda: [0, 0])
    classes = collections.Counter()
    for s, e, name in kernels:
        by[name[:90]][0] += 1
        by[name[:90]][1] += e - s
        classes[kernel_class(name)] += e - s
    out["top_kernels"] = [{"name": k, "per_step": c / n_steps, "us_per_step": d / 1e3 / n_steps}
                          for k, (c, d) in sorted(by.items(), key=lambda kv: -kv[1][1])[:60]]
    out["by_class_us_per_step"] = {k: d / 1e3 / n_steps for k, d in classes.most_common()}
    out["step_kernels"] = [{"name": name[:90], "us": (e - s) / 1e3}
                           for s, e, name in kernels[-max(1, len(kernels) // n_steps):]]
    return out


def trace_calls(out_dir: str, name: str, call: Callable[[], object], n_calls: int, steps_per_call: int = 1) -> dict:
    """Runs `call` `n_calls` times under the profiler (waiting for the last result), writes
    the summary per step to `out_dir/trace_<name>.json` and returns its headline fields
    (kernels_per_step, gpu_busy_ms, gpu_span_ms, by_class_us_per_step)."""
    session = start_session()
    out = None
    for _ in range(n_calls):
        out = call()
    jax.block_until_ready(out)
    return write_summary(out_dir, name, session.stop(), n_calls * steps_per_call)


def write_summary(out_dir: str, name: str, xspace: bytes, n_steps: int) -> dict:
    """`trace_summary` of `n_steps` steps written to `out_dir/trace_<name>.json`; returns its
    headline fields (kernels_per_step, gpu_busy_ms, gpu_span_ms, by_class_us_per_step)."""
    summary = trace_summary(xspace, n_steps)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"trace_{name}.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return {"kernels_per_step": summary.get("kernels_per_step"),
            "gpu_busy_ms": (summary.get("gpu_busy_us_per_step") or 0) / 1e3,
            "gpu_span_ms": (summary.get("gpu_span_us_per_step") or 0) / 1e3,
            "by_class_us_per_step": summary.get("by_class_us_per_step")}
