"""Issue 54, the structure step: what a ``Quantization`` measures on the model as built (``precision/measures.py``),
each measure handed its values (the targets, the settings a resume compares, the probe) instead of reading them back
from the ``Quantization``."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import Reference
from lightning_hbm.precision.config import QuantizationConfig
from lightning_hbm.precision.measures import Measures, on_fake_tensors, one_batch
from lightning_hbm.precision.quantization import CORRECTION_PROBE_TOKENS
from lightning_hbm.probe import Probe


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_the_measures_run_alone_on_the_targets_and_the_probe_handed_to_them() -> None:
    model, batch = _model(), torch.randn(64, 16)
    measures = Measures(QuantizationConfig("int8-dynamic-smooth", "float32", probe_batch=batch, correction_rank=2, smoothing="auto"), "QuantizedPrecision")
    assert measures.correction is not None and measures.smoothing is not None and measures.gptq is None
    drawn: list[Probe] = []

    def probe() -> Probe:
        drawn.append(Probe(model, batch))
        return drawn[-1]

    targets = [("0", model[0]), ("2", model[2])]
    measures.measure_model(model, targets, None, True, True, {}, probe)
    assert measures.correction.hessians is not None and set(measures.correction.hessians) == {"0", "2"}
    assert measures.smoothing.shifts is not None and set(measures.smoothing.shifts) <= {"0", "2"}
    assert drawn  # the probe handed in, not one of its own
    assert not on_fake_tensors(model)


def test_the_plugin_hands_its_parts_to_the_measures_and_reads_them_back() -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", rounding="gptq", correction_rank=2, probe_batch=torch.randn(64, 16))
    quantization = plugin.quantization
    assert quantization.gptq is quantization.measures.gptq and quantization.correction is quantization.measures.correction
    model = _model()
    plugin.convert_module(model)
    assert plugin.rounding_digest is not None and plugin.quantization.correction_report is not None
    assert quantization.measures.reference is None and quantization.measures.stepped is None  # handed on, then dropped
    assert quantization.probe(None) is quantization.config.probe_batch
    assert CORRECTION_PROBE_TOKENS == 2048  # importable where it was


def test_one_batch_tells_whether_the_check_measures_the_choices_batch() -> None:
    model, batch = _model(), torch.randn(4, 16)
    probe = Probe(model, batch)
    assert one_batch(lambda: probe, lambda: probe)

    def missing() -> Probe:
        raise ValueError("no batch")

    assert one_batch(missing, lambda: probe)  # nothing to draw: the choice says why, nothing is recorded either way
    assert not one_batch(lambda: probe, lambda: Probe(model, batch))


@pytest.mark.parametrize("said", [False, True])
def test_a_reference_that_cannot_be_recorded_is_said_once(said: bool) -> None:
    # the 4-bit mode choice said the model went unmeasured (handed down as ``said``): not said again
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    measures = Measures(QuantizationConfig("nf4-dq", "float32"), "QuantizedPrecision")
    measures.reference = Reference(["0"], ["0"])

    def missing() -> Probe:
        raise ValueError("no probe batch")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        measures.record_reference(model, missing, None, said)
    assert measures.reference is None
    said_here = [str(w.message) for w in caught if "is not measured at fit start" in str(w.message)]
    assert len(said_here) == (0 if said else 1), said_here
    if not said:
        assert "Sequential with its 1 convolutions stored quantized ('0')" in said_here[0] and "ValueError: no probe batch" in said_here[0]
