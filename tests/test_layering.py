"""The package's layering, checked over the source with ``ast`` (nothing is imported).

Levels, bottom to top; a module imports only from its own level or lower ones:

0. base: ``_compat`` (libraries' internals, one module per library), ``memory``, ``naming``, ``requirements``, ``quiet``, ``data``, ``probe`` (probe a model on a batch,
   shared by the precision choices and ``QuantizationQuality``), ``probe_record`` (what a probe forward did: its
   module calls and data-dependent selections, recorded and followed), ``probe_batch`` (the probe batch, drawn from the
   Trainer's train dataloader), ``probe_stand_ins`` (what a probe step lends the user's step: no-op logging, optimizer
   stand-ins read from ``configure_optimizers``' source), ``display`` (the progress bar and model summary
   the surgery spine swaps in), ``record`` (what lightning_hbm knows of a model it changed, in weak maps, nothing set
   on the model: the layer kinds write to it, the surgery, precision and callbacks read it), ``running`` (the stack
   of modules whose forward is running, kept by forward hooks: the layer-weight probe, the memory tracker and the
   attention-caller recorder share it)
1. layer kinds: ``layers`` (a package: one module per job generic over kinds, ``kinds``, ``finding``, ``source_scan``,
   ``heads``, ``outside``, ``coverage_table``, and one module per kind), ``models``; ``resume`` (a package: the
   checkpoint format, its checks, the atomic IO and the load hooks; it reads the layer kinds' key maps, and the
   surgery spine registers how a run's settings are read (``register_run_settings``) and hands it, as data, what
   checkpoints are packed with, instead of being imported)
2. the surgery spine: ``surgery``
3. ``precision`` (reads the callbacks it must know about by duck typing: ``modules_to_save``)
4. the jobs that need no other job: ``adapters`` (``LoRA``), ``optim`` (``MemoryEfficientOptimizer``), ``quality``
   (``QuantizationQuality``)
5. ``activations`` (``ActivationCheckpointing``, ``AttentionKernel``, ``FusedLoss``; the recompute keeps each block's
   last adapted layer in order: ``adapters.lora.order``)
6. ``profiling`` (``HBMProfiler``; its run facts read the settings of the callbacks above)
7. ``strategies`` (``CPUOffloadStrategy`` reuses ``optim``)
8. ``planner`` (builds candidates out of callbacks and strategies; ``HBMProfiler`` finds ``AutoFit`` by duck typing)
9. entry points: ``cli``, ``planner.__main__``, the package's ``__init__``; ``callbacks`` (the callbacks' former
   module paths, aliases of the jobs' modules: nothing in the package imports it)

Each job's package has its callback class as its face (``lightning_hbm.activations.FusedLoss``); ``callbacks/``
defines no function or class (``test_callbacks_only_re_export``), and a callback's module is imported only from above
it or by the package re-exporting it (``test_nothing_below_a_callback_imports_it``).

Modules of one level may import each other, but the module graph has no cycle.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path
from typing import Iterator

import pytest

PACKAGE = "lightning_hbm"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# longest dotted prefix (relative to the package) wins; "" is the package's own __init__
LEVELS = {
    "_compat": 0, "_validate": 0, "memory": 0, "naming": 0, "requirements": 0, "quiet": 0, "data": 0, "probe": 0, "probe_record": 0, "probe_batch": 0, "probe_stand_ins": 0,
    "pretrained": 0, "display": 0, "record": 0, "running": 0,
    "layers": 1, "resume": 1, "models": 1,
    "surgery": 2,
    "precision": 3,
    "adapters": 4, "optim": 4, "quality": 4,
    "activations": 5,
    "profiling": 6,
    "strategies": 7,
    "planner": 8,
    "cli": 9, "planner.__main__": 9, "": 9, "_factory": 9, "callbacks": 9,
}

# Imports allowed inside functions: optional dependencies (extras in pyproject.toml, or only needed by one
# feature), and two core ones imported on first use behind a RequirementCache check that turns a missing or
# broken install into an install hint (``precision.bnb.import_bnb``, ``adapters.lora._import_peft``):
# bitsandbytes, whose import loads native libraries, and peft. ``torch.distributed``: absent from some builds.
LAZY_ALLOWED = (
    "bitsandbytes", "peft", "transformers", "torchao", "matplotlib", "rich", "liger_kernel", "flash_attn",
    "gguf", "deepspeed", "torch.distributed",
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _level(module: str) -> int:
    rel = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    parts = rel.split(".") if rel else []
    for n in range(len(parts), -1, -1):
        key = ".".join(parts[:n])
        if key in LEVELS:
            return LEVELS[key]
    raise AssertionError(f"{module} has no level: add it to LEVELS in tests/test_layering.py")


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.Module:
    """Each file parsed once per run (every check, and every case of test_each_check_catches_its_case, walks them all)."""
    return ast.parse(path.read_text(), str(path))


def _imports(module: str) -> Iterator[tuple[ast.stmt, str, list[str], bool]]:
    """``(node, imported module, imported names, inside a function)`` for every import statement."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = _parse(path)

    def visit(node: ast.AST, in_function: bool) -> Iterator[tuple[ast.stmt, str, list[str], bool]]:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                for alias in child.names:
                    yield child, alias.name, [], in_function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join([*anchor, *([child.module] if child.module else [])])
                yield child, base, [a.name for a in child.names], in_function
            else:
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                yield from visit(child, inner)

    yield from visit(tree, False)


