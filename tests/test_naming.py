"""One vocabulary (issue 35): one rule for module-name options, one dtype check, one name per entry point.

``LoRA(target_modules=...)``, ``exclude_modules``, ``modules_to_save`` and ``QuantizedPrecision(ignore_modules=...)``
match module names by :func:`lightning_hbm.naming.name_matches` (docs/adapters.md says they match alike); a format's
dtype refusal reads the same from the plugin and from ``quantize_model``; ``precision_plugin`` is a deprecated
spelling of ``QuantizedPrecision``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision, precision_plugin, quantize_model
from lightning_hbm.naming import name_matches, selected, under
from lightning_hbm.record import left_alone


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleDict({"fc1": nn.Linear(16, 16), "fc2": nn.Linear(16, 16)}) for _ in range(2))
        self.head = nn.Linear(16, 4)


@pytest.mark.parametrize(("name", "patterns", "expected"), [
    ("blocks.0.fc1", ["fc1"], True),  # a name matches as a dotted suffix (peft's rule)
    ("blocks.0.fc1", ["0.fc1"], True),
    ("blocks.0.xfc1", ["fc1"], False),  # not a part of a component
    ("blocks.0.fc1", ["blocks.*.fc1"], True),  # a glob matches the full name
    ("blocks.0.fc1", ["*.fc?"], True),
    ("blocks.0.fc1", ["blocks.*.fc2"], False),
    ("blocks.0.fc1", r"blocks\.\d\.fc1", True),  # one string: a regex, full match
    ("blocks.0.fc1", r"fc1", False),
])  # fmt: skip
def test_name_matches_names_suffixes_globs_and_one_regex(name: str, patterns: str | list[str], expected: bool) -> None:
    assert name_matches(name, patterns) is expected


def test_under_is_a_parent_relation_on_dotted_names() -> None:
    assert under("a.b", ["a"]) and under("a", ["a"]) and not under("ab", ["a"]) and not under("a", ["a.b"])


def test_selected_is_each_match_with_everything_under_it_decided_once_for_a_model() -> None:
    names = [n for n, _ in Tiny().named_modules()]
    # a name is selected when it or a module it is under matches: the rule ignore_modules and modules_to_save follow
    by_name = {n for n in names if any(name_matches(".".join(n.split(".")[:i]), ["0"]) for i in range(1, n.count(".") + 2))}
    assert selected(names, ["0"]) == by_name == {"blocks.0", "blocks.0.fc1", "blocks.0.fc2"}
    assert selected(names, r"blocks\.1") == {"blocks.1", "blocks.1.fc1", "blocks.1.fc2"}  # a regex: a full match
    assert selected(names, ["*.fc2", "head"]) == {"blocks.0.fc2", "blocks.1.fc2", "head"}
    assert selected(names, ["blocks.0.fc"]) == selected(names, []) == set()  # a part of a component is no name


def test_lora_targets_and_ignore_modules_select_the_same_layers_with_a_glob() -> None:
    """Was: ignore_modules took globs, LoRA's target_modules did not ('matches no module of the model')."""
    lora = LoRA(r=2, target_modules=["blocks.*.fc1"])
    adapted = Tiny()
    lora.transform_model(adapted)
    quantized = Tiny()
    quantize_model(quantized, "nf4", dtype="float32", ignore_modules=["blocks.*.fc1"])
    ignored = [n for n, m in quantized.named_modules() if (left_alone(m) or (None,))[0] == "QuantizedPrecision(ignore_modules=...)"]
    assert sorted(lora.adapted_modules) == sorted(ignored) == ["blocks.0.fc1", "blocks.1.fc1"]
    excluded = LoRA(r=2, target_modules=["fc1", "fc2"], exclude_modules=["*.1.*"])
    excluded.transform_model(Tiny())
    assert sorted(excluded.adapted_modules) == ["blocks.0.fc1", "blocks.0.fc2"]


def test_the_dtype_refusal_reads_the_same_from_the_plugin_and_quantize_model() -> None:
    with pytest.raises(ValueError) as plugin:
        QuantizedPrecision("nf4", dtype=torch.float64)
    with pytest.raises(ValueError) as direct:
        quantize_model(Tiny(), "nf4", dtype=torch.float64)
    assert str(plugin.value) == str(direct.value)
    assert "does not support dtype torch.float64. Supported: " in str(plugin.value)


def test_precision_plugin_is_a_deprecated_spelling_of_quantized_precision() -> None:
    with pytest.warns(DeprecationWarning, match=r"precision_plugin\('int8'\) is deprecated: write QuantizedPrecision\('int8'\)"):
        plugin = precision_plugin("int8", dtype="bf16")
    assert type(plugin) is QuantizedPrecision and plugin.mode.name == "int8" and plugin.dtype == torch.bfloat16


def test_one_name_each() -> None:
    """``QuantMode`` (an alias), ``get_mode`` (returned a format) and ``register_mode`` (no caller) are gone."""
    from lightning_hbm import precision

    assert not {"QuantMode", "get_mode", "register_mode"} & set(dir(precision) + dir(precision.registry))


