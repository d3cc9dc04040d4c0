"""`python -m jrl.train`: the entry point; the program is `jrl.launch` (it sits above
jrl.train and jrl.rl, so this package's library modules never import jrl.rl)."""

import sys

from jrl.launch import main

if __name__ == "__main__":
    sys.exit(main())
