"""The layer kinds lightning_hbm knows: one registered entry per kind, used by quantization, LoRA and reports.

A *layer kind* is a way real models store a big weight matrix: ``nn.Linear`` (and its subclasses,
such as ``nn.MultiheadAttention``'s ``NonDynamicallyQuantizableLinear`` ``out_proj``), transformers'
``Conv1D`` (GPT-2: the same matmul with the weight stored transposed), ``nn.MultiheadAttention``
(a raw ``in_proj_weight`` Parameter, no Linear) and the 3-D expert Parameters of transformers-5
mixture-of-experts layers (``gate_up_proj``/``down_proj`` of shape ``[experts, out, in]``).

Each :class:`LayerKind` says how a layer of that kind is found, how it is quantized (``to_linear``:
an equivalent ``nn.Linear`` handed to the precision mode's ``replace``, so every mode of
:mod:`lightning_hbm.precision.registry` covers every kind), how LoRA reaches it and what to do when
it is left alone. ``QuantizedPrecision`` (quantization), ``LoRA.resolve`` (targets) and
:func:`coverage` (the fit-start table) all go through :func:`find_layers`, so adding a kind is one
:func:`register_kind` call.

``nn.MultiheadAttention`` and experts layers are *prepared* first (:func:`prepare_model`): replaced by
the equivalent :class:`~lightning_hbm.multihead_attention.ProjectedMultiheadAttention` (four Linear
projections) and :class:`~lightning_hbm.experts.LinearExperts` (one Linear per expert), whose
Linears are quantizable and adaptable (see those modules for why).
"""

from __future__ import annotations

import ast
import functools
import inspect
import logging
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Iterator, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm.experts import LinearExperts, supported
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.multihead_attention import ProjectedMultiheadAttention

log = logging.getLogger(__name__)

KIND_ATTR = "_lightning_hbm_kind"  # set on a module that replaced a layer of another kind
LEFT_ALONE_ATTR = "_lightning_hbm_left_alone"  # (reason, deliberate) set by QuantizedPrecision on skipped layers
CONVERTED_ATTR = "_lightning_hbm_converted"  # kind name, set on the module prepare() put in a layer's place
PLAN_ATTR = "_lightning_hbm_checkpoint"  # set by ActivationCheckpointing on each checkpointed block
WARN_SHARE = 0.05  # a kind left alone (not by choice) above this share of all parameters is a warning


@dataclass(frozen=True)
class LayerKind:
    """One kind of weight-holding layer.

    Attributes:
        name: shown in the coverage table and the layer-kind table of docs/adapters.md.
        matches: whether a module (as the user built it) is a layer of this kind.
        to_linear: an equivalent ``nn.Linear`` holding the layer's weight (the mode's ``replace``
            quantizes it); ``None``: this kind is not quantized.
        prepare: replaces the layer by an equivalent module made of quantizable/adaptable layers
            (run before quantization and LoRA; returns ``None`` for a variant it cannot convert, which
            stays as it is); ``None``: used as it is.
        quantized_as: how it is quantized (docs/adapters.md table).
        adapted_as: how LoRA reaches it (docs/adapters.md table).
        option: what to pass when it is left alone (named in the warning).
        as_built_keys: for a kind with ``prepare``, the replacement's tensors as forms of the layer's as
            built: ``{replacement key: as-built key}`` (local names, e.g. ``{"q_proj.weight": "in_proj_weight"}``).
            A checkpoint that left the frozen base out (adapter-only) is checked against it on resume.
    """

    name: str
    matches: Callable[[nn.Module], bool]
    to_linear: Optional[Callable[[nn.Module], nn.Linear]]
    quantized_as: str
    adapted_as: str
    option: str
    prepare: Optional[Callable[[nn.Module], Optional[nn.Module]]] = None
    as_built_keys: Optional[Callable[[nn.Module], dict[str, str]]] = None


_KINDS: dict[str, LayerKind] = {}


