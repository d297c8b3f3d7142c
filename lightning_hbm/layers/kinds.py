"""The layer-kind protocol and registry: :class:`LayerKind`, :func:`register_kind`, and the lookups over the
registered kinds (:func:`kind_of`, :func:`layer_kinds`, the kind table of docs/adapters.md).

A *layer kind* is a way real models store a big weight matrix. Each kind is one file of this package that builds
one :class:`LayerKind` and registers it (:func:`register_kind`): ``linear.py`` (``nn.Linear`` and its subclasses),
``conv1d.py`` (transformers' GPT-2 ``Conv1D``), ``multihead_attention.py`` (``nn.MultiheadAttention``), ``conv.py``
(``nn.Conv1d``/``2d``/``3d``), ``conv_transpose.py`` (``nn.ConvTranspose1d``/``2d``/``3d``), ``embedding.py`` and ``experts.py`` (the 3-D expert Parameters of transformers-5 MoE layers).

A kind says how a layer of it is found (``matches``), rewritten first if it must be (``prepare``: an equivalent
module made of Linears), quantized (``to_linear``: an equivalent ``nn.Linear`` handed to the precision mode's
``replace``, so every mode of :mod:`lightning_hbm.precision.registry` covers every kind), adapted by LoRA
(``adaptable_names``), counted by the planner and shown in the coverage table and in docs/adapters.md's kind table
(:func:`kind_table`). ``QuantizedPrecision`` (quantization), ``LoRA.resolve`` (targets), the sensitivity plan's byte
prediction and the coverage table (:mod:`~lightning_hbm.layers.coverage_table`) go through
:func:`~lightning_hbm.layers.finding.find_layers` / :func:`kind_of`; nothing here names a kind.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Callable, Optional, cast

from torch import nn

from lightning_hbm import record


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


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of ``module`` (the kind it replaced, if any), or ``None``."""
    tagged = record.counted_as(module)  # a module that replaced a layer of another kind
    if tagged is not None:
        return _KINDS[tagged]
    return next((kind for kind in _KINDS.values() if kind.matches(module)), None)


def kind_named(name: Optional[str]) -> Optional[LayerKind]:
    """The registered kind called ``name``, or ``None`` (no such kind, or no name)."""
    return _KINDS.get(name or "")


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



__all__ = [
    "LayerKind",
    "itself",
    "kind_named",
    "kind_names",
    "kind_of",
    "kind_table",
    "layer_kinds",
    "linear_features",
    "no_names",
    "register_kind",
    "stored_in",
]
