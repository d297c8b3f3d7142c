"""The fit-start accuracy check of models with quantized convolutions (``precision/accuracy.py``), attacked from
outside (session 25): outputs of every shape, constant and huge outputs, overflow, forwards that draw random numbers
or change their input, real transformers and diffusers classes from small configs (no download).

Was, each a healthy model told something false or a model left unmeasured with no word:
- a constant output (diffusers' ControlNet at init: its zero convolutions give exact zeros) measured 0.0000 and
  warned; outputs past about 1e19 measured 0.0000 (float32 squares overflowed) and warned;
- ``mode="int8"`` on a model whose output has no ``logits`` (transformers' Wav2Vec2Model / ConvNextModel, diffusers'
  UNet2DModel / ControlNetModel, a dict of features) was not measured at all, silently;
- float16 computing overflowed to inf on the probe and nothing was said (the figure was NaN);
- a forward that draws noise (a diffusion training step) was measured against another draw: 0.01, warned;
- a forward that changes its input in place was measured on its twice-changed input.
"""

from __future__ import annotations

import random
import warnings
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import ConvAccuracy, centred_cosine

SAID = "convolutions stored quantized"


def _convert(model: nn.Module, batch: Any, mode: str = "int8", dtype: str = "float32") -> tuple[ConvAccuracy, list[str]]:
    plugin = QuantizedPrecision(mode, dtype=dtype, probe_batch=batch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(model)
    measured = plugin.quantization.conv_accuracy
    assert measured is not None, "not measured"
    return measured, [str(w.message) for w in seen if SAID in str(w.message)]


class Scaled(nn.Module):
    """One convolution, its output times ``scale`` plus ``shift``, or a constant (``constant=True``)."""

    def __init__(self, scale: float = 1.0, constant: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.scale, self.constant = nn.Conv2d(3, 8, 3, padding=1), scale, constant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        return y * 0 + 1.0 if self.constant else y * self.scale


X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["int8", "nf4-dq"])
def test_a_constant_output_is_not_warned_as_a_cosine_of_zero(mode: str) -> None:
    measured, said = _convert(Scaled(constant=True), X, mode)
    assert measured.cosine == 1.0 and not said


def test_a_controlnet_at_init_whose_output_is_exact_zeros_is_measured_equal_not_warned() -> None:
    from diffusers import ControlNetModel

    class Control(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = ControlNetModel(
                in_channels=4, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4, cross_attention_dim=8,
                attention_head_dim=2, down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), conditioning_embedding_out_channels=(4, 8),
            )  # fmt: skip

        def forward(self, x: torch.Tensor, cond: torch.Tensor, text: torch.Tensor) -> Any:
            return self.net(x, torch.tensor([10]), encoder_hidden_states=text, controlnet_cond=cond)

    batch = {"x": torch.randn(2, 4, 16, 16), "cond": torch.randn(2, 3, 32, 32), "text": torch.randn(2, 5, 8)}
    measured, said = _convert(Control(), batch)  # a ControlNetOutput, no logits: was not measured in int8 either
    assert measured.cosine == 1.0 and not said


def test_huge_outputs_are_measured_in_float64_not_warned() -> None:
    measured, said = _convert(Scaled(scale=1e30), X)
    assert measured.cosine > 0.999 and not said
    want = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 1e25
    assert centred_cosine(want, want) == pytest.approx(1.0)
    assert centred_cosine(torch.zeros(0), torch.zeros(0)) != centred_cosine(torch.zeros(0), torch.zeros(0))  # NaN
    assert centred_cosine(torch.ones(5), torch.zeros(5)) != centred_cosine(torch.ones(5), torch.zeros(5))  # no figure


def test_float16_overflow_on_the_probe_is_warned_with_the_count_and_a_dtype_with_the_range() -> None:
    """The model as built is finite; computed in float16 its output passes 65504 (inf)."""
    measured, said = _convert(Scaled(scale=3e4), X, dtype="float16")
    assert measured.nonfinite > 0 and measured.warned
    assert len(said) == 1 and f"has {measured.nonfinite} values that are inf or NaN" in said[0]
    assert "Fix: QuantizedPrecision(..., dtype='bfloat16'" in said[0]
    measured, said = _convert(Scaled(scale=3e4), X, dtype="bfloat16")
    assert measured.nonfinite == 0 and not said


def _models() -> dict[str, tuple[nn.Module, Any]]:
    from diffusers import UNet2DModel
    from transformers import ConvNextConfig, ConvNextModel, Wav2Vec2Config, Wav2Vec2Model

    class UNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unet = UNet2DModel(
                sample_size=16, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
                down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
            )  # fmt: skip

        def forward(self, x: torch.Tensor) -> Any:
            return self.unet(x, torch.tensor([10]))  # a UNet2DOutput: .sample

    torch.manual_seed(0)
    speech = Wav2Vec2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16),
                            conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=1)
    convnext = ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2)
    return {
        "wav2vec2": (Wav2Vec2Model(speech), torch.randn(2, 800)),
        "convnext": (ConvNextModel(convnext), {"pixel_values": torch.randn(2, 3, 32, 32)}),
        "unet2d": (UNet(), torch.randn(2, 3, 16, 16)),
    }


