import sys

from jrl.serve.cli import main

sys.exit(main(prog="python -m jrl.serve"))
