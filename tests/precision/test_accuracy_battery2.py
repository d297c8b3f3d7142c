"""The fit-start accuracy check (``precision/accuracy.py``) attacked from outside, session 26: a forward that hands
back its input beside its output (``(x, features)``) was measured with the input in the figure: the same whatever the
quantization, it raised the cosine (0.9919 where the features alone measure 0.9899)."""

from __future__ import annotations

import warnings

import torch

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision import accuracy
from tests.test_probe_battery2 import ConvNet, X  # the same BatchNorm ConvNet, one definition


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
