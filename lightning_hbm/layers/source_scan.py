"""The source scan: what the code of a model's classes does with its layers' weights, read from their source.

Which layers' weights an enclosing module's code reads directly (:func:`source_readers`, a hint beside the probe step
of :mod:`lightning_hbm.layers.readers`; :func:`weight_readers`, the decision), which ``nn.Linear`` and convolution subclasses compute
something else in their own forward, and how a module's code uses each of its own attributes (:func:`attribute_uses`:
the coverage table's rows for weights outside any layer kind). Code without source is not seen.
"""

from __future__ import annotations

import ast
import functools
import math
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.layers.finding import base_layer, find_layers
from lightning_hbm.layers.readers import observed_readers
from lightning_hbm.memory.storage import quantized_format
from lightning_hbm.probe import source_tree

# Reading these of a layer's weight is harmless once it is quantized; anything else (a matmul, .dtype, .shape, .T)
# sees the packed integer weight, and an adapter around the layer is never called.
_HARMLESS = ("device", "requires_grad")
# Metadata reads: wrong on a packed quantized weight, harmless on an adapted one (peft's layer shows its base's weight).
_METADATA = ("dtype", "shape", "size", "ndim", "dim")
# Libraries whose modules are known: torch's nn.MultiheadAttention reads out_proj.weight, but it is converted
# (prepare_model); peft, bitsandbytes and lightning_hbm read the layers they made themselves.
_KNOWN = ("torch.", "peft.", "bitsandbytes.", "lightning_hbm.", "lightning.", "transformers.modeling_utils")


@functools.lru_cache(maxsize=None)
def _weight_paths(cls: type) -> tuple[tuple[str, str, bool], ...]:
    """``(child path, "Class.method", metadata only)`` for each ``self.<path>.weight`` that code of ``cls`` (not its
    init) reads."""
    found: dict[str, tuple[str, bool]] = {}
    for klass in cls.__mro__:
        if not issubclass(klass, nn.Module) or klass.__module__.startswith(_KNOWN) or klass is nn.Module:
            continue
        tree = source_tree(klass)
        if tree is None:
            continue  # no source (built in a REPL, compiled): nothing to tell
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) or "init" in func.name or "reset" in func.name or func.name == "extra_repr":
                continue
            nodes = list(ast.walk(func))
            harmless = {id(n.value) for n in nodes if isinstance(n, ast.Attribute) and n.attr in _HARMLESS}
            # isinstance(self.wo.weight, torch.Tensor) (T5's feed-forward) is a type check: true of any weight
            harmless |= {id(n.args[0]) for n in nodes if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "isinstance" and n.args}
            metadata = {id(n.value) for n in nodes if isinstance(n, ast.Attribute) and n.attr in _METADATA}
            for node in nodes:
                if not isinstance(node, ast.Attribute) or node.attr != "weight" or id(node) in harmless:
                    continue
                path, value, hop = [], node.value, _hop(node.value)
                while hop is not None:  # self.model.layers[0].mlp.up_proj: model.layers.0.mlp.up_proj
                    path.append(hop[0])
                    value, hop = hop[1], _hop(hop[1])
                if path and isinstance(value, ast.Name) and value.id == "self":
                    key, use = ".".join(reversed(path)), (f"{klass.__name__}.{func.name}", id(node) in metadata)
                    if key not in found or found[key][1] and not use[1]:  # a real use wins over a metadata read
                        found[key] = use
    return tuple((path, reader, meta) for path, (reader, meta) in found.items())


def _hop(node: ast.AST) -> Optional[tuple[str, ast.expr]]:
    """One step up a module path: ``x.name`` gives ``("name", x)``, ``x[0]`` or ``x["name"]`` (a child of a
    ``ModuleList``/``Sequential``/``ModuleDict``) ``("0", x)``; else ``None`` (session 38: a ``training_step`` reading
    ``self.model.layers[0].mlp.up_proj.weight`` only under bfloat16 was not seen, the fit stopped on a shape error)."""
    if isinstance(node, ast.Attribute):
        return node.attr, node.value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and type(node.slice.value) in (int, str):
        return str(node.slice.value), node.value
    return None


