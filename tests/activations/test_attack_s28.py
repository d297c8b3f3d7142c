"""Outside-style attack on session 27's activation code (session 28): the checkpoint's replay of buffers a block
writes in place, remade inputs (``regenerate``), the second derivative through the fed q/k/v and the offload, on
what users' runs do. Each test failed on the code before its fix."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.planner import max_context


class _RunningNorm(nn.Module):
    """A user's norm keeping a running mean with ``register_buffer``, updated in training only (as BatchNorm).

    ``warmup``: training steps before the mean is first written (its counter is written from the first; reused by
    test_attack_s29's norm started after a warm-up)."""

    def __init__(self, width: int, momentum: float = 0.1, warmup: int = 0) -> None:
        super().__init__()
        self.momentum, self.warmup = momentum, warmup
        self.register_buffer("mean", torch.zeros(width))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                if not self.warmup or int(self.steps) >= self.warmup:
                    self.mean.mul_(1 - self.momentum).add_(self.momentum * x.mean(0))
                self.steps.add_(1)
        return x - self.mean


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), _RunningNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("regenerate", [1, 2])
def test_a_gradient_in_eval_mode_first_does_not_teach_the_replay_that_nothing_is_written(regenerate: int) -> None:
    # the buffers a block writes were learnt on its first forward with gradients: in eval mode (a saliency map, a
    # gradient penalty measured before training) a norm writes none, so its statistics were then updated twice per
    # training step (steps 6 instead of 3; 9 on the block remaking the next one's input) and the recompute read
    # the updated ones (gradients 0.8 off), silently
    torch.manual_seed(0)
    reference = _Net()
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    x = torch.randn(4, 8)
    for net in (reference, model):
        net.eval()
        net(x).sum().backward()
        net.train()
        for _ in range(3):
            net(x).square().sum().backward()
    assert [int(b.norm.steps) for b in model.blocks] == [int(b.norm.steps) for b in reference.blocks] == [3, 3, 3]
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert ours.grad is not None and theirs.grad is not None and torch.equal(ours.grad, theirs.grad), name


@pytest.mark.parametrize(("options", "shown"), [({}, "host_budget=None, device='cuda'"), ({"host_budget": "64GiB", "device": "cpu"}, "host_budget='64GiB', device='cpu'")])
def test_max_context_refuses_a_max_regenerate_it_would_ignore(options: dict[str, str], shown: str) -> None:
    # remade inputs are planned only where the offloaded inputs overflow host_budget: without one (or on 'cpu', where
    # nothing is offloaded) max_regenerate=4 was ignored silently (the CLI refuses the same), now refused before any
    # model is built
    built: list[int] = []

    def factory() -> nn.Module:
        built.append(1)
        return nn.Linear(2, 2)

    with pytest.raises(ValueError, match=rf"max_context\(max_regenerate=4, {re.escape(shown)}\): .*Fix: give both, or max_regenerate=1"):
        max_context(factory, "24GiB", max_regenerate=4, **options)  # type: ignore[arg-type]
    assert not built
