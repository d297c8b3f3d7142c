"""The offload hooks of ``ActivationCheckpointing(offload=...)`` as the planner traces them.

Planned for a CUDA device, the host copies are fake tensors on the meta device (:class:`_HostOffload`): the tracker
does not count them as device memory, and their host bytes are what the run's pinned pieces take. The first ``count``
checkpointed blocks offload their inputs in a traced step, the rest keep them (:func:`_offload_first`).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn

from lightning_hbm.activations import OffloadSavedTensors, host_footprint
from lightning_hbm.activations.recompute import check_offload_blocks
from lightning_hbm.record import checkpoint_setup


class _HostOffload(OffloadSavedTensors):
    """``OffloadSavedTensors`` planned for a CUDA device: the host copies are fake tensors on the meta device, which
    the tracker does not count as device memory; their host bytes are what the run's pinned pieces take (:func:`host_footprint`). Everything the
    hooks keep on the device (the tensor in flight, the restored and prefetched inputs) is traced as it runs."""

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    def __init__(self, device: Union[str, torch.device]) -> None:
        super().__init__(device)
        self.sizes: list[int] = []  # bytes of each tensor moved, before the pinned rounding (max_context's host fit)

    def reset_counts(self) -> None:
        super().reset_counts()
        self.sizes = []

    def _footprint(self, tensor: torch.Tensor) -> int:
        self.sizes.append(tensor.numel() * tensor.element_size())
        return host_footprint(tensor)


def _offload_to_host(module: nn.Module) -> list[OffloadSavedTensors]:
    """Replace the offload hooks of every checkpointed block whose target is host memory by :class:`_HostOffload`
    (one per original hooks object, shared as the original was); returns them."""
    replaced: dict[int, OffloadSavedTensors] = {}
    for block in module.modules():
        setup = checkpoint_setup(block)
        offload = getattr(setup, "offload", None)
        if isinstance(offload, OffloadSavedTensors) and offload.device.type == "cpu":
            if id(offload) not in replaced:
                replaced[id(offload)] = _HostOffload(offload.device)
            setup.offload = replaced[id(offload)]  # type: ignore[union-attr]  # a _BlockSetup, found by its offload
    return list(replaced.values())


def _offload_first(module: nn.Module, count: Optional[int]) -> tuple[int, Optional[tuple[nn.Module, nn.Module]]]:
    """Make the first ``count`` checkpointed blocks with offload hooks offload their inputs, the rest keep them (None:
    every one). Returns how many offload, and (the last that offloads, the first that keeps) when both kinds run.
    Raises ``ValueError`` (the callback's own) for more than there are."""
    blocks = [(block, setup) for block in module.modules() for setup in [checkpoint_setup(block)]
              if setup is not None and getattr(setup, "offload", None) is not None]
    check_offload_blocks(count, len(blocks))
    moved = len(blocks) if count is None else count
    for index, (_, setup) in enumerate(blocks):
        setup.moves = index < moved
    return moved, (blocks[moved - 1][0], blocks[moved][0]) if 0 < moved < len(blocks) else None
