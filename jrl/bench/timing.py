"""Device-synchronised timing: every time here ends at `jax.block_until_ready`."""

from __future__ import annotations

import contextlib
import ctypes
import statistics
import time
from collections.abc import Callable

import jax


def timeit(fn: Callable, *args, iters: int = 10, reps: int = 5, profile: bool = False) -> float:
    """Median seconds per call over `reps` batches of `iters` back-to-back calls (after
    one call that compiles); with `profile` the timed calls run inside `profiled()`."""
    jax.block_until_ready(fn(*args))
    times = []
    with profiled() if profile else contextlib.nullcontext():
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(iters):
                out = fn(*args)
            jax.block_until_ready(out)
            times.append((time.perf_counter() - t0) / iters)
    return statistics.median(times)


@contextlib.contextmanager
def profiled():
    """The calls inside are what a profiler started with `--profile-from-start off` records
    (`ncu`, `nsys`): CUDA's cuProfilerStart / cuProfilerStop around them, so compiles,
    warm-up calls and the other columns' work stay out of the report."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise RuntimeError(f"profiling needs the CUDA driver (libcuda.so.1): {e}") from None
    if (err := cuda.cuProfilerStart()) != 0:
        raise RuntimeError(f"cuProfilerStart failed with CUresult {err}")
    try:
        yield
    finally:
        cuda.cuProfilerStop()


def timed(fn: Callable, *args, **kwargs) -> tuple[object, float]:
    """(result, seconds) of one call, its outputs waited for."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args, **kwargs))
    return out, time.perf_counter() - t0


class Budget:
    """Wall-clock budget of a run: `spent()` once `seconds` have passed since creation."""

    def __init__(self, seconds: float):
        self.start, self.seconds = time.perf_counter(), seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def spent(self) -> bool:
        return self.elapsed() > self.seconds
