"""lightning_hbm's ``lightning.pytorch.callbacks_factory`` entry point (pyproject.toml).

Lightning loads and calls it in every ``Trainer.__init__`` once lightning_hbm is installed, whether that Trainer uses
lightning_hbm or not, and an exception from the load or the call stops the Trainer. So it is a top-level module of
its own, importing nothing but the standard library: a broken lightning_hbm (a missing file, a failing dependency) or
an older checkout first on ``sys.path`` never runs for a Trainer without a lightning_hbm precision plugin (issue 55:
either made every plain ``Trainer()`` fail).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import FrameType
from typing import Any, Optional


def plugin_callbacks() -> list[Any]:
    """``[PluginAttach()]`` for a Trainer built with a lightning_hbm precision plugin and no lightning_hbm callback
    (:func:`lightning_hbm.surgery.plugin_callbacks`), else ``[]``.

    Never raises: a failure is one warning, and the Trainer goes on without the callback. A Trainer whose precision
    plugin is not lightning_hbm's runs nothing of the package.
    """
    try:
        if not _is_ours(_precision_plugin_being_built()):
            return []
        surgery = importlib.import_module("lightning_hbm.surgery")  # imported already: the plugin's class needs it
        return list(surgery.plugin_callbacks())
    except Exception as err:  # noqa: BLE001 - any failure: the Trainer goes on without our checks, and says so
        where = getattr(sys.modules.get("lightning_hbm"), "__file__", "?")
        warnings.warn(
            f"lightning_hbm: its Trainer callbacks factory failed ({type(err).__name__}: {err}); this Trainer gets no "
            f"lightning_hbm callback from it (lightning_hbm imported from {where}). "
            "Reinstall lightning_hbm (pip install -e .), or remove a stale copy of it from sys.path.",
            UserWarning,
            stacklevel=2,
        )
        return []


def _precision_plugin_being_built() -> Optional[Any]:
    """The precision plugin of the Trainer whose ``__init__`` calls the factories, or ``None``.

    Lightning calls the factories without arguments (``_CallbackConnector.on_trainer_init`` ->
    ``_load_external_callbacks``) after the accelerator connector set the strategy: the connector on the call stack is
    the only way to see which Trainer asks. Matched by class name: importing Lightning here is what this module avoids.
    """
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if candidate is not None and type(candidate).__name__ == "_CallbackConnector":
            return candidate.trainer.strategy.precision_plugin
        frame = frame.f_back
    return None


def _is_ours(plugin: Any) -> bool:
    """Whether ``plugin`` is (or subclasses) a class defined in lightning_hbm."""
    return plugin is not None and any(c.__module__.split(".")[0] == "lightning_hbm" for c in type(plugin).__mro__)
