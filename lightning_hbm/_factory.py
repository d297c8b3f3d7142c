"""lightning_hbm's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml). Lightning calls it in every
``Trainer.__init__`` once lightning_hbm is installed, whether the Trainer uses lightning_hbm or not: it stays light
(no import of the rest of lightning_hbm) and adds nothing to a Trainer without a lightning_hbm precision plugin."""

from __future__ import annotations

import importlib
import sys
from typing import Any


def plugin_callbacks() -> list[Any]:
    """``[PluginAttach()]`` for a Trainer built with a lightning_hbm precision plugin and no lightning_hbm callback
    (:class:`lightning_hbm.surgery.PluginAttach`: the checkpoint checks before Lightning restores), else ``[]``."""
    if "lightning_hbm.surgery" not in sys.modules:  # no lightning_hbm plugin exists without the surgery imported
        return []
    return importlib.import_module("lightning_hbm.surgery").plugin_callbacks()  # imported already: costs nothing
