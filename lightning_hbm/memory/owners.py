"""Who owns a storage: the tensors a module and its optimizers hold, one function per owner.

The ``category`` terms of :data:`lightning_hbm.memory.terms.TERMS` name these functions as their ``owns`` (how the
term is measured); :func:`lightning_hbm.memory.categories.owned_tensors` iterates the registry, so a category's
owner is stated once, in its entry.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Union

import torch
from torch import nn
from torch.optim import Optimizer

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.memory.storage import module_parameter_tensors, nested_tensors

Optimizers = Union[Optimizer, Iterable[Optimizer]]


def parameter_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors of the **parameters** category: parameters plus their quantization constants."""
    return module_parameter_tensors(module)


def gradient_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Tensors of the **gradients** category: every ``.grad`` that exists."""
    return [p.grad for p in module.parameters() if p.grad is not None]


def optimizer_state_tensors(optimizers: Optimizers) -> list[torch.Tensor]:
    """Tensors of the **optimizer_states** category: everything in ``optimizer.state``."""
    if isinstance(optimizers, Optimizer):
        optimizers = [optimizers]
    tensors: list[torch.Tensor] = []
    for optimizer in optimizers:
        # LightningOptimizer wraps the real one; .state is forwarded, but be explicit.
        optimizer = lightning_compat.unwrap_optimizer(optimizer)
        for state in optimizer.state.values():
            tensors.extend(nested_tensors(state))
    return tensors


def buffer_tensors(module: nn.Module) -> list[torch.Tensor]:
    """Module buffers: counted in **other** (not trained, not parameters)."""
    return list(module.buffers())


__all__ = ["Optimizers", "buffer_tensors", "gradient_tensors", "optimizer_state_tensors", "parameter_tensors"]
