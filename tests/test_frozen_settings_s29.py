"""Issue 54, settings as typed, immutable configs: ``LoRAConfig.rank_pattern`` / ``alpha_pattern`` and
``QuantizationConfig.layer_modes`` / ``sensitive_mode`` cannot be changed once checked; the friendly constructors still
take dicts and lists, and build the same model; copies, pickles and checkpoints keep plain values."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora import LoRAConfig
from lightning_hbm.precision import QuantizationConfig


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8))


def test_the_lora_patterns_cannot_be_changed_after_the_check() -> None:
    lora = LoRA(r=4, rank_pattern={"0": 8}, alpha_pattern={"2": 16.0})
    for pattern in (lora.config.rank_pattern, lora.config.alpha_pattern, lora.rank_pattern):
        assert pattern is not None
        with pytest.raises(TypeError, match="does not support item assignment"):
            pattern["4"] = 2  # type: ignore[index]
        assert not hasattr(pattern, "update") and not hasattr(pattern, "pop") and not hasattr(pattern, "clear")
    assert lora.config.rank_pattern == {"0": 8} and lora.config.alpha_pattern == {"2": 16.0}


def test_the_quantization_layer_modes_and_sensitive_modes_cannot_be_changed() -> None:
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"2": "none"}, sensitive_mode=["none"])
    config = plugin.config
    assert config.layer_modes is not None
    with pytest.raises(TypeError, match="does not support item assignment"):
        config.layer_modes["0"] = "none"  # type: ignore[index]
    assert config.sensitive_mode == ("none",)
    with pytest.raises(AttributeError):
        config.sensitive_mode.append("int8")  # type: ignore[union-attr]
    assert dict(config.layer_modes) == {"2": "none"}
    # the checkpoint's settings are plain values (a list and a dict, as before: older checkpoints compare equal)
    assert plugin.resume_config()["layer_modes"] == {"2": "none"} and type(plugin.resume_config()["layer_modes"]) is dict


def test_built_from_dicts_the_lora_model_is_the_one_the_patterns_say() -> None:
    model = _model()
    lora = LoRA(r=4, alpha=8.0, rank_pattern={"0": 8}, alpha_pattern={"2": 16.0}, target_modules=["0", "2", "4"])
    lora.transform_model(model)
    first, second, last = model[0], model[2], model[4]
    assert first.r["default"] == 8 and first.lora_A["default"].weight.shape == (8, 16)
    assert second.r["default"] == 4 and second.scaling["default"] == pytest.approx(16.0 / 4)
    assert last.r["default"] == 4 and last.scaling["default"] == pytest.approx(8.0 / 4)
    saved = lora.resume_config()
    assert type(saved["rank_pattern"]) is dict and saved["rank_pattern"] == {"0": 8} and saved["alpha_pattern"] == {"2": 16.0}


def test_built_from_a_dict_the_quantized_model_keeps_the_pinned_layer() -> None:
    model = _model()
    QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"2": "none"}).convert_module(model)
    assert type(model[2]) is nn.Linear and type(model[0]) is not nn.Linear and type(model[4]) is not nn.Linear


def test_copies_and_pickles_keep_the_frozen_settings() -> None:
    lora_config = LoRAConfig(r=4, rank_pattern={"0": 8}, alpha_pattern={"2": 16.0})
    quant_config = QuantizationConfig("int8-dynamic", "float32", layer_modes={"2": "none"}, sensitive_mode=["none"])
    for config in (lora_config, quant_config):
        for copied in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
            for field in ("rank_pattern", "alpha_pattern", "layer_modes", "sensitive_mode"):
                if hasattr(config, field):
                    assert getattr(copied, field) == getattr(config, field)
    assert dataclasses.replace(lora_config, r=8).rank_pattern == {"0": 8}
    # a config built from another's frozen values is the same config
    assert LoRAConfig(r=4, rank_pattern=lora_config.rank_pattern, alpha_pattern=lora_config.alpha_pattern) == lora_config


def test_the_friendly_constructors_take_the_frozen_values_of_another_config() -> None:
    lora = LoRA(r=4, rank_pattern={"0": 8}, alpha_pattern={"2": 16.0})
    again = LoRA(r=4, rank_pattern=lora.rank_pattern, alpha_pattern=lora.alpha_pattern)
    assert again.config == lora.config
    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"2": "none"}, sensitive_mode=["none"])
    other = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes=plugin.config.layer_modes, sensitive_mode=plugin.config.sensitive_mode)
    assert other.resume_config() == plugin.resume_config()
