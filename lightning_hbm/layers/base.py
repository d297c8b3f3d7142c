"""The layer-kind protocol and registry, and what is generic over kinds: finding, preparing, LoRA names, coverage.

A *layer kind* is a way real models store a big weight matrix. Each kind is one file of this package that builds
one :class:`LayerKind` and registers it (:func:`register_kind`): ``linear.py`` (``nn.Linear`` and its subclasses),
``conv1d.py`` (transformers' GPT-2 ``Conv1D``), ``multihead_attention.py`` (``nn.MultiheadAttention``), ``conv.py``
(``nn.Conv1d``/``2d``/``3d``), ``conv_transpose.py`` (``nn.ConvTranspose1d``/``2d``/``3d``), ``embedding.py`` and ``experts.py`` (the 3-D expert Parameters of transformers-5 MoE layers).

A kind says how a layer of it is found (``matches``), rewritten first if it must be (``prepare``: an equivalent
module made of Linears), quantized (``to_linear``: an equivalent ``nn.Linear`` handed to the precision mode's
``replace``, so every mode of :mod:`lightning_hbm.precision.registry` covers every kind), adapted by LoRA
(``adaptable_names``), counted by the planner and shown in the coverage table and in docs/adapters.md's kind table
(:func:`kind_table`). ``QuantizedPrecision`` (quantization), ``LoRA.resolve`` (targets), the sensitivity plan's byte
prediction and :func:`coverage` (the fit-start table) go through :func:`find_layers` / :func:`kind_of`; nothing here
names a kind.
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator, Optional, Union, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import record
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.layers.readers import observed_readers
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.memory.storage import quantized_format

log = logging.getLogger(__name__)

WARN_SHARE = 0.05  # a kind left alone (not by choice) above this share of all parameters is a warning


def itself(layer: nn.Module) -> list[str]:
    """``adaptable_names`` of a kind whose layer LoRA adapts as it is: the layer itself (``""``)."""
    return [""]


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """``features`` of a kind whose layer is an ``nn.Linear`` (its own or the projections ``prepare`` made)."""
    return cast(int, layer.in_features), cast(int, layer.out_features)


@dataclass(frozen=True)
class LayerKind:
    """One kind of weight-holding layer (one file of :mod:`lightning_hbm.layers` each).

    Attributes:
        name: the kind's row in the coverage table (and its ``layers/<name>/...`` logged keys).
        matches: whether a module (as the user built it, or quantized) is a layer of this kind.
        to_linear: an equivalent ``nn.Linear`` holding the layer's weight (the mode's ``replace``
            quantizes it); ``None``: this kind is not quantized.
        quantized_as: how it is quantized (kind table; the coverage reason of a kind never quantized).
        adapted_as: how LoRA reaches it (kind table).
        option: what to pass when it is left alone (named in the coverage warning).
        modules: the modules of this kind, as the kind table names them.
        found_in: models that have them (kind table).
        planned_as: how the planner's fake-tensor trace counts it (kind table).
        prepare: replaces the layer by an equivalent module made of quantizable/adaptable layers
            (run before quantization and LoRA; returns ``None`` for a variant it cannot convert, which
            stays as it is); ``None``: used as it is.
        as_built_keys: for a kind with ``prepare``, the replacement's tensors as forms of the layer's as
            built: ``{replacement key: as-built key}`` (local names, e.g. ``{"q_proj.weight": "in_proj_weight"}``).
            A checkpoint that left the frozen base out (adapter-only) is checked against it on resume.
        after_prepare: run once on the whole model after layers of this kind were replaced (what a parent decided
            at init from the layers as built, e.g. ``nn.TransformerEncoder``'s fast path).
        adaptable_names: the names LoRA can adapt in a layer of this kind, relative to it and as they will be
            after ``prepare`` (``""``: the layer itself; ``[]``: none).
        features: ``(in_features, out_features)`` of the ``nn.Linear`` a mode stores for the layer (the
            sensitivity plan's byte prediction); only called for kinds with ``to_linear``.
        not_adapted: why LoRA skips a layer of this kind whose ``adaptable_names`` is ``[]``, and the fix (the
            coverage reason of such a layer when LoRA took part); ``""``: every layer of the kind is adaptable.
        wrap: for a kind whose layer does not compute as a Linear (a convolution), the module put in the layer's
            place around the mode's quantized Linear: ``wrap(layer, quantized, dequantize, compute_dtype)``;
            ``None``: the mode's layer itself goes in its place.
        stored_in: the mode's layer inside a wrapped layer (``None``: not wrapped, not quantized): the storage
            counted, dequantized and saved; never a layer of its own.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    to_linear: Optional[Callable[[nn.Module], nn.Linear]]
    quantized_as: str
    adapted_as: str
    option: str
    modules: str
    found_in: str
    planned_as: str
    prepare: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None
    as_built_keys: Optional[Callable[[nn.Module], dict[str, str]]] = None
    adaptable_names: Callable[[nn.Module], list[str]] = itself
    after_prepare: Optional[Callable[[nn.Module], None]] = None
    features: Callable[[nn.Module], tuple[int, int]] = linear_features
    not_adapted: str = ""
    wrap: Optional[Callable[..., nn.Module]] = None
    stored_in: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None


def stored_in(layer: nn.Module) -> Optional[nn.Module]:
    """The precision mode's layer that holds ``layer``'s quantized weight when its kind wraps it (a quantized
    convolution), else ``None``."""
    kind = kind_of(layer)
    return kind.stored_in(layer) if kind is not None and kind.stored_in is not None else None


_KINDS: dict[str, LayerKind] = {}


def register_kind(kind: LayerKind) -> LayerKind:
    """Add ``kind`` to the registry (names are unique); earlier registrations match first."""
    if kind.name in _KINDS:
        raise ValueError(f"Layer kind {kind.name!r} is already registered.")
    texts = {f.name: getattr(kind, f.name) for f in fields(kind) if isinstance(getattr(kind, f.name), str)}
    broken = {name: text for name, text in texts.items() if "|" in text or "\n" in text}
    if broken:  # they are cells of the markdown kind table
        raise ValueError(f"Layer kind {kind.name!r}: {broken} contain '|' or a line break, which break the kind table. Reword them.")
    _KINDS[kind.name] = kind
    return kind


def layer_kinds() -> list[LayerKind]:
    """The registered kinds, in matching order."""
    return list(_KINDS.values())


# ------------------------------------------------------------------------------------ finding


def _lora_layer_cls() -> tuple[type, ...]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return (LoraLayer,)


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of ``module`` (the kind it replaced, if any), or ``None``."""
    tagged = record.counted_as(module)  # a module that replaced a layer of another kind
    if tagged is not None:
        return _KINDS[tagged]
    return next((kind for kind in _KINDS.values() if kind.matches(module)), None)


def is_adapted(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (an adapted layer)."""
    lora = _lora_layer_cls()
    return bool(lora) and isinstance(module, lora)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer itself: a peft LoRA layer's base layer, else ``module``."""
    lora = _lora_layer_cls()
    return module.get_base_layer() if lora and isinstance(module, lora) else module  # type: ignore[operator]


def find_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module, LayerKind]]:
    """``(name, layer, kind)`` for every layer of a registered kind, quantized, adapted or not.

    An adapted layer is reported once, under the peft LoRA layer's name (the module a parent calls);
    the adapters' own Linears (``lora_A``, ``lora_B``) are not layers of the model.
    """
    lora: tuple[type[Any], ...] = _lora_layer_cls()
    # named_modules is pre-order: a module inside a skipped one has it as an ancestor prefix. A set looked up per
    # ancestor is O(depth); scanning a list of every skipped name was O(layers) per module (seconds at 200+ LoRA layers)
    skip: set[str] = set()
    for name, sub in module.named_modules():
        if skip and _under(name, skip):
            continue
        if lora and isinstance(sub, lora):
            skip.add(name)
            kind = kind_of(base_layer(sub))
            if kind is not None:
                yield name, sub, kind
            continue
        kind = kind_of(sub)
        if kind is not None:
            if kind.stored_in is not None and kind.stored_in(sub) is not None:
                skip.add(name)  # its quantized storage is part of it, not a layer of the model
            yield name, sub, kind


