"""Session 29 outside-style attack on the checkpoint's replay and ``regenerate=n`` (issue 53: never stop a healthy
model, nothing silent): gradients compared with the plain model's on what users' models do."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing


class _LazyNorm(nn.Module):
    """A user's norm that creates its running mean on its first training batch (``register_buffer(name, None)``, then
    assigned; or ``hasattr`` and ``register_buffer``), and updates it in place after."""

    def __init__(self, slot: bool) -> None:
        super().__init__()
        self.slot = slot
        if slot:
            self.register_buffer("mean", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                if getattr(self, "mean", None) is None:
                    self.register_buffer("mean", 0.5 * x.mean(0))
                else:
                    self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return x - self.mean


class _WarmNorm(nn.Module):
    """A user's norm whose running mean is first written after a warm-up step (its counter is written from the first)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                if int(self.steps) >= 1:
                    self.mean.mul_(0.5).add_(0.5 * x.mean(0))
                self.steps.add_(1)
        return x - self.mean


class _Block(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), norm()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class _Net(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module], blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(norm) for _ in range(blocks))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _same_steps(reference: nn.Module, model: nn.Module, steps: int, batch: Callable[[int], Any], loss: Callable[[Any], Tensor]) -> None:
    """``steps`` training steps of both (gradients set to None before each), gradients and buffers equal after each."""
    for step in range(steps):
        grads = []
        for net in (reference, model):
            net.train()
            net.zero_grad(set_to_none=True)
            loss(net(batch(step))).backward()
            grads.append([p.grad for p in net.parameters()])
        for (name, _), ours, theirs in zip(model.named_parameters(), grads[1], grads[0]):
            assert ours is not None and theirs is not None and torch.allclose(ours, theirs, rtol=0, atol=1e-6), (step, name)
        for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(ours, theirs), (step, name)


def _batch(step: int) -> Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("regenerate", [1, 2])
@pytest.mark.parametrize("slot", [True, False])
def test_a_buffer_a_block_creates_on_its_first_batch_is_replayed_exactly(slot: bool, regenerate: int) -> None:
    # the buffers a block writes were learnt on its first training forward, from those it had before it: one it
    # creates there (None or absent before) was never learnt, so the recompute found it created and updated it a
    # second time, every step, and read the updated mean: gradients 0.03-0.2 off, silently
    torch.manual_seed(0)
    reference = _Net(lambda: _LazyNorm(slot))
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    _same_steps(reference, model, 4, _batch, lambda out: out.square().sum())


@pytest.mark.parametrize("regenerate", [1, 2])
def test_a_buffer_first_written_after_a_warm_up_step_is_said_and_replayed_from_then_on(regenerate: int) -> None:
    # learnt on the first step as written by nothing: from the second step on it was updated twice per step and the
    # recompute read the updated mean (gradients 0.01 off every step), silently. Now: the step that first writes it
    # is said (its recompute reads the updated value, its statistics are not updated twice), every later one exact
    torch.manual_seed(0)
    reference = _Net(lambda: _WarmNorm(8))
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    _same_steps(reference, model, 1, _batch, lambda out: out.square().sum())
    with pytest.warns(UserWarning, match=r"_Block's training forward wrote its buffer\(s\) norm.mean for the first time"):
        for net in (reference, model):
            net(_batch(1)).square().sum().backward()
    _same_steps(reference, model, 3, lambda step: _batch(step + 2), lambda out: out.square().sum())
