"""The rollout engine under tensor parallelism, on 8 simulated CPU devices.

A JAX process fixes its device count at first use, so the cases
(tests/parallel_cases/rollout_cases.py) run in a fresh `python -m pytest` started with
`XLA_FLAGS=--xla_force_host_platform_device_count=8`, like tests/test_parallel.py's.
"""

from __future__ import annotations

import subprocess
import sys

from test_parallel import CASES, REPO, cpu_env


def test_engine_cases_on_eight_simulated_devices(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}",
         str(CASES / "rollout_cases.py")],
        cwd=REPO, env=cpu_env(8, tmp_path / "jax_cache"), capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, f"rollout_cases.py failed:\n{result.stdout[-12000:]}\n{result.stderr[-4000:]}"
