"""A Linear or convolution subclass whose forward takes more than the input is its own layer, kept (session 31).

Was: the check "does this subclass compute the plain layer's product?" called it on one input tensor, and a forward
that takes more (``forward(x, scale)``: diffusers-style scaled layers) raised its ``TypeError`` out of the surgery:
``QuantizedPrecision`` refused the whole model instead of leaving that one layer wide with its reason.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers import weight_readers


class ScaledConv(nn.Conv2d):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


class ScaledLinear(nn.Linear):
    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x) * scale


class Model(nn.Module):
    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.conv = conv
        self.own: nn.Module = ScaledConv(8, 16, 3) if conv else ScaledLinear(8, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.own(x, 2.0)
        return self.head(h.mean((2, 3)) if self.conv else h)


@pytest.mark.parametrize("conv", [True, False], ids=["conv", "linear"])
def test_a_subclass_whose_forward_takes_more_is_kept_wide_and_the_rest_quantized(conv: bool) -> None:
    model = Model(conv)
    x = torch.randn(2, 8, 6, 6) if conv else torch.randn(2, 8)
    base = "Conv2d" if conv else "Linear"
    assert weight_readers(model)["own"] == f"{type(model.own).__name__}.forward (an nn.{base} subclass with its own forward)"  # was: TypeError
    QuantizedPrecision("int8", dtype="float32").convert_module(model)
    assert type(model.own) in (ScaledConv, ScaledLinear) and type(model.head) is not nn.Linear  # the head quantized
    assert model(x).shape == (2, 4)


class SameProduct(nn.Linear):
    """FalconLinear's way: the plain product computed in its own forward (an ordinary Linear)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T + self.bias


def test_the_check_does_not_call_the_users_hooks_on_the_layer() -> None:
    model = nn.Sequential(SameProduct(8, 16), nn.Linear(16, 4))
    seen: list[torch.Tensor] = []
    model[0].register_forward_hook(lambda module, args, output: seen.append(args[0]))  # e.g. an activation recorder
    assert "0" not in weight_readers(model)  # the same product: an ordinary Linear
    assert seen == []  # was: one call with the check's made-up input
