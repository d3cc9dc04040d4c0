#!/usr/bin/env bash
# Creates ./.venv with Python 3.12 (through pyenv when python3.12 is not on PATH) and
# installs jrl into it. `bootstrap.sh dev` adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
is_312() { "$@" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; }
# A Python without its venv package (Debian's python3.12-venv) makes .venv/bin/python and
# then fails; the half-made .venv would pass the next run's version check, so it goes.
make_venv() {
  if ! "$@" -m venv .venv; then
    rm -rf .venv
    echo "bootstrap: python3.12 could not make a venv (on Debian or Ubuntu: apt install python3.12-venv), then run again" >&2
    exit 1
  fi
}
if [ ! -x .venv/bin/python ]; then
  if is_312 python3.12; then
    make_venv python3.12
  elif is_312 python3; then
    make_venv python3
  # (No `grep -q` in a pipeline here: it exits at the first match, pyenv can then die of
  # SIGPIPE, and under pipefail the whole test fails now and then.)
  elif command -v pyenv >/dev/null 2>&1 && v312="$(pyenv versions --bare | grep '^3\.12' | tail -n 1)" \
      && [ -n "$v312" ]; then
    # `pyenv exec`, not `python3`: without pyenv's shims on PATH (a shell that never ran
    # `pyenv init`) `python3` is the system's, and the venv would be of another Python
    PYENV_VERSION="$v312" make_venv pyenv exec python3
  else
    echo "bootstrap: Python 3.12 not found (install it, or pyenv install 3.12)" >&2
    exit 1
  fi
fi
if ! is_312 .venv/bin/python; then  # e.g. left by an earlier run that picked another Python
  echo "bootstrap: .venv is not a Python 3.12 environment: remove it (rm -rf .venv) and run again" >&2
  exit 1
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -e ".[$extras]"
else
  .venv/bin/python -m pip install -q -e .
fi
