"""A checkpointed block's recompute sees the state its forward saw: the buffers of its parametrizations.

spectral_norm computes its weight in training mode by one step of a power iteration that updates its buffers ``_u``,
``_v`` in place. Recomputed in the backward, the block ran that step a second time: the recompute divided by another
estimate of the largest singular value than the forward did (the gradients were not those of the loss computed), and
the estimate moved two steps per training step. Measured: LoRA on a two-block spectral_norm model, 4 AdamW steps at
lr 1e-2, adapters up to 0.015 apart with and without checkpointing (0 for a parametrization without state). Here the
recompute starts from the values the forward started from and leaves the values the forward left: the run is the
one without checkpointing, bit for bit (``tests/adapters/lora/test_merge_parametrized.py``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


class ForwardState:
    """The parametrization buffers of ``block`` as its forward is about to find them (none: nothing is copied)."""

    def __init__(self, block: nn.Module) -> None:
        # looked up at each forward: a move to another device replaces the buffers
        self.buffers = [b for m in block.modules() if isinstance(m, torch.nn.utils.parametrize.ParametrizationList) for b in m.buffers()]
        self.before = [b.detach().clone() for b in self.buffers]

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        """Around a call of the block: the recompute (``recompute``) runs from the forward's starting values, and the
        values the forward left are put back after it."""
        if not recompute or not self.buffers:
            yield
            return
        after = [b.detach().clone() for b in self.buffers]
        with torch.no_grad():
            for buffer, value in zip(self.buffers, self.before):
                buffer.copy_(value)
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, value in zip(self.buffers, after):
                    buffer.copy_(value)


__all__ = ["ForwardState"]
