"""Issue 54, the structure step: ``Quantization`` down to its steps. The checks' step (the measures, the layer modes once,
the reference) is :func:`~lightning_hbm.precision.mode_choice.measure_and_choose`, returning what it chose; which run's
surgery took the layer modes belongs to the resume face (:class:`~lightning_hbm.precision.saved_settings.SavedSettings`);
the accuracy check's forward leaves the bitsandbytes layers as quantized (``forward_as_quantized``)."""

from __future__ import annotations

import pickle
import warnings

import lightning.pytorch as pl
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm.precision.mode_choice import ModesChosen, measure_and_choose


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))


def test_the_checks_step_returns_what_it_chose_and_the_quantization_keeps_it() -> None:
    model, batch = _mlp(), torch.randn(32, 16)
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", min_cosine=0.995, probe_batch=batch)
    quantization = plugin.quantization
    targets = quantization.targets(model)
    chosen = measure_and_choose(model, targets, None, False, quantization.measures, quantization.saved, quantization.settings(), None)
    assert isinstance(chosen, ModesChosen) and chosen.report is not None and chosen.layer_modes == chosen.report.modes
    assert chosen.conv is None and chosen.recorded == ["0", "2"]  # no Trainer: every quantized layer recorded
    assert quantization.measures.reference is not None  # handed on to the quantization
    assert all(type(model[i]) is nn.Linear for i in (0, 2))  # the checks change nothing
    plugin.check_model(model)
    assert plugin.layer_modes == chosen.layer_modes and plugin.sensitivity_report is not None  # kept by the Quantization


def test_which_run_took_the_layer_modes_belongs_to_the_resume_face_and_is_not_pickled() -> None:
    quantization = QuantizedPrecision("nf4-dq", dtype="float32", min_cosine=0.995).quantization
    ran, other = pl.Trainer(logger=False), pl.Trainer(logger=False)
    quantization.layer_modes = {"0": "int8", "2": "nf4-dq"}  # as a surgery of `ran` chose them
    quantization.saved.taken_by(ran)
    assert quantization.resume_config(ran)["layer_modes"] == {"0": "int8", "2": "nf4-dq"}
    assert "layer_modes" not in quantization.resume_config(other)  # a reused plugin: not that run's plan
    copied = pickle.loads(pickle.dumps(quantization))
    assert copied.saved._modes_run is None and copied.resume_config(None)["layer_modes"] == {"0": "int8", "2": "nf4-dq"}


def test_the_accuracy_checks_forward_leaves_int8_layers_as_quantized() -> None:
    model = _mlp()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        QuantizedPrecision("int8", dtype="float32").convert_module(model)
    assert type(model[0]).__name__ == "Linear8bitLt"
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with bnb_compat.forward_as_quantized(model), torch.no_grad():
        model(torch.randn(4, 16))
    assert all(getattr(model[i].weight, "SCB", None) is not None for i in (0, 2))  # the int8 states back on the weight
    model.load_state_dict(saved)  # a checkpoint being resumed loads into it next
