"""`python -m jrl <command> ...`: the `jrl` console script (jrl.cli) for an environment
where the script is not on PATH (a checkout on PYTHONPATH, a venv not activated)."""

import sys

from jrl.cli import main

if __name__ == "__main__":
    sys.exit(main())
