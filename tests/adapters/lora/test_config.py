"""``LoRAConfig``: the callback's settings, checked once and frozen (issue 54: settings as typed configs)."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest

from lightning_hbm import LoRA
from lightning_hbm.adapters.lora import LoRAConfig


def test_the_callback_builds_its_config_from_its_arguments() -> None:
    lora = LoRA(r=16, alpha=32, target_modules=("q_proj", "v_proj"), rank_pattern={"v_proj": 8})
    assert lora.config == LoRAConfig(r=16, alpha=32.0, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8})
    # normalised once: names kept as a tuple (frozen; a checkpoint stores a list), alpha a float
    assert lora.config.target_modules == ("q_proj", "v_proj") and isinstance(lora.config.alpha, float)
    assert lora.resume_config()["target_modules"] == ["q_proj", "v_proj"]
    # read as the callback's own, as before
    assert (lora.r, lora.alpha, lora.target_modules, lora.rank_pattern) == (16, 32.0, ("q_proj", "v_proj"), {"v_proj": 8})


def test_resume_settings_are_the_configs() -> None:
    lora = LoRA(r=4, modules_to_save=["head"], use_rslora=True)
    assert lora.resume_config() == lora.config.resume_config()
    assert lora.resume_config()["modules_to_save"] == ["head"] and "dropout" not in lora.resume_config()


def test_a_setting_written_afterwards_is_refused() -> None:
    lora = LoRA(r=8)
    with pytest.raises(AttributeError, match=r"LoRA\.r is a setting.*LoRA\(r=16\)"):
        lora.r = 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        lora.config.r = 16  # type: ignore[misc]
    assert lora.r == 8


def test_copies_and_pickles_keep_the_settings() -> None:
    lora = LoRA(r=8, exclude_modules=["lm_head"])
    for twin in (copy.deepcopy(lora), pickle.loads(pickle.dumps(lora))):
        assert twin.config == lora.config and twin.exclude_modules == ("lm_head",)
    with pytest.raises(AttributeError, match="no attribute 'not_a_setting'"):
        _ = lora.not_a_setting


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"r": 2.0}, TypeError, r"r must be an int.*got 2\.0"),
        ({"r": 0}, ValueError, r"r must be a positive rank, got r=0"),
        ({"alpha": float("nan")}, ValueError, r"alpha must be a positive number"),
        ({"dropout": 1.0}, ValueError, r"dropout must be in \[0, 1\)"),
        ({"target_modules": "("}, ValueError, r"target_modules='\(' is not a valid regex"),
        ({"exclude_modules": "all-linear"}, ValueError, r"exclude_modules='all-linear' is not allowed"),
        ({"target_modules": []}, TypeError, r"target_modules must be 'all-linear', a regex string or a non-empty list"),
        ({"modules_to_save": "head"}, TypeError, r"modules_to_save must be a list of module names"),
        ({"adapter_dtype": "int4"}, ValueError, r"adapter_dtype must be 'float32' or 'bfloat16', got 'int4'"),
        ({"bias": "some"}, ValueError, r"bias must be 'none', 'all' or 'lora_only'"),
        ({"init_lora_weights": "corda"}, ValueError, r"init_lora_weights must be True, False"),
    ],
)
def test_the_config_refuses_what_the_callback_refuses(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        LoRAConfig(**kwargs)
    # the callback checks the argument types first (check_args: "LoRA(r=2.0): wrong type float"), then builds the config
    with pytest.raises(error, match=next(iter(kwargs))):
        LoRA(**kwargs)


def test_the_names_cannot_be_appended_to_and_the_users_list_is_copied() -> None:
    """A frozen config held lists: ``lora.config.target_modules.append(...)`` changed the settings after the check
    (and after a checkpoint recorded them), and so did the user's own list, which the config kept."""
    names, saved = ["q_proj", "v_proj"], ["lm_head"]
    config = LoRAConfig(target_modules=names, exclude_modules=("k_proj",), modules_to_save=saved)
    for field in ("target_modules", "exclude_modules", "modules_to_save"):
        value = getattr(config, field)
        assert isinstance(value, tuple), field
        with pytest.raises(AttributeError, match="append"):
            value.append("o_proj")
    names.append("o_proj")
    saved.clear()
    assert config.target_modules == ("q_proj", "v_proj") and config.modules_to_save == ("lm_head",)
    # a checkpoint records (and a resume compares) the arguments as written, lists: older checkpoints still match
    assert config.resume_config()["target_modules"] == ["q_proj", "v_proj"] and config.resume_config()["exclude_modules"] == ["k_proj"]
    assert LoRA(modules_to_save=["head"]).modules_to_save == ["head"]  # the callback's resolved list, as before
    assert dataclasses.replace(config, r=4).target_modules == ("q_proj", "v_proj")  # a tuple given back is accepted


def test_the_callback_is_built_from_a_config() -> None:
    """Issue 54: the callback takes its typed settings (peft's ``LoraConfig`` style), the keyword face unchanged."""
    config = LoRAConfig(r=16, alpha=32, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8}, use_rslora=True)
    lora = LoRA.from_config(config)
    assert type(lora) is LoRA and lora.config == config
    assert lora.resume_config() == LoRA(r=16, alpha=32, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 8}, use_rslora=True).resume_config()
    # every field round-trips, the defaults included
    assert LoRA.from_config(LoRAConfig()).config == LoRA().config
    full = LoRAConfig(
        r=4, alpha=8, dropout=0.1, target_modules="model.*proj", exclude_modules=["o_proj"], modules_to_save=[],
        adapter_dtype="bfloat16", full_checkpoint=True, allow_base_change=True, use_dora=True,
        init_lora_weights="gaussian", bias="lora_only", alpha_pattern={"q_proj": 4.0},
    )  # fmt: skip
    assert LoRA.from_config(full).config == full
    # another callback like this one at another rank
    assert LoRA.from_config(dataclasses.replace(lora.config, r=32)).config.rank_pattern == {"v_proj": 8}


def test_a_config_given_as_the_rank_or_a_dict_names_the_fix() -> None:
    with pytest.raises(TypeError, match=r"LoRA\(LoRAConfig\(r=16.*not its rank r.*LoRA\.from_config\(config\)"):
        LoRA(LoRAConfig(r=16))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"LoRA\.from_config\(\{'r': 16\}\): pass a LoRAConfig.*LoRA\(\*\*settings\)"):
        LoRA.from_config({"r": 16})  # type: ignore[arg-type]
