"""lightning_hbm's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml).

Lightning loads and calls it in every ``Trainer.__init__`` once lightning_hbm is installed, whether that Trainer uses
lightning_hbm or not, and an exception from the load or the call stops the Trainer. So it is a top-level module of
its own, importing nothing but the standard library: a broken lightning_hbm (a missing file, a failing dependency) or
an older checkout first on ``sys.path`` never runs here, and a plain Trainer in a process that never imported
lightning_hbm costs one dictionary lookup (issue 55: either made every plain ``Trainer()`` fail).
"""

from __future__ import annotations

import sys
import warnings
from typing import Any


def plugin_callbacks() -> list[Any]:
    """``[PluginAttach()]`` for a Trainer built with a lightning_hbm precision plugin and no lightning_hbm callback
    (:func:`lightning_hbm.surgery.plugin_callbacks`: it finds the Trainer on the call stack), else ``[]``.

    Never raises: a failure is one warning, and the Trainer goes on without the callback.
    """
    surgery = sys.modules.get("lightning_hbm.surgery")
    if surgery is None:  # no lightning_hbm precision plugin exists before the surgery is imported: nothing to add
        return []
    try:
        return list(surgery.plugin_callbacks())
    except Exception as err:  # noqa: BLE001 - any failure: the Trainer goes on without our checks, and says so
        warnings.warn(
            f"lightning_hbm: its Trainer callbacks factory failed ({type(err).__name__}: {err}); this Trainer gets no "
            f"lightning_hbm callback from it (lightning_hbm imported from {getattr(surgery, '__file__', '?')}). "
            "Reinstall lightning_hbm (pip install -e .), or remove a stale copy of it from sys.path.",
            UserWarning,
            stacklevel=2,
        )
        return []
