"""bitsandbytes 4-bit storage: a 16-bit run's weight unpacks straight into its compute dtype in the backward."""

from __future__ import annotations

import copy

import pytest
import torch
from bitsandbytes.functional import dequantize_4bit
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.precision import bnb as bnb_format
from lightning_hbm.surgery import run_surgery


def _quantized(mode: str, dtype: str) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 2048), nn.Linear(2048, 256))
    return run_surgery(model, QuantizedPrecision(mode, dtype=dtype), [])


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4"])
def test_a_bf16_runs_state_unpacks_in_bf16_to_the_same_values(mode: str) -> None:
    layer = _quantized(mode, "bfloat16")[0]
    state = layer.weight.quant_state
    assert state.dtype == torch.bfloat16  # the weight was fp32 when quantized
    wide = copy.copy(state)
    wide.dtype = torch.float32
    assert torch.equal(dequantize_4bit(layer.weight.data, state), dequantize_4bit(layer.weight.data, wide).to(torch.bfloat16))
    assert _quantized(mode, "float32")[0].weight.quant_state.dtype == torch.float32  # an fp32 run: unchanged


def _step_peak_and_grad(model: nn.Module) -> tuple[int, torch.Tensor]:
    x = torch.randn(4, 256, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1), requires_grad=True)

    def step() -> None:
        model(x).float().square().sum().backward()

    peak = torch_peak_bytes(step, model)
    x.grad = None
    step()
    return peak, x.grad.clone()


def test_the_backward_holds_no_fp32_copy_of_the_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    # bitsandbytes' MatMul4Bit.backward: dequantize_4bit(B, ctx.state).to(grad.dtype); with an fp32 state that was an
    # fp32 copy (2 MiB for a 2048 x 256 weight) beside the bf16 one
    peak, grad = _step_peak_and_grad(_quantized("nf4-dq", "bfloat16"))
    monkeypatch.setattr(bnb_format, "_unpack_in_compute_dtype", lambda layer: None)  # the rule before
    old_peak, old_grad = _step_peak_and_grad(_quantized("nf4-dq", "bfloat16"))
    assert old_peak - peak >= 2048 * 256 * 3, (old_peak, peak)  # measured: 3.70 MB -> 1.63 MB
    assert torch.equal(grad, old_grad)
