"""torch's internals that lightning_hbm relies on (torch 2.13; ``tests/_compat/test_torch.py`` checks each)."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import _disable_current_modes  # planner.realvalues, planner.tracing


def forward_override(module: nn.Module) -> Optional[Callable[..., Any]]:
    """The ``forward`` set on this instance by :func:`override_forward` (``None``: the class's own)."""
    return module.__dict__.get("forward")


def override_forward(module: nn.Module, forward: Optional[Callable[..., Any]]) -> None:
    """Give one module instance another ``forward`` (``None``: back to its class's).

    ``nn.Module.__call__`` calls ``self.forward``: an instance attribute shadows the class's method and the
    module's hooks still run. torch has no public per-instance forward replacement.
    """
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def record_memory_history(**kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history``: the allocator trace behind ``memory_viz`` (no public name)."""
    torch.cuda.memory._record_memory_history(**kwargs)


def dump_memory_snapshot(path: str) -> None:
    """``torch.cuda.memory._dump_snapshot``: write the recorded trace (a pickle ``memory_viz`` reads)."""
    torch.cuda.memory._dump_snapshot(path)


def load_state_dict_pre_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The callables registered with ``register_load_state_dict_pre_hook`` (torch lists them nowhere public;
    it keeps each in a ``_WrappedHook`` whose ``hook`` is the callable)."""
    return [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]
