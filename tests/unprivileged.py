"""Running a test's subprocess under file permissions, root's included."""

from __future__ import annotations

import os
import shutil

import pytest


def unprivileged_prefix(what: str) -> list[str]:
    """A command prefix under which file permissions bind the process: none for a normal
    user; for root, setpriv dropping the capabilities that pass them (DAC override and
    read-search). Without setpriv root cannot give them up, so the test is skipped: `what`
    (e.g. "reads a mode-000 file") is what root would do instead of failing."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip(f"root {what}, and without setpriv (util-linux) it cannot give that up: no permission error "
                    "to provoke")
    return ["setpriv", "--bounding-set", "-dac_override,-dac_read_search", "--"]
