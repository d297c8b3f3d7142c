"""Time to the first step (session 34): what the fit start ran that the checks did not need.

``benchmarks/time_to_first_step.py --breakdown`` separates the fit start of the default recipe on SmolLM2-135M
(benchmarks/README.md, Costs). A LightningModule without ``forward`` (the benchmark's, and the usual one: its
``training_step`` calls ``self.model``) ran its submodule once more before any measurement, only to see whether it
takes the probe batch (``probe.stepped_inputs``): 0.5 s of that CPU fit start. The first measuring forward now tells
it, and the submodule runs on the batch alone only where that forward fails. Real classes from tiny configs.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.probe import Stepped, forwarding, stepped_inputs

transformers = pytest.importorskip("transformers")

from tests.test_accuracy_check_cost_s33 import NoForward, llama  # noqa: E402  (one definition of each)


class WithForward(NoForward):
    def forward(self, **batch: Any) -> Any:
        return self.model(**batch)


class Prepared(NoForward):
    """No ``forward``, and a step that prepares the batch before calling the model: the model does not take it."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch["ids"]).logits.float().mean()


def _measured(module: pl.LightningModule, batch: Any) -> tuple[QuantizedPrecision, list[int]]:
    calls: list[int] = []
    handle = module.model.register_forward_pre_hook(lambda *args: calls.append(1))
    plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=batch)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            plugin.convert_module(module)
    finally:
        handle.remove()
    return plugin, calls


def test_a_module_without_forward_runs_its_model_only_for_the_measurements() -> None:
    """Was 3 forwards of the model at the check (one only to see it takes the probe batch), now 2: the reference and
    the quantized model's, with the same figure as the same model behind a ``forward``."""
    module = NoForward()
    plugin, calls = _measured(module, module.batch)
    assert len(calls) == 2, calls
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.cosine > 0.99
    assert "forward" not in vars(module) and plugin.quantization.measures.stepped is None
    same = WithForward()
    other, _ = _measured(same, same.batch)
    assert other.quantization.conv_accuracy is not None and other.quantization.conv_accuracy.cosine == measured.cosine


def test_a_model_that_does_not_take_the_probe_batch_is_said_with_the_fix_as_before(caplog: pytest.LogCaptureFixture) -> None:
    module = Prepared()
    with caplog.at_level(logging.INFO, logger="lightning_hbm"):
        plugin, _ = _measured(module, {"ids": module.batch["input_ids"]})
    assert plugin.quantization.conv_accuracy is None  # not measured: no one submodule takes the batch
    said = [r.getMessage() for r in caplog.records if "not measured at fit start" in r.getMessage()]
    assert said and "Prepared defines no forward for the probe batch" in said[0] and "define Prepared.forward" in said[0], said
    assert "forward" not in vars(module)


def test_a_measurement_that_fails_on_its_own_keeps_its_error() -> None:
    """The first call raising is not taken for "does not take the batch" when the model runs on the batch alone."""
    module = NoForward()
    stepped = stepped_inputs(module, module.batch, ["model.lm_head"])
    assert isinstance(stepped, Stepped) and stepped.takes_batch is None  # nothing run yet

    failed: list[int] = []

    def failing(*args: Any) -> None:  # the first call only: a measurement's own hook, say
        if not failed:
            failed.append(1)
            raise RuntimeError("a measurement's own error")

    handle = module.model.lm_head.register_forward_pre_hook(failing)
    with forwarding(module, lambda: stepped), pytest.raises(RuntimeError, match="a measurement's own error"):
        module(**module.batch)
    handle.remove()
    assert stepped.takes_batch is True
    with forwarding(module, lambda: stepped), torch.no_grad():
        assert module(**module.batch).logits.shape == (2, 16, 128)


def test_a_module_without_3d_parameters_is_not_asked_for_its_expert_count(monkeypatch: pytest.MonkeyPatch) -> None:
    """``kind_of`` runs on every module of every walk of the surgery; the experts kind asked each one for six expert
    count attributes first (each a raised ``AttributeError`` in ``nn.Module.__getattr__``): 2.9x the time of a walk's
    ``kind_of`` on SmolLM2-135M. Now only a module holding a 3-D parameter is asked; the kinds found are the same."""
    from lightning_hbm.layers import experts
    from lightning_hbm.layers.kinds import kind_of

    asked: list[nn.Module] = []
    real = experts.expert_counts
    monkeypatch.setattr(experts, "expert_counts", lambda module: asked.append(module) or real(module))
    model, _ = llama()
    kinds = {name: kind_of(sub) for name, sub in model.named_modules()}
    assert not asked
    assert sorted({kind.name for kind in kinds.values() if kind is not None}) == ["Linear"]
    assert sum(kind is not None for kind in kinds.values()) == 2 * 7 + 1  # each block's 7 Linears and the head

    class Experts(nn.Module):  # transformers' layout: [experts, out, in], the count on the module
        def __init__(self) -> None:
            super().__init__()
            self.num_experts = 4
            self.gate_up_proj = nn.Parameter(torch.zeros(4, 8, 6))
            self.down_proj = nn.Parameter(torch.zeros(4, 6, 4))

    kind = kind_of(Experts())
    assert kind is not None and kind.name == "Experts (3-D parameters)" and len(asked) == 1
