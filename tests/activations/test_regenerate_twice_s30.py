"""``regenerate=n`` with two forwards of the model in one step (a siamese or contrastive pair, DPO's chosen and
rejected answers): the first block of the second forward starts a chain of its own, fed by the input, and keeps its
input as the first forward's first block does; no warning (session 30 review: it was noted as "unmatched", fed
something else than the block called before it, the last block of the first forward, and warned to use regenerate=1)."""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return h


def _pair(step: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(4, 8, generator=g), torch.randn(4, 8, generator=g)


def test_two_forwards_in_one_step_start_two_chains_and_are_not_warned() -> None:
    torch.manual_seed(0)
    reference = _Stack()
    model = copy.deepcopy(reference)
    callback = ActivationCheckpointing("full", regenerate=2)
    callback.transform_model(model)
    for step in range(2):
        callback.remade.reset()
        chosen, rejected = _pair(step)
        for net in (reference, model):
            net.zero_grad(set_to_none=True)
            (net(chosen).square().mean() - net(rejected).square().mean()).backward()
        for ours, theirs in zip(model.parameters(), reference.parameters()):
            assert ours.grad is not None and theirs.grad is not None and torch.allclose(ours.grad, theirs.grad, rtol=0, atol=1e-6)
    assert callback.remade.unmatched == {}
    assert list(callback.remade.kept) == ["blocks.0", "blocks.2", "blocks.0 (call 2)", "blocks.2 (call 2)"]
    assert callback.remade.inputs == 4
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.warn_unremade()


def test_a_block_fed_a_blocks_output_changed_on_the_way_is_still_named() -> None:
    # the input of the second forward's first block computed from the first forward's output: not a chain's start
    torch.manual_seed(0)
    model = _Stack()
    callback = ActivationCheckpointing("full", regenerate=2)
    callback.transform_model(model)
    callback.remade.reset()
    h = model(_pair(0)[0])
    second = h * 2.0
    for block in model.blocks:
        second = block(second)
    second.sum().backward()
    assert list(callback.remade.unmatched) == ["blocks.0 (call 2)"]
