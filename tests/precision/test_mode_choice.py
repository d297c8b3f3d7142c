"""Issue 54, the structure step: the mode choice (``precision/mode_choice.py``) is handed the settings, the probe and
the GPTQ statistics and returns what it measured and said; the ``Quantization`` keeps it (or the checkpoint's modes)."""

from __future__ import annotations

import warnings

import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.mode_choice import ConvChoice, conv_modes, linear_modes
from lightning_hbm.probe import Probe


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1), nn.Flatten(), nn.Linear(16 * 64, 4))


def _missing() -> Probe:
    raise ValueError("no probe batch")


def test_the_convolutions_choice_returns_what_it_measured_and_changes_nothing_else() -> None:
    model, batch = _conv_net(), torch.randn(4, 3, 8, 8)
    config = QuantizationConfig("nf4-dq", "float32")
    choice = conv_modes(model, ["0", "3"], config, lambda: Probe(model, batch), None)
    assert isinstance(choice, ConvChoice) and choice.report is not None and not choice.said_unmeasured
    assert choice.widened == {n: m for n, m in choice.report.modes.items() if m != "nf4-dq"}
    assert all(isinstance(model[i], nn.Conv2d) for i in (0, 3))  # measured on swapped copies: the model as it was


def test_a_conv_net_without_a_probe_batch_is_said_unmeasured_once_by_the_choice() -> None:
    model = _conv_net()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = conv_modes(model, ["0", "3"], QuantizationConfig("nf4-dq", "float32"), _missing, None)
    assert choice == ConvChoice(said_unmeasured=True)
    assert sum("without a measured plan" in str(w.message) for w in caught) == 1
    # without BatchNorm: logged only, and the accuracy check is left to say it
    plain = nn.Sequential(nn.Conv2d(3, 4, 3))
    assert conv_modes(plain, ["0"], QuantizationConfig("nf4-dq", "float32"), _missing, None) == ConvChoice()


def test_the_linear_choice_returns_its_report() -> None:
    torch.manual_seed(0)
    model, batch = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8)), torch.randn(32, 16)
    config = QuantizationConfig("nf4-dq", "float32", min_cosine=0.995)
    report = linear_modes(model, ["0", "2"], config, lambda: Probe(model, batch), None)
    assert set(report.modes) == {"0", "2"} and report.cosine >= 0.995
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", min_cosine=0.995, probe_batch=batch)
    plugin.convert_module(model)
    assert plugin.sensitivity_report is not None and plugin.layer_modes == report.modes  # kept by the Quantization


class _UNet(nn.Module):
    """diffusers' UNet2DModel (tiny config) on a fixed timestep: its code casts the timestep embedding to
    ``ModelMixin.dtype``, the dtype of the model's first float parameter (``conv_in``'s)."""

    def __init__(self) -> None:
        super().__init__()
        import diffusers

        torch.manual_seed(0)
        self.model = diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1, norm_num_groups=4,
            down_block_types=("DownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "UpBlock2D"),
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x, torch.tensor([10, 500])).sample


def test_a_diffusers_unet_s_convolutions_are_measured_in_bf16_and_the_model_keeps_its_dtype() -> None:
    """Was (issue 53, session 38): the swapped-in quantized ``conv_in`` registered its bf16 bias as the model's first
    float parameter, diffusers cast the timestep embedding to bf16 for its fp32 ``time_embedding`` Linear ("mat1 and
    mat2 must have the same dtype, BFloat16 and Float"): every convolution stored uniform nf4-dq, unmeasured."""
    model, batch = _UNet(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    names = [name for name, layer in model.named_modules() if isinstance(layer, nn.Conv2d)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        choice = conv_modes(model, names, QuantizationConfig("nf4-dq", "bfloat16"), lambda: Probe(model, batch), None)
    assert not any("without a measured plan" in str(w.message) for w in caught), [str(w.message) for w in caught]
    assert choice.report is not None and not choice.said_unmeasured
    assert choice.report.cosine >= choice.report.uniform_cosine
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # measured on swapped copies: the model as it was
