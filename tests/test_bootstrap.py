"""scripts/bootstrap.sh, the README's first command, makes a Python 3.12 `.venv` whichever
way 3.12 is found: on a machine whose `python3` is another version and whose 3.12 is a
pyenv version reached only through the `pyenv` command (its shims not on PATH, as in a
shell that never ran `pyenv init`) it made a venv of the other Python and said nothing; and
a `.venv` of another Python left from such a run was installed into as if it were 3.12."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PY311 = """#!/bin/sh
# a Python 3.11: fails bootstrap's version check; `-m venv DIR` makes a "venv" of itself
if [ "$1" = -m ] && [ "$2" = venv ]; then mkdir -p "$3/bin" && cp "$0" "$3/bin/python" && exit 0; fi
exit 1
"""
PYENV = f"""#!/bin/sh
# pyenv with 3.11.7 and 3.12.1 installed; `exec` runs the PYENV_VERSION's command
case "$1" in
  versions) echo 3.11.7; echo 3.12.1 ;;
  exec) [ "$PYENV_VERSION" = 3.12.1 ] && [ "$2" = python3 ] && shift 2 && exec {sys.executable} "$@"; exit 127 ;;
  *) exit 1 ;;
esac
"""


def executable(path: pathlib.Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


@pytest.fixture
def checkout(tmp_path):
    """A checkout holding only scripts/bootstrap.sh, and a PATH whose `python3` is 3.11,
    whose `python3.12` is a shim with no version selected and whose pyenv has 3.12.1."""
    (tmp_path / "repo" / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "bootstrap.sh", tmp_path / "repo" / "scripts" / "bootstrap.sh")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    executable(bin_dir / "python3", PY311)
    executable(bin_dir / "python3.12", "#!/bin/sh\necho 'pyenv: python3.12: command not found' >&2\nexit 127\n")
    executable(bin_dir / "pyenv", PYENV)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin", "PIP_NO_INDEX": "1",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    env.pop("PYENV_VERSION", None)
    return tmp_path / "repo", env


def bootstrap(repo: pathlib.Path, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(repo / "scripts" / "bootstrap.sh")], cwd=repo, env=env,
                          capture_output=True, text=True, timeout=300)


def test_bootstrap_makes_the_venv_of_pyenvs_312_without_its_shims_on_path(checkout):
    repo, env = checkout
    bootstrap(repo, env)  # installing jrl fails here (no index, no project): the venv is the point
    version = subprocess.run([str(repo / ".venv" / "bin" / "python"), "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True)
    assert version.stdout.strip() == "(3, 12)", (version.returncode, version.stdout)


def test_bootstrap_refuses_a_venv_of_another_python_naming_the_fix(checkout):
    repo, env = checkout
    (repo / ".venv" / "bin").mkdir(parents=True)
    executable(repo / ".venv" / "bin" / "python", PY311)
    result = bootstrap(repo, env)
    assert result.returncode == 1
    assert result.stderr.strip() == "bootstrap: .venv is not a Python 3.12 environment: remove it (rm -rf .venv) and run again"


def test_bootstrap_removes_a_half_made_venv_and_names_the_missing_venv_package(checkout):
    """Debian's Python without its venv package makes `.venv/bin/python` and then fails
    (no ensurepip): the half-made `.venv` then passed the next run's version check and
    failed at `pip` with "No module named pip"."""
    repo, env = checkout
    bin_dir = pathlib.Path(env["PATH"].split(":")[0])
    executable(bin_dir / "python3.12", f"""#!/bin/sh
if [ "$1" = -m ] && [ "$2" = venv ]; then
  mkdir -p "$3/bin" && ln -s {sys.executable} "$3/bin/python"
  echo "The virtual environment was not created successfully because ensurepip is not available." >&2
  exit 1
fi
exec {sys.executable} "$@"
""")
    result = bootstrap(repo, env)
    assert result.returncode == 1
    assert not (repo / ".venv").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        "bootstrap: python3.12 could not make a venv (on Debian or Ubuntu: "
        "apt install python3.12-venv), then run again")
