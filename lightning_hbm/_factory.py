"""The ``lightning.pytorch.callbacks_factory`` target of installs made before issue 55: their metadata names
``lightning_hbm._factory:plugin_callbacks``, and an editable install updated by ``git pull`` keeps that metadata until
``pip install -e .`` runs again. Deleting this module would make every ``Trainer()`` of such an install fail
(``ModuleNotFoundError``). It gives what the current target, the top-level ``lightning_hbm_factory``, gives."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _from_file() -> ModuleType:
    """``lightning_hbm_factory`` from its file beside this package: an install whose import mapping predates the
    module (an editable install's finder maps only the names it knew) cannot import it by name."""
    path = Path(__file__).resolve().parents[1] / "lightning_hbm_factory.py"
    spec = importlib.util.spec_from_file_location("lightning_hbm_factory", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"lightning_hbm: no callbacks factory module at {path}; reinstall lightning_hbm (pip install -e .)")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return sys.modules.setdefault("lightning_hbm_factory", module)


try:
    import lightning_hbm_factory as _target
except ImportError:
    _target = _from_file()

plugin_callbacks = _target.plugin_callbacks

__all__ = ["plugin_callbacks"]
