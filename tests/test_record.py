"""``lightning_hbm/record.py``: one typed record per model, one mark per layer, nothing set on the user's modules."""

from __future__ import annotations

import ast
import copy
import pickle
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
from torch import nn
from transformers import GPT2Config, GPT2LMHeadModel

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision, applied_transforms, coverage_of, quantize_model, record
from lightning_hbm.layers import find_layers, kind_of

PACKAGE = Path(__file__).resolve().parents[1] / "lightning_hbm"
STAMP = "_lightning_hbm_"


def _object_setattr_calls(tree: ast.AST) -> list[ast.Call]:
    """``object.__setattr__(...)`` calls, except a frozen dataclass normalising its own fields in ``__post_init__``."""
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name == "__post_init__":
            allowed |= {id(c) for c in ast.walk(node) if isinstance(c, ast.Call) and _is_self_call(c)}
    return [c for c in ast.walk(tree) if isinstance(c, ast.Call) and _is_object_setattr(c) and id(c) not in allowed]


def _is_object_setattr(call: ast.Call) -> bool:
    func = call.func
    return isinstance(func, ast.Attribute) and func.attr == "__setattr__" and isinstance(func.value, ast.Name) and func.value.id == "object"


def _is_self_call(call: ast.Call) -> bool:
    return _is_object_setattr(call) and bool(call.args) and isinstance(call.args[0], ast.Name) and call.args[0].id == "self"


def test_no_module_of_the_package_stamps_attributes_on_other_objects() -> None:
    """The old state bus: ``object.__setattr__(module, "_lightning_hbm_...", ...)`` at ~40 sites. None may come back."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        rel = path.relative_to(PACKAGE.parent)
        found += [f"{rel}:{n}: {STAMP}" for n, line in enumerate(text.splitlines(), 1) if STAMP in line]
        found += [f"{rel}:{c.lineno}: object.__setattr__" for c in _object_setattr_calls(ast.parse(text, str(path)))]
    assert found == []


def test_the_check_catches_a_stamp() -> None:
    bad = "def f(m):\n    object.__setattr__(m, 'x', 1)\n"
    own = "class C:\n    def __post_init__(self):\n        object.__setattr__(self, 'x', 1)\n"
    assert len(_object_setattr_calls(ast.parse(bad))) == 1 and _object_setattr_calls(ast.parse(own)) == []


def _no_stamps(*objects: Any) -> list[str]:
    # the old private stamps (_lightning_hbm_...) and the public one the coverage table was (lightning_hbm_coverage)
    return [f"{type(o).__name__}.{key}" for o in objects for key in vars(o) if key.startswith((STAMP, STAMP[1:]))]


def test_a_converted_model_carries_no_stamp_and_its_record_is_read_through_functions(
    llama_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    model = llama_factory()
    assert record.record_of(model) is None and record.applied_transforms(model) == []  # nothing before the surgery
    plugin = QuantizedPrecision("nf4", dtype="float32")
    lora, checkpointing = LoRA(r=4), ActivationCheckpointing()
    trainer_factory(max_steps=1, plugins=[plugin], callbacks=[lora, checkpointing]).fit(model, datamodule=datamodule_factory())

    assert _no_stamps(plugin, *model.modules(), *model.parameters()) == []
    assert applied_transforms(model) == record.applied_transforms(model) == ["QuantizedPrecision(nf4)", "LoRA", "ActivationCheckpointing"]
    entry = record.record_of(model)
    assert isinstance(entry, record.Record) and entry.as_built is record.as_built(model)
    assert set(entry.as_built) >= {"schema", "fingerprints"}
    assert set(entry.appliers) == {"LoRA", "ActivationCheckpointing"} and entry.appliers["LoRA"] == id(lora)
    assert coverage_of(model) is record.coverage_of(model) is not None  # the documented accessor, the record's rows
    assert record.checkpointed_blocks(model) == checkpointing.checkpointed != []
    # the output head: left alone by the quantization, with its reason
    heads = [sub for name, sub, _ in find_layers(model) if name.endswith("lm_head")]
    assert heads and record.left_alone(heads[0]) is not None and record.left_alone(heads[0])[1]


def test_a_quantized_conv1d_is_counted_as_one_through_its_mark() -> None:
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=64, n_head=2, vocab_size=64, n_positions=16))
    quantize_model(model, "nf4", dtype="float32")
    layer = model.transformer.h[0].attn.c_attn
    # the mode and rounding it was built in too (session 39: the export for the quantized base records them)
    assert record.mark_of(layer) == record.LayerMark(kind="Conv1D", quantized_as=("nf4", "nearest")) and kind_of(layer).name == "Conv1D"
    assert _no_stamps(*model.modules()) == []


def test_copies_keep_the_checkpointed_blocks_and_take_the_rest_only_through_copy_record(gpt_factory: Callable[..., Any]) -> None:
    """A checkpointed block's mark is its forward (copied with it); the record and the layer marks live outside the
    model, so a plain deepcopy or pickle is, to lightning_hbm, a model nobody changed until copy_record gives them."""
    model = gpt_factory()
    quantize_model(model, "nf4", dtype="float32")
    ActivationCheckpointing().transform_model(model)
    record.mark_applied(model, "X")
    head = record.left_alone(model.model.lm_head)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert record.checkpointed_blocks(twin) == record.checkpointed_blocks(model) != []
        assert record.checkpoint_setup(twin.model.h[0]) is not record.checkpoint_setup(model.model.h[0])
        assert record.applied_transforms(twin) == [] and record.left_alone(twin.model.lm_head) is None
    twin = copy.deepcopy(model)
    record.copy_record(model, twin)
    assert record.applied_transforms(twin) == ["X"] and record.left_alone(twin.model.lm_head) == head is not None
    record.mark_applied(twin, "Y")  # copied, not shared
    assert record.applied_transforms(model) == ["X"]


def test_copy_record_refuses_another_tree() -> None:
    with pytest.raises(ValueError, match="another module tree"):
        record.copy_record(nn.Sequential(nn.Linear(2, 2)), nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