def register_kind(kind: LayerKind) -> LayerKind:
    """Add ``kind`` to the registry (names are unique); earlier registrations match first."""
    if kind.name in _KINDS:
        raise ValueError(f"Layer kind {kind.name!r} is already registered.")
    _KINDS[kind.name] = kind
    return kind


def layer_kinds() -> list[LayerKind]:
    """The registered kinds, in matching order."""
    return list(_KINDS.values())


# ---------------------------------------------------------------------------------------- kinds


def _is_linear(module: nn.Module) -> bool:
    # Any Linear subclass (NonDynamicallyQuantizableLinear included) whose weight is still float: an
    # already quantized layer (bitsandbytes, Int8DynamicLinear) holds an integer weight.
    return isinstance(module, nn.Linear) and module.weight.is_floating_point()


def _linear_as_linear(module: nn.Module) -> nn.Linear:
    return module  # type: ignore[return-value]


def _conv1d_class() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _is_conv1d(module: nn.Module) -> bool:
    cls = _conv1d_class()
    return cls is not None and isinstance(module, cls) and module.weight.is_floating_point()


def _conv1d_as_linear(conv: nn.Module) -> nn.Linear:
    # Conv1D computes x @ W + b with W stored [in, out]: the Linear with weight W.T is the same map.
    # The transposed copy is transient (the mode quantizes it); the bias Parameter is shared.
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None, device="meta")
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=False)
    if conv.bias is not None:
        linear.bias = conv.bias
    return linear


def _is_mha(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention)


def _prepare_mha(module: nn.Module) -> nn.Module:
    new = ProjectedMultiheadAttention.from_torch(module)  # type: ignore[arg-type]
    object.__setattr__(new, CONVERTED_ATTR, "MultiheadAttention")
    for proj in (new.q_proj, new.k_proj, new.v_proj, new.out_proj):
        object.__setattr__(proj, KIND_ATTR, "MultiheadAttention")
    return new


def _prepare_experts(module: nn.Module) -> Optional[nn.Module]:
    if not supported(module):
        return None  # left as it is: the coverage table names it
    new = LinearExperts.from_transformers(module)
    object.__setattr__(new, CONVERTED_ATTR, EXPERTS.name)
    for linear in [*new.gate_up_proj, *new.down_proj]:
        object.__setattr__(linear, KIND_ATTR, EXPERTS.name)
    return new


def _is_experts(module: nn.Module) -> bool:
    # transformers-5 MoE layers keep all experts in 3-D Parameters [experts, out, in]; convolutions
    # (also 3-D weights) are another kind of layer, and a 3-D Parameter with one leading row is a learned
    # token or position table broadcast over the batch (ViT cls_token / pos_embed, SigLIP's pooling probe):
    # counted with the embeddings ("other").
    if isinstance(module, nn.modules.conv._ConvNd):
        return False
    return any(p.dim() == 3 and p.shape[0] > 1 for p in module.parameters(recurse=False))


LINEAR = register_kind(
    LayerKind(
        name="Linear",
        matches=_is_linear,
        to_linear=_linear_as_linear,
        quantized_as="the mode's layer (bitsandbytes Linear4bit / Linear8bitLt, Int8DynamicLinear)",
        adapted_as="peft LoRA Linear around it",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
    )
)
CONV1D = register_kind(
    LayerKind(
        name="Conv1D",
        matches=_is_conv1d,
        to_linear=_conv1d_as_linear,
        quantized_as="weight transposed into the mode's Linear layer (as transformers' bitsandbytes integration does)",
        adapted_as="peft LoRA around it (peft's Conv1D layer, or its Linear layer once quantized)",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
    )
)
MULTIHEAD_ATTENTION = register_kind(
    LayerKind(
        name="MultiheadAttention",
        matches=_is_mha,
        # prepare() first turns the module into four Linears tagged with this kind; those are quantized
        to_linear=_linear_as_linear,
        prepare=_prepare_mha,
        as_built_keys=lambda new: new.as_built_keys(),
        quantized_as="replaced by an equivalent module with q/k/v/out Linear projections, each quantized",
        adapted_as="peft LoRA on the q_proj/k_proj/v_proj/out_proj Linears of the replacement",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
    )
)
def _is_conv(module: nn.Module) -> bool:
    return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.weight.is_floating_point()


