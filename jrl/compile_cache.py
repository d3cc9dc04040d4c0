"""JAX's persistent compilation cache, on by default for every jrl process.

    from jrl.compile_cache import enable_compilation_cache
    enable_compilation_cache()            # what Trainer, Engine and generate() call
    enable_compilation_cache("/fast/disk/jax-cache")   # before them: another directory

A compiled XLA program is written to a directory and read back by the next process that
compiles the same program, instead of compiling it again (on a GPU an engine decode step
compiles in 5-50 s, a training step in several seconds). The directory, in this order:

1. a directory configured through JAX itself (`JAX_COMPILATION_CACHE_DIR`, or
   `jax.config.update("jax_compilation_cache_dir", ...)` before the first jrl call): used
   as it is, with JAX's own settings; jrl changes nothing;
2. the `path` argument of an explicit call (made before the first compile);
3. `$JRL_COMPILATION_CACHE`; `off` (or `0`, `false`, `no`, `none`) turns the cache off,
   `on` (or `1`, `true`, `yes`) means the default below (`./1` is a directory named 1);
4. `$XDG_CACHE_HOME/jrl/jax-<jax version>` (default `~/.cache/jrl/jax-<jax version>`).

A relative directory is made absolute against the working directory of that first call.

jrl also sets, where they are still JAX's defaults (not set in code or through their
`JAX_...` environment variables): `jax_persistent_cache_min_compile_time_secs` =
`MIN_COMPILE_SECS` (0.1 s instead of JAX's 1 s; see below) and
`jax_compilation_cache_max_size` = `MAX_SIZE_BYTES`, whose least recently used entries are
evicted beyond it. The size limit also makes JAX take a file lock around every read and
write of the directory: without one (JAX's default, no limit) an entry is written in place
with `write_bytes`, not atomically, so a process (another pytest-xdist worker, a second
engine) may read a half-written entry. An entry that cannot be read back (cut short by a
process killed while writing it, or by a full disk) is written anew, with a warning naming
it, by the next process that compiles its program (JAX would keep it and compile again in
every process).

Why 0.1 s: measured on the CPU, reading an entry back took 3-5 ms for small programs and
about 2% of the compile time for the step programs (0.11 s for a 5.3 s compile).
Programs that compile in under 0.1 s (eager ops, small reductions, the engine's per-leaf
finiteness checks) are therefore not written: little to save, and one file each. Everything
slower (every engine step, training step and jitted init) is. JAX's 1 s default would leave
every program of 0.1 to 1 s to compile again in each process, though reading it back costs
a few percent of that.

What invalidates an entry (a different key, so a compile and a new entry; stale entries
are never served): the jax / jaxlib version (hence one directory per jax version), the
XLA flags and compiler options (e.g. the engine's cuBLAS decode programs), the device
kind and count, the backend's platform version (CUDA driver / plugin), and the program
itself: model config, shapes, dtypes, shardings, static arguments (the engine's step
layout) and the code traced. Source locations are not part of the key, so moving code
does not invalidate anything.

The directory is trusted: an entry is executable code. Do not point it at a directory
other users can write to.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import warnings
from pathlib import Path

import jax

try:  # JAX internals, for `_replace_unreadable_entries` (where they moved, it changes nothing)
    from jax._src import compilation_cache as _jax_cache
    from jax._src.compilation_cache_interface import CacheInterface as _CacheInterface
    from jax._src.lru_cache import LRUCache as _LRUCache
except ImportError:
    _jax_cache = _CacheInterface = _LRUCache = None

ENV = "JRL_COMPILATION_CACHE"
OFF = frozenset({"off", "0", "false", "no", "none"})
ON = frozenset({"on", "1", "true", "yes"})  # the default directory, not one named "1"
MIN_COMPILE_SECS = 0.1
MAX_SIZE_BYTES = 16 * 2**30

_JAX_MIN_COMPILE_SECS = 1.0  # jax's default of jax_persistent_cache_min_compile_time_secs
_JAX_NO_MAX_SIZE = -1  # jax's default of jax_compilation_cache_max_size

logger = logging.getLogger(__name__)

# What the first call decided: None (not called yet), or ("dir", path) / ("off", None) /
# ("jax", path) when the directory was configured through JAX itself.
_decided: tuple[str, str | None] | None = None


def _have_filelock() -> bool:
    """JAX needs `filelock` for a size limit (and its lock); without it, no limit."""
    return importlib.util.find_spec("filelock") is not None


def default_cache_dir(environ: dict[str, str] | None = None) -> str | None:
    """The directory jrl uses when nothing was configured through JAX and no path is
    given: `$JRL_COMPILATION_CACHE`, None when that says off, else
    `$XDG_CACHE_HOME/jrl/jax-<version>` (`~/.cache/...` without XDG_CACHE_HOME, or
    when it says on)."""
    env = os.environ if environ is None else environ
    value = env.get(ENV, "").strip()
    if value.lower() in OFF:
        return None
    if value and value.lower() not in ON:
        return _absolute(value)
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or "~") / ".cache")
    return _absolute(Path(base) / "jrl" / f"jax-{jax.__version__}")


def _absolute(path: str | os.PathLike) -> str:
    """`path` with `~` expanded, made absolute against the working directory now: JAX
    resolves a relative cache directory at every read and write, so a later os.chdir
    would move the cache. ValueError when `~` cannot be expanded."""
    try:
        expanded = Path(path).expanduser()
    except RuntimeError:  # ~user of no such user, or no HOME and no passwd entry
        raise ValueError(f"cannot expand ~ in {str(path)!r} (no such user, or no home directory)") from None
    return os.path.abspath(expanded)


def enable_compilation_cache(path: str | os.PathLike | None = None) -> str | None:
    """Turns JAX's persistent compilation cache on for this process (see the module
    docstring for which directory and settings); returns the directory in use, or None
    when the cache is off. Idempotent: later calls without `path` return what the first
    decided. A `path` (or "off") given later still applies, but JAX opens its directory
    at the first compile that uses it, so only a call before that takes effect."""
    global _decided
    configured = jax.config.jax_compilation_cache_dir
    ours = _decided[1] if _decided is not None and _decided[0] == "dir" else None
    if configured and configured != ours:  # configured through JAX: leave it alone
        _decided = ("jax", configured)
        return configured if jax.config.jax_enable_compilation_cache else None
    if path is None and _decided is not None:
        return _decided[1]
    if path is not None and str(path).strip().lower() in OFF:
        target = None
    else:
        try:
            target = default_cache_dir() if path is None else _absolute(path)
        except ValueError as e:
            warnings.warn(f"persistent compilation cache off: {e} (set {ENV} to a writable directory, or to "
                          f"'off')", stacklevel=2)
            target = None  # off as "off" is: a directory an earlier call set is taken back
    if target is None:
        if ours is not None:
            jax.config.update("jax_compilation_cache_dir", None)
        _decided = ("off", None)
        logger.debug("persistent compilation cache: off")
        return None
    if not jax.config.jax_enable_compilation_cache:  # JAX_ENABLE_COMPILATION_CACHE=false
        _decided = ("off", None)
        return None
    try:  # JAX would warn at its first read and cache nothing; say why once, here
        Path(target).mkdir(parents=True, exist_ok=True)
        writable = os.access(target, os.W_OK)
    except OSError:
        writable = False
    if not writable:
        warnings.warn(f"persistent compilation cache off: cannot write to {target} (set {ENV} to a "
                      f"writable directory, or to 'off')", stacklevel=2)
        _decided = ("off", None)
        return None
    if "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS" not in os.environ \
            and jax.config.jax_persistent_cache_min_compile_time_secs == _JAX_MIN_COMPILE_SECS:
        jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECS)
    if "JAX_COMPILATION_CACHE_MAX_SIZE" not in os.environ \
            and jax.config.jax_compilation_cache_max_size == _JAX_NO_MAX_SIZE and _have_filelock():
        jax.config.update("jax_compilation_cache_max_size", MAX_SIZE_BYTES)
    jax.config.update("jax_compilation_cache_dir", target)
    _decided = ("dir", target)
    _replace_unreadable_entries()
    logger.debug("persistent compilation cache: %s", target)
    return target


def _replace_unreadable_entries() -> None:
    """Makes JAX open jrl's directory (at its first compile) through a cache whose `put`
    replaces an entry that cannot be read back. JAX writes an entry in place and never over
    an existing one, so an entry cut short (a process killed while writing it, a full disk)
    made every later process warn "Error reading persistent compilation cache entry" and
    compile the program again. JAX writes a key only after its read missed or failed, so
    the check (decompressing the entry on disk) runs on that rare path alone. Uses JAX
    internals: where they moved, nothing changes."""
    open_cache = getattr(_jax_cache, "get_file_cache", None)
    if open_cache is None or _CacheInterface is None:
        logger.debug("persistent compilation cache: unreadable entries are not replaced (JAX internals moved)")
        return
    if getattr(open_cache, "_jrl", False):
        return

    class ReplacingUnreadable(_CacheInterface):
        def __init__(self, cache: _LRUCache) -> None:
            self._cache = cache

        @property
        def _path(self):
            return self._cache._path

        def get(self, key: str) -> bytes | None:
            return self._cache.get(key)

        def put(self, key: str, value: bytes) -> None:
            entry = Path(self._cache._path) / f"{key}-cache"
            try:
                _jax_cache.decompress_executable(entry.read_bytes())
            except FileNotFoundError:
                pass
            except Exception as e:  # whatever the decompressor raises
                warnings.warn(f"persistent compilation cache: replaced the unreadable entry {entry} "
                              f"({type(e).__name__}: {e}) with the program compiled again", stacklevel=2)
                entry.unlink(missing_ok=True)
            self._cache.put(key, value)

    def get_file_cache(path, *args, **kwargs):
        opened = open_cache(path, *args, **kwargs)
        if opened is not None and type(opened[0]) is _LRUCache and _decided == ("dir", str(path)):
            return ReplacingUnreadable(opened[0]), opened[1]
        return opened  # JAX's directory, or its VerificationCache (jax_compilation_cache_check_contents)

    get_file_cache._jrl = True
    _jax_cache.get_file_cache = get_file_cache
