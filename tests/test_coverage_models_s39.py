"""Coverage round four (session 39, issue 53): decoders, vision-language, audio-language, vision and time-series
models nobody here tried, through the default recipe (``benchmarks/coverage_s39.py``, the table in
benchmarks/README.md). What broke, each a test:

* Gemma 3n (``Gemma3nForCausalLM``) stopped at its first training step: ``Gemma3nTextAltUp.predict`` clamps its
  ``prediction_coefs`` weight in place through ``.data`` (``self.prediction_coefs.weight.data.clamp_(...)``, training
  only). The probe step saw the ``.data`` read but not the write (made on the alias ``.data`` returns), so the layer
  was stored quantized with a computed weight, and the clamp raised "clamp_ would write to a weight stored
  quantized". Now an alias (``.data``, ``.detach()``) of a followed weight is followed too: the write is seen and the
  layer is kept as built, with its reason in the coverage table.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests import families_s39 as families

transformers = pytest.importorskip("transformers")


def _default(module: Any, name: str) -> Any:
    from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
    from lightning_hbm.surgery import run_surgery

    batch = families.FAMILIES[name].batch(1)
    return run_surgery(module, QuantizedPrecision(), [LoRA(r=8, alpha=16), ActivationCheckpointing()], batch=batch), batch


def test_a_weight_clamped_in_place_through_data_is_kept_as_built_and_the_model_trains() -> None:
    """Gemma 3n: was "RuntimeError: lightning_hbm: clamp_ would write to a weight stored quantized" at the first step."""
    from lightning_hbm.layers.coverage_table import coverage

    torch.manual_seed(0)
    module = families.Task("gemma3n_text")
    if not hasattr(transformers, "Gemma3nForCausalLM"):
        pytest.skip("no Gemma3nForCausalLM")
    module, batch = _default(module, "gemma3n_text")
    module.train()
    loss = module.training_step(batch, 0)  # the clamp runs in training mode only
    loss.backward()
    assert torch.isfinite(loss)
    altup = module.model.model.layers[0].altup
    coefs = altup.prediction_coefs
    assert type(coefs) is torch.nn.Linear and coefs.weight.dtype == torch.bfloat16, type(coefs)  # as built, compute dtype
    reasons = {reason for row in coverage(module, quantizing=True, adapting=True) for reason in row.reasons}
    assert any("read directly by Gemma3nTextDecoderLayer.forward" in r and "kept in the compute dtype" in r for r in reasons), reasons
    assert coefs.weight.abs().max() <= module.model.config.altup_coef_clip  # the model's own clamp ran on its weight


class _ClampsLater(torch.nn.Module):
    """Reads ``proj.weight`` directly (served from the storage), and from its second call on clamps it in place: a
    write the probe step (the first call) cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.proj, self.calls = torch.nn.Linear(64, 64), 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls > 1:
            self.proj.weight.data.clamp_(-1, 1)
        return torch.nn.functional.linear(x, self.proj.weight, self.proj.bias)


def test_a_write_the_probe_did_not_see_names_the_layer_and_its_fix() -> None:
    """Was: "... Keep this layer as built: QuantizedPrecision(ignore_modules=[<its name>])", no name."""
    from lightning_hbm import QuantizedPrecision
    from lightning_hbm.layers.read_weight import ReadableLinear
    from lightning_hbm.surgery import run_surgery

    model = torch.nn.Sequential(_ClampsLater())
    x = torch.randn(2, 64)
    model = run_surgery(model, QuantizedPrecision(), [], batch=x)
    assert isinstance(model[0].proj, ReadableLinear)
    with pytest.raises(RuntimeError, match=r"clamp_ would write to the weight of '0\.proj' stored quantized .*read directly by "
                       r"_ClampsLater\.forward.*ignore_modules=\['0\.proj'\]"):
        model(x.to(torch.bfloat16))


def test_experts_with_a_plain_activation_function_are_quantized_and_train() -> None:
    """LFM2-MoE (``Lfm2MoeExperts.act_fn = F.silu``, a function, not a module): was "TypeError: cannot assign
    'torch.nn.functional.silu' as child module 'act_fn'" when its experts were split into Linears, before any step."""
    from lightning_hbm.layers.experts import LinearExperts

    if not hasattr(transformers, "Lfm2MoeForCausalLM"):
        pytest.skip("no Lfm2MoeForCausalLM")
    torch.manual_seed(0)
    module, batch = _default(families.Task("lfm2_moe"), "lfm2_moe")
    experts = [m for m in module.modules() if isinstance(m, LinearExperts)]
    assert experts and all(e.act_fn(torch.ones(1)).item() == pytest.approx(torch.nn.functional.silu(torch.ones(1)).item()) for e in experts)
    module.train()
    loss = module.training_step(batch, 0)
    loss.backward()
    assert torch.isfinite(loss)
