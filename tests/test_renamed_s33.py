"""Renamed names (issue 54, session 33): "plan" names the planner's alone.

- A checkpointed block's setup (formerly ``_BlockPlan``, read with ``record.checkpoint_plan``, held as
  ``CheckpointedForward.plan``) is ``_BlockSetup`` / ``record.checkpoint_setup`` / ``CheckpointedForward.setup``. A
  model pickled before the rename names the old class and key: it still loads, and its blocks still checkpoint.
- Every former name that warns is listed in docs/extending.md's "Renamed names" table, with the release that removes it.
"""

from __future__ import annotations

import importlib
import pickle
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from lightning_hbm import ActivationCheckpointing, QuantizedPrecision, record
from lightning_hbm.activations import checkpointing

ROOT = Path(__file__).resolve().parents[1]


def _llama() -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.train()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _as_pickled_before_the_rename(model: torch.nn.Module) -> bytes:
    """``model`` pickled as code before session 33 wrote it: protocol 0 spells each class path and dict key as text,
    so the new class name and key are replaced by the former ones (``_BlockPlan``, ``"plan"``)."""
    # session 34 moved the classes to activations/block_forward.py: before, they were named under checkpointing
    data = pickle.dumps(model, protocol=0).replace(b"lightning_hbm.activations.block_forward\n", b"lightning_hbm.activations.checkpointing\n")
    new_class = b"\n_BlockSetup\n"
    new_key = b"Vsetup\n"  # the setup's key in each CheckpointedForward's __dict__ (pickled once, then memoized)
    assert data.count(new_class) == 1 and data.count(new_key) == 1
    old = data.replace(new_class, b"\n_BlockPlan\n").replace(new_key, b"Vplan\n")
    assert b"_BlockSetup" not in old and b"lightning_hbm.activations.checkpointing\n_BlockPlan\n" in old
    return old


def test_a_model_pickled_under_the_former_names_loads_and_its_blocks_still_checkpoint() -> None:
    """transformers' Llama, checkpointed, pickled with the old class path and key: it loads, each block's setup is a
    ``_BlockSetup`` found by ``checkpoint_setup``, and a training step gives the loss and gradients of the model it was
    pickled from (the checkpointed forward runs: the old key was read back as ``setup``)."""
    model = _llama()
    callback = ActivationCheckpointing()
    callback.transform_model(model)
    assert callback.checkpointed == ["model.layers.0", "model.layers.1", "model.layers.2"]
    old = pickle.loads(_as_pickled_before_the_rename(model))

    assert record.checkpointed_blocks(old) == record.checkpointed_blocks(model) == callback.checkpointed
    for block, twin in zip(model.model.layers, old.model.layers):
        setup = record.checkpoint_setup(twin)
        assert type(setup) is checkpointing._BlockSetup and setup is not record.checkpoint_setup(block)
        assert "plan" not in vars(twin.forward) and twin.forward.setup is setup and twin.forward.block is twin
        assert setup.name == record.checkpoint_setup(block).name
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, ids)
    old_loss, old_grads = _loss_and_grads(old, ids)
    assert torch.equal(loss, old_loss) and len(grads) == len(old_grads) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads, old_grads))
    assert checkpointing._BlockPlan is checkpointing._BlockSetup  # the alias pickle finds


def test_the_former_checkpoint_names_warn_and_give_the_same_thing() -> None:
    model = _llama()
    ActivationCheckpointing().transform_model(model)
    block = model.model.layers[0]
    with pytest.warns(DeprecationWarning, match=r"lightning_hbm\.record\.checkpoint_plan is deprecated: use checkpoint_setup"):
        assert record.checkpoint_plan(block) is record.checkpoint_setup(block) is not None  # type: ignore[attr-defined]
    with pytest.warns(DeprecationWarning, match="use checkpoint_setup"):
        from lightning_hbm.record import checkpoint_plan  # type: ignore[attr-defined]  # noqa: F401  # the import form warns too
    with pytest.warns(DeprecationWarning, match=r"CheckpointedForward\.plan is deprecated: read its setup"):
        assert block.forward.plan is block.forward.setup  # type: ignore[attr-defined]
    with pytest.raises(AttributeError, match="has no attribute 'checkpoint_plans'"):
        record.checkpoint_plans  # type: ignore[attr-defined]  # noqa: B018


