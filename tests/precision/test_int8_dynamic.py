"""``int8-dynamic``: INT8 weights + per-token INT8 activations, integer matmul, frozen base with input gradients."""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from peft import LoraConfig, inject_adapter_in_model
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hbm import QuantizedPrecision, available_precisions, precision_plugin, quantize_model
from lightning_hbm.activations.checkpointing import ActivationCheckpointing
from lightning_hbm.adapters.lora import LoRA
from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes
from lightning_hbm.precision.int8_dynamic import Int8DynamicLinear, quantize_rowwise, uses_integer_kernel
from lightning_hbm.quality import QuantizationQuality


def linear_stack(seed: int = 0, width: int = 256, depth: int = 3) -> nn.Sequential:
    """A fixed random MLP: Linear/ReLU layers, weights ~ N(0, 1/width), non-zero biases."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def sqnr_db(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    return 10 * math.log10(reference.pow(2).sum().item() / (reference - approximation).pow(2).sum().item())


def quantized(model: nn.Module, mode: str, dtype: str = "float32") -> nn.Module:
    model = copy.deepcopy(model)
    quantize_model(model, mode, dtype)
    return model


def int8_layers(model: nn.Module) -> list[Int8DynamicLinear]:
    return [m for m in model.modules() if isinstance(m, Int8DynamicLinear)]


def test_registered_next_to_bitsandbytes_modes() -> None:
    assert "int8-dynamic" in available_precisions()
    plugin = precision_plugin("int8-dynamic", dtype="bf16")
    assert plugin.mode.name == "int8-dynamic" and plugin.dtype == torch.bfloat16


def test_output_sqnr_beats_nf4_at_about_one_byte_per_weight() -> None:
    model = linear_stack()
    x = torch.randn(8, 16, 256, generator=torch.Generator().manual_seed(1))
    reference = model(x)
    int8 = quantized(model, "int8-dynamic")
    nf4 = quantized(model, "nf4")
    int8_sqnr, nf4_sqnr = sqnr_db(reference, int8(x)), sqnr_db(reference, nf4(x))
    assert int8_sqnr > nf4_sqnr + 10, (int8_sqnr, nf4_sqnr)  # ~37 dB vs ~16 dB
    assert int8_sqnr > 30

    layers = int8_layers(int8)
    assert len(layers) == 3
    for layer in layers:
        # the scales are found by the parameters term: int8 values + one fp32 scale per output row
        assert quantization_tensors(layer) == [layer.weight_scale]
        stored = unique_bytes([layer.weight, *quantization_tensors(layer)])
        assert stored == 256 * 256 + 4 * 256
        assert stored / layer.weight.numel() <= 1.1
    frozen = parameter_bytes(int8, trainable=False)
    assert frozen == 3 * (256 * 256 + 4 * 256)
    # biases stay trainable, everything else is frozen
    assert {n for n, p in int8.named_parameters() if p.requires_grad} == {"0.bias", "2.bias", "4.bias"}


def test_forward_is_per_token_int8_times_per_channel_int8() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = Int8DynamicLinear.from_linear(linear)
    assert layer.bias is linear.bias  # the same trainable Parameter
    x = torch.randn(2, 5, 64)
    w_q, w_s = quantize_rowwise(linear.weight.detach())
    x_q, x_s = quantize_rowwise(x.reshape(-1, 64))
    assert w_q.dtype == torch.int8 and w_q.abs().max() == 127
    torch.testing.assert_close(layer.weight, w_q)
    # the integer product, rescaled: exactly what the layer computes
    expected = (x_q.long() @ w_q.long().t()).float() * x_s[:, None] * w_s[None, :] + linear.bias
    torch.testing.assert_close(layer(x), expected.reshape(2, 5, 48), rtol=1e-6, atol=1e-6)
    # and close to the float layer
    relative = (layer(x) - linear(x)).norm() / linear(x).norm()
    assert relative < 0.02


def test_integer_matmul_kernel_runs_on_cpu() -> None:
    layer = Int8DynamicLinear.from_linear(nn.Linear(64, 32))
    assert uses_integer_kernel(layer)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        layer(torch.randn(4, 64))
    ops = {event.key for event in prof.key_averages()}
    assert "aten::_int_mm" in ops
    assert "aten::mm" not in ops and "aten::addmm" not in ops  # no float matmul in the forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_reaches_input_through_dequantized_weight(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32)
    layer = Int8DynamicLinear.from_linear(linear)
    layer.bias.data = layer.bias.data.to(dtype)
    x = torch.randn(3, 7, 64, dtype=dtype, requires_grad=True)
    out = layer(x)
    assert out.dtype == dtype
    grad_out = torch.randn_like(out)
    out.backward(grad_out)
    dequantized = layer.weight.float() * layer.weight_scale[:, None]
    expected = grad_out.float() @ dequantized  # straight-through: no activation-rounding term
    torch.testing.assert_close(x.grad.float(), expected, **({} if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-3)))
    assert layer.weight.grad is None and not layer.weight.requires_grad
    torch.testing.assert_close(layer.bias.grad, grad_out.sum((0, 1)))


def reference_linear(layer: Int8DynamicLinear, dtype: torch.dtype) -> nn.Linear:
    """``nn.Linear`` holding the weight the int8 layer really uses (``int8 * scale``), in ``dtype``."""
    linear = nn.Linear(layer.in_features, layer.out_features, bias=False).to(dtype)
    linear.weight.data = layer.dequantize().to(dtype)
    return linear


def test_fp16_gradient_of_1e5_reaches_input_and_lora_a_like_nn_linear() -> None:
    # Before: grad_out * weight_scale (~1e-5 * 1e-3) was cast to fp16 before the matmul, below fp16's smallest
    # subnormal: the input gradient was exactly 0, so every LoRA adapter below such a layer trained nothing.
    torch.manual_seed(0)
    layer = Int8DynamicLinear.from_linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(4, 64, dtype=torch.float16, requires_grad=True)
    grad_out = torch.full((4, 32), 1e-5, dtype=torch.float16)
    layer(x).backward(grad_out)
    x_ref = x.detach().clone().requires_grad_()
    reference_linear(layer, torch.float16)(x_ref).backward(grad_out)
    assert x_ref.grad.abs().min() > 0
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-3, atol=1e-7)

    # the same through peft: a LoRA adapter on the layer below gets a non-zero gradient
    model = nn.Sequential(nn.Linear(64, 64), Int8DynamicLinear.from_linear(nn.Linear(64, 32))).half()
    inject_adapter_in_model(LoraConfig(r=4, target_modules=["0"], init_lora_weights=False), model)
    (model(x.detach()) * 1e-5).sum().backward()
    assert model[0].lora_A["default"].weight.grad.abs().sum() > 0


@pytest.mark.parametrize("magnitude", [1e36, 1e-30], ids=["large-output-1e36", "tiny-input-1e-30"])
def test_large_output_in_fp32_is_finite_like_nn_linear(magnitude: float) -> None:
    # Before: acc * x_scale (~1e6 * 1e34) overflowed fp32 to inf for inputs around 1e36 where nn.Linear is
    # finite; and a 1e-12 floor on the scales rounded every row below ~1e-10 to zero.
    torch.manual_seed(0)
    layer = Int8DynamicLinear.from_linear(nn.Linear(64, 32, bias=False))
    x = torch.randn(4, 64) * magnitude
    out, expected = layer(x), reference_linear(layer, torch.float32)(x)
    assert out.isfinite().all() and expected.isfinite().all()
    out, expected = out / magnitude, expected / magnitude  # the norm of 1e36-sized values overflows fp32
    assert (out - expected).norm() / expected.norm() < 0.02


def test_works_under_non_reentrant_activation_checkpointing() -> None:
    model = quantized(linear_stack(depth=2), "int8-dynamic")
    x = torch.randn(4, 256, requires_grad=True)
    model(x).square().sum().backward()
    plain = x.grad.clone()
    grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
    x.grad = None
    model.zero_grad()
    checkpoint(model, x, use_reentrant=False).square().sum().backward()
    torch.testing.assert_close(x.grad, plain, rtol=0, atol=0)
    for before, param in zip(grads, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(param.grad, before, rtol=0, atol=0)


def test_state_dict_round_trip_and_scale_links() -> None:
    source = quantized(linear_stack(seed=0), "int8-dynamic")
    state = source.state_dict()
    assert state["0.weight"].dtype == torch.int8 and state["0.weight_scale"].dtype == torch.float32
    target = quantized(linear_stack(seed=1), "int8-dynamic")
    target.load_state_dict(state)
    x = torch.randn(3, 256)
    torch.testing.assert_close(target(x), source(x), rtol=0, atol=0)
    for assign in (False, True):
        fresh = quantized(linear_stack(seed=2), "int8-dynamic")
        fresh.load_state_dict(copy.deepcopy(state), assign=assign)
        for layer in int8_layers(fresh):
            assert quantization_tensors(layer) == [layer.weight_scale]  # the bytes counter sees the live scales
        torch.testing.assert_close(fresh(x), source(x), rtol=0, atol=0)
    copied = copy.deepcopy(source)  # deepcopy rebuilds Parameters without their attributes
    moved = copy.deepcopy(source).float()  # any _apply (.to, .float, .cuda) replaces buffers
    for model in (copied, moved):
        assert all(quantization_tensors(layer) == [layer.weight_scale] for layer in int8_layers(model))
        assert parameter_bytes(model, trainable=False) == parameter_bytes(source, trainable=False)


def test_meta_weight_is_a_clear_error() -> None:
    with torch.device("meta"):
        linear = nn.Linear(8, 8)
    with pytest.raises(ValueError, match=r"Linear\(8, 8\) whose weight is on the meta device"):
        Int8DynamicLinear.from_linear(linear)


def test_peft_lora_wraps_the_int8_layer() -> None:
    model = quantized(linear_stack(depth=2), "int8-dynamic")
    inject_adapter_in_model(LoraConfig(r=4, lora_alpha=8, target_modules=["0", "2"], init_lora_weights=False), model)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert isinstance(model[0].get_base_layer(), Int8DynamicLinear)
    x = torch.randn(5, 256, requires_grad=True)
    model(x).sum().backward()
    assert all(model.get_parameter(n).grad is not None and model.get_parameter(n).grad.abs().sum() > 0 for n in trainable)
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.slow
def test_qlora_style_fit_with_int8_dynamic_base_and_checkpointing_reduces_loss(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, loss_recorder: Any
) -> None:
    model = gpt_factory(lr=1e-2)
    recorder = loss_recorder()
    quality = QuantizationQuality(on_validation=False)
    checkpointing = ActivationCheckpointing("full")
    trainer = trainer_factory(
        max_steps=12,
        # the output head too (quantize_head, named in target_modules): on this tiny model its adapter does much of
        # the learning, and "all-linear" / the default leave the head (layers.output_heads) alone
        plugins=[QuantizedPrecision("int8-dynamic", dtype="bfloat16", quantize_head=True)],
        callbacks=[LoRA(r=8, alpha=16, target_modules=["c_attn", "c_proj", "c_fc", "lm_head"]), checkpointing, quality, recorder],
    )
    trainer.fit(model, datamodule_factory(batch_size=8))
    layers = int8_layers(model)
    assert len(layers) == 9  # every Linear, lm_head included, each under a peft LoRA wrapper
    assert checkpointing.checkpointed == ["model.h.0", "model.h.1"]  # blocks recomputed in backward
    assert all(not layer.weight.requires_grad and layer.weight.grad is None for layer in layers)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    first, last = sum(recorder.losses[:4]) / 4, sum(recorder.losses[-4:]) / 4
    assert last < first - 0.5, recorder.losses
    # the quality table reads the int8 weights through the LoRA wrappers: ~44 dB per layer
    assert len(quality.layer_sqnr) == 9 and all(35 < sqnr < 60 for _, sqnr in quality.layer_sqnr)


def test_checkpoint_resume_restores_int8_base(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, tmp_path: Any
) -> None:
    model = gpt_factory(seed=0)
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")])
    trainer.fit(model, datamodule_factory())
    path = tmp_path / "int8.ckpt"
    trainer.save_checkpoint(path)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    assert saved["model.h.0.attn.c_attn.weight"].dtype == torch.int8

    resumed = gpt_factory(seed=1)  # different init: everything must come from the checkpoint
    trainer = trainer_factory(max_steps=2, plugins=[QuantizedPrecision("int8-dynamic", dtype="float32")])
    trainer.fit(resumed, datamodule_factory(), ckpt_path=path)  # max_steps reached: restores, trains nothing
    state = resumed.state_dict()
    assert state.keys() == saved.keys()
    for key, value in saved.items():
        torch.testing.assert_close(state[key], value, rtol=0, atol=0, msg=key)


@pytest.mark.gpu
def test_cuda_uses_integer_matmul_and_reports_step_time_vs_bf16() -> None:
    device = torch.device("cuda")
    torch.manual_seed(0)
    width = 4096
    reference = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width)).to(device, torch.bfloat16)
    model = copy.deepcopy(reference)
    quantize_model(model, "int8-dynamic", "bfloat16", device=device)
    assert all(uses_integer_kernel(layer) for layer in int8_layers(model))
    x = torch.randn(8, 512, width, device=device, dtype=torch.bfloat16, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(x).float().square().mean().backward()
    assert "aten::_int_mm" in {event.key for event in prof.key_averages()}
    # short inputs (<= 16 rows) are padded for cuBLASLt; odd widths fall back to exact-ish float products
    small = Int8DynamicLinear.from_linear(nn.Linear(64, 40).to(device))
    assert uses_integer_kernel(small) and small(torch.randn(3, 64, device=device)).shape == (3, 40)
    odd = Int8DynamicLinear.from_linear(nn.Linear(100, 36).to(device))
    assert not uses_integer_kernel(odd) and odd(torch.randn(20, 100, device=device)).shape == (20, 36)

    def step_time(net: nn.Module) -> float:
        for _ in range(3):
            net(x).float().square().mean().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            net(x).float().square().mean().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / 10

    bf16, int8 = step_time(reference), step_time(model)
    print(f"\nint8-dynamic step time / bf16 step time (H={width}, tokens=4096): {int8 / bf16:.2f} ({int8 * 1e3:.2f} ms vs {bf16 * 1e3:.2f} ms)")
    out_ref, out_q = reference(x).float(), model(x).float()
    assert F.cosine_similarity(out_ref.flatten(), out_q.flatten(), dim=0) > 0.999
