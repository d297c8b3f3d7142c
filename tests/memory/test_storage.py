"""Storage counting asks a quantized layer's format (shape, constants); optimizer states are plain containers."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.memory.categories import optimizer_state_tensors
from lightning_hbm.memory.storage import nested_tensors, parameter_count, quantization_tensors, tensor_bytes


def small_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "nf4-torchao", "int8"])
def test_a_packed_weight_counts_its_unpacked_elements(mode: str) -> None:
    model = small_model()
    dense = parameter_count(model)
    quantize_model(model, mode, "float32", quantize_head=True)
    assert parameter_count(model) == dense == 128 * 64 + 64 + 64 * 10 + 10
    assert parameter_count(model, trainable=False) == 128 * 64 + 64 * 10  # the frozen bases, unpacked


def test_a_4bit_count_reads_the_layer_state_once_the_weight_lost_it() -> None:
    # FSDP2 swaps the weight for a DTensor shard: the QuantState kept on the layer is the only shape left
    model = small_model()
    quantize_model(model, "nf4-dq", "float32", quantize_head=True)
    packed = nn.Parameter(model[0].weight.data.clone(), requires_grad=False)  # a plain tensor: no quant_state
    model[0].weight = packed
    assert parameter_count(model[0]) == 128 * 64 + 64
    assert packed.numel() == 128 * 64 // 2  # what a count of the stored elements would say


def test_a_4bit_layer_constants_include_the_nested_state() -> None:
    model = small_model()
    quantize_model(model, "nf4-dq", "float32", quantize_head=True)
    state = model[0].weight.quant_state
    expected = {id(t) for t in (state.absmax, state.code, state.offset, state.state2.absmax, state.state2.code)}
    assert expected <= {id(t) for t in quantization_tensors(model[0])}
    # 128 block absmax in 8 bits, the 16-value NF4 code (fp32), the offset, one fp32 absmax of the absmax and
    # the 256-value code of the second quantization (fp32)
    assert tensor_bytes(quantization_tensors(model[0])) == 128 + 16 * 4 + 4 + 4 + 256 * 4


def test_bitsandbytes_optimizer_states_are_counted_as_plain_tensors() -> None:
    import bitsandbytes as bnb

    param = nn.Parameter(torch.randn(4096 + 64))  # above 4096 elements: bitsandbytes keeps 8-bit states
    optimizer = bnb.optim.AdamW8bit([param])
    param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state[param]
    assert {id(t) for t in optimizer_state_tensors(optimizer)} == {id(v) for v in state.values() if isinstance(v, torch.Tensor)}
    assert state["state1"].dtype == torch.uint8 and "absmax1" in state


def test_nested_tensors_walks_containers_only() -> None:
    a, b, c = torch.zeros(1), torch.zeros(2), torch.zeros(3)

    class Holder:
        def __init__(self) -> None:
            self.t = c

    found: list[Any] = list(nested_tensors({"x": [a, (b,)], "y": Holder(), "z": 3}))
    assert [id(t) for t in found] == [id(a), id(b)]
