"""A checkpointed block's recompute sees the state its forward saw: the buffers a training forward changes in place.

Two kinds of layer change buffers in a training forward. BatchNorm updates its running statistics (``running_mean``,
``running_var``, ``num_batches_tracked``; InstanceNorm too with ``track_running_stats=True``); spectral_norm computes
its weight by one step of a power iteration that updates its buffers ``_u``, ``_v``. Recomputed in the backward, the
block did it a second time: BatchNorm's momentum was applied twice per step (a two-block Conv-BN LoRA net, 4 steps:
``num_batches_tracked`` 8 instead of 4, ``running_var`` 0.18 away from the run without checkpointing, so the eval-mode
model differed), and spectral_norm's recompute divided by another estimate of the largest singular value than its
forward (the gradients were not those of the loss computed: adapters up to 0.015 apart after 4 AdamW steps at lr
1e-2). Here the recompute starts from the values the forward started from (of the buffers it reads: a norm's
statistics are only updated in training), and the values the forward left are put back after it: the run is the one
without checkpointing, bit for bit (``tests/activations/test_replay.py``,
``tests/adapters/lora/test_merge_parametrized.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from lightning_hbm._compat import torch as torch_compat


class ForwardState:
    """The buffers of ``block`` that its training forward changes, those it also reads as the forward is about to
    find them (none: nothing is copied)."""

    def __init__(self, block: nn.Module) -> None:
        # Looked up at each forward, not kept from the last one: a move to another device or dtype replaces the
        # buffers, and a block can gain a BatchNorm through ``Sequential.insert``, which no registration hook sees.
        found = torch_compat.training_buffers(block)
        self.buffers = [*found.read, *found.updated]
        # Only what the forward reads is copied here: a BatchNorm in training normalizes by the batch's statistics,
        # so its recompute needs no restart, only its second update undone (half the copies: the replay's own time
        # inside an EfficientNet-B0's CPU step, 144 buffers, went from 1.8-2.0 % to 1.2-1.3 %, benchmarks/README.md).
        self.read = found.read
        with torch.no_grad():
            self.before = [b.clone() for b in self.read]

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        """Around a call of the block: the recompute (``recompute``) runs from the forward's starting values of what
        it reads, and the values the forward left are put back after it."""
        if not recompute or not self.buffers:
            yield
            return
        # outside the recompute's dispatch modes: the selective policy's would find copies its forward never made
        with torch_compat.dispatch_modes_off(), torch.no_grad():
            after = [b.clone() for b in self.buffers]
            for buffer, value in zip(self.read, self.before):
                buffer.copy_(value)
        try:
            yield
        finally:
            with torch_compat.dispatch_modes_off(), torch.no_grad():
                for buffer, value in zip(self.buffers, after):
                    buffer.copy_(value)


__all__ = ["ForwardState"]
