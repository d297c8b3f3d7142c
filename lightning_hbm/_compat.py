"""The private names of torch, Lightning and transformers that lightning_hbm relies on, gathered in one place.

Any of them may change in a minor release of its library: when one does, this is the file to fix
(``tests/test_layering.py`` fails on a private name imported from a library anywhere else). Modules under
private paths that are their library's de facto API for a feature (``torch.utils._pytree``,
``torch._subclasses.fake_tensor``, ``torch.utils._python_dispatch``, ``torch.distributed._tools``) are
imported where they are used.
"""

from __future__ import annotations

from typing import Optional

from lightning.fabric.connector import _PRECISION_INPUT_STR  # the Trainer's precision values (cli)
from lightning.fabric.utilities.init import _materialize_distributed_module  # QuantizedFSDPStrategy
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # QuantizedFSDPStrategy
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt  # planner
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from torch.utils._python_dispatch import _disable_current_modes  # planner.realvalues


def _default_gate() -> Optional[object]:
    """transformers' default expert gate function (``None`` without transformers 5's MoE integration)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    return _default_apply_gate


__all__ = [
    "_PATH",
    "_PRECISION_INPUT_STR",
    "_RICH_AVAILABLE",
    "_configure_optimizers",
    "_configure_schedulers_automatic_opt",
    "_default_gate",
    "_disable_current_modes",
    "_materialize_distributed_module",
    "_optimizers_to_device",
]
