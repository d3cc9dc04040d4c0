"""The persistent compilation cache (jrl.compile_cache): on by default in a per-user
directory, a second process reads the step programs back instead of compiling them,
the off switch writes nothing, and a directory configured through JAX is left alone.

Each case runs fresh Python processes (the cache is per-process JAX state) with HOME
pointed at a temporary directory, so the default location is exercised without touching
the real one."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from jrl.compile_cache import default_cache_dir

ROOT = Path(__file__).resolve().parent.parent

# One small generate() call; prints which programs were read from the cache and which
# were compiled and written (JAX logs both per module at DEBUG level).
SCRIPT = r"""
import collections, json, logging, sys
import jax
hits, writes = collections.Counter(), collections.Counter()

class Record(logging.Handler):
    def emit(self, record):
        msg = record.getMessage()
        if msg.startswith("Persistent compilation cache hit for '"):
            hits[msg.split("'")[1]] += 1
        elif msg.startswith("Writing ") and "to persistent compilation cache" in msg:
            writes[msg.split()[1]] += 1

log = logging.getLogger("jax._src.compilation_cache")
log.setLevel(logging.DEBUG); log.addHandler(Record())
log = logging.getLogger("jax._src.compiler")
log.setLevel(logging.DEBUG); log.addHandler(Record())

from jrl.config import ModelConfig
from jrl.models import init_params
from jrl.rollout import generate

cfg = ModelConfig()
params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(0))
prompts = [[1, 2, 3], [4, 5, 6, 7, 8]]
outs = generate(params, cfg, prompts, jax.random.key(1), max_new_tokens=6)
print(json.dumps({"dir": jax.config.jax_compilation_cache_dir, "hits": hits, "writes": writes,
                  "tokens": [o.tokens.tolist() for o in outs]}))
