"""Blocks held as plain children of a module whose forward runs them in order are blocks (issue 53, session 38).

Was: timm RegNetX-200MF (``RegStage`` holds its blocks as plain children ``b1..bN`` and loops over
``self.children()``) made ``ActivationCheckpointing()`` raise "found no repeated blocks", so the default recipe refused
a healthy model. Only a forward read as a loop over the children, or one ``x = self.<child>(x)`` per child in order, is
taken: anything else between or around them stays unchecked.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.planner.block_cuts import _block_list


def block() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 8), nn.GELU())


class LoopStage(nn.Module):  # timm's RegStage: b1..bN added with add_module, a loop over self.children()
    def __init__(self, depth: int) -> None:
        super().__init__()
        for i in range(depth):
            self.add_module(f"b{i + 1}", block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.children():
            x = layer(x)
        return x


class CallStage(nn.Module):  # one statement per child, in order
    def __init__(self) -> None:
        super().__init__()
        self.b1, self.b2, self.b3 = block(), block(), block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b1(x)
        x = self.b2(x)
        x = self.b3(x)
        return x


class ShuffledStage(CallStage):  # runs them out of their order
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.b2(x)
        x = self.b1(x)
        x = self.b3(x)
        return x


class SkipStage(CallStage):  # one expression with a skip connection: not a run of blocks
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b3(self.b2(self.b1(x)))


class Net(nn.Module):
    def __init__(self, stage: type = LoopStage) -> None:
        super().__init__()
        self.stem = nn.Linear(4, 8)
        self.s1 = LoopStage(1) if stage is LoopStage else stage()
        self.s2 = LoopStage(4) if stage is LoopStage else stage()
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.s2(self.s1(self.stem(x))))


def test_plain_children_run_in_a_loop_are_the_blocks_and_checkpoint_to_the_same_gradients() -> None:
    torch.manual_seed(0)
    net = Net()
    # s1 holds one block: the same level as its sibling's (RegNetX-200MF's s1.b1, s2.b1)
    assert [n for n, _ in find_blocks(net)] == ["s1.b1", "s2.b1", "s2.b2", "s2.b3", "s2.b4"]
    ref, x = copy.deepcopy(net), torch.randn(3, 4)
    callback = ActivationCheckpointing()
    callback.transform_model(net)  # was: ValueError "found no repeated blocks"
    assert callback.checkpointed == ["s1.b1", "s2.b1", "s2.b2", "s2.b3", "s2.b4"]
    net(x).square().sum().backward()
    ref(x).square().sum().backward()
    for (name, p), q in zip(net.named_parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad), name
    # the planner traces such a stage whole (its blocks cannot be sliced off a plain module)
    assert _block_list(Net()) == ("", 0)


def test_one_call_per_child_in_order_is_a_run_and_anything_else_is_not() -> None:
    assert [n for n, _ in find_blocks(Net(CallStage))] == [f"s{s}.b{b}" for s in (1, 2) for b in (1, 2, 3)]
    for stage in (ShuffledStage, SkipStage):
        assert find_blocks(Net(stage)) == []
        with pytest.raises(ValueError, match="found no repeated blocks"):
            ActivationCheckpointing().transform_model(Net(stage))


def test_timm_regnet_trains_under_the_default_blocks() -> None:
    try:
        import timm  # noqa: PLC0415
    except Exception as err:  # absent, or its torchvision without the nms op
        pytest.skip(f"timm not importable: {err}")
    model = timm.create_model("regnetx_002", num_classes=4)
    names = [n for n, _ in find_blocks(model)]
    assert names[:3] == ["s1.b1", "s2.b1", "s3.b1"] and len(names) == 13
