"""LoRA dequantizes no quantized convolution needlessly (issue 53, session 29: planner speed).

A quantized convolution's ``weight`` property dequantizes a new tensor at each read. The tied-weight check of
``target_modules="all-linear"`` read it once per layer, three times per planner trace (about 2.4 s of a 28 s profiled
plan of a tiny MobileViT); it now looks up the registered parameter, which such a layer does not have.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA
from lightning_hbm.adapters.lora.config import LoRAConfig
from lightning_hbm.adapters.lora.targets import select
from lightning_hbm.layers import QuantizedConv2d
from lightning_hbm.precision import quantize_model


def counted(calls: list[int], dequantize: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        calls.append(1)
        return dequantize(*args, **kwargs)

    return run


@pytest.mark.slow  # ~1.4 s on the 2-core dev machine (the first quantization)
def test_all_linear_selection_dequantizes_no_convolution_and_still_finds_tied_weights() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(64, 64, 3), nn.Conv2d(64, 64, 1), nn.Flatten(), nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 10))
    model[4].weight = model[3].weight  # tied: left out of the targets
    quantize_model(model, "nf4", dtype="float32", ignore_modules=["3", "4"])
    calls: list[int] = []
    convs = [m for m in model.modules() if isinstance(m, QuantizedConv2d)]
    assert len(convs) == 2
    for conv in convs:
        conv._dequantize = counted(calls, conv._dequantize)
    assert convs[0].weight.shape == (64, 64, 3, 3) and calls == [1]  # the property itself still dequantizes
    calls.clear()
    selection = select(model, LoRAConfig(r=8, alpha=16), [])
    assert calls == [] and selection.targets == ["0", "1", "5"], (calls, selection.targets)


@pytest.mark.slow
def test_peft_building_the_adapters_dequantizes_each_convolution_once() -> None:
    """peft read each quantized convolution's weight ~10 times while building its adapter (a dequantize each, ~2 s of
    the MobileViT plan); inside LoRA's injection a repeated read returns the last read's tensor: one dequantize per
    layer, and the adapted model computes what the quantized one did (lora_B starts at zero)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(16, 64, 3), nn.Conv2d(64, 64, 1), nn.Conv2d(64, 32, 1))
    quantize_model(model, "nf4", dtype="float32")
    x = torch.randn(2, 16, 6, 6)
    want = model(x)
    calls: list[int] = []
    convs = [m for m in model.modules() if isinstance(m, QuantizedConv2d)]
    for conv in convs:
        conv._dequantize = counted(calls, conv._dequantize)
    LoRA(r=8, alpha=16).transform_model(model)
    assert len(calls) == len(convs) == 3, len(calls)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    calls.clear()
    assert convs[0].weight is not convs[0].weight and len(calls) == 2  # outside the injection: a new tensor per read
