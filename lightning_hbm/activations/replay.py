"""A checkpointed block's recompute sees the state its forward saw: the buffers a training forward changes in place.

Two kinds of layer change buffers in a training forward. BatchNorm updates its running statistics
(``running_mean``, ``running_var``, ``num_batches_tracked``); spectral_norm computes its weight by one step of a
power iteration that updates its buffers ``_u``, ``_v``. Recomputed in the backward, the block did it a second time:
BatchNorm's momentum was applied twice per step (a two-block Conv-BN LoRA net, 4 steps: ``num_batches_tracked`` 8
instead of 4, ``running_var`` 0.18 away from the run without checkpointing, so the eval-mode model differed), and
spectral_norm's recompute divided by another estimate of the largest singular value than its forward (the gradients
were not those of the loss computed: adapters up to 0.015 apart after 4 AdamW steps at lr 1e-2). Here the recompute
starts from the values the forward started from, and the values the forward left are put back after it: the run is
the one without checkpointing, bit for bit (``tests/activations/test_replay.py``,
``tests/adapters/lora/test_merge_parametrized.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_hbm._compat import _disable_current_modes
from lightning_hbm._compat import torch as torch_compat


class ForwardState:
    """The buffers of ``block`` that its training forward changes, as the forward is about to find them (none:
    nothing is copied)."""

    def __init__(self, block: nn.Module) -> None:
        # looked up at each forward: a move to another device replaces the buffers
        self.buffers = torch_compat.buffers_changed_in_training(block)
        self.before = [b.detach().clone() for b in self.buffers]

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        """Around a call of the block: the recompute (``recompute``) runs from the forward's starting values, and the
        values the forward left are put back after it."""
        if not recompute or not self.buffers:
            yield
            return
        # outside the recompute's dispatch modes: the selective policy's would find copies its forward never made
        with _disable_current_modes(), torch.no_grad():
            after = [b.detach().clone() for b in self.buffers]
            for buffer, value in zip(self.buffers, self.before):
                buffer.copy_(value)
        try:
            yield
        finally:
            with _disable_current_modes(), torch.no_grad():
                for buffer, value in zip(self.buffers, after):
                    buffer.copy_(value)


__all__ = ["ForwardState"]
