"""LoRA on a convolution whose own forward computes with its weight (issue 53, session 31): BiT trains with LoRA.

Was: transformers BiT's ``WeightStandardizedConv2d`` (it standardizes its weight and pads "SAME" itself) was kept as
built, rightly, and left out of LoRA's 'all-linear' (peft's convolution adapter adds an unpadded term to a padded
output), so ``LoRA()`` on BiT adapted nothing and refused the model ("selects no Linear layer"). Now such a layer is
adapted by a low-rank delta of its weight: its own forward runs on ``W + scaling * B @ A``, so the padding and the
standardization apply to the adapted weight and ``LoRA.merge`` (which adds that delta to ``W``) is the same function.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import LoRA
from lightning_hbm.precision import quantize_model
from tests.layers.test_conv_own_forward_s30 import Standardized


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Standardized(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 8, 1))


def _train(model: nn.Module, x: torch.Tensor, steps: int = 3) -> None:
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()


def test_its_weight_is_adapted_through_its_own_forward() -> None:
    model, x = net(), torch.randn(2, 3, 8, 8)
    built = copy.deepcopy(model)
    lora = LoRA(r=4)
    lora.transform_model(model)
    assert "0" in lora.adapted_modules  # was: left out ("its own forward")
    torch.testing.assert_close(model(x), built(x), rtol=0, atol=0)  # B = 0: the model as built
    model(x).pow(2).mean().backward()
    layer = model[0]
    assert layer.lora_B["default"].weight.grad.abs().sum() > 0
    _train(model, x)
    # the adapted layer is the layer's own forward (standardization, padding) on W + scaling * B @ A
    delta = layer.get_delta_weight("default")
    want = F.conv2d(x, _standardized(built[0].weight + delta), built[0].bias, 1, 1)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def _standardized(w: torch.Tensor) -> torch.Tensor:
    return (w - w.mean(dim=(1, 2, 3), keepdim=True)) / (w.std(dim=(1, 2, 3), keepdim=True) + 1e-5)


def test_merge_gives_the_function_trained() -> None:
    model, x = net(), torch.randn(2, 3, 8, 8)
    LoRA(r=4).transform_model(model)
    _train(model, x)
    merged = LoRA.merge(model, dtype="float32")
    fresh = net()
    fresh.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x), rtol=1e-5, atol=1e-5)


class Causal(nn.Conv3d):
    """diffusers Wan's ``WanCausalConv3d``: pads time on one side itself; its ``__init__`` takes no ``bias``."""

    def __init__(self, cin: int, cout: int, k: int) -> None:
        super().__init__(cin, cout, k, padding=0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(F.pad(x, (1, 1, 1, 1, 2, 0)))


def test_a_subclass_whose_init_peft_cannot_call_is_adapted() -> None:
    """Was (with such layers adapted): peft builds the adapter's convolutions as ``type(base_layer)(..., bias=False)``:
    "WanCausalConv3d.__init__() got an unexpected keyword argument 'bias'". The adapter's are plain convolutions."""
    torch.manual_seed(0)
    model, x = nn.Sequential(Causal(2, 8, 3), nn.ReLU(), nn.Conv3d(8, 4, 1)), torch.randn(2, 2, 3, 4, 4)
    built = copy.deepcopy(model)
    lora = LoRA(r=2)
    lora.transform_model(model)
    assert "0" in lora.adapted_modules and type(model[0].base_layer) is Causal
    assert type(model[0].lora_A["default"]) is nn.Conv3d
    torch.testing.assert_close(model(x), built(x), rtol=0, atol=0)
    _train(model, x)
    delta = model[0].get_delta_weight("default")
    want = F.conv3d(F.pad(x, (1, 1, 1, 1, 2, 0)), built[0].weight + delta, built[0].bias)
    torch.testing.assert_close(model[0](x), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("conv", [nn.Conv1d(4, 8, 3, dilation=3, padding=3), nn.Conv1d(4, 8, 3, padding=1, padding_mode="reflect")])
def test_a_dilated_or_reflect_padded_convolution_is_adapted_by_its_weight(conv: nn.Conv1d) -> None:
    """Was: peft's adapter term has no dilation nor padding mode: descript DAC's dilated residual convolutions stopped
    at the first step ("The size of tensor a (256) must match the size of tensor b (268)"); a reflect-padded one
    silently added a zero-padded term."""
    torch.manual_seed(0)
    model, x = nn.Sequential(conv, nn.ReLU(), nn.Conv1d(8, 2, 1)), torch.randn(2, 4, 16)
    built = copy.deepcopy(model)
    LoRA(r=2).transform_model(model)
    _train(model, x)
    delta = model[0].get_delta_weight("default")
    want = built[0]._conv_forward(x, built[0].weight + delta, built[0].bias)
    torch.testing.assert_close(model[0](x), want, rtol=1e-5, atol=1e-5)


def test_a_quantized_dilated_convolution_is_adapted_by_its_weight() -> None:
    """Under QuantizedPrecision the dilated convolution is stored in 4 bits: its delta goes onto the dequantized weight
    (was, with the weight delta first tried: "property 'weight' of 'QuantizedConv1d' object has no setter")."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Conv1d(4, 64, 3, dilation=3, padding=3), nn.ReLU(), nn.Conv1d(64, 2, 1)), torch.randn(2, 4, 16)
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=2).transform_model(model)
    _train(model, x)
    layer = model[0]
    assert type(layer.base_layer).__name__ == "QuantizedConv1d"
    want = F.conv1d(x, layer.base_layer.weight + layer.get_delta_weight("default"), layer.base_layer.bias, dilation=3, padding=3)
    torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-5)


def test_with_dropout_it_is_left_out_saying_why() -> None:
    """Dropout acts on the input, which a weight delta cannot: such a layer is left out then, as before."""
    lora = LoRA(r=4, dropout=0.1)
    lora.transform_model(net())
    assert lora.adapted_modules == ["2"]


@pytest.mark.slow
def test_bit_trains_with_lora() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.BitConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=3, layer_type="preactivation",
                                    global_padding="SAME", num_groups=4)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.BitForImageClassification(config)
    lora = LoRA(r=4, modules_to_save=["classifier"])
    lora.transform_model(model)  # was: ValueError "selects no Linear layer of BitForImageClassification"
    assert len(lora.adapted_modules) == 9 and all(re.search(r"conv|convolution", n) for n in lora.adapted_modules)
    x, labels = torch.randn(2, 3, 32, 32), torch.tensor([0, 2])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(4):
        opt.zero_grad()
        loss = model(pixel_values=x, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(float(loss))
    assert losses[-1] < losses[0], losses
    assert all(model.get_submodule(n).lora_A["default"].weight.grad.abs().sum() > 0 for n in lora.adapted_modules)