CONV = register_kind(
    LayerKind(
        name="Conv",
        matches=_is_conv,
        to_linear=None,  # bitsandbytes (and int8-dynamic) have no convolution kernel
        quantized_as="not quantized: bitsandbytes has no convolution kernel (kept in the compute dtype, frozen)",
        adapted_as="peft LoRA Conv layer (not grouped/depthwise convolutions: peft needs r divisible by groups and "
        "cannot merge them)",
        option="LoRA(target_modules='all-linear') adapts them, but no precision mode shrinks them: with a CNN the "
        "quantized base saves little; exclude them knowingly",
    )
)
EXPERTS = register_kind(
    LayerKind(
        name="Experts (3-D parameters)",
        matches=_is_experts,
        # prepare() turns a supported experts layer into one Linear per expert and projection, tagged
        # with this kind; those are quantized and adapted like any Linear
        to_linear=_linear_as_linear,
        prepare=_prepare_experts,
        as_built_keys=lambda new: new.as_built_keys(),
        quantized_as="replaced by an equal module with one Linear per expert and projection, each quantized",
        adapted_as="peft LoRA on each expert's gate_up_proj / down_proj Linear",
        option="only transformers-5 experts in the default layout (concatenated gate/up, no bias) are converted; "
        "this one stays at full size in the parameters term: exclude it knowingly or train a model whose experts "
        "are nn.Linear layers",
    )
)


# ------------------------------------------------------------------------------------ finding


def _lora_layer_cls() -> tuple[type, ...]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return (LoraLayer,)


def kind_of(module: nn.Module) -> Optional[LayerKind]:
    """The kind of ``module`` (the kind it replaced, if any), or ``None``."""
    tagged = getattr(module, KIND_ATTR, None)
    if tagged is not None:
        return _KINDS[tagged]
    return next((kind for kind in _KINDS.values() if kind.matches(module)), None)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer itself: a peft LoRA layer's base layer, else ``module``."""
    lora = _lora_layer_cls()
    return module.get_base_layer() if lora and isinstance(module, lora) else module  # type: ignore[operator]


def find_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module, LayerKind]]:
    """``(name, layer, kind)`` for every layer of a registered kind, quantized, adapted or not.

    An adapted layer is reported once, under the peft LoRA layer's name (the module a parent calls);
    the adapters' own Linears (``lora_A``, ``lora_B``) are not layers of the model.
    """
    lora = _lora_layer_cls()
    skip: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(s + ".") for s in skip):
            continue
        if lora and isinstance(sub, lora):
            skip.append(name)
            kind = kind_of(base_layer(sub)) or _quantized_kind(base_layer(sub))
            if kind is not None:
                yield name, sub, kind
            continue
        kind = kind_of(sub) or _quantized_kind(sub)
        if kind is not None:
            yield name, sub, kind


def _quantized_kind(module: nn.Module) -> Optional[LayerKind]:
    # a quantized Linear (integer weight) that carries no tag was a plain Linear
    if isinstance(module, nn.Linear) and not module.weight.is_floating_point():
        return LINEAR
    return None