def _targets(base: str, names: list[str]) -> list[str]:
    """The lightning_hbm modules an import loads: ``from pkg import mod`` names the submodule."""
    if not (base == PACKAGE or base.startswith(PACKAGE + ".")):
        return []
    subs = [f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES]
    return subs or [base]


def _edges() -> dict[str, set[str]]:
    return {
        m: {t for _, base, names, _ in _imports(m) for t in _targets(base, names) if t != m} for m in MODULES
    }


def test_every_module_has_a_level() -> None:
    for module in MODULES:
        _level(module)


def test_the_docs_draw_the_levels_of_the_test() -> None:
    """docs/extending.md's "Layering, bottom to top" line names every entry of ``LEVELS`` at its level (the groups
    between its ``<-``), and nothing the test does not know: the map drawn for contributors is the one enforced."""
    text = (ROOT.parent / "docs" / "extending.md").read_text()
    line = text.split("Layering, bottom to top:", 1)[1].split("A module imports only", 1)[0]
    drawn = {name: level for level, group in enumerate(line.split("<-")) for name in re.findall(r"`([\w.]+)`", group)}
    drawn = {("" if name == "__init__" else name): level for name, level in drawn.items()}
    missing = sorted(name or "the package __init__" for name in LEVELS if name not in drawn)
    wrong = sorted(f"{name or '__init__'}: docs {drawn.get(name)}, test {level}" for name, level in LEVELS.items() if name in drawn and drawn[name] != level)
    unknown = sorted(name for name in drawn if name not in LEVELS)
    assert not missing and not wrong and not unknown, f"docs/extending.md's layering line: missing {missing}, wrong level {wrong}, unknown {unknown}"


def test_no_import_goes_up_a_level() -> None:
    wrong = [
        f"{m}:{node.lineno} imports {t} (level {_level(m)} -> {_level(t)})"
        for m in MODULES
        for node, base, names, _ in _imports(m)
        for t in _targets(base, names)
        if _level(t) > _level(m)
    ]
    assert not wrong, "imports against the layering (move the shared code down):\n" + "\n".join(wrong)


def test_module_graph_has_no_cycle() -> None:
    edges, done, stack = _edges(), set(), []

    def visit(module: str) -> None:
        if module in stack:
            raise AssertionError("import cycle: " + " -> ".join([*stack[stack.index(module) :], module]))
        if module in done:
            return
        stack.append(module)
        for target in sorted(edges[module]):
            visit(target)
        stack.pop()
        done.add(module)

    for module in MODULES:
        visit(module)


def test_callbacks_only_re_export() -> None:
    """``lightning_hbm/callbacks/`` keeps the callbacks' former module paths importable and nothing else: no function
    or class of its own (the code lives in the package of its job), and no module of the package imports it."""
    callbacks = f"{PACKAGE}.callbacks"
    own = [
        f"{m}:{node.lineno} defines {node.name}"
        for m in MODULES
        if m == callbacks or m.startswith(callbacks + ".")
        for node in ast.walk(_parse(MODULES[m]))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    users = [
        f"{m} imports {t}"
        for m, targets in _edges().items()
        if not (m == callbacks or m.startswith(callbacks + "."))
        for t in targets
        if t == callbacks or t.startswith(callbacks + ".")
    ]
    assert not own and not users, "callbacks/ only re-exports (move the code to its job's package):\n" + "\n".join(own + users)


def _callback_modules() -> dict[str, list[str]]:
    """``{module: the Lightning callback classes it defines}`` (a base named ``Callback`` or ``...Callback``)."""
    found: dict[str, list[str]] = {}
    for m, path in MODULES.items():
        for node in _parse(path).body:
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).rpartition(".")[2].endswith("Callback") for b in node.bases):
                found.setdefault(m, []).append(node.name)
    return found