def _former_names() -> list[tuple[str, str, Callable[[], Any]]]:
    """(the name in the docs' table, the warning's text, a read of the former name)."""
    from lightning_hbm.precision import quantization, sensitivity

    plugin = QuantizedPrecision("int8-dynamic", dtype="float32", layer_modes={"0": "none"})
    model = _llama()
    ActivationCheckpointing().transform_model(model)
    forward = model.model.layers[0].forward
    old_module = importlib.import_module("lightning_hbm.precision.plan")
    read_plan = importlib.import_module("lightning_hbm.precision.read_plan")
    import lightning_hbm

    return [
        ("lightning_hbm.precision_plugin", r"precision_plugin\('int8'\) is deprecated", lambda: lightning_hbm.precision_plugin("int8")),
        ("QuantizedPrecision.plan", r"QuantizedPrecision\.plan is deprecated", lambda: plugin.plan),
        ("QuantizedPrecision.plan_report", r"QuantizedPrecision\.plan_report is deprecated", lambda: plugin.plan_report),
        ("QuantizedPrecision.pinned_plan", r"QuantizedPrecision\.pinned_plan is deprecated", lambda: plugin.pinned_plan),
        ("QuantizationConfig.pinned_plan", r"QuantizationConfig\.pinned_plan is deprecated", lambda: plugin.config.pinned_plan),
        ("QuantizedPrecision.measures_plan", r"QuantizedPrecision\.measures_plan is deprecated", lambda: plugin.measures_plan),
        ("QuantizationConfig.measures_plan", r"QuantizationConfig\.measures_plan is deprecated", lambda: plugin.config.measures_plan),
        ("lightning_hbm.precision.plan", r"precision\.plan is deprecated: import Quantization", lambda: old_module.Quantization),
        ("QuantizationPlan", r"precision\.plan\.QuantizationPlan is deprecated", lambda: old_module.QuantizationPlan),
        ("QuantizationPlan", r"quantization\.QuantizationPlan is deprecated", lambda: quantization.QuantizationPlan),
        ("Quantization.saved_plan", r"Quantization\.saved_plan is deprecated", lambda: plugin.quantization.saved_plan(None)),
        ("lightning_hbm.precision.read_plan", r"read_plan is deprecated: import is_read", lambda: read_plan.is_read),
        ("SensitivityPlan", r"sensitivity\.SensitivityPlan is deprecated", lambda: sensitivity.SensitivityPlan),
        ("choose_plan", r"sensitivity\.choose_plan is deprecated", lambda: sensitivity.choose_plan),
        ("greedy_plan", r"sensitivity\.greedy_plan is deprecated", lambda: sensitivity.greedy_plan),
        ("check_plan_args", r"sensitivity\.check_plan_args is deprecated: use check_layer_mode_args", lambda: sensitivity.check_plan_args),
        ("lightning_hbm.record.checkpoint_plan", r"record\.checkpoint_plan is deprecated", lambda: record.checkpoint_plan),  # type: ignore[attr-defined]
        ("CheckpointedForward.plan", r"CheckpointedForward\.plan is deprecated", lambda: forward.plan),
        # session 34: the convolutions' mode choice, and predict_parameter_bytes's argument (a {layer: mode} dict)
        ("CONV_PLAN_TARGET", r"sensitivity\.CONV_PLAN_TARGET is deprecated: use CONV_TARGET_COSINE \(the same value\)",
         lambda: sensitivity.CONV_PLAN_TARGET),
        ("unplanned_convs_warning", r"sensitivity\.unplanned_convs_warning is deprecated: use unmeasured_convs_warning",
         lambda: sensitivity.unplanned_convs_warning),
        ("planned_convs_warning", r"sensitivity\.planned_convs_warning is deprecated: use widened_convs_warning",
         lambda: sensitivity.planned_convs_warning),
        ("predict_parameter_bytes(module, plan=", r"predict_parameter_bytes\(plan=\.\.\.\) is deprecated: pass layer_modes=",
         lambda: sensitivity.predict_parameter_bytes(torch.nn.Linear(2, 2), plan={})),
    ]


def _renamed_table() -> str:
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("## Renamed names"):]
    section = section[: section.index("\n## ")]
    assert re.search(r"removed in \*\*\d+\.\d+\.\d+\*\*", section), "the table says the release that removes the names"
    return section


def test_every_former_name_warns_and_is_listed_in_the_renamed_table() -> None:
    """Each former name still gives its object with a DeprecationWarning, and docs/extending.md lists it."""
    table = _renamed_table()
    for listed, message, read in _former_names():
        with pytest.warns(DeprecationWarning, match=message):
            read()
        assert f"`{listed}" in table or f", `{listed}`" in table or f"{listed}`" in table, f"{listed} is not in docs/extending.md's Renamed names table"


def test_every_module_that_warns_of_a_former_name_is_covered_here() -> None:
    """A new DeprecationWarning in another module fails here: list its former name in docs/extending.md's "Renamed
    names" table (with the release that removes it) and in :func:`_former_names`."""
    warning = [str(p.relative_to(ROOT)) for p in sorted((ROOT / "lightning_hbm").rglob("*.py")) if "DeprecationWarning," in p.read_text()
               or "DeprecationWarning)" in p.read_text()]
    assert warning == [
        "lightning_hbm/precision/__init__.py",
        "lightning_hbm/precision/config.py",
        "lightning_hbm/precision/plan.py",
        "lightning_hbm/precision/plugin.py",
        "lightning_hbm/precision/quantization.py",
        "lightning_hbm/precision/read_plan.py",
        "lightning_hbm/precision/sensitivity.py",
        "lightning_hbm/record.py",
    ]
