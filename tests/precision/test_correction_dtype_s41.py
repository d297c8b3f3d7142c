"""The calibrated correction's factors are stored in the compute dtype (session 41 stored them in bf16 under fp32
compute; session 42 measured that worse as trained on SmolLM2-135M, +1.40 / +2.15 % above 16-bit LoRA against +0.75 /
+0.41 % with fp32 factors, and went back: ``storage_dtype``'s docstring). Every count follows the storage exactly: the
surgery's report, ``parameter_bytes``, the coverage table, the byte budget's fixed bytes and the planner; a resume keeps
the factors as the checkpoint holds them, a session-41 checkpoint's bf16 factors included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers import coverage
from lightning_hbm.layers.correction import LowRankCorrection, correction_of, storage_dtype
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import quantized_parameter_bytes
from lightning_hbm.precision.correction import corrected_layers
from lightning_hbm.precision.mode_choice import correction_bytes
from lightning_hbm.resume.sealing import seal

PROBE = torch.randint(0, 256, (4, 32), generator=torch.Generator().manual_seed(0))


def test_the_storage_dtype_is_the_compute_dtype() -> None:
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert storage_dtype(dtype) == dtype


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_factors_are_in_the_compute_dtype_and_every_count_follows_them_exactly(gpt_factory: Any, dtype: str) -> None:
    plain, corrected = gpt_factory(), gpt_factory()
    names = [n for n, m in plain.named_modules() if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")]
    budgeted = correction_bytes(plain, names, 4, getattr(torch, dtype))  # what a byte budget counts, before the surgery
    QuantizedPrecision("nf4-dq", dtype=dtype, probe_batch=PROBE).convert_module(plain)
    plugin = QuantizedPrecision("nf4-dq", dtype=dtype, probe_batch=PROBE, correction_rank=4)
    plugin.convert_module(corrected)
    stored = {}
    for name in corrected_layers(corrected):
        correction = correction_of(corrected.get_submodule(name))
        assert correction is not None
        assert correction.right.dtype == correction.left.dtype == getattr(torch, dtype), name
        stored[name] = sum(p.numel() * p.element_size() for p in correction.parameters())
    factors = sum(stored.values())
    shapes = {n: m.weight.shape for n, m in gpt_factory().named_modules() if n in stored}  # [out, in] before the surgery
    size = storage_dtype(getattr(torch, dtype)).itemsize
    assert stored == {n: min(4, *shape) * sum(shape) * size for n, shape in shapes.items()}  # r (in + out) x its bytes
    assert plugin.correction_report.bytes == factors
    assert parameter_bytes(corrected) - parameter_bytes(plain) == factors
    rows, plain_rows = coverage(corrected, quantizing=True, adapting=False), coverage(plain, quantizing=True, adapting=False)
    assert sum(r.bytes for r in rows) - sum(r.bytes for r in plain_rows) == factors
    assert {n: b for n, b in budgeted.items() if n in stored} == stored and budgeted.keys() == stored.keys()
    planned = [quantized_parameter_bytes(gpt_factory, "nf4-dq", dtype, correction_rank=rank) for rank in (0, 4)]
    assert planned[1] - planned[0] == factors


def test_16_bit_factors_compute_in_the_inputs_dtype_forward_and_backward() -> None:
    """A session-41 checkpoint's bf16 factors resumed under fp32 compute: widened to fp32, the input is not rounded to
    bf16 (before session 41: cast to the factors' dtype, so a bf16-stored correction computed in bf16)."""
    g = torch.Generator().manual_seed(0)
    right, left = torch.randn(4, 24, generator=g).bfloat16(), torch.randn(16, 4, generator=g).bfloat16()
    correction = LowRankCorrection(right, left)
    x = torch.randn(2, 5, 24, generator=g, requires_grad=True)
    term = correction(x)
    assert term.dtype == torch.float32
    torch.testing.assert_close(term, (x.detach() @ right.float().t()) @ left.float().t(), rtol=1e-6, atol=1e-6)
    grad = torch.randn(term.shape, generator=g)
    term.backward(grad)
    assert x.grad is not None and x.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, (grad @ left.float()) @ right.float(), rtol=1e-6, atol=1e-6)
    assert not right.requires_grad and correction.right.grad is None


def test_a_checkpoint_holding_bf16_factors_resumes_with_them_bit_for_bit(tmp_path: Path) -> None:
    """A run saved by session 41's version (bf16 factors under fp32 compute) goes on with its own factors, not
    refitted nor widened in storage."""
    from test_correction import _fit

    straight, _ = _fit(tmp_path / "straight", 2, PROBE)
    path = tmp_path / "straight" / "step=2.ckpt"
    checkpoint = torch.load(path, weights_only=False)
    state = checkpoint["lightning_hbm"]["state_dict"]
    factors = [k for k in state if ".lowrank_correction." in k]
    assert factors and all(state[k].dtype == torch.float32 for k in factors)  # what this version saves
    # as session 41's version saved them: rounded to bf16
    for key in factors:
        state[key] = state[key].bfloat16()
    old = tmp_path / "old.ckpt"
    seal(checkpoint)  # sealed as that version's save sealed it
    torch.save(checkpoint, old)
    resumed, plugin = _fit(tmp_path / "resumed", 3, PROBE, ckpt_path=old)
    assert plugin.correction_report.resumed
    got = resumed.state_dict()
    for key in factors:
        want = state[key]
        have = next(v for k, v in got.items() if k.endswith(key.split("model.", 1)[-1]) or k == key)
        assert have.dtype == torch.bfloat16 and torch.equal(have, want), key
