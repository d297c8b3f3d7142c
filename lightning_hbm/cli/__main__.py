"""``python -m lightning_hbm.cli``: the ``lightning-hbm`` console script."""

import sys

from lightning_hbm.cli import main

if __name__ == "__main__":  # guarded: import_all_classes imports every module of the package
    sys.exit(main())