class Features(nn.Module):
    """A dict of features with members that are not floating tensors: None, indices, a tuple with strings."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3)

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = self.conv(x)
        return {"features": y, "none": None, "argmax": y.argmax(1), "rest": (y.mean(), None, 3, "label")}


def test_int8_measures_models_whose_output_has_no_logits() -> None:
    """ModelOutputs without ``logits`` and dicts: their every floating tensor is the figure (was: no reference, no word)."""
    for name, (model, batch) in {**_models(), "dict": (Features(), X)}.items():
        measured, said = _convert(model, batch)
        assert measured.cosine > 0.99 and not said, name


class Noisy(nn.Module):
    """A diffusion training step's forward: it draws noise and a time from torch's global RNG."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise, t = torch.randn_like(x), torch.rand(x.shape[0], 1, 1, 1)
        return self.conv2(torch.relu(self.conv1(x * (1 - t) + noise * t))) - noise


def test_a_forward_that_draws_noise_is_measured_with_the_reference_draws() -> None:
    """Under nf4-dq the reference is the plan's first forward; the quantized model was run on other draws (0.01)."""
    measured, said = _convert(Noisy(), X, "nf4-dq")
    assert measured.cosine > 0.99 and not said


class InPlace(nn.Module):
    """A forward that normalises its input in place; nonlinear after it, so another input gives another output."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean()).mul_(3.0)
        return torch.tanh(self.conv(x))


def test_a_forward_that_changes_its_input_in_place_is_measured_on_the_input_the_reference_had() -> None:
    measured, said = _convert(InPlace(), X.clone())
    assert measured.cosine > 0.999 and not said


class Trained(nn.Module):
    """Conv-BN-dropout with BatchNorm in training mode, a frozen eval-mode block and a frozen parameter."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn, self.drop = nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.Dropout(0.5)
        self.frozen = nn.Sequential(nn.Conv2d(8, 8, 1), nn.BatchNorm2d(8)).eval()
        self.frozen[1].weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.drop(self.bn(self.conv(x)))) + random.random() * 0 + float(np.random.rand()) * 0


def _state(model: nn.Module) -> tuple:
    return (
        {k: v.clone() for k, v in model.state_dict().items() if ".bn" in f".{k}" or k.startswith(("bn", "frozen.1"))},
        [(n, m.training) for n, m in model.named_modules() if isinstance(m, (nn.BatchNorm2d, nn.Dropout))],
        {n: p.requires_grad for n, p in model.named_parameters() if "bn" in n or n.startswith("frozen.1")},
        torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist(),
    )


@pytest.mark.parametrize("mode", ["int8", "nf4-dq"])
def test_the_check_leaves_buffers_modes_requires_grad_and_every_rng_as_they_were(mode: str) -> None:
    model = Trained().train()
    model.frozen.eval()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    before = _state(model)
    _convert(model, X, mode)
    after = _state(model)
    assert before[0].keys() == after[0].keys() and all(torch.equal(before[0][k], after[0][k]) for k in before[0])
    assert before[1:3] == after[1:3] and torch.equal(before[3], after[3]) and before[4:] == after[4:]


def test_the_convolutions_plan_measures_a_forward_that_draws_noise_on_the_same_draws() -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.convert_module(Noisy())
    assert plugin.quantization.conv_report is not None and plugin.quantization.conv_report.cosine > 0.95


@pytest.mark.parametrize("mode", ["int8", "nf4-dq"])
def test_the_probe_forwards_leave_the_users_batch_as_it_was(mode: str) -> None:
    batch = X.clone()
    _convert(InPlace(), batch, mode)
    assert torch.equal(batch, X)


def test_the_4bit_convolutions_plan_measures_models_whose_output_has_no_logits() -> None:
    """A dict of features, a transformers ModelOutput without ``logits``, a diffusers UNet's ``.sample``: the plan measures
    their first floating tensor (was: "without a measured plan", every convolution uniform)."""
    for name, (model, batch) in {**_models(), "dict": (Features(), X)}.items():
        plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plugin.convert_module(model)
        assert plugin.quantization.conv_report is not None, name
        assert not any("without a measured plan" in str(w.message) for w in caught), name