def test_nothing_below_a_callback_imports_it() -> None:
    """A callback class is a face: only a level above it (the planner, the strategies, the CLI), the packages that
    re-export it (its own package's ``__init__.py``) and ``callbacks/`` import its module; the code beside and below it
    (kernels, figures, the domain) never does, so none of it depends on the Lightning adapter (issue 54)."""
    callbacks, edges = f"{PACKAGE}.callbacks", _edges()
    wrong = [
        f"{m} imports {face} ({', '.join(classes)})"
        for face, classes in _callback_modules().items()
        for m, targets in edges.items()
        if face in targets and _level(m) <= _level(face)
        and not face.startswith(m + ".") and not (m == callbacks or m.startswith(callbacks + "."))
    ]
    assert not wrong, "only what stands above a callback imports its module (move the shared code out of it):\n" + "\n".join(wrong)


def _lazy_allowed(base: str) -> bool:
    return any(base == root or base.startswith(root + ".") for root in LAZY_ALLOWED)


def test_imports_inside_functions_are_optional_dependencies_only() -> None:
    wrong = [
        f"{m}:{node.lineno} imports {base} inside a function"
        for m in MODULES
        for node, base, _, in_function in _imports(m)
        if in_function and not _lazy_allowed(base)
    ]
    assert not wrong, "move these imports to the top of their module:\n" + "\n".join(wrong)


def _private_imports(module: str) -> Iterator[str]:
    """Private names ``module`` imports from another lightning_hbm package (a subpackage shares its own)."""
    own_package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node, base, names, _ in _imports(module):
        if not base.startswith(PACKAGE) or base.rpartition(".")[2].startswith("_compat"):
            continue
        target_package = base if base in MODULES and MODULES[base].name == "__init__.py" else base.rpartition(".")[0]
        if target_package == own_package:
            continue
        for name in names:
            if name.startswith("_"):
                yield f"{module}:{node.lineno} imports {base}.{name}"


def test_no_private_name_crosses_packages() -> None:
    wrong = [line for m in MODULES for line in _private_imports(m)]
    assert not wrong, "make these names public (or pass them through a protocol):\n" + "\n".join(wrong)


def test_private_names_of_libraries_come_through_compat() -> None:
    """The libraries' ``_names`` are imported only by ``lightning_hbm/_compat/``.

    Modules under private paths (``torch.utils._pytree``, ``torch._subclasses.fake_tensor``, ...) are left
    where they are used: they are those libraries' de facto API for their feature.
    """
    wrong = [
        f"{m}:{node.lineno} imports {base}.{name}"
        for m in MODULES
        if m != f"{PACKAGE}._compat" and not m.startswith(f"{PACKAGE}._compat.")
        for node, base, names, _ in _imports(m)
        if not base.startswith(PACKAGE)
        for name in names
        if name.startswith("_") and name != "annotations"
    ]
    assert not wrong, "import these through lightning_hbm/_compat/<library>.py:\n" + "\n".join(wrong)


# The libraries whose private attributes (``torch.cuda.memory._x``) and module globals (``bnb.functional.x = ...``)
# only ``lightning_hbm/_compat/`` may reach; ``import_bnb()`` / ``_import_peft()`` return their library.
FOREIGN = ("torch", "lightning", "bitsandbytes", "peft", "transformers")
IMPORTERS = {"import_bnb": "bitsandbytes", "_import_peft": "peft"}
# private module paths that are their library's de facto API (see test_private_names_of_libraries_come_through_compat)
PRIVATE_MODULES = {"_subclasses", "_pytree", "_python_dispatch", "_tools"}


def _foreign_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the foreign module (or object) it is bound to, by import or by ``import_bnb()``."""
    roots: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                roots[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for a in node.names:
                roots[a.asname or a.name] = f"{node.module}.{a.name}"
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) and isinstance(node.value.func, ast.Name):
            library = IMPORTERS.get(node.value.func.id)
            for target in node.targets:
                if library and isinstance(target, ast.Name):
                    roots[target.id] = library
    return {k: v for k, v in roots.items() if v.split(".")[0] in FOREIGN}


def _foreign_reaches(module: str) -> Iterator[str]:
    """Private attributes of a foreign module reached through it, and writes into a foreign module's globals."""
    tree = _parse(MODULES[module])
    roots = _foreign_names(tree)
    inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or id(node) in inner:
            continue  # the outermost attribute of each chain only
        chain, root = [], node
        while isinstance(root, ast.Attribute):
            chain.insert(0, root.attr)
            root = root.value
        if not isinstance(root, ast.Name) or root.id not in roots:
            continue
        path = roots[root.id].split(".") + chain
        if path[:2] == ["torch", "ops"]:
            continue  # operator names (``torch.ops.aten._foo``) are the dispatcher's public namespace
        if any(c.startswith("_") and not c.startswith("__") and c not in PRIVATE_MODULES for c in chain):
            yield f"{module}:{node.lineno} reaches {'.'.join([root.id, *chain])}"
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign) else []
        for target in targets:
            base = target.value if isinstance(target, ast.Subscript) else target
            names = [n.id for n in ast.walk(base) if isinstance(n, ast.Name)]
            if isinstance(base, ast.Attribute) and names and names[0] in roots and _is_module_chain(base, roots):
                yield f"{module}:{node.lineno} writes {ast.unparse(target)}"


