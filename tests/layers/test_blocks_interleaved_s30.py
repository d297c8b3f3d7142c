"""Blocks interleaved with leaf layers in one ``nn.Sequential`` are blocks (issue 53, session 30).

Was: diffusers ``AutoencoderTiny`` (a convolution, a block, a strided convolution, a block, ... in one Sequential) made
``ActivationCheckpointing()`` raise "found no repeated blocks", so the default recipe refused the model.
"""

from __future__ import annotations

from torch import nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.layers.blocks import find_blocks


def block() -> nn.Module:
    return nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = block()

    def forward(self, x):  # type: ignore[no-untyped-def]
        return x + self.body(x)


def test_the_repeated_composite_children_of_a_mixed_sequential_are_the_blocks() -> None:
    net = nn.Sequential(nn.Conv2d(3, 4, 3), Residual(), nn.Conv2d(4, 4, 3, stride=2), Residual(), nn.Upsample(scale_factor=2), Residual())
    assert [n for n, _ in find_blocks(net)] == ["1", "3", "5"]
    callback = ActivationCheckpointing()
    callback.transform_model(net)  # was: ValueError "found no repeated blocks"
    assert callback.checkpointed == ["1", "3", "5"]


def test_a_stack_still_wins_and_a_lone_composite_is_no_block() -> None:
    stacked = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ModuleList([Residual(), Residual()]), Residual())
    assert [n for n, _ in find_blocks(stacked)] == ["1.0", "1.1"]  # the one-class stack, as before
    assert find_blocks(nn.Sequential(nn.Conv2d(3, 4, 3), Residual(), block())) == []  # no class occurs twice
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))) == []  # leaves only