def _inline_unders(source: str) -> list[int]:
    """Lines holding ``any(x == p or x.startswith(p + ".") for p in ps)``: :func:`lightning_hbm.naming.under` written
    out again (the f-string spelling ``f"{p}."`` too)."""
    import ast

    def dotted(arg: ast.expr) -> str | None:
        if isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Add) and isinstance(arg.right, ast.Constant) and arg.right.value == ".":
            return ast.unparse(arg.left)
        if isinstance(arg, ast.JoinedStr) and len(arg.values) == 2 and isinstance(arg.values[0], ast.FormattedValue):
            return ast.unparse(arg.values[0].value) if ast.unparse(arg.values[1]) == "'.'" else None
        return None

    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2):
            continue
        equal, starts = node.values
        if (isinstance(equal, ast.Compare) and isinstance(equal.ops[0], ast.Eq) and isinstance(starts, ast.Call)
                and isinstance(starts.func, ast.Attribute) and starts.func.attr == "startswith" and len(starts.args) == 1):
            pair = {ast.unparse(equal.left), ast.unparse(equal.comparators[0])}
            if pair == {ast.unparse(starts.func.value), dotted(starts.args[0])}:
                found.append(node.lineno)
    return found


def test_under_is_written_once() -> None:
    """One helper for "this module or inside it" (issue 54: three ``under`` helpers became one; this keeps copies of its
    body from growing back inline). ``next(b for b in blocks if ...)``, which names the prefix, is not a copy."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lightning_hbm"
    copies = [
        f"{path.relative_to(root.parent)}:{line}"
        for path in sorted(root.rglob("*.py")) if path.name != "naming.py"
        for line in _inline_unders(path.read_text())
        if "next(" not in path.read_text().splitlines()[line - 1]
    ]
    assert copies == [], "call lightning_hbm.naming.under(name, prefixes) instead"
    assert sorted(_inline_unders('any(n == b or n.startswith(b + ".") for b in bs)\nx == p or x.startswith(f"{p}.")\n')) == [1, 2]


# every name with "plan" in it outside the planner (planner/, and cli/: the planner's command line), by
# (file under lightning_hbm/, top-level definition it stands in, name): the planner's own words (``planned_as``: how
# the planner's trace counts a kind; ``planning``: a fake-tensor trace) and the deprecated former names, kept working
PLAN_NAMES_OUTSIDE_THE_PLANNER = {
    ("activations/checkpointing.py", "<module>", "_BlockPlan"),  # former name of _BlockSetup (pickled models)
    ("layers/conv.py", "<module>", "planned_as"),
    ("layers/conv1d.py", "<module>", "planned_as"),
    ("layers/conv_transpose.py", "<module>", "planned_as"),
    ("layers/embedding.py", "<module>", "planned_as"),
    ("layers/experts.py", "<module>", "planned_as"),
    ("layers/kinds.py", "LayerKind", "planned_as"),
    ("layers/kinds.py", "kind_table", "planned_as"),
    ("layers/linear.py", "<module>", "planned_as"),
    ("layers/multihead_attention.py", "<module>", "planned_as"),
    ("precision/config.py", "QuantizationConfig", "measures_plan"),  # deprecated: measures_layer_modes
    ("precision/config.py", "QuantizationConfig", "pinned_plan"),  # deprecated: pinned_layer_modes
    ("precision/plugin.py", "QuantizedPrecision", "plan"),  # deprecated: layer_modes
    ("precision/plugin.py", "QuantizedPrecision", "plan_report"),  # deprecated: sensitivity_report
    ("precision/quantization.py", "Quantization", "saved_plan"),  # deprecated: saved_layer_modes
    ("precision/sensitivity.py", "_layer_modes_argument", "plan"),  # predict_parameter_bytes(plan=...), deprecated
    ("precision/sensitivity.py", "predict_parameter_bytes", "plan"),
    ("precision/targets.py", "_linear_reasons", "planning"),
    ("record.py", "CheckpointedForward", "plan"),  # deprecated: setup
}


def _plan_names(source: str) -> set[tuple[str, str]]:
    """``(top-level definition or "<module>", name)`` for each identifier with "plan" in it (not "planner")."""
    import ast

    found: set[tuple[str, str]] = set()

    def visit(node: ast.AST, owner: str) -> None:
        for child in ast.iter_child_nodes(node):
            defined = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            inner = child.name if defined and not owner else owner
            name = (child.id if isinstance(child, ast.Name) else child.arg if isinstance(child, (ast.arg, ast.keyword))
                    else child.attr if isinstance(child, ast.Attribute) else child.name if defined else None)
            if name and "plan" in name.lower() and "planner" not in name.lower() and "explain" not in name.lower():
                found.add((inner or "<module>", name))
            visit(child, inner)

    visit(ast.parse(source), "")
    return found


def test_plan_is_left_to_the_planner() -> None:
    """Issue 54 item 4: "plan" names the planner's (``planner.plan``, ``Plan``); the layer modes a quantization takes
    are ``layer_modes``, the sensitivity search's candidates ``choice``/``choices``. A new name with "plan" in it
    outside the planner fails here: name it by what it holds, or add it above if it is the planner's or a former name."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "lightning_hbm"
    names = {
        (path.relative_to(root).as_posix(), owner, name)
        for path in sorted(root.rglob("*.py")) if not path.relative_to(root).as_posix().startswith(("planner/", "cli/"))
        for owner, name in _plan_names(path.read_text())
    }
    assert sorted(names - PLAN_NAMES_OUTSIDE_THE_PLANNER) == [], "outside the planner: name these by what they hold"
    assert _plan_names("def f(plan):\n    plans = [plan]\n") == {("f", "plan"), ("f", "plans")}
