"""The repeated blocks of a model (:func:`find_blocks`): what activation checkpointing wraps and the planner traces."""

from __future__ import annotations

import ast
import functools
from collections import Counter
from typing import Optional

from torch import nn

from lightning_hbm.probe import source_tree


def find_blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The innermost repeated blocks of ``module``: children of an ``nn.ModuleList`` or ``nn.Sequential`` that all share one class.

    Covers nanoGPT-style ``h``, transformers' ``model.layers`` (decoder layers), the ``nn.Sequential``
    encoders of timm / torchvision (``encoder.layers``, ``blocks``) and lazily built models alike
    (called after ``configure_model``). Blocks are named as the model names them (torchvision's ViT
    builds ``encoder.layers`` from an ``OrderedDict``: ``encoder.layers.encoder_layer_0``). A stack inside a block
    replaces that block by its items, the same level everywhere (the layers, not the stages: checkpointing a stage
    keeps every layer's recompute alive at once, 0.69x of the activations against 0.52x per layer on a SegFormer):
    an ``nn.Sequential`` stack (timm ConvNeXt's ``stages.0.blocks``, timm EfficientNet's stage ``Sequential``s) or an
    ``nn.ModuleList`` of deep modules (transformers ``SegformerStage.blocks``, Swin's stage ``blocks``: layers made of
    attention and MLP modules). Other lists nested inside a block (the experts of a mixture-of-experts layer: shallow
    MLPs of Linears, called side by side rather than one after another) are not blocks themselves. No block is ever
    inside another (checkpointing both would recompute the inner blocks twice). A stage holding a single block, beside
    stages that gave way to their blocks, gives way to that block too (the same memory, one level of names: timm
    EfficientNet's ``blocks.0.0``, not ``blocks.0``); what it holds outside that block (SegFormer's patch embedding
    and norm) is then not checkpointed, as in the other stages. Leaf modules (a list of ``nn.Linear`` heads) are not
    blocks: recomputing one matmul saves nothing. A model with no such stack may be a hybrid (transformers Jamba,
    Zamba2: Mamba and attention layers in one ``nn.ModuleList``): the outermost ``nn.ModuleList`` whose children are
    all composite modules is its stack. Failing that, a stack of one: the innermost ``nn.ModuleList`` holding a single
    composite module (a model built with one layer; transformers ALBERT, whose one shared ``AlbertLayer`` runs
    ``num_hidden_layers`` times: was "found no repeated blocks"). Before that, an ``nn.Sequential`` whose composite
    modules of one class recur between leaf layers (diffusers ``AutoencoderTiny``: a convolution, a block, a strided
    convolution, a block, ...): those modules (was: "found no repeated blocks", the default recipe refused the model).
    A plain module whose children all share one composite class and whose own ``forward`` runs them one after
    another (timm RegNet's ``RegStage``: blocks ``b1..bN`` as plain children, a ``for block in self.children()`` loop;
    was refused, naming ``blocks=[...]``) is a stack too (:func:`_runs_in_order`); a stage of that class holding a
    single block then gives its block as well (RegNetX-200MF's ``s1.b1``), the same level as its siblings.
    """
    blocks: dict[str, nn.Module] = {}
    stack_of: dict[str, str] = {}  # block -> the stack it is an item of
    descended: set[str] = set()  # stacks one of whose items gave way to its own items
    # classes of plain modules that hold a run of two blocks or more: a stage of theirs holding one block counts too
    plain = {type(c) for n, c in module.named_modules() if not isinstance(c, (nn.ModuleList, nn.Sequential)) and _stack_items(n, c, 2)}
    for name, child in module.named_modules():
        items = _stack_items(name, child, 1 if type(child) in plain else 2)
        if items is None:
            continue
        # a stack that is itself a block (timm EfficientNet: the stage Sequentials are the items of `blocks`) or lies
        # inside one: its items replace that block, never both (a block inside a checkpointed block is recomputed twice)
        outer = next((b for b in blocks if name == b or name.startswith(b + ".")), None)
        if outer is not None:
            if outer != name and not _inner_stack(child):
                continue
            descended.add(stack_of.pop(outer))
            del blocks[outer]  # the innermost repeated block: a stage's blocks rather than the stage
        blocks.update(items)
        stack_of.update(dict.fromkeys(items, name))
    # the same level everywhere: a stage of one block, whose sibling stages gave way to their blocks, gives way too
    for outer in [b for b in blocks if stack_of[b] in descended]:
        inner = _single_stack(outer, blocks[outer])
        if inner:
            del blocks[outer]
            blocks.update(inner)
    if not blocks:
        blocks = _hybrid_blocks(module) or _interleaved_blocks(module) or _lone_blocks(module)
    order = {n: i for i, (n, _) in enumerate(module.named_modules())}
    return sorted(blocks.items(), key=lambda item: order[item[0]])


def unordered_stacks(module: nn.Module) -> list[tuple[str, type, list[str]]]:
    """``(name, class of its children, their names)`` of each plain module (no ``nn.ModuleList``, ``nn.Sequential``)
    whose children are two or more composite modules of one class that its ``forward`` does not run one after another
    (:func:`_runs_in_order`): not a stack; named when a model has none (ActivationCheckpointing's error)."""
    found = []
    for name, child in module.named_modules():
        items = dict(child.named_children())
        if isinstance(child, (nn.ModuleList, nn.Sequential)) or len(items) < 2 or len({type(c) for c in items.values()}) != 1:
            continue
        first = next(iter(items.values()))
        if any(True for _ in first.children()) and _stack_items(name, child, 2) is None:
            found.append((name, type(first), [f"{name}.{n}" if name else n for n in items]))
    return found


def _stack_items(name: str, child: nn.Module, least: int) -> Optional[dict[str, nn.Module]]:
    """The items of ``child`` by full name if it is a stack of at least ``least`` composite modules of one class."""
    # An nn.Sequential of mixed layers (Linear, GELU, Linear) is not a stack of blocks: the one-class test tells them apart.
    items = list(child.named_children())
    if len(items) < least or len({type(c) for _, c in items}) != 1 or not any(True for _ in items[0][1].children()):
        return None
    if not isinstance(child, (nn.ModuleList, nn.Sequential)) and not _runs_in_order(type(child), tuple(n for n, _ in items)):  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
        return None
    return {f"{name}.{n}" if name else n: c for n, c in items}


@functools.lru_cache(maxsize=None)
def _runs_in_order(cls: type, names: tuple[str, ...]) -> bool:
    """Whether the ``forward`` of ``cls`` (a plain module, no ``nn.Sequential``) runs its children ``names`` one after
    another, each on the previous one's output, read from its source.

    Checkpointing its children one by one is only sound when nothing else runs between them and each runs once, in
    order: so only two shapes are taken, a loop over ``self.children()`` (or ``named_children()``,
    ``_modules.values()``; timm's ``RegStage``) or one statement per child ``x = self.<child>(x)`` in the order they
    were registered. Anything else (calls nested in one expression, a skip connection, a child called twice) is not a
    stack; a class without source neither.
    """
    tree = source_tree(getattr(cls, "forward", None))
    if tree is None:
        return False
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.FunctionDef) else []
    for node in ast.walk(ast.Module(body=body, type_ignores=[])):
        if isinstance(node, ast.For) and _iterates_children(node.iter):
            return True
    called = [
        stmt.value.func.attr
        for stmt in body
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call) and isinstance(stmt.value.func, ast.Attribute)
        and isinstance(stmt.value.func.value, ast.Name) and stmt.value.func.value.id == "self"
    ]
    return tuple(called) == names


def _iterates_children(node: ast.expr) -> bool:
    # self.children(), self.named_children(), self._modules.values() / .items()
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    owner, method = node.func.value, node.func.attr
    if isinstance(owner, ast.Name) and owner.id == "self":
        return method in ("children", "named_children")
    return method in ("values", "items") and isinstance(owner, ast.Attribute) and owner.attr == "_modules" and isinstance(owner.value, ast.Name) and owner.value.id == "self"


def _single_stack(name: str, block: nn.Module) -> dict[str, nn.Module]:
    """The items of the first stack of one or more blocks that is ``block`` itself or lies inside it ({}: none)."""
    for sub_name, sub in block.named_modules(prefix=name):
        items = _stack_items(sub_name, sub, 1) if sub_name == name or _inner_stack(sub) else None
        if items:
            return items
    return {}


def _inner_stack(child: nn.Module) -> bool:
    """Whether a stack found inside a block runs its items one after another, so they replace the block.

    An ``nn.Sequential`` does by construction. An ``nn.ModuleList`` is taken to when its items are deep (modules of
    modules: SegFormer's ``SegformerLayer`` holds an attention and an MixFFN module), not when they are shallow
    (Linears and activations only: a mixture-of-experts layer's experts, called side by side on their tokens).
    """
    if isinstance(child, nn.Sequential):
        return True
    return isinstance(child, nn.ModuleList) and all(
        any(any(True for _ in grandchild.children()) for grandchild in c.children()) for c in child.children()
    )


def _hybrid_blocks(module: nn.Module) -> dict[str, nn.Module]:
    # An nn.ModuleList of layers of several classes (not an nn.Sequential: a Linear, GELU, Linear MLP is one); only
    # when no one-class stack exists, so a model with one never changes blocks.
    blocks: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        if not isinstance(child, nn.ModuleList) or len(child) < 2 or any(name.startswith(b + ".") for b in blocks):
            continue
        items = list(child.named_children())
        if all(any(True for _ in c.children()) for _, c in items):
            blocks.update({f"{name}.{n}" if name else n: c for n, c in items})
    return blocks


def _interleaved_blocks(module: nn.Module) -> dict[str, nn.Module]:
    # Only when no stack exists: in an nn.Sequential, the composite children of a class that occurs at least twice (the
    # leaf layers between them, a strided convolution or an upsampling, stay outside); the outermost such Sequential.
    blocks: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        if not isinstance(child, nn.Sequential) or any(name.startswith(b + ".") for b in blocks):
            continue
        composite = [(n, c) for n, c in child.named_children() if any(True for _ in c.children())]
        counts = Counter(type(c) for _, c in composite)
        blocks.update({f"{name}.{n}" if name else n: c for n, c in composite if counts[type(c)] >= 2})
    return blocks


def _lone_blocks(module: nn.Module) -> dict[str, nn.Module]:
    # Only when no stack of two exists: an nn.ModuleList of one composite module, the innermost (ALBERT's one
    # AlbertLayerGroup holds a list of one AlbertLayer: the layer). A list of one leaf (a Linear) is no block.
    blocks: dict[str, nn.Module] = {}
    for name, child in module.named_modules():
        items = _stack_items(name, child, 1) if isinstance(child, nn.ModuleList) else None
        if items is None:
            continue
        for outer in [b for b in blocks if name.startswith(b + ".")]:
            del blocks[outer]
        blocks.update(items)
    return blocks


__all__ = ["find_blocks"]
