"""``int4-g32`` (lightning_hbm/precision/int4_asym.py): asymmetric int4 in groups of 32, exact on a Q4_1 grid."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from lightning_hbm import QuantizedPrecision, available_precisions, quantize_model
from lightning_hbm.adapters.lora import LoRA
from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes
from lightning_hbm.models import NanoGPT
from lightning_hbm.planner import quantized_parameter_bytes
from lightning_hbm.precision import format_of, get_format
from lightning_hbm.precision.int4_asym import (
    Int4GroupLinear,
    dequantize_groups,
    on_4bit_grid,
    quantize_groups,
    regrid_warning,
)

MODE = "int4-g32"
TINY_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)


def q4_1_weight(out_features: int, in_features: int, seed: int = 0) -> torch.Tensor:
    """A weight as llama.cpp dequantizes a GGUF Q4_1 tensor: ``code * d + m`` in fp32, fp16 ``d`` and ``m`` per 32."""
    g = torch.Generator().manual_seed(seed)
    groups = (out_features, in_features // 32)
    d = (torch.rand(groups, generator=g) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(groups, generator=g) * 0.08).half().float()
    codes = torch.randint(0, 16, (*groups, 32), generator=g).float()
    codes[..., 0], codes[..., 1] = 0, 15  # Q4_1 maps each block's minimum to 0 and its maximum to 15
    return (codes * d[..., None] + m[..., None]).reshape(out_features, in_features)


def int4_layers(model: nn.Module) -> list[Int4GroupLinear]:
    return [m for m in model.modules() if isinstance(m, Int4GroupLinear)]


def test_registered_by_its_file_alone() -> None:
    assert MODE in available_precisions() and get_format(MODE).name == MODE


def test_a_q4_1_weight_is_stored_exactly() -> None:
    weight = q4_1_weight(64, 256)
    packed, scale, minimum = quantize_groups(weight)
    assert packed.dtype == torch.uint8 and packed.shape == (64, 128)
    assert scale.dtype == minimum.dtype == torch.float16 and scale.shape == (64, 8)
    assert torch.equal(dequantize_groups(packed, scale, minimum, torch.float32), weight)


def test_a_real_valued_weight_reads_back_within_a_group_step() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(1))
    packed, scale, minimum = quantize_groups(weight)
    back = dequantize_groups(packed, scale, minimum, torch.float32)
    step = scale.float().repeat_interleave(32, dim=1)
    assert ((back - weight).abs() <= step / 2 + 1e-3 * step + 1e-6).all()  # nearest level (fp16-rounded grid)
    # a finer grid than NF4's blocks of 64: lower error on Gaussian weights (for more bytes: 0.625 vs ~0.52)
    nf4 = copy.deepcopy(nn.Linear(96, 48, bias=False))
    nf4.weight.data = weight.clone()
    model = nn.Sequential(nf4)
    quantize_model(model, "nf4-dq", dtype="float32", quantize_head=True)
    nf4_back = format_of(model[0]).dequantize(model[0], torch.float32)
    assert (back - weight).norm() < 0.9 * (nf4_back - weight).norm()


def test_forward_and_input_gradient_are_the_dequantized_matmul_and_save_no_float_weight() -> None:
    linear = nn.Linear(64, 32)
    layer = Int4GroupLinear.from_linear(linear)
    assert layer.bias is linear.bias and not layer.weight.requires_grad
    x = torch.randn(5, 64, requires_grad=True)
    saved: list[torch.Tensor] = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = layer(x)
    dense = layer.dequantize(torch.float32)
    x2 = x.detach().clone().requires_grad_(True)
    torch.testing.assert_close(out, F.linear(x2, dense, linear.bias))
    out.sum().backward()
    F.linear(x2, dense, linear.bias).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    assert not any(t.is_floating_point() and t.shape == (32, 64) for t in saved)  # the weight is dequantized again


def test_storage_is_five_bits_per_weight_and_the_planner_predicts_it() -> None:
    torch.manual_seed(0)
    real = NanoGPT(**TINY_GPT)
    planned = quantized_parameter_bytes(real, MODE, "bfloat16")  # the format ran on FakeTensors
    quantize_model(real, MODE, "bfloat16")
    assert planned == parameter_bytes(real)
    for layer in int4_layers(real):
        numel = layer.in_features * layer.out_features
        assert unique_bytes([layer.weight, *quantization_tensors(layer)]) == numel // 2 + numel // 32 * 4


def test_a_row_that_is_not_whole_groups_ends_in_a_short_group() -> None:
    linear = nn.Linear(40, 6, bias=False)  # 32 + 8
    layer = Int4GroupLinear.from_linear(linear)
    assert layer.weight.shape == (6, 32) and layer.weight_scale.shape == (6, 2)
    back = layer.dequantize(torch.float32)
    assert back.shape == (6, 40)
    tail = linear.weight.detach()[:, 32:]  # its own range: the 8 weights' minimum is read back exactly
    torch.testing.assert_close(back[:, 32:].amin(dim=1), tail.amin(dim=1).half().float())
    x = torch.randn(3, 40, requires_grad=True)
    torch.testing.assert_close(layer(x), x @ back.T)
    layer(x).sum().backward()
    torch.testing.assert_close(x.grad, back.sum(dim=0).expand(3, 40))


def test_a_weight_beyond_float16_is_refused_by_name_before_any_change() -> None:
    big = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 8))
    with torch.no_grad():
        big[0].weight[0, 0] = 1e5
    with pytest.raises(ValueError, match=r"float16 \(largest 65504\), but 0 holds a weight of magnitude 100000.*ignore_modules=\['0'\]"):
        quantize_model(big, MODE, dtype="float32")
    assert type(big[0]) is nn.Linear and type(big[1]) is nn.Linear


def test_grid_detection_and_its_warning() -> None:
    on_grid, plain, zero = q4_1_weight(32, 128), torch.randn(32, 128), torch.zeros(32, 128)
    assert on_4bit_grid(on_grid) and not on_4bit_grid(plain) and not on_4bit_grid(zero)
    assert on_4bit_grid(nn.Parameter(on_grid)) and not on_4bit_grid(on_grid.t().contiguous().t())  # a view: not sampled
    large = q4_1_weight(4100, 4096)  # above 2**24 elements: the first and the last group are always among the samples
    assert on_4bit_grid(large)
    large[-1, -32:] = torch.randn(32)
    assert not on_4bit_grid(large)
    with FakeTensorMode():  # the planner's fake weights are never read
        assert not on_4bit_grid(torch.empty(32, 128))
    layers = []
    for w in (on_grid, plain):
        layer = nn.Linear(128, 32, bias=False)
        layer.weight.data = w
        layers.append(layer)
    message = regrid_warning([("a", layers[0]), ("b", layers[1])], "nf4-dq")
    assert message is not None and "1 of 2 layers to quantize (a) hold weights that are already 4-bit" in message
    assert "QuantizedPrecision('int4-g32')" in message
    assert regrid_warning([("a", layers[0])], MODE) is None and regrid_warning([("b", layers[1])], "nf4-dq") is None


def test_quantized_precision_warns_at_fit_start_on_a_4bit_checkpoint(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any
) -> None:
    model = gpt_factory()
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, nn.Linear) and layer.in_features % 32 == 0:
                layer.weight.copy_(q4_1_weight(*layer.weight.shape))
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4)])
    with pytest.warns(UserWarning, match=r"already 4-bit.*QuantizedPrecision\('int4-g32'\) stores them exactly"):
        trainer.fit(model, datamodule_factory())
    model = gpt_factory()  # real-valued weights: nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        warnings.filterwarnings("ignore", message=r"(?!.*already 4-bit)")
        trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")]).fit(model, datamodule_factory())


def test_lora_trains_merges_and_refuses_dora(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    model = gpt_factory()
    trainer = trainer_factory(max_steps=3, plugins=[QuantizedPrecision(MODE, dtype="float32")], callbacks=[LoRA(r=4)])
    trainer.fit(model, datamodule_factory())
    adapted = [(n, m) for n, m in model.named_modules() if hasattr(m, "lora_B")]
    assert adapted and all(isinstance(m.get_base_layer(), Int4GroupLinear) for _, m in adapted)
    assert all(m.lora_B["default"].weight.abs().sum() > 0 for _, m in adapted)  # every adapter got a gradient
    with pytest.warns(UserWarning, match=r"merged into their DEQUANTIZED base weights"):
        merged = LoRA.merge(model, dtype="float32")
    for name, layer in adapted:
        base = layer.get_base_layer()
        expected = base.dequantize(torch.float32) + layer.get_delta_weight("default").float()
        torch.testing.assert_close(merged[f"{name}.weight"], expected)
    dora = trainer_factory(max_steps=1, plugins=[QuantizedPrecision(MODE, dtype="float32")], callbacks=[LoRA(r=4, use_dora=True)])
    with pytest.raises(ValueError, match=r"use_dora=True on int4-g32: peft's DoRA reads the raw packed uint8 codes"):
        dora.fit(gpt_factory(), datamodule_factory())


def test_peft_variants_train_on_it_and_pissa_is_refused(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any) -> None:
    """docs/adapters.md's int4-g32 column: rsLoRA, gaussian init, bias and rank patterns train; PiSSA is refused."""
    variants = LoRA(r=4, use_rslora=True, bias="all", init_lora_weights="gaussian", rank_pattern={"c_fc": 2})
    model = gpt_factory()
    trainer_factory(max_steps=2, plugins=[QuantizedPrecision(MODE, dtype="float32")], callbacks=[variants]).fit(model, datamodule_factory())
    assert model.model.h[0].mlp.c_fc.lora_A["default"].weight.shape[0] == 2 and int4_layers(model)
    pissa = trainer_factory(max_steps=1, plugins=[QuantizedPrecision(MODE, dtype="float32")],
                            callbacks=[LoRA(r=4, init_lora_weights="pissa")])
    with pytest.raises(ValueError, match=r"init_lora_weights='pissa' rewrites the base weight"):
        pissa.fit(gpt_factory(), datamodule_factory())


@pytest.mark.gpu
def test_on_cuda_it_trains_in_bf16_and_stores_a_q4_1_grid_exactly(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any
) -> None:
    weight = q4_1_weight(64, 256).cuda()
    assert torch.equal(dequantize_groups(*quantize_groups(weight), torch.float32), weight)
    model = gpt_factory()
    trainer = trainer_factory(accelerator="cuda", max_steps=3, plugins=[QuantizedPrecision(MODE, dtype="bfloat16")],
                              callbacks=[LoRA(r=4)])
    trainer.fit(model, datamodule_factory())
    layers = int4_layers(model)
    assert layers and all(layer.weight.device.type == "cuda" for layer in layers)
    adapted = [m for m in model.modules() if hasattr(m, "lora_B")]
    assert adapted and all(m.lora_B["default"].weight.abs().sum() > 0 for m in adapted)
