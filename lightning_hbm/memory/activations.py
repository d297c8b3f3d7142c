"""Bytes kept alive for backward by one forward: the **activations** term, measured."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from lightning_hbm.memory.categories import owned_storages
from lightning_hbm.memory.tracker import LiveStorageTracker


def saved_activation_bytes(forward: Callable[[], torch.Tensor], module: torch.nn.Module) -> int:
    """Run ``forward()`` and return the bytes its graph keeps alive for backward.

    ``forward`` returns the loss with its graph attached. The result is the sum of the distinct
    storages created during the call and still alive when it returns, minus those owned by
    ``module`` (parameters, quantization constants, gradients, buffers). Counting live storages
    rather than ``saved_tensors_hooks`` is what makes it right under activation checkpointing:
    with ``torch.utils.checkpoint`` around the blocks it reports less than without.
    The graph is freed before returning (no backward runs).

    Example::

        nbytes = saved_activation_bytes(lambda: model.loss(batch), model)
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"saved_activation_bytes needs the torch.nn.Module that runs the forward, got {type(module).__name__}.")
    if not callable(forward):
        raise TypeError(f"saved_activation_bytes needs a callable that runs the forward and returns the loss, got {forward!r}.")
    tracker = LiveStorageTracker()
    with tracker:
        loss = forward()
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"forward() must return the loss tensor (graph attached), got {type(loss).__name__}.")
    owned = owned_storages(module)
    nbytes = sum(n for key, n in tracker.live_storages().items() if key not in owned)
    del loss  # frees the graph and with it the saved tensors
    return nbytes


__all__ = ["saved_activation_bytes"]
