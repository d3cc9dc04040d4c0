"""`python -m jrl.bench <stage> [flags]` (= `jrl bench ...`)."""

import sys

from jrl.bench.cli import main

sys.exit(main())
