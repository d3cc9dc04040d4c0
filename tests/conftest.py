"""Test-session settings.

The suite compiles about 4,600 small XLA programs on the CPU, and compiling them is about
half its time (2 cores, jax.monitoring's `backend_compile_duration`). LLVM at
optimization level 2 instead of XLA's default 3 compiles them faster while the programs
still run at about the same speed: five compile-heavy end-to-end files took 182 s instead
of 221 s on 2 cores (level 1: 184 s; level 0 compiled faster still but ran the learning
tests 2-3x slower and changed what the default run learns). Set here, before any test
imports jax, and inherited by the subprocesses the tests start; an
`--xla_backend_optimization_level` already in `XLA_FLAGS` wins.

Each pytest-xdist worker (and the processes its tests start) gets a compilation cache
directory of its own, unless `JRL_COMPILATION_CACHE` or JAX's own setting names one: two
cold clean-clone runs of the suite each lost a worker to a crash (SIGSEGV, SIGABRT) inside
JAX's `deserialize_executable` while both workers filled one shared directory; warm runs
never did. Per worker, a directory is filled by one test process at a time and the ones it starts.

`file_size_limit`: a test's way to fill the disk (a cap on the size of files written).
"""

import os
import resource
import signal
import tempfile

import pytest

_LEVEL = "--xla_backend_optimization_level"

if _LEVEL not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_LEVEL}=2".strip()

if "JRL_COMPILATION_CACHE" not in os.environ and "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JRL_COMPILATION_CACHE"] = os.path.join(
        tempfile.gettempdir(), f"jrl-tests-jax-cache-{os.getuid()}", os.environ.get("PYTEST_XDIST_WORKER", "main"))


@pytest.fixture
def file_size_limit():
    """Lets the test cap the size of files this process may write (EFBIG past it). While
    capped, nothing is written to JAX's compilation cache: JAX writes an entry in place, so
    a cut write would leave a truncated executable there, which crashes (SIGSEGV) the next
    process of the session that reads it."""
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
