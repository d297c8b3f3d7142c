"""The fit-start accuracy check (``precision/accuracy.py``) attacked from outside, session 26: a forward that hands
back its input beside its output (``(x, features)``) was measured with the input in the figure: the same whatever the
quantization, it raised the cosine (0.9919 where the features alone measure 0.9899)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision import accuracy

X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


class ConvNet(nn.Module):
    """Two convolutions around a BatchNorm with a trained network's statistics; ``(x, features)`` or the features."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)
        with torch.no_grad():
            self.bn.running_mean.normal_(0, 0.5)
            self.bn.running_var.uniform_(0.05, 0.2)

    def forward(self, x: torch.Tensor) -> Any:
        features = self.c2(torch.relu(self.bn(self.c1(x))))
        return (x, features) if self.kind == "input-first" else features


def _measured(kind: str) -> float:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.convert_module(ConvNet(kind))
    measured = plugin.quantization.conv_accuracy
    assert measured is not None
    return measured.cosine


def test_an_input_handed_back_is_left_out_of_the_figure() -> None:
    assert _measured("input-first") == _measured("features")


def test_echoes_are_the_inputs_handed_back_unchanged() -> None:
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    echoes = accuracy.echoes
    assert echoes((x.clone(), y, {"a": x + 0, "b": x * 2}), ((x,), {})) == [0, 2]
    assert echoes(y, ((x,), {})) == [] and echoes((x.long(), x), ((x,), {})) == [0]  # floating positions only
