"""fp32 LoRA adapters on a bf16 model compute in bf16, their weights cast, not their inputs (lightning_hbm.adapters.lora.compute)."""

from __future__ import annotations

import copy
import pickle
from typing import Any, Optional

import peft
import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora.compute import Bf16ComputeLinear, compute_in_input_dtype


def peft_layer(model_dtype: torch.dtype, adapter_dtype: torch.dtype, use_dora: bool = False, seed: int = 0) -> Any:
    """One peft LoRA Linear on a ``model_dtype`` base, adapters in ``adapter_dtype``, B nonzero (as after training)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(64, 96)).to(model_dtype)
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0"], use_dora=use_dora), model)
    layer = model[0]
    layer.lora_A["default"].to(adapter_dtype)
    layer.lora_B["default"].to(adapter_dtype)
    if use_dora:
        layer.lora_magnitude_vector["default"].to(adapter_dtype)
    nn.init.normal_(layer.lora_B["default"].weight, std=0.05)
    return layer


def saved_for_backward(layer: nn.Module, x: torch.Tensor) -> list[tuple[torch.dtype, int]]:
    saved: list[tuple[torch.dtype, int]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return saved


def test_bf16_model_keeps_no_fp32_copy_of_the_input_and_trains_fp32_weights() -> None:
    reference, layer = peft_layer(torch.bfloat16, torch.float32), peft_layer(torch.bfloat16, torch.float32)
    assert compute_in_input_dtype(layer)
    x = torch.randn(4, 32, 64, dtype=torch.bfloat16, requires_grad=True)
    # peft's own path saves an fp32 copy of x for lora_A's weight gradient; ours saves nothing fp32 of that size
    assert (torch.float32, x.numel()) in saved_for_backward(reference, x)
    assert not [s for s in saved_for_backward(layer, x) if s[0] == torch.float32 and s[1] >= x.numel()]
    out = layer(x)
    assert out.dtype == torch.bfloat16
    # the same sum as torch.autocast computes it: the rank-r weights cast to bf16, the matmuls in bf16
    a, b = (layer.lora_A["default"].weight, layer.lora_B["default"].weight)
    expected = layer.base_layer(x) + (x @ a.bfloat16().T) @ b.bfloat16().T * layer.scaling["default"]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(out.float(), reference(x).float(), rtol=0.02, atol=0.02)  # vs peft's fp32 adapters
    out.float().square().sum().backward()
    assert a.grad is not None and a.grad.dtype == torch.float32 and b.grad.dtype == torch.float32 and a.grad.abs().sum() > 0


def test_fp32_model_is_unchanged_to_the_bit() -> None:
    reference, layer = peft_layer(torch.float32, torch.float32), peft_layer(torch.float32, torch.float32)
    compute_in_input_dtype(layer)
    x = torch.randn(4, 32, 64, requires_grad=True)
    ours, theirs = layer(x), reference(x)
    assert torch.equal(ours, theirs)
    ours.sum().backward()
    theirs.sum().backward()
    for adapter in ("lora_A", "lora_B"):
        assert torch.equal(getattr(layer, adapter)["default"].weight.grad, getattr(reference, adapter)["default"].weight.grad)


def test_bf16_adapters_on_an_fp32_model_still_cast_the_input_down() -> None:
    reference, layer = peft_layer(torch.float32, torch.bfloat16), peft_layer(torch.float32, torch.bfloat16)
    compute_in_input_dtype(layer)
    x = torch.randn(4, 32, 64)
    assert torch.equal(layer(x), reference(x))  # peft's behaviour: the adapter computes in its own bf16


def test_fp16_model_keeps_peft_fp32_adapter_compute() -> None:
    """fp16 has no exponent room for adapter gradients without a loss scaler: the input is still cast to fp32."""
    reference, layer = peft_layer(torch.float16, torch.float32), peft_layer(torch.float16, torch.float32)
    compute_in_input_dtype(layer)
    x = torch.randn(4, 32, 64, dtype=torch.float16)
    assert torch.equal(layer(x), reference(x))
    assert (torch.float32, x.numel()) in saved_for_backward(layer, x.requires_grad_())


def test_dora_keeps_peft_input_cast() -> None:
    layer = peft_layer(torch.bfloat16, torch.float32, use_dora=True)
    assert not compute_in_input_dtype(layer)
    assert not isinstance(layer.lora_A["default"].__dict__.get("forward"), Bf16ComputeLinear)
    assert layer(torch.randn(2, 8, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_adapted_layer_copies_and_pickles_with_its_forward() -> None:
    layer = peft_layer(torch.bfloat16, torch.float32)
    compute_in_input_dtype(layer)
    x = torch.randn(2, 8, 64, dtype=torch.bfloat16)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        forward: Optional[Any] = clone.lora_A["default"].__dict__.get("forward")
        assert isinstance(forward, Bf16ComputeLinear) and forward.linear is clone.lora_A["default"]
        assert torch.equal(clone(x), layer(x))


def test_bf16_qlora_fit_trains_fp32_adapters_in_bf16(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any) -> None:
    model, recorder = gpt_factory(lr=1e-2), loss_recorder()
    trainer = trainer_factory(max_steps=8, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")], callbacks=[LoRA(r=8), recorder])
    trainer.fit(model, datamodule_factory())
    adapters = [m for m in model.modules() if isinstance(m, nn.Linear) and isinstance(m.__dict__.get("forward"), Bf16ComputeLinear)]
    assert adapters and all(m.weight.dtype == torch.float32 for m in adapters)
    assert recorder.losses[-1] < recorder.losses[0]


@pytest.mark.gpu
def test_on_cuda_a_bf16_forward_holds_no_fp32_input_copy() -> None:
    """The CPU test above counts saved tensors; this one asks the CUDA allocator (not yet run on a GPU)."""
    held = {}
    x = torch.randn(8, 512, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for name in ("peft", "ours"):
        layer = peft_layer(torch.bfloat16, torch.float32).cuda()
        if name == "ours":
            compute_in_input_dtype(layer)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        out = layer(x)  # the graph keeps what the backward reads
        torch.cuda.synchronize()
        held[name] = torch.cuda.memory_allocated() - before - out.numel() * out.element_size()
        out.float().sum().backward()
        del out, layer
    assert held["ours"] <= held["peft"] - x.numel() * 4, held
