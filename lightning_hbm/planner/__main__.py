"""``python -m lightning_hbm.planner [options]``: the same as ``lightning-hbm plan [options]``.

Example::

    python -m lightning_hbm.planner -c examples/qlora.yaml --budget 24GiB
"""

import sys

from lightning_hbm.cli import main

if __name__ == "__main__":
    sys.exit(main(["plan", *sys.argv[1:]]))