def _is_module_chain(node: ast.Attribute, roots: dict[str, str]) -> bool:
    """``bnb.functional.name2qmap`` (a chain from a foreign name), not ``layer.weight`` (a local object)."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return isinstance(node, ast.Name) and node.id in roots


def test_private_attributes_of_libraries_come_through_compat() -> None:
    """No ``torch.cuda.memory._x``, ``torch._C...`` or ``bnb.functional.cache[...] = ...`` outside ``_compat/``.

    Attributes of objects (``trainer._x``, ``getattr(m, "_x")``) are not traced here: the table in
    docs/extending.md lists them, each behind a function in ``lightning_hbm/_compat/``.
    """
    wrong = [line for m in MODULES if not m.startswith(f"{PACKAGE}._compat") for line in _foreign_reaches(m)]
    assert not wrong, "move these into lightning_hbm/_compat/<library>.py:\n" + "\n".join(wrong)


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from lightning_hbm.planner import plan\n", "lightning_hbm.precision.x:1 imports lightning_hbm.planner (level 3 -> 8)"),
        ("def f():\n    import yaml\n", "lightning_hbm.precision.x:2 imports yaml inside a function"),
        ("from lightning_hbm.surgery import _STATE_ATTR\n", "lightning_hbm.precision.x:1 imports lightning_hbm.surgery._STATE_ATTR"),
        ("from torch.nn.modules.module import _addindent\n", "lightning_hbm.precision.x:1 imports torch.nn.modules.module._addindent"),
        ("import torch\ntorch.cuda.memory._dump_snapshot('s')\n", "lightning_hbm.precision.x:2 reaches torch.cuda.memory._dump_snapshot"),
        ("from torch import nn\nnn.modules.conv._ConvNd\n", "lightning_hbm.precision.x:2 reaches nn.modules.conv._ConvNd"),
        ("bnb = import_bnb()\nbnb.functional.name2qmap['dynamic'] = 1\n", "lightning_hbm.precision.x:2 writes bnb.functional.name2qmap['dynamic']"),
        ("import transformers\ntransformers.PreTrainedModel.from_pretrained = f\n", "lightning_hbm.precision.x:2 writes transformers.PreTrainedModel.from_pretrained"),
    ],
)
def test_each_check_catches_its_case(source: str, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above fail on a module that breaks them (so a passing run means something)."""
    fake = tmp_path / PACKAGE / "precision" / "x.py"
    fake.parent.mkdir(parents=True)
    fake.write_text(source)
    monkeypatch.setitem(MODULES, "lightning_hbm.precision.x", fake)
    checks = (test_no_import_goes_up_a_level, test_imports_inside_functions_are_optional_dependencies_only,
              test_no_private_name_crosses_packages, test_private_names_of_libraries_come_through_compat,
              test_private_attributes_of_libraries_come_through_compat)
    messages = []
    for check in checks:
        try:
            check()
        except AssertionError as err:
            messages.append(str(err))
    assert any(expected in m for m in messages), messages


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("callbacks.x", "from lightning_hbm.adapters import LoRA\n\ndef helper():\n    pass\n", "lightning_hbm.callbacks.x:3 defines helper"),
        ("profiling.x", "from lightning_hbm.callbacks import FORMER_PATHS\n", "lightning_hbm.profiling.x imports lightning_hbm.callbacks"),
    ],
)
def test_callbacks_check_catches_its_case(module: str, source: str, expected: str, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Code under callbacks/, or a module of the package importing callbacks/, fails test_callbacks_only_re_export."""
    fake = tmp_path / "x.py"
    fake.write_text(source)
    monkeypatch.setitem(MODULES, f"{PACKAGE}.{module}", fake)
    with pytest.raises(AssertionError, match=expected):
        test_callbacks_only_re_export()


def test_the_callback_face_check_catches_its_case(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel beside ``ActivationCheckpointing`` importing its module fails test_nothing_below_a_callback_imports_it."""
    fake = tmp_path / "x.py"
    fake.write_text("from lightning_hbm.activations.checkpointing import check_offload_blocks\n")
    monkeypatch.setitem(MODULES, f"{PACKAGE}.activations.x", fake)
    with pytest.raises(AssertionError, match=r"lightning_hbm.activations.x imports lightning_hbm.activations.checkpointing \(ActivationCheckpointing\)"):
        test_nothing_below_a_callback_imports_it()