def _own_forward(layer: nn.Module) -> bool:
    """Whether ``layer`` is an ``nn.Linear`` (or convolution) subclass whose forward computes something else than
    ``F.linear`` (the convolution's).

    transformers' Llama4Router returns ``(scores, logits)``: the mode's layer or peft's would replace that forward.
    FalconLinear computes the same product in its own code: it is an ordinary Linear. transformers' BiT
    ``WeightStandardizedConv2d`` standardizes its weight and pads the input itself ("SAME"): was quantized as a plain
    convolution, which dropped both (a shape error in the next residual sum, or, where the shapes agree, a silently
    different model). Told apart by one call on a fixed input (no random numbers drawn); on meta or fake weights only
    the output's type and shape count.
    """
    cls = type(layer)
    if isinstance(layer, _CONVS):
        return _own_conv_forward(layer)
    if not isinstance(layer, nn.Linear) or cls.forward is nn.Linear.forward or cls.__module__.startswith(_KNOWN):
        return False
    if quantized_format(layer) is not None:  # a registered format's own layer (one defined outside this package too)
        return False
    weight = layer.weight
    x = torch.arange(2 * layer.in_features, dtype=weight.dtype, device=weight.device).reshape(2, -1).sin()
    with torch.no_grad():
        out = _called(layer, x)
        return _differs(out, (2, layer.out_features), weight, lambda: F.linear(x, weight, layer.bias))


_FAILED = object()


def _called(layer: nn.Module, x: torch.Tensor) -> object:
    """``layer.forward(x)`` (not ``layer(x)``: the user's hooks on the layer see no call of this check; was one extra
    call with a made-up input, session 31), or a marker where a call on one input tensor fails (a forward that takes
    more arguments, or another input: ``forward(x, scale)``): not the plain layer's forward, so its own (was: the
    ``TypeError`` stopped the surgery of the whole model, session 31)."""
    try:
        return layer.forward(x)
    except Exception:  # noqa: BLE001 - any failure of the subclass's own forward on the plain layer's input
        return _FAILED


def own_forward(layer: nn.Module) -> bool:
    """Whether ``layer`` is a Linear or convolution subclass whose own forward computes something else with its weight."""
    return _own_forward(layer)


_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _own_conv_forward(conv: Union[nn.Conv1d, nn.Conv2d, nn.Conv3d]) -> bool:
    base = next(c for c in _CONVS if isinstance(conv, c))
    if type(conv).forward is base.forward or type(conv).__module__.startswith(_KNOWN) or quantized_format(conv) is not None:
        return False
    weight = conv.weight
    # room for the kernel, two strides and any padding mode (reflect needs an input wider than its pad)
    size = [(k - 1) * d + 1 + 2 * s for k, d, s in zip(conv.kernel_size, conv.dilation, conv.stride)]
    x = torch.arange(conv.in_channels * math.prod(size), dtype=weight.dtype, device=weight.device).reshape(1, -1, *size).sin()
    with torch.no_grad():
        expected = base._conv_forward(conv, x, weight, conv.bias)  # type: ignore[operator, arg-type]  # nn.ConvNd's own computation
        return _differs(_called(conv, x), tuple(expected.shape), weight, lambda: expected)


def _differs(out: object, shape: tuple[int, ...], weight: torch.Tensor, expected: Callable[[], torch.Tensor]) -> bool:
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != shape:
        return True
    if weight.device.type == "meta" or type(weight.data) is not torch.Tensor:  # no values to compare (planner)
        return False
    return not torch.allclose(out, expected(), rtol=1e-3, atol=1e-5)


def embedding_readers(module: nn.Module) -> dict[str, str]:
    """``{name: "Class.method"}``: the plain ``nn.Embedding`` s whose table the source of an enclosing module's class
    reads (``self.<path>.weight``, its values: not ``.dtype``/``.shape``) instead of calling the embedding (CLIP's
    ``position_embedding``, DeBERTa-v2's ``rel_embeddings``). The quantization keeps them in the compute dtype with
    that reason: a read on a path the probe step did not take would be refused as a quantized layer's."""
    embeddings = {id(sub): name for name, sub in module.named_modules() if type(sub) is nn.Embedding}
    found: dict[str, str] = {}
    for _, sub in module.named_modules():
        for path, reader, metadata in _weight_paths(type(sub)):  # type: ignore[arg-type]  # as in source_readers
            if metadata:
                continue
            try:
                target = sub.get_submodule(path)
            except AttributeError:
                continue
            if id(target) in embeddings:
                found.setdefault(embeddings[id(target)], reader)
    return found