def prepare_model(module: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Replace the layers whose kind has a ``prepare`` step (``nn.MultiheadAttention``), in place.

    Checks every layer first (an unsupported one raises before anything changes); idempotent.
    Modules for which ``skip(name)`` is true stay as they are. Returns the names of the replaced modules.
    """
    planned = [(n, m, k) for n, m in module.named_modules() for k in [kind_of(m)] if k is not None and k.prepare and k.matches(m) and not skip(n)]
    replacements = [(name, kind.prepare(sub)) for name, sub, kind in planned]  # type: ignore[misc]
    replacements = [(name, new) for name, new in replacements if new is not None]
    for name, new in replacements:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, new)
    if replacements:
        for sub in module.modules():
            # nn.TransformerEncoder decided at init whether to use its nested-tensor fast path, which
            # reads the attention's raw in_proj weights: off, the replacement has none.
            if isinstance(sub, nn.TransformerEncoder):
                sub.use_nested_tensor = False
    return [name for name, _ in replacements]


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
    return wide[-1:]


def weight_readers(module: nn.Module, uses_only: bool = False) -> dict[str, str]:
    """``{layer name: "Class.method"}``: layers of a registered kind whose weight an enclosing module's code reads
    directly (``self.dt_proj.weight @ x`` in transformers' Mamba, ``F.linear(x, self.qkv.weight)`` in
    torchvision's Swin) instead of calling the layer.

    Such a layer cannot be quantized (the reader gets the packed integer weight: a low-level dtype or shape
    error) nor adapted (the adapter is never called). Found by reading the source of the model's classes
    (``inspect``/``ast``), before any change and without a batch: methods whose name has ``init``/``reset``
    (weight initialisation) and ``.weight.device`` reads are not readers. ``uses_only``: leave out metadata reads
    (``.weight.dtype``/``.shape``: wrong once quantized, harmless for an adapter). Code without source is not seen.
    """
    layers = {id(base_layer(layer)): name for name, layer, _ in find_layers(module)}
    readers: dict[str, str] = {}
    for name, sub in module.named_modules():
        for path, reader, metadata in _weight_paths(type(sub)):
            if metadata and uses_only:
                continue
            try:
                target = sub.get_submodule(path)
            except AttributeError:
                continue
            layer = layers.get(id(base_layer(target)))
            if layer is not None:
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
        kind = _KINDS.get(getattr(sub, CONVERTED_ATTR, None) or "")
        if kind is None or kind.as_built_keys is None:
            continue
        prefix = name.replace(".base_layer", "") + "." if name else ""
        keys.update({prefix + new: prefix + old for new, old in kind.as_built_keys(sub).items()})
    return keys


def adaptable_names(module: nn.Module) -> list[str]:
    """Names of the layers LoRA can adapt, as they will be named after :func:`prepare_model`.

    Linears (quantized or not), Conv1D layers and convolutions (not grouped); for an ``nn.MultiheadAttention`` not yet prepared,
    the four projections its replacement will have.
    """
    names: list[str] = []
    for name, sub, kind in find_layers(module):
        if kind is CONV and base_layer(sub).groups > 1:
            continue  # grouped/depthwise: peft needs r divisible by groups and cannot merge them
        if kind is MULTIHEAD_ATTENTION and isinstance(sub, nn.MultiheadAttention):
            names.extend(f"{name}.{proj}" for proj in ("q_proj", "k_proj", "v_proj"))
        elif kind is EXPERTS and kind.matches(sub):
            if supported(sub):
                experts = sub.gate_up_proj.shape[0]
                names.extend(f"{name}.{proj}.{e}" for proj in ("gate_up_proj", "down_proj") for e in range(experts))
        else:
            names.append(name)
    return names


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


def _checkpointed_names(module: nn.Module) -> list[str]:
    return [n for n, m in module.named_modules() if PLAN_ATTR in vars(m)]


def _left_alone_reason(layer: nn.Module, kind: LayerKind, quantizing: bool, adapting: bool, reader: Optional[str] = None) -> tuple[str, bool]:
    tagged = getattr(layer, LEFT_ALONE_ATTR, None)
    if tagged is not None:
        return tagged
    if reader is not None:
        return f"weight read directly by {reader}, not by calling the layer: kept in the compute dtype", False
    if kind.prepare is not None and kind.matches(layer):
        return f"{kind.name}: this variant is not supported yet", False
    if kind.to_linear is None and quantizing:
        return kind.quantized_as, False
    if quantizing:  # the plugin tags what it skips; an untagged float layer came after it
        return "added after quantization", True
    return "frozen in full precision (no QuantizedPrecision" + (", not a LoRA target)" if adapting else ")"), True


def coverage(module: nn.Module, quantizing: bool, adapting: bool) -> list[CoverageRow]:
    """One row per registered kind present in ``module``, the LoRA adapters, and ``other`` (embeddings, norms, ...).

    ``quantizing``/``adapting``: whether a QuantizedPrecision / LoRA took part (for the reasons).
    """
    lora = _lora_layer_cls()
    blocks = _checkpointed_names(module)
    rows: dict[str, CoverageRow] = {}
    in_kinds: set[int] = set()
    readers, users = weight_readers(module), weight_readers(module, uses_only=True)
    for name, sub, kind in find_layers(module):
        layer = base_layer(sub)
        row = rows.setdefault(kind.name, CoverageRow(kind.name))
        # a layer's own parameters: the children of an unconverted MultiheadAttention or experts module
        # (out_proj, a router) are layers or "other" parameters of their own
        own = list(layer.parameters(recurse=False))
        has_children = next(layer.children(), None) is not None
        count = sum(p.numel() for p in own) if has_children else parameter_count(layer)
        in_kinds.update(id(p) for p in own)
        row.layers += 1
        row.params += count
        row.bytes += sum(p.numel() * p.element_size() for p in own) if has_children else parameter_bytes(layer)
        quantized = any(not p.is_floating_point() for p in own)
        adapted = bool(lora) and isinstance(sub, lora)
        row.quantized += count if quantized else 0
        row.adapted += count if adapted else 0
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
    other = CoverageRow("other (embeddings, norms, ...)")
    adapters = CoverageRow("LoRA adapters (trained)")
    for name, param in module.named_parameters():
        if id(param) not in in_kinds:
            row = adapters if ".lora_" in name else other
            row.params += param.numel()
    other.left_alone = other.params
    return [*rows.values(), *([adapters] if adapters.params else []), other]


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
        if r.unhandled / total > WARN_SHARE:
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
            messages.append(
                f"lightning_hbm: {100 * r.unhandled / total:.1f}% of the parameters are {r.kind} layers {state}: "
                f"{r.undeliberate[:4]}{' ...' if len(r.undeliberate) > 4 else ''}. {option}."
            )
    return messages


def report_coverage(module: nn.Module, quantizing: bool) -> list[CoverageRow]:
    """Compute, print (rank 0), log and store (``module.lightning_hbm_coverage``) the coverage table; warn.

    Logged through the Trainer's loggers (when ``module`` is attached to one), per kind ``K``:
    ``layers/K/params``, ``layers/K/quantized``, ``layers/K/adapted``, ``layers/K/checkpointed``,
    ``layers/K/left_alone`` (parameter counts).
    """
    while not isinstance(module, pl.LightningModule) and isinstance(getattr(module, "module", None), nn.Module):
        module = module.module  # DDP / wrappers: the LightningModule inside
    lora = _lora_layer_cls()
    adapting = bool(lora) and any(isinstance(m, lora) for m in module.modules())
    rows = coverage(module, quantizing, adapting)
    object.__setattr__(module, "lightning_hbm_coverage", rows)
    rank_zero_info("lightning_hbm: layer kinds (parameters)\n" + format_coverage(rows))
    for message in coverage_warnings(rows):
        rank_zero_warn(message)
    trainer = getattr(module, "_trainer", None)
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
    "CONV",
    "CONV1D",
    "EXPERTS",
    "LINEAR",
    "MULTIHEAD_ATTENTION",
    "CoverageRow",
    "LayerKind",
    "adaptable_names",
    "base_layer",
    "converted_keys",
    "weight_readers",
    "coverage",
    "coverage_warnings",
    "find_layers",
    "format_coverage",
    "kind_of",
    "layer_kinds",
    "prepare_model",
    "register_kind",
    "report_coverage",
]
