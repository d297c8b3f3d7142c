"""A buffer a checkpointed block creates at every training forward (a scratch slot registered as None, filled and
emptied by each forward) is noted once, not once per step (session 30 review of session 29's registration hook)."""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.activations import replay


class _Scratch(nn.Module):
    """Holds the block's input in a buffer slot for the length of its forward (a user's scratch space), then empties it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.register_buffer("held", None)

    def forward(self, x: Tensor) -> Tensor:
        self.held = x.detach() * 1
        out = torch.tanh(self.lin(x)) + 0.1 * self.held
        self.held = None
        return out


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Scratch() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_buffer_created_at_every_step_is_noted_once_and_the_gradients_are_the_plain_ones() -> None:
    # was: its name appended to the block's replayed buffers at every step (20 steps: 20 entries, each looked up at
    # every later forward: the notes and the time to read them grew without end)
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full").transform_model(model)
    for step in range(20):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for net in (reference, model):
            net.zero_grad(set_to_none=True)
            net(x).square().sum().backward()
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert ours.grad is not None and theirs.grad is not None and torch.allclose(ours.grad, theirs.grad, atol=1e-6)
    for block in model.blocks:
        assert replay._WRITTEN.get(block, []).count("held") <= 1 and block.held is None