def source_readers(module: nn.Module, uses_only: bool = False) -> list[tuple[str, str, str]]:
    """``(reader module name, "Class.method", layer name)`` for each layer whose weight the source of an enclosing
    module's class reads (``self.<path>.weight`` outside ``init``/``reset`` methods and ``.weight.device`` reads).

    A hint only (:mod:`lightning_hbm.layers.readers`): it also counts paths that never run (Bloom's
    ``slow_but_exact``, a utility never called in training). It decides only when the model could not be run, and
    it places the guards for the paths the probe step did not take. Code without source is not seen.
    """
    layers = {id(base_layer(layer)): name for name, layer, _ in find_layers(module)}
    found: list[tuple[str, str, str]] = []
    for name, sub in module.named_modules():
        for path, reader, metadata in _weight_paths(type(sub)):  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
            if metadata and uses_only:
                continue
            try:
                target = sub.get_submodule(path)
            except AttributeError:
                continue
            layer = layers.get(id(base_layer(target)))
            if layer is not None:
                found.append((name, reader, layer))
    return found


def weight_readers(module: nn.Module, uses_only: bool = False) -> dict[str, str]:
    """``{layer name: "Class.method"}``: layers of a registered kind whose weight an enclosing module's code reads
    directly (``F.linear(x, self.qkv.weight)`` in torchvision's Swin) instead of calling the layer.

    Such a layer cannot be quantized (the reader gets the packed integer weight: a low-level dtype or shape
    error) nor adapted (the adapter is never called). Decided by running: what the probe step
    (:func:`lightning_hbm.layers.readers.observe`, run by the surgery before any change) saw; a model that was never
    observed (a plain call of ``quantize_model``, a step that cannot run) falls back to its source
    (:func:`source_readers`). An ``nn.Linear`` subclass whose forward computes something else reads its own weight.
    ``uses_only``: leave out metadata reads (``.weight.dtype``/``.shape``: wrong once quantized, harmless for an
    adapter).
    """
    readers: dict[str, str] = {}
    layer: Union[nn.Module, str]  # a layer here, a layer's name below
    for name, layer, _ in find_layers(module):
        if _own_forward(base_layer(layer)):
            base = next(c for c in (*_CONVS, nn.Linear) if isinstance(base_layer(layer), c))
            readers[name] = f"{type(base_layer(layer)).__name__}.forward (an nn.{base.__name__} subclass with its own forward)"
    seen = observed_readers(module, uses_only)
    if seen is not None:
        layers = {name for name, _, _ in find_layers(module)}
        for name, reader in seen.items():
            if name in layers:
                readers.setdefault(name, reader)
        return readers
    for _, reader, layer in source_readers(module, uses_only):
        readers.setdefault(layer, reader)
    return readers


_MATMULS = {"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "conv1d", "conv2d", "conv3d", "tensordot"}


@functools.lru_cache(maxsize=None)
def attribute_uses(cls: type) -> dict[str, frozenset[str]]:
    """``{attribute: {"matmul", "add"}}``: how the code of ``cls`` (not its init) uses each ``self.<attribute>``.

    "matmul": an argument of a matmul-like call (``F.linear``, ``torch.bmm``, ``einsum``, ...) or an operand of ``@``,
    possibly indexed, transposed or cast first; "add": an operand of ``+``. What the module does with the tensor, read
    from its source (no batch at fit start to run it on); code without source is not seen.
    """
    found: dict[str, set[str]] = {}
    for klass in cls.__mro__:
        if not issubclass(klass, nn.Module) or klass is nn.Module:
            continue
        tree = source_tree(klass)
        if tree is None:
            continue
        parents = {id(child): node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"):
                continue
            at: ast.AST
            use, at = None, node
            for _ in range(4):  # self.w[...].t().to(x) @ h: climb through indexing, methods and casts
                parent = parents.get(id(at))
                if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.MatMult):
                    use = "matmul"
                elif isinstance(parent, (ast.BinOp, ast.AugAssign)) and isinstance(parent.op, ast.Add):
                    use = "add"
                elif isinstance(parent, ast.Call) and at is not parent.func:
                    func = parent.func
                    use = "matmul" if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in _MATMULS else None
                elif isinstance(parent, (ast.Subscript, ast.Attribute, ast.Call)):
                    at = parent
                    continue
                break
            if use is not None:
                found.setdefault(node.attr, set()).add(use)
    return {name: frozenset(uses) for name, uses in found.items()}


__all__ = ["attribute_uses", "source_readers", "weight_readers"]
