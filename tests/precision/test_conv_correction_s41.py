"""The calibrated correction on convolutions (``QuantizedPrecision(correction_rank=r)``, issue 52): fitted over the
input patches, carried by the quantized convolution (added to the weight it dequantizes), its bytes counted and
planned, resumed bit for bit; grouped convolutions left out and said (real bitsandbytes storage and peft LoRA)."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import QuantizedConv1d, QuantizedConv2d, coverage, stored_in
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.correction import corrected_layers
from lightning_hbm.precision.mode_choice import correction_bytes
from lightning_hbm.precision.registry import format_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "layers"))
from conv_models import classifier, small_images  # noqa: E402


class Net(nn.Module):
    """Two full convolutions (one strided), one depthwise (left out), a BatchNorm with data-like statistics."""

    def __init__(self) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv = nn.Conv2d(32, 48, 3, stride=2, padding=1, bias=False)
        self.dw = nn.Conv2d(48, 48, 3, padding=1, groups=48)
        self.head = nn.Linear(48, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        return self.head(self.dw(F.relu(self.conv(x))).mean((2, 3)))


PROBE, HELD_OUT = small_images(0, 4), small_images(1, 4)


def _net() -> Net:
    torch.manual_seed(0)
    net = Net()
    net.bn.momentum = None
    with torch.no_grad():  # running statistics of image-like batches (a net at init statistics hides the loss)
        net.train()(small_images(5, 16))
    return net.eval()


def _quantized(model: nn.Module, **settings: Any) -> QuantizedPrecision:
    # min_cosine=0: every convolution in nf4-dq (no widening), so both arms store the same weights
    plugin = QuantizedPrecision(**{"mode": "nf4-dq", "dtype": "float32", "probe_batch": PROBE, "min_cosine": 0.0, **settings})
    plugin.convert_module(model)
    return plugin


def _conv_error(conv: nn.Module, original: nn.Module, x: torch.Tensor) -> float:
    with torch.no_grad():
        want = original(x)
        return float((conv(x) - want).norm() / want.norm())


def test_a_corrected_convolution_has_less_output_error_on_the_probe_and_beyond() -> None:
    reference = _net()
    plain, corrected = copy.deepcopy(reference), copy.deepcopy(reference)
    _quantized(plain)
    _quantized(corrected, correction_rank=4)
    inputs = {"stem": (PROBE, HELD_OUT)}
    with torch.no_grad():  # the second convolution's own inputs, as the reference computes them
        inputs["conv"] = tuple(F.relu(reference.bn(reference.stem(x))) for x in (PROBE, HELD_OUT))
    for name, (probe, held) in inputs.items():
        layer = corrected.get_submodule(name)
        assert isinstance(layer, QuantizedConv2d) and correction_of(layer) is not None
        original = reference.get_submodule(name)
        before = [_conv_error(plain.get_submodule(name), original, x) for x in (probe, held)]
        after = [_conv_error(layer, original, x) for x in (probe, held)]
        assert after[0] < 0.8 * before[0], (name, before, after)  # fitted to those patches
        assert after[1] < before[1], (name, before, after)  # and on images it never saw
    # the whole model's output, held out
    with torch.no_grad():
        want = reference(HELD_OUT)
        errors = [float((m(HELD_OUT) - want).norm() / want.norm()) for m in (plain, corrected)]
    assert errors[1] < errors[0], errors


def test_the_factors_are_the_weights_fit_over_the_patches_and_frozen_in_the_compute_dtype() -> None:
    model = _net()
    _quantized(model, correction_rank=4, dtype="bfloat16")
    conv = model.conv
    correction, storage = correction_of(conv), stored_in(conv)
    assert correction is not None and storage is not None and correction.rank == 4
    # [r, in x kernel] and [out, r]: peft's conv LoRA shapes (a rank-r 3x3 convolution, then a 1x1 one)
    assert correction.right.shape == (4, 32 * 9) and correction.left.shape == (48, 4)
    assert correction.right.dtype == correction.left.dtype == torch.bfloat16 and not correction.right.requires_grad
    # the weight the convolution computes with (and that peft, LoRA.merge and QuantizationQuality read) is Q + B A
    fmt = format_of(storage)
    assert fmt is not None
    want = fmt.dequantize(storage, torch.bfloat16) + (correction.left @ correction.right)
    torch.testing.assert_close(conv.weight, want.reshape(48, 32, 3, 3), rtol=0, atol=0)


def test_a_conv1d_is_corrected_too() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(8, 32, 5, padding=2), nn.GELU(), nn.Conv1d(32, 16, 3))
    x, held = torch.randn(4, 8, 64, generator=torch.Generator().manual_seed(0)), torch.randn(4, 8, 64)
    reference = copy.deepcopy(model)
    plain = copy.deepcopy(model)
    _quantized(plain, probe_batch=x)
    _quantized(model, probe_batch=x, correction_rank=4)
    assert isinstance(model[0], QuantizedConv1d) and corrected_layers(model) == ["0", "2"]
    with torch.no_grad():
        errors = [float((m(held) - reference(held)).norm() / reference(held).norm()) for m in (plain, model)]
    assert errors[1] < 0.9 * errors[0], errors


def test_bytes_are_counted_exactly_in_the_layer_the_table_and_the_plan() -> None:
    plain, corrected = _net(), _net()
    _quantized(plain)
    with pytest.warns(UserWarning, match=r"correction_rank=4\): 1 quantized layer\(s\) get no calibrated correction.* dw: a grouped or depthwise convolution \(groups=48\)"):
        plugin = _quantized(corrected, correction_rank=4)
    assert corrected_layers(corrected) == ["stem", "conv", "head"]
    factors = {n: sum(p.numel() * p.element_size() for p in correction_of(corrected.get_submodule(n)).parameters()) for n in ["stem", "conv", "head"]}  # type: ignore[union-attr]
    assert factors["conv"] == 4 * (32 * 9 + 48) * 4  # stored in the compute dtype, fp32 here
    assert parameter_bytes(corrected) - parameter_bytes(plain) == sum(factors.values()) == plugin.correction_report.bytes
    rows = {row.kind: row for row in coverage(corrected, quantizing=True, adapting=False)}
    plain_rows = {row.kind: row for row in coverage(plain, quantizing=True, adapting=False)}
    assert rows["Conv"].bytes - plain_rows["Conv"].bytes == factors["stem"] + factors["conv"]
    assert rows["Conv"].params == plain_rows["Conv"].params  # the factors are bytes of the layer, not more weights
    # what a byte budget plans with: the same bytes per layer, none for the depthwise one
    planned = correction_bytes(_net(), ["stem", "conv", "dw", "head"], 4, torch.float32)
    assert planned == factors


def _fit(root: Path, max_steps: int, probe: torch.Tensor, ckpt_path: Any = None) -> tuple[Any, QuantizedPrecision]:
    module = classifier(_net())
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, correction_rank=4, min_cosine=0.0)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=root, plugins=[plugin],
        callbacks=[LoRA(r=2, target_modules=["stem", "conv"]), ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
    )  # fmt: skip
    g = torch.Generator().manual_seed(3)
    # one epoch every 2 steps: the checkpoint at step 2 is an epoch's end (a plain DataLoader restarts mid-epoch)
    batches = [(small_images(10 + i, 4), torch.randint(0, 10, (4,), generator=g)) for i in range(2)]
    trainer.fit(module, DataLoader(batches, batch_size=None), ckpt_path=ckpt_path)
    return module, plugin


def test_a_resume_takes_the_conv_factors_from_the_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    straight, _ = _fit(tmp_path / "straight", 4, PROBE)
    assert corrected_layers(straight) == ["net.stem.base_layer", "net.conv.base_layer", "net.head"]
    checkpoint = torch.load(tmp_path / "straight" / "step=2.ckpt", weights_only=False)
    saved = [k for k in checkpoint["lightning_hbm"]["state_dict"] if ".lowrank_correction." in k]
    assert len(saved) == 2 * 3
    # another probe would fit other factors: the resume takes the file's, so the run goes on as if never stopped
    resumed, plugin = _fit(tmp_path / "resumed", 4, HELD_OUT, ckpt_path=tmp_path / "straight" / "step=2.ckpt")
    assert plugin.correction_report is not None and plugin.correction_report.resumed
    want, got = straight.state_dict(), resumed.state_dict()
    keys = [k for k in want if ".lora_" in k or ".lowrank_correction." in k]
    assert any("conv.base_layer.lowrank_correction" in k for k in keys)
    for key in keys:
        assert torch.equal(want[key], got[key]), key


def test_the_planner_counts_the_factors_of_convolutions() -> None:
    from lightning_hbm.planner import quantized_parameter_bytes

    model = classifier(_net())
    planned = quantized_parameter_bytes(copy.deepcopy(model), "nf4-dq", "float32", correction_rank=4)
    _quantized(model, correction_rank=4)
    assert planned == parameter_bytes(model)
