"""lightning_hbm's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml). Lightning calls it in every
``Trainer.__init__`` once lightning_hbm is installed, whether the Trainer uses lightning_hbm or not: it stays light
(no import of the rest of lightning_hbm) and adds nothing to a Trainer without a lightning_hbm precision plugin."""

from __future__ import annotations

import importlib
import sys
import warnings
from typing import Any


def plugin_callbacks() -> list[Any]:
    """``[PluginAttach()]`` for a Trainer built with a lightning_hbm precision plugin and no lightning_hbm callback
    (:class:`lightning_hbm.surgery.PluginAttach`: the checkpoint checks before Lightning restores), else ``[]``.

    Never raises: Lightning calls this for every Trainer, so a broken or mismatched lightning_hbm (an older checkout
    first on ``sys.path``) must not stop a Trainer that does not use it. A failure is one warning.
    """
    if "lightning_hbm.surgery" not in sys.modules:  # no lightning_hbm plugin exists without the surgery imported
        return []
    try:
        return list(importlib.import_module("lightning_hbm.surgery").plugin_callbacks())  # imported already: free
    except Exception as err:  # noqa: BLE001 - any failure: the Trainer goes on without our checks, and says so
        warnings.warn(
            f"lightning_hbm: its Trainer callbacks factory failed ({type(err).__name__}: {err}); this Trainer gets no "
            "lightning_hbm callback from it. Reinstall lightning_hbm (pip install -e .) or remove the stale copy from "
            "sys.path.",
            UserWarning,
            stacklevel=2,
        )
        return []