"""


def start(tmp_path: Path, **env) -> subprocess.Popen:
    environ = {k: v for k, v in os.environ.items()
               if k not in ("JRL_COMPILATION_CACHE", "XDG_CACHE_HOME") and not k.startswith("JAX_")}
    environ.update(HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **env)
    return subprocess.Popen([sys.executable, "-c", SCRIPT], env=environ, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen) -> tuple[dict, str]:
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def run(tmp_path: Path, **env) -> dict:
    return result(start(tmp_path, **env))[0]


def entries(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob("*-cache")) if path.exists() else []


def test_on_by_default_and_a_second_process_reads_the_step_programs(tmp_path):
    default = tmp_path / "home" / ".cache" / "jrl" / f"jax-{jax.__version__}"
    first = run(tmp_path)
    assert first["dir"] == str(default)
    assert first["writes"].get("jit_step", 0) >= 2, first  # at least a prefill and a decode program
    assert not first["hits"], first
    written = entries(default)
    assert sum(name.startswith("jit_step-") for name in written) == first["writes"]["jit_step"]

    second = run(tmp_path)
    assert second["hits"].get("jit_step") == first["writes"]["jit_step"], second  # every one read back
    assert "jit_step" not in second["writes"], second  # none compiled again
    assert second["tokens"] == first["tokens"]
    # no step program written again (small helper programs may cross the 0.1 s threshold
    # on a loaded machine in one process and not the other)
    steps = lambda names: [n for n in names if n.startswith("jit_step-")]
    assert steps(entries(default)) == steps(written)


def test_env_directory_and_off_switch(tmp_path):
    elsewhere = tmp_path / "elsewhere"
    out = run(tmp_path, JRL_COMPILATION_CACHE=str(elsewhere))
    assert out["dir"] == str(elsewhere) and any(n.startswith("jit_step-") for n in entries(elsewhere))

    off = run(tmp_path, JRL_COMPILATION_CACHE="off")
    assert off["dir"] is None and not off["writes"] and not off["hits"]
    assert not (tmp_path / "home" / ".cache").exists()


def test_a_directory_configured_through_jax_is_kept(tmp_path):
    theirs = tmp_path / "theirs"
    out = run(tmp_path, JAX_COMPILATION_CACHE_DIR=str(theirs), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
    assert out["dir"] == str(theirs)
    assert not (tmp_path / "home" / ".cache").exists()
    # JAX's own settings stay: with a 0 s threshold even the tiny eager programs are written
    assert len(out["writes"]) > 1 and entries(theirs)


@pytest.mark.parametrize("value", ["off", "OFF", "0", "false", "none", " no "])
def test_off_values(value):
    assert default_cache_dir({"JRL_COMPILATION_CACHE": value, "HOME": "/h"}) is None


def test_default_dir_resolution():
    version = f"jax-{jax.__version__}"
    assert default_cache_dir({"HOME": "/h"}) == f"/h/.cache/jrl/{version}"
    assert default_cache_dir({"HOME": "/h", "XDG_CACHE_HOME": "/x"}) == f"/x/jrl/{version}"
    assert default_cache_dir({"HOME": "/h", "JRL_COMPILATION_CACHE": "/c/d"}) == "/c/d"
    assert default_cache_dir({"HOME": "/h", "JRL_COMPILATION_CACHE": ""}) == f"/h/.cache/jrl/{version}"


def test_an_unwritable_directory_turns_the_cache_off(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    out = run(tmp_path, JRL_COMPILATION_CACHE=str(blocked / "cache"))
    assert out["dir"] is None and not out["writes"] and not out["hits"]


def test_processes_filling_one_directory_at_once(tmp_path):
    # pytest-xdist workers share the default directory: JAX locks it (jrl sets a size
    # limit, which turns the lock on), so no process reads a half-written entry.
    procs = [start(tmp_path) for _ in range(2)]
    outs = [result(p) for p in procs]
    for out, stderr in outs:
        assert "persistent compilation cache" not in stderr.lower(), stderr[-4000:]
    assert outs[0][0]["tokens"] == outs[1][0]["tokens"]
    assert entries(tmp_path / "home" / ".cache" / "jrl" / f"jax-{jax.__version__}")


@pytest.mark.parametrize("value", ["on", "ON", "1", "true", " yes "])
def test_on_values_mean_the_default_directory(value):
    # JRL_COMPILATION_CACHE=1 meant "on", not a directory named "1" in the working directory
    version = f"jax-{jax.__version__}"
    assert default_cache_dir({"JRL_COMPILATION_CACHE": value, "HOME": "/h"}) == f"/h/.cache/jrl/{version}"


def test_a_relative_directory_stays_where_it_was_when_the_cwd_changes(tmp_path):
    # JAX resolves its cache directory at every read and write: a relative one moved with
    # os.chdir, splitting the cache between directories
    (tmp_path / "elsewhere").mkdir()
    script = ("import os, jax\n"
              "jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)\n"
              "from jrl.compile_cache import enable_compilation_cache\n"
              "print(enable_compilation_cache())\n"
              "jax.jit(lambda x: x + 1)(1)\n"
              "os.chdir('elsewhere')\n"
              "jax.jit(lambda x: x * 3)(1)\n")
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    environ.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JRL_COMPILATION_CACHE="rel/cache")
    out = subprocess.run([sys.executable, "-c", script], env=environ, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == [str(tmp_path / "rel" / "cache")]
    assert sum(n.startswith("jit__lambda-") for n in entries(tmp_path / "rel" / "cache")) == 2
    assert not (tmp_path / "elsewhere" / "rel").exists()


# A program slow enough to be written (threshold 0) and its result, printed
SMALL = r"""
import jax, jax.numpy as jnp
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from jrl.compile_cache import enable_compilation_cache
enable_compilation_cache()
print(jax.jit(lambda x: jnp.sin(x) @ x)(jnp.eye(4)).sum())
"""


def run_small(tmp_path: Path, cache: Path) -> tuple[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    environ.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JRL_COMPILATION_CACHE=str(cache))
    out = subprocess.run([sys.executable, "-c", SMALL], env=environ, cwd=tmp_path, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout, out.stderr


def test_a_truncated_entry_is_replaced_by_the_next_process_that_compiles_it(tmp_path):
    # a process killed (or a disk filled) while JAX wrote an entry leaves it cut short; JAX
    # never writes over an existing entry, so every later process warned and compiled again
    cache = tmp_path / "cache"
    first, _ = run_small(tmp_path, cache)
    [entry] = [cache / n for n in entries(cache) if n.startswith("jit__lambda-")]
    whole = entry.read_bytes()
    entry.write_bytes(whole[:len(whole) // 2])
    second, stderr = run_small(tmp_path, cache)
    assert second == first
    assert f"replaced the unreadable entry {entry}" in stderr, stderr[-4000:]
    assert entry.read_bytes() == whole
    third, stderr = run_small(tmp_path, cache)
    assert third == first and "compilation cache" not in stderr, stderr[-4000:]


def test_a_directory_of_an_unknown_user_turns_the_cache_off_with_a_warning(tmp_path):
    # Path.expanduser raised "RuntimeError: Could not determine home directory." out of
    # Engine(), naming neither the setting nor its value
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    environ.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", JRL_COMPILATION_CACHE="~no-such-user-jrl/cache")
    out = subprocess.run([sys.executable, "-c", "from jrl.compile_cache import enable_compilation_cache as e; "
                          "print(e())"], env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.split() == ["None"]
    assert ("persistent compilation cache off: cannot expand ~ in '~no-such-user-jrl/cache' (no such user, "
            "or no home directory)") in out.stderr, out.stderr
    assert not list(tmp_path.iterdir())


def test_an_unexpandable_path_after_a_directory_turns_the_cache_off(tmp_path):
    # the warning said off, but the first call's directory stayed in JAX's config, where the
    # next call took it for one configured through JAX: the cache stayed on
    environ = {k: v for k, v in os.environ.items() if not k.startswith("JAX_") and k != "JRL_COMPILATION_CACHE"}
    environ.update(PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", HOME=str(tmp_path / "home"))
    out = subprocess.run([sys.executable, "-c", "import jax; from jrl.compile_cache import enable_compilation_cache "
                          f"as e; e({str(tmp_path / 'first')!r}); e('~no-such-user-jrl/cache'); "
                          "print(e(), jax.config.jax_compilation_cache_dir)"],
                         env=environ, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-4000:]
    assert "persistent compilation cache off: cannot expand ~" in out.stderr, out.stderr
    assert out.stdout.split() == ["None", "None"]
