"""``QuantizedPrecision`` over its ``Quantization``: the engine reaches it through ``SurgeryPlugin`` only, the targets
are listed once per surgery, and every checkpoint (``save_weights_only`` included) gets the plugin's part, taken once per
surgery."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, run_surgery
from lightning_hbm.precision import targets as targets_module
from lightning_hbm.surgery.protocol import SurgeryPlugin

PROBE = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))


def test_only_lightning_hbms_plugins_are_surgery_plugins() -> None:
    assert isinstance(QuantizedPrecision("int8-dynamic", dtype="float32"), SurgeryPlugin)
    assert issubclass(QuantizedPrecision, SurgeryPlugin)
    assert not isinstance(Precision(), SurgeryPlugin) and not isinstance(HalfPrecision("bf16-true"), SurgeryPlugin)


def test_the_plugin_reads_and_sets_its_plans_settings() -> None:
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"body.0": "none"})
    assert plugin.mode is plugin.config.mode and plugin.dtype == torch.float32 and plugin.rounding == "nearest"
    assert plugin.pinned_layer_modes == {"body.0": "none"} and not plugin.measures_layer_modes and plugin.name == "QuantizedPrecision(int8-dynamic)"
    fake = plugin.mode.for_fake_tensors()
    plugin.mode = fake  # the planner's fake-tensor twin
    assert plugin.config.mode is fake and plugin.quantization.config is plugin.config
    measured = QuantizedPrecision("nf4", dtype="float32", max_bytes_per_param=1.0)
    assert measured.measures_layer_modes and measured.pinned_layer_modes is None


def test_the_settings_are_one_frozen_config_checked_once() -> None:
    import dataclasses

    from lightning_hbm.precision import QuantizationConfig
    from lightning_hbm.precision.quantization import Quantization

    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", ignore_modules=["0"], sensitive_mode=("none",), min_cosine=0.9)
    config = plugin.config
    assert isinstance(config, QuantizationConfig) and config.mode is plugin.mode and config.dtype == torch.float32
    assert config.ignore_modules == ("0",) and config.sensitive_mode == ("none",) and config.correction_rank == 0
    assert plugin.sensitive_mode == ("none",) and plugin.min_cosine == 0.9 and plugin.measures_layer_modes  # read through
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rounding = "gptq"  # type: ignore[misc]
    # the config refuses what the plugin refuses, with the plugin's messages
    with pytest.raises(ValueError, match=r"QuantizedPrecision\(rounding='fast'\): use one of"):
        QuantizationConfig("int8-dynamic", "float32", rounding="fast")
    with pytest.raises(ValueError, match=r"ignore_modules='\[' is a string, read as a regex"):
        QuantizationConfig("int8-dynamic", "float32", ignore_modules="[")
    assert isinstance(plugin.quantization, Quantization)
    with pytest.raises(AttributeError, match=r"QuantizedPrecision.rounding is a setting.*build the plugin with rounding='gptq'"):
        plugin.rounding = "gptq"  # would be read by nothing
    with pytest.raises(AttributeError, match="no attribute 'moed'"):
        plugin.moed  # noqa: B018


def test_the_targets_are_listed_once_per_surgery(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    listed = targets_module._linear_listing

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return listed(*args, **kwargs)

    monkeypatch.setattr(targets_module, "_linear_listing", counting)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", quantize_head=True)
    # the plugin's checks, LoRA's checks (quantization_targets) and the quantization share one listing
    run_surgery(model, plugin, [LoRA(r=2, target_modules=["0", "2"])])
    assert len(calls) == 1
    assert sum(type(m).__name__ == "Int8DynamicLinear" for m in model.modules()) == 3


def _fit(trainer_factory: Any, llama_factory: Any, datamodule_factory: Any) -> tuple[Any, QuantizedPrecision]:
    plugin = QuantizedPrecision("int8-dynamic-smooth", dtype="float32", smoothing=0.5, rounding="gptq", probe_batch=PROBE)
    trainer = trainer_factory(max_steps=1, plugins=[plugin], callbacks=[LoRA(r=2)])
    trainer.fit(llama_factory(), datamodule_factory())
    return trainer, plugin


def test_every_checkpoint_gets_the_plugins_part_once(
    tmp_path: Any, trainer_factory: Any, llama_factory: Any, datamodule_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    added = []
    save = QuantizedPrecision.add_checkpoint_metadata
    monkeypatch.setattr(QuantizedPrecision, "add_checkpoint_metadata", lambda self, meta: (added.append(1), save(self, meta)))
    trainer, plugin = _fit(trainer_factory, llama_factory, datamodule_factory)
    assert len(added) == 1  # once per surgery: handed down to resume as data, which packs every checkpoint with it
    parts = {}
    for weights_only in (False, True):  # save_weights_only: Lightning calls no save hook, the checked IO packs
        path = tmp_path / f"weights_only_{weights_only}.ckpt"
        trainer.save_checkpoint(path, weights_only=weights_only)
        parts[weights_only] = torch.load(path, weights_only=True)["lightning_hbm"]
    assert len(added) == 1  # no save calls back up into the plugin
    assert plugin.rounding_digest is not None and plugin.input_shifts
    for meta in parts.values():
        assert meta["gptq_digest"] == plugin.rounding_digest
        assert meta["input_shifts"].keys() == plugin.input_shifts.keys()
        assert all(torch.equal(meta["input_shifts"][k], v) for k, v in plugin.input_shifts.items())
        keys = list(meta)
        assert keys.index("gptq_digest") + 1 == keys.index("input_shifts") > keys.index("configs")  # after the packing


def test_the_former_plan_names_warn_naming_the_new_ones_and_give_the_same_thing() -> None:
    """"plan" names the planner's (issue 54): ``SensitivityPlan`` -> ``SensitivityReport``, ``choose_plan`` ->
    ``choose_layer_modes``, ``plugin.plan_report`` -> ``plugin.sensitivity_report``, ``QuantizationPlan`` ->
    ``Quantization``, ``plugin.plan`` -> ``plugin.layer_modes``: the old names still work, with a DeprecationWarning
    naming the new one; the attributes stay read-only."""
    from lightning_hbm.precision import quantization, sensitivity

    for module, old, new in ((sensitivity, "SensitivityPlan", "SensitivityReport"), (sensitivity, "choose_plan", "choose_layer_modes"),
                             (quantization, "QuantizationPlan", "Quantization")):
        with pytest.warns(DeprecationWarning, match=rf"{module.__name__}\.{old} is deprecated: use {new} "):
            assert getattr(module, old) is getattr(module, new)
    with pytest.warns(DeprecationWarning, match="use SensitivityReport"):
        from lightning_hbm.precision.sensitivity import SensitivityPlan  # noqa: F401  # the import form warns too
    with pytest.raises(AttributeError, match="has no attribute 'choose_plans'"):
        sensitivity.choose_plans  # noqa: B018
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"0": "none"})
    for old, new in (("plan_report", "sensitivity_report"), ("plan", "layer_modes")):
        with pytest.warns(DeprecationWarning, match=rf"QuantizedPrecision\.{old} is deprecated: read plugin\.{new} "):
            assert getattr(plugin, old) == getattr(plugin, new)
        with pytest.raises(AttributeError):
            setattr(plugin, old, None)  # read-only, as the new name


def test_the_former_plan_names_of_session_29_warn_and_give_the_same_thing() -> None:
    """Issue 54, continued: the module ``precision.plan`` -> ``precision.quantization``, ``pinned_plan`` ->
    ``pinned_layer_modes``, ``measures_plan`` -> ``measures_layer_modes``, ``Quantization.saved_plan`` ->
    ``saved_layer_modes``: the old names still work, each with a DeprecationWarning naming the new one."""
    import importlib

    from lightning_hbm.precision import quantization

    old_module = importlib.import_module("lightning_hbm.precision.plan")  # importing it alone says nothing
    for name in ("Quantization", "GPTQRounding", "saved_meta", "DIGEST_KEY"):
        with pytest.warns(DeprecationWarning, match=rf"lightning_hbm\.precision\.plan is deprecated: import {name} from lightning_hbm\.precision\.quantization"):
            assert getattr(old_module, name) is getattr(quantization, name)
    with pytest.warns(DeprecationWarning, match=r"QuantizationPlan is deprecated: use lightning_hbm\.precision\.quantization\.Quantization"):
        from lightning_hbm.precision.plan import QuantizationPlan  # noqa: F401  # the import form warns too
    with pytest.raises(AttributeError, match="has no attribute 'Quantizaton'"):
        old_module.Quantizaton  # noqa: B018
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"0": "none"})
    for old, new in (("pinned_plan", "pinned_layer_modes"), ("measures_plan", "measures_layer_modes")):
        with pytest.warns(DeprecationWarning, match=rf"QuantizationConfig\.{old} is deprecated: read {new} "):
            assert getattr(plugin.config, old) == getattr(plugin.config, new)
        with pytest.warns(DeprecationWarning, match=rf"{old} is deprecated: read {new} "):
            assert getattr(plugin, old) == getattr(plugin, new)  # read through the plugin as before
    with pytest.warns(DeprecationWarning, match=r"Quantization\.saved_plan is deprecated: use Quantization\.saved_layer_modes "):
        assert plugin.quantization.saved_plan(None) is None and plugin.quantization.saved_layer_modes(None) is None

