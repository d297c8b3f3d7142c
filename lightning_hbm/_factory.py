"""The ``lightning.pytorch.callbacks_factory`` target of installs made before issue 55: their metadata names
``lightning_hbm._factory:plugin_callbacks``, and an editable install updated by ``git pull`` keeps that metadata until
``pip install -e .`` runs again. Deleting this module would make every ``Trainer()`` of such an install fail
(``ModuleNotFoundError``). It gives what the current target, the top-level ``_lightning_hbm_factory``, gives."""

from __future__ import annotations

import sys
from typing import Any

try:
    from _lightning_hbm_factory import plugin_callbacks
except ImportError:  # an install made before that module existed does not map it: the same lookup, here

    def plugin_callbacks() -> list[Any]:  # type: ignore[misc]  # the same signature as the import above
        """``[PluginAttach()]`` for a Trainer built with a lightning_hbm precision plugin and no lightning_hbm
        callback, else ``[]`` (:func:`lightning_hbm.surgery.plugin_callbacks`)."""
        surgery = sys.modules.get("lightning_hbm.surgery")
        return [] if surgery is None else list(surgery.plugin_callbacks())


__all__ = ["plugin_callbacks"]
