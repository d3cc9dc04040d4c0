"""Test-session settings.

The suite compiles about 4,600 small XLA programs on the CPU, and compiling them is about
half its time (2 cores, jax.monitoring's `backend_compile_duration`). LLVM at
optimization level 2 instead of XLA's default 3 compiles them faster while the programs
still run at about the same speed: five compile-heavy end-to-end files took 182 s instead
of 221 s on 2 cores (level 1: 184 s; level 0 compiled faster still but ran the learning
tests 2-3x slower and changed what the default run learns). Set here, before any test
imports jax, and inherited by the subprocesses the tests start; an
`--xla_backend_optimization_level` already in `XLA_FLAGS` wins.

The pytest-xdist workers share one compilation cache directory (unless
`JRL_COMPILATION_CACHE` or JAX's own setting names one); jrl's size limit makes JAX lock it
around every read and write.

A worker process lives through ~1,000 tests, and every compiled XLA:CPU program that stays
loaded holds about six memory maps (its code and data sections). Linux allows
`vm.max_map_count` (65,530 by default) a process; a worker that kept every program reached
60,000 halfway through the suite, and past the limit LLVM cannot map the next program's
sections: SIGSEGV inside `deserialize_executable`, or SIGABRT with "LLVM ERROR: Unable to
allocate section memory!". So after each test module that leaves more than
`MAX_MAPS_KEPT` maps, JAX's caches are cleared; later modules read their programs back
from the persistent cache.

`file_size_limit`: a test's way to fill the disk (a cap on the size of files written).
"""

import gc
import os
import resource
import signal
import sys
import tempfile

import pytest

_LEVEL = "--xla_backend_optimization_level"

if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=2".strip()

if "JRL_COMPILATION_CACHE" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JRL_COMPILATION_CACHE"] = os.path.join(tempfile.gettempdir(), f"jrl-tests-jax-cache-{os.getuid()}")

MAX_MAPS_KEPT = 40_000


def memory_map_count() -> int | None:
    """How many memory maps this process holds (None off Linux)."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return sum(1 for _ in maps)
    except OSError:
        return None


@pytest.fixture(autouse=True, scope="module")
def release_compiled_programs():
    """Unloads the compiled programs a test module leaves behind once they hold more than
    `MAX_MAPS_KEPT` memory maps (see the module docstring)."""
    yield
    if (memory_map_count() or 0) > MAX_MAPS_KEPT:
        import jax

        jax.clear_caches()
        gc.collect()


@pytest.fixture(autouse=True)
def forget_modules_written_by_tests(tmp_path_factory):
    """Drops, once a test ends, the modules it imported from pytest's temporary directories
    (a user's `my_rewards.py`, a tool package): the next test to write a module of the same
    name must import its own, not find this one in `sys.modules`."""
    yield
    base = str(tmp_path_factory.getbasetemp())
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(base):
            del sys.modules[name]


@pytest.fixture
def file_size_limit():
    """Lets the test cap the size of files this process may write (EFBIG past it). While
    capped, nothing is written to JAX's compilation cache: JAX writes an entry in place, so
    a cut write would leave a truncated entry there, which every later reader of the session
    warns about and compiles again."""
    import jax

    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    old_min_secs = jax.config.jax_persistent_cache_min_compile_time_secs

    def limit(n_bytes):
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1e9)  # no entry is written
        resource.setrlimit(resource.RLIMIT_FSIZE, (n_bytes, old_limit[1]))

    yield limit
    resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
    signal.signal(signal.SIGXFSZ, old_handler)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old_min_secs)
