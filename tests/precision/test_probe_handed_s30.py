"""Issue 54, the structure step: the measures of one quantization are handed the model and its probe batch once (a
``lightning_hbm.probe.Probe``) instead of each taking them apart and drawing the batch again."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.measures import Measures
from lightning_hbm.precision.smoothing import choose_smoothing
from lightning_hbm.probe import Probe, forward_on, input_absmax, probe_output


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_the_measures_of_one_surgery_draw_the_probe_batch_once(monkeypatch: pytest.MonkeyPatch) -> None:
    # the calibrated correction's input statistics and the smoothing both measure: one draw (was one each)
    drawn: list[Any] = []
    real = Measures.probe
    monkeypatch.setattr(Measures, "probe", lambda self, trainer: drawn.append(trainer) or real(self, trainer))
    model = _model()
    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", correction_rank=2, probe_batch=torch.randn(64, 16))
    plugin.convert_module(model)
    assert plugin.quantization.smoothing_report is not None and plugin.quantization.correction_report is not None
    assert len(drawn) == 1


@pytest.mark.parametrize("settings", [dict(rounding="gptq", max_bytes_per_param=4.0), dict(correction_rank=2, min_cosine=0.9)])
def test_the_checks_and_the_layer_modes_choice_share_the_one_draw(monkeypatch: pytest.MonkeyPatch, settings: dict) -> None:
    # GPTQ statistics or the correction's, then the sensitivity-aware choice: one draw per surgery (was two)
    drawn: list[Any] = []
    real = Measures.probe
    monkeypatch.setattr(Measures, "probe", lambda self, trainer: drawn.append(trainer) or real(self, trainer))
    model = _model()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=torch.randn(64, 16), **settings)
    plugin.convert_module(model)
    assert plugin.sensitivity_report is not None
    assert len(drawn) == 1


def test_a_probe_runs_the_functions_it_names_on_its_model_and_batch() -> None:
    model, batch = _model(), torch.randn(8, 16)
    probe = Probe(model, batch)
    assert torch.equal(probe.output(), probe_output(model, batch))
    assert torch.equal(probe.forward(), forward_on(model, batch))
    layers = {"0": model[0], "2": model[2]}
    (absmax, output), (want, want_output) = probe.input_absmax(layers), input_absmax(model, layers, batch)
    assert torch.equal(output, want_output) and all(torch.equal(absmax[n], want[n]) for n in layers)
    model.train()
    with probe.eval_no_grad():
        assert not model.training and not torch.is_grad_enabled()
    assert model.training
    with probe.recording_calls({"0"}) as calls:
        probe.output()
    assert [call.key for call in calls] == [("0", 0)]


def test_the_smoothing_measures_the_same_on_a_probe_as_on_its_batch() -> None:
    model, batch = _model(), torch.randn(64, 16)
    given, handed = (choose_smoothing(model, ["0", "2"], "auto", "float32", probe) for probe in (batch, Probe(model, batch)))
    assert given.alphas == handed.alphas and given.layer_errors == handed.layer_errors
    assert (given.cosine_before, given.cosine_after) == (handed.cosine_before, handed.cosine_after)
    assert all(torch.equal(given.shifts[n], handed.shifts[n]) for n in given.shifts)
