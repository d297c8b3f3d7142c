"""LoRA's target selection reads no quantized convolution's weight (issue 53, session 29: planner speed).

A quantized convolution's ``weight`` property dequantizes a new tensor at each read. The tied-weight check of
``target_modules="all-linear"`` read it once per layer, three times per planner trace (about 2.4 s of a 28 s profiled
plan of a tiny MobileViT); it now looks up the registered parameter, which such a layer does not have.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from torch import nn

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
