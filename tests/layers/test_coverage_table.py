"""The coverage table (``lightning_hbm/layers/coverage_table.py``): its rows, kept in the model's record and read
through ``lightning_hbm.coverage_of`` (nothing set on the model), and the reason of every layer kept wide."""

from __future__ import annotations

import torch
from torch import nn

import lightning_hbm
from lightning_hbm import LoRA, QuantizedPrecision, coverage_of, record
from lightning_hbm.layers import report_coverage
from lightning_hbm.surgery import run_surgery


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 16))


def test_the_table_is_kept_in_the_record_and_read_through_coverage_of() -> None:
    """Issue 54: the table was also set on the user's model as ``lightning_hbm_coverage``; it lives in the record."""
    model = _model()
    assert coverage_of(model) is None  # nothing reported yet
    run_surgery(model, QuantizedPrecision("nf4-dq", dtype="float32"), [], batch=torch.randn(2, 16))
    rows = report_coverage(model, quantizing=True)
    assert lightning_hbm.coverage_of(model) is rows is record.coverage_of(model)
    assert {r.kind: r.quantized for r in rows}["Linear"] == 2 * (16 * 16 + 16)  # weights and biases
    assert [key for m in model.modules() for key in vars(m) if "lightning_hbm" in key] == []


def test_an_adapted_layer_kept_wide_has_its_reason() -> None:
    """Issue 53: coverage() gave a reason only to layers neither quantized nor adapted; a layer kept wide but adapted
    (here by ``ignore_modules``) had none in the table printed at fit start."""
    model = _model()
    run_surgery(model, QuantizedPrecision("nf4-dq", dtype="float32", ignore_modules=["2"]), [LoRA(r=2, target_modules=["0", "2"])], batch=torch.randn(2, 16))
    rows = {r.kind: r for r in report_coverage(model, quantizing=True)}
    assert rows["Linear"].reasons == {"QuantizedPrecision(ignore_modules=...); adapted by LoRA": 16 * 16 + 16}