def _under(name: str, prefixes: set[str]) -> bool:
    """Whether a strict ancestor of the module ``name`` (dotted) is in ``prefixes``."""
    end = name.rfind(".")
    while end > 0:
        if name[:end] in prefixes:
            return True
        end = name.rfind(".", 0, end)
    return False


def prepare_model(module: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Replace the layers whose kind has a ``prepare`` step (``nn.MultiheadAttention``, experts), in place.

    Checks every layer first (an unsupported one raises before anything changes); idempotent.
    Modules for which ``skip(name)`` is true stay as they are. Returns the names of the replaced modules.
    """
    planned = [(n, m, k) for n, m in module.named_modules() for k in [kind_of(m)] if k is not None and k.prepare and k.matches(m) and not skip(n)]
    replacements = [(name, kind, kind.prepare(sub)) for name, sub, kind in planned]  # type: ignore[misc]
    replacements = [(name, kind, new) for name, kind, new in replacements if new is not None]
    for name, kind, new in replacements:
        # the replacement's Linears count as layers of the kind they replace (coverage, quantize_model's tags)
        record.set_converted(cast(nn.Module, new), kind.name)  # not None: filtered above
        for sub in cast(nn.Module, new).modules():
            if isinstance(sub, nn.Linear):
                record.set_kind(sub, kind.name)
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, new)
    for kind in {kind.name: kind for _, kind, _ in replacements}.values():
        if kind.after_prepare is not None:
            kind.after_prepare(module)
    return [name for name, _, _ in replacements]


# ------------------------------------------------------------------------ direct weight readers

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
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
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
                path, value = [], node.value
                while isinstance(value, ast.Attribute):
                    path.append(value.attr)
                    value = value.value
                if path and isinstance(value, ast.Name) and value.id == "self":
                    key, use = ".".join(reversed(path)), (f"{klass.__name__}.{func.name}", id(node) in metadata)
                    if key not in found or found[key][1] and not use[1]:  # a real use wins over a metadata read
                        found[key] = use
    return tuple((path, reader, meta) for path, (reader, meta) in found.items())


def _own_forward(layer: nn.Module) -> bool:
    """Whether ``layer`` is an ``nn.Linear`` subclass whose forward computes something else than ``F.linear``.

    transformers' Llama4Router returns ``(scores, logits)``: the mode's layer or peft's would replace that forward.
    FalconLinear computes the same product in its own code: it is an ordinary Linear. Told apart by one call on a
    fixed 2-row input (no random numbers drawn); on meta or fake weights only the output's type and shape count.
    """
    cls = type(layer)
    if not isinstance(layer, nn.Linear) or cls.forward is nn.Linear.forward or cls.__module__.startswith(_KNOWN):
        return False
    if quantized_format(layer) is not None:  # a registered format's own layer (one defined outside this package too)
        return False
    weight = layer.weight
    x = torch.arange(2 * layer.in_features, dtype=weight.dtype, device=weight.device).reshape(2, -1).sin()
    with torch.no_grad():
        out = layer(x)
        if not isinstance(out, torch.Tensor) or out.shape != (2, layer.out_features):
            return True
        if weight.device.type == "meta" or type(weight.data) is not torch.Tensor:  # no values to compare (planner)
            return False
        return not torch.allclose(out, F.linear(x, weight, layer.bias), rtol=1e-3, atol=1e-5)


def output_heads(module: nn.Module) -> list[str]:
    """Names of the output heads inside ``module``, one rule for every model.

    Per model: transformers' ``get_output_embeddings()``; else a Linear whose weight is an
    ``nn.Embedding``'s (a tied head); else the last registered Linear whose ``out_features`` is the
    vocabulary (the widest ``nn.Embedding``'s ``num_embeddings``): LitGPT's ``lm_head``, torchtune's
    ``output``, nanoGPT's untied ``lm_head``. The precision plugin keeps them in the compute dtype,
    LoRA leaves them alone and ``FusedLoss`` fuses them.
    """
    by_id = {id(m): n for n, m in module.named_modules()}
    heads: list[str] = []
    for sub in module.modules():
        getter = getattr(sub, "get_output_embeddings", None)
        head = getter() if callable(getter) else None
        if isinstance(head, nn.Module) and id(head) in by_id and by_id[id(head)] not in heads:
            heads.append(by_id[id(head)])
    if heads:
        return heads
    embeddings = [m for m in module.modules() if isinstance(m, nn.Embedding)]
    if not embeddings:
        return []
    linears = [(n, m) for n, m in module.named_modules() if hasattr(m, "out_features") and isinstance(getattr(m, "weight", None), nn.Parameter)]
    shared = {id(e.weight) for e in embeddings}
    tied = [n for n, m in linears if id(m.weight) in shared]
    if tied:
        return tied
    # the widest embedding is the vocabulary: narrower ones (positions, token types) would match classifiers
    vocab = max(e.num_embeddings for e in embeddings)
    wide = [n for n, m in linears if m.out_features == vocab]
    # a Linear inside a repeated block (an nn.ModuleList's element) is no head, even if its width equals the
    # vocabulary: LitGPT registers lm_head before its blocks, whose MLP may be as wide as a tiny vocabulary
    in_blocks = {f"{n}.{i}" if n else str(i) for n, m in module.named_modules() if isinstance(m, nn.ModuleList) for i in range(len(m))}
    outside = [n for n in wide if not any(n == b or n.startswith(b + ".") for b in in_blocks)]
    return (outside or wide)[-1:]


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
            readers[name] = f"{type(base_layer(layer)).__name__}.forward (an nn.Linear subclass with its own forward)"
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


def converted_keys(module: nn.Module) -> dict[str, str]:
    """``{prefix of a converted tensor: as-built key}`` for every layer :func:`prepare_model` replaced in ``module``.

    E.g. ``{"enc.attn.q_proj.weight": "enc.attn.in_proj_weight", "moe.experts.down_proj.3.weight":
    "moe.experts.down_proj"}``, from each kind's ``as_built_keys``. Peft's ``base_layer`` is left out of
    the names (see :func:`lightning_hbm.resume.as_built_key`).
    """
    keys: dict[str, str] = {}
    for name, sub in module.named_modules():
        kind = _KINDS.get(record.converted_from(sub) or "")
        if kind is None or kind.as_built_keys is None:
            continue
        prefix = name.replace(".base_layer", "") + "." if name else ""
        keys.update({prefix + new: prefix + old for new, old in kind.as_built_keys(sub).items()})
    return keys


def adaptable_names(module: nn.Module) -> list[str]:
    """Names of the layers LoRA can adapt, as they will be named after :func:`prepare_model` (each kind's
    ``adaptable_names``: e.g. the q/k/v projections of an ``nn.MultiheadAttention`` not yet prepared)."""
    names: list[str] = []
    for name, sub, kind in find_layers(module):
        names.extend(f"{name}.{local}" if local else name for local in kind.adaptable_names(base_layer(sub)))
    return names


def no_names(layer: nn.Module) -> list[str]:
    """``adaptable_names`` of a kind LoRA never adapts (quantized embeddings): none."""
    return []


def kind_names(quantized: bool = False, adapted: bool = False) -> str:
    """The registered kinds, for messages: ``"Linear, Conv1D, ..."`` (``quantized``: only those a mode quantizes;
    ``adapted``: only those LoRA adapts)."""
    return ", ".join(
        k.name for k in _KINDS.values() if (not quantized or k.to_linear is not None) and (not adapted or k.adaptable_names is not no_names)
    )


def kind_table() -> str:
    """The kind table of docs/adapters.md (markdown), one row per registered kind (tests/layers check the page)."""
    lines = ["| layer kind | found in | quantized as | LoRA adapts | the planner counts it as |", "|---|---|---|---|---|"]
    for k in _KINDS.values():
        lines.append(f"| {k.modules} | {k.found_in} | {k.quantized_as} | {k.adapted_as} | {k.planned_as} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------- coverage


@dataclass
class CoverageRow:
    """Parameters of one kind (logical element counts) and what was done with them."""

    kind: str
    layers: int = 0
    params: int = 0
    quantized: int = 0
    adapted: int = 0
    checkpointed: int = 0
    left_alone: int = 0
    bytes: int = 0  # storage bytes of the layers' parameters (quantization constants included)
    unhandled: int = 0  # left alone not by choice (nothing supports them): warned above 5 %
    reasons: dict[str, int] = field(default_factory=dict)  # why left alone -> parameters
    undeliberate: list[str] = field(default_factory=list)  # names of layers left alone not by choice


def _left_alone_reason(layer: nn.Module, kind: LayerKind, quantizing: bool, adapting: bool, reader: Optional[str] = None) -> tuple[str, bool]:
    tagged = record.left_alone(layer)
    if tagged is not None:
        return tagged
    if reader is not None:
        return f"weight read directly by {reader}, not by calling the layer: kept in the compute dtype", False
    if kind.prepare is not None and kind.matches(layer):
        return f"{kind.name}: this variant is not supported yet", False
    # a layer LoRA cannot adapt (a grouped convolution) is said so, with the fix, not just "not quantized"
    skipped = f"; {kind.not_adapted}" if adapting and kind.not_adapted and not kind.adaptable_names(layer) else ""
    if kind.to_linear is None and quantizing:
        return kind.quantized_as + skipped, False
    if quantizing:  # the plugin tags what it skips; an untagged float layer came after it
        return "added after quantization", True
    if skipped:
        return "frozen in full precision (no QuantizedPrecision)" + skipped, True
    return "frozen in full precision (no QuantizedPrecision" + (", not a LoRA target)" if adapting else ")"), True


def coverage(module: nn.Module, quantizing: bool, adapting: bool) -> list[CoverageRow]:
    """One row per registered kind present in ``module``, the LoRA adapters, and ``other`` (embeddings, norms, ...).

    ``quantizing``/``adapting``: whether a QuantizedPrecision / LoRA took part (for the reasons).
    """
    lora = _lora_layer_cls()
    blocks = record.checkpointed_blocks(module)
    rows: dict[str, CoverageRow] = {}
    in_kinds: set[int] = set()
    readers, users = weight_readers(module), weight_readers(module, uses_only=True)
    for name, sub, kind in find_layers(module):
        layer = base_layer(sub)
        row = rows.setdefault(kind.name, CoverageRow(kind.name))
        # a layer's own parameters: the children of an unconverted MultiheadAttention or experts module
        # (out_proj, a router) are layers or "other" parameters of their own
        own = list(layer.parameters(recurse=False))
        storage = kind.stored_in(layer) if kind.stored_in is not None else None
        if storage is not None:  # a wrapped quantized layer: its storage's tensors are its own
            own += list(storage.parameters())
        # a quantized layer's calibrated correction: part of its stored weight (its bytes), not more weights
        correction = correction_of(layer)
        factors = list(correction.parameters()) if correction is not None else []
        has_children = storage is None and any(child is not correction for child in layer.children())
        count = sum(p.numel() for p in own) if has_children else parameter_count(layer) - sum(p.numel() for p in factors)
        in_kinds.update(id(p) for p in [*own, *factors])
        row.layers += 1
        row.params += count
        if has_children:
            row.bytes += sum(p.numel() * p.element_size() for p in [*own, *factors])
        else:
            row.bytes += parameter_bytes(layer)
        quantized = storage is not None or any(not p.is_floating_point() for p in own) or quantized_format(layer) is not None
        adapted = bool(lora) and isinstance(sub, lora)
        row.quantized += count if quantized else 0
        row.adapted += count if adapted else 0
        note = getattr(layer, "coverage_note", None)  # stored small but not computed as the others (T5's fp32 `wo`)
        if quantized and note:
            row.reasons[note] = row.reasons.get(note, 0) + count
        if any(name == b or name.startswith(b + ".") for b in blocks):
            row.checkpointed += count
        if not quantized and not adapted:
            reader = (readers if kind.to_linear is not None else users).get(name)  # a convolution is never quantized
            reason, deliberate = _left_alone_reason(layer, kind, quantizing, adapting, reader)
            row.left_alone += count
            row.reasons[reason] = row.reasons.get(reason, 0) + count
            if not deliberate:
                row.undeliberate.append(name)
                row.unhandled += count
        elif adapted and quantizing and not quantized and kind.to_linear is None:
            # adapted, but its frozen base stays at full size (a convolution): said, and warned above 5 %
            reason = f"{kind.quantized_as}; adapted by LoRA"
            row.reasons[reason] = row.reasons.get(reason, 0) + count
            row.undeliberate.append(name)
            row.unhandled += count
        elif adapted and quantizing and not quantized:
            # adapted but kept wide (ignore_modules, the head, the sensitivity plan): its reason too (issue 53: every
            # layer kept wide has its reason in the table)
            # (in the table only: an adapted layer trains, so it is not counted among those warned as left alone)
            reason, _ = _left_alone_reason(layer, kind, quantizing, adapting, readers.get(name))
            reason = f"{reason}; adapted by LoRA"
            row.reasons[reason] = row.reasons.get(reason, 0) + count
    other = CoverageRow("other (embeddings, norms, ...)")
    adapters = CoverageRow("LoRA adapters (trained)")
    # its "layers": the adapted layers (peft LoRA layers), each holding one lora_A/lora_B pair
    adapters.layers = sum(1 for m in module.modules() if isinstance(m, lora)) if lora else 0
    outside = {kind: CoverageRow(kind) for kind in OUTSIDE_ROWS}
    owners = {id(p): n for n, m in module.named_modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    kinds = _outside_kinds(module, {id(p) for p in module.parameters() if id(p) not in in_kinds})
    holders: dict[str, list[str]] = {kind: [] for kind in OUTSIDE_ROWS}
    for name, param in module.named_parameters():
        if id(param) in in_kinds:
            continue
        if ".lora_" in name:
            adapters.params += param.numel()
        elif id(param) in owners and id(param) in kinds:
            # a weight matrix no layer kind holds (DBRX's experts: 2-D w1/v1/w2 Parameters, routers, RG-LRU gates,
            # weight_norm's factors): never quantized or adapted; its own row says what it is, warned above 5 %
            owner, row = owners[id(param)], outside[kinds[id(param)]]
            reason, deliberate, _ = _OUTSIDE[row.kind]
            row.params += param.numel()
            row.left_alone += param.numel()
            row.reasons[reason] = row.reasons.get(reason, 0) + param.numel()
            row.checkpointed += param.numel() if any(owner == b or owner.startswith(b + ".") for b in blocks) else 0
            row.unhandled += 0 if deliberate else param.numel()
            if owner not in holders[row.kind]:
                holders[row.kind].append(owner)
        else:
            other.params += param.numel()
    other.left_alone = other.params
    for row in outside.values():
        row.layers = len(holders[row.kind])
        row.undeliberate = [] if _OUTSIDE[row.kind][1] else holders[row.kind]
    present = [row for row in outside.values() if row.params]
    return [*rows.values(), *present, *([adapters] if adapters.params else []), other]


RAW_WEIGHTS = "weights outside any layer"
RAW_WEIGHTS_REASON = "Parameters of 2+ dimensions used by their module's own code (no layer kind lightning_hbm knows)"
ROUTER_WEIGHTS = "router (F.linear)"
PARAMETRIZED_WEIGHTS = "parametrized weights"
GROUPED_WEIGHTS = "3-D weights, not experts"
POSITION_TABLES = "position tables"
#: Rows of the coverage table for Parameters outside any layer kind: (reason, deliberate, what to do when warned).
_OUTSIDE: dict[str, tuple[str, bool, str]] = {
    RAW_WEIGHTS: (
        RAW_WEIGHTS_REASON,
        False,
        "Parameters of {names}, which their module's own code uses (no nn.Linear or other layer kind). They stay at full "
        "size in the parameters term: exclude them knowingly, or use a model whose weights are nn.Linear layers",
    ),
    ROUTER_WEIGHTS: (
        "MoE router: a Parameter its module's forward applies with F.linear (one logit per expert, no nn.Linear); kept in "
        "full precision, as routers are (quantized routing changes which experts run), and not adapted",
        True,
        "routers of {names}: kept in full precision on purpose",
    ),
    PARAMETRIZED_WEIGHTS: (
        "factors of a weight computed by a torch parametrization (weight_norm's g and v, parametrize's original0/1): "
        "the layer's weight is recomputed from them at every call, so there is nothing fixed to quantize and LoRA "
        "does not reach them",
        False,
        "factors of {names}. They stay at full size in the parameters term: QuantizedPrecision folds a convolution's "
        "weight_norm into one quantized weight; else remove the parametrization before training "
        "(torch.nn.utils.parametrize.remove_parametrizations(layer, 'weight') or torch.nn.utils.remove_weight_norm) to "
        "make each an ordinary layer, or exclude them knowingly",
    ),
    GROUPED_WEIGHTS: (
        "3-D Parameters [groups, in, out] whose leading dim is no expert count (RecurrentGemma's RG-LRU per-head gates), "
        "used in their module's own batched matmul (no nn.Linear, no experts layer): not quantized, no adapter",
        False,
        "3-D weights of {names}, used in their module's own batched matmul. They are not experts (no MoE advice "
        "applies): they stay at full size in the parameters term; exclude them knowingly",
    ),
    POSITION_TABLES: (
        "tables their module adds to the activations (learned positions), not multiplied: kept in full precision like "
        "the embeddings",
        True,
        "tables of {names}: kept in full precision on purpose",
    ),
}
OUTSIDE_ROWS = tuple(_OUTSIDE)


def _is_raw_weight(param: nn.Parameter) -> bool:
    # a matrix (or stack of them) of at least 2 rows; a [1, tokens, width] table broadcast over the batch (ViT
    # cls_token / pos_embed, SigLIP's probe, RWKV's time mixes) is an embedding
    return param.dim() >= 2 and param.shape[0] > 1 and param.is_floating_point()


_MATMULS = {"linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "einsum", "conv1d", "conv2d", "conv3d", "tensordot"}


@functools.lru_cache(maxsize=None)
def _uses(cls: type) -> dict[str, frozenset[str]]:
    """``{attribute: {"matmul", "add"}}``: how the code of ``cls`` (not its init) uses each ``self.<attribute>``.

    "matmul": an argument of a matmul-like call (``F.linear``, ``torch.bmm``, ``einsum``, ...) or an operand of ``@``,
    possibly indexed, transposed or cast first; "add": an operand of ``+``. What the module does with the tensor, read
    from its source (no batch at fit start to run it on); code without source is not seen.
    """
    found: dict[str, set[str]] = {}
    for klass in cls.__mro__:
        if not issubclass(klass, nn.Module) or klass is nn.Module:
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
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


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "num_routed_experts", "total_experts", "n_routed_experts", "moe_num_experts")


def expert_counts(module: nn.Module) -> set[int]:
    """The expert counts ``module`` declares (its own attributes, then its ``config``'s); empty for any other module."""
    counts: set[int] = set()
    for source in (module, getattr(module, "config", None)):
        for attr in _EXPERT_COUNTS:
            value = getattr(source, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                counts.add(value)
    return counts


def _outside_kinds(module: nn.Module, candidates: set[int]) -> dict[int, str]:
    """``{id(parameter): row}`` for the weight-like Parameters among ``candidates`` (no layer kind holds them)."""
    found: dict[int, str] = {}
    for parent in module.modules():
        # a router scores one logit per expert: its weight's rows are the expert count of an experts layer beside it
        counts = {n for child in parent.children() for n in expert_counts(child)}
        for owner in parent.children():
            weight_norm = any(type(hook).__name__ == "WeightNorm" for hook in owner._forward_pre_hooks.values())
            listed = isinstance(owner, torch.nn.utils.parametrize.ParametrizationList)
            # weight_norm's g ([out, 1, 1], or [1, 1, k] along another dim) goes with its v, whatever its shape
            factors = {n for n, p in owner.named_parameters(recurse=False) if p.is_floating_point() and (listed or weight_norm and n.endswith(("_g", "_v")))}
            own = [(n, p) for n, p in owner.named_parameters(recurse=False) if id(p) in candidates and (n in factors or _is_raw_weight(p))]
            if not own:
                continue  # nothing to classify: no need to parse the class's source (seconds over a model's classes)
            uses = _uses(type(owner))  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
            grouped = any(p.dim() == 3 and "matmul" in uses.get(n, {"matmul"}) for n, p in own)
            for local, param in own:
                if local in factors:
                    found[id(param)] = PARAMETRIZED_WEIGHTS
                elif param.dim() == 2 and param.shape[0] in counts:
                    found[id(param)] = ROUTER_WEIGHTS
                elif uses.get(local) == frozenset({"add"}):
                    found[id(param)] = POSITION_TABLES
                else:
                    found[id(param)] = GROUPED_WEIGHTS if grouped else RAW_WEIGHTS
    for name, param in module.named_parameters(recurse=False):  # the root's own (no parent to look from)
        if id(param) in candidates and _is_raw_weight(param):
            found.setdefault(id(param), POSITION_TABLES if _uses(type(module)).get(name) == frozenset({"add"}) else RAW_WEIGHTS)  # type: ignore[arg-type]  # mypy: a class is not Hashable (lru_cache)
    return found


def format_coverage(rows: list[CoverageRow]) -> str:
    """The coverage table as text (one line per kind)."""
    total = max(sum(r.params for r in rows), 1)
    header = f"{'layer kind':<30} {'layers':>6} {'params':>12} {'share':>6} {'quantized':>12} {'adapted':>12} {'checkpointed':>12} {'left alone':>12}  why left alone"
    lines = [header]
    for r in rows:
        why = "; ".join(f"{reason} ({n:,})" for reason, n in r.reasons.items())
        lines.append(
            f"{r.kind:<30} {r.layers:>6} {r.params:>12,} {100 * r.params / total:>5.1f}% {r.quantized:>12,} "
            f"{r.adapted:>12,} {r.checkpointed:>12,} {r.left_alone:>12,}  {why}"
        )
    return "\n".join(lines)


def coverage_warnings(rows: list[CoverageRow]) -> list[str]:
    """One message per kind left alone, not by choice, holding more than 5 % of all parameters."""
    total = max(sum(r.params for r in rows), 1)
    messages = []
    for r in rows:
        if r.unhandled / total > WARN_SHARE and r.kind in _OUTSIDE:
            names = f"{r.undeliberate[:4]}{' ...' if len(r.undeliberate) > 4 else ''}"
            messages.append(
                f"lightning_hbm: {100 * r.unhandled / total:.1f}% of the parameters are {r.kind}, left as they were (not "
                f"quantized, no adapter): {_OUTSIDE[r.kind][2].format(names=names)}."
            )
        elif r.unhandled / total > WARN_SHARE:
            kind = _KINDS[r.kind]
            read = [why for why in r.reasons if why.startswith("weight read directly")]
            option = (
                f"{'; '.join(read)}. Replace the reading code by a call of the layer to quantize/adapt them"
                if read else f"Option: {kind.option}"
            )
            # convolutions LoRA adapted are unhandled too (not quantized), but not left as they were
            state = "left as they were (not quantized, no adapter)" if r.left_alone >= r.unhandled else "not quantized"
            if kind.to_linear is None and kind.prepare is None:
                option = f"{kind.quantized_as}. {option}"
            if kind.not_adapted and any(kind.not_adapted in why for why in r.reasons):
                option = f"{option}. {kind.not_adapted}"
            messages.append(
                f"lightning_hbm: {100 * r.unhandled / total:.1f}% of the parameters are {r.kind} layers {state}: "
                f"{r.undeliberate[:4]}{' ...' if len(r.undeliberate) > 4 else ''}. {option}."
            )
    return messages


def report_coverage(module: nn.Module, quantizing: bool) -> list[CoverageRow]:
    """Compute, print (rank 0), log and store the coverage table; warn.

    Stored in the model's record (:func:`lightning_hbm.record.coverage_of`) and, as documented in docs/adapters.md,
    as ``module.lightning_hbm_coverage``.

    Logged through the Trainer's loggers (when ``module`` is attached to one), per kind ``K``:
    ``layers/K/params``, ``layers/K/quantized``, ``layers/K/adapted``, ``layers/K/checkpointed``,
    ``layers/K/left_alone`` (parameter counts).
    """
    while not isinstance(module, pl.LightningModule) and isinstance(getattr(module, "module", None), nn.Module):
        module = cast(nn.Module, module.module)  # DDP / wrappers: the LightningModule inside
    lora = _lora_layer_cls()
    adapting = bool(lora) and any(isinstance(m, lora) for m in module.modules())
    rows = coverage(module, quantizing, adapting)
    record.set_coverage(module, rows)
    cast(Any, module).lightning_hbm_coverage = rows  # a plain list: nn.Module keeps it in __dict__, as any attribute
    rank_zero_info("lightning_hbm: layer kinds (parameters)\n" + format_coverage(rows))
    for message in coverage_warnings(rows):
        rank_zero_warn(message)
    trainer = lightning_compat.attached_trainer(module)
    if trainer is not None:
        metrics = {
            f"layers/{r.kind.split(' ')[0]}/{field}": float(getattr(r, field))
            for r in rows
            for field in ("params", "quantized", "adapted", "checkpointed", "left_alone")
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
    return rows


__all__ = [
    "CoverageRow",
    "LayerKind",
    "adaptable_names",
    "base_layer",
    "expert_counts",
    "is_adapted",
    "converted_keys",
    "source_readers",
    "stored_in",
    "weight_readers",
    "coverage",
    "coverage_warnings",
    "find_layers",
    "format_coverage",
    "itself",
    "kind_names",
    "kind_of",
    "kind_table",
    "layer_kinds",
    "linear_features",
    "prepare_model",
    "register_kind",
    "report_coverage",
]
