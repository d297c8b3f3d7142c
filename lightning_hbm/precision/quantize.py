"""Model-level quantization: which Linear-like layers a precision mode stores quantized, and the replacement.

What it shrinks: the **parameters** term. :func:`quantize_model` is the one place a model's layers become quantized
storage (the planner calls it on fake tensors); each layer left alone is tagged with its reason for the coverage table.
It runs one way, each step handing its value to the next: the checks (:func:`_validate`), the targets
(:func:`prepare_targets` under a :class:`TargetRule`), each target's mode (:func:`_layer_modes`), then the
replacement (:func:`quantize_targets`). ``QuantizedPrecision`` (:class:`~lightning_hbm.precision.plan.Quantization`)
runs the same steps at the surgery point, starting from the targets its checks listed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence, Union, cast

import torch
from torch import Tensor, nn

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm import record
from lightning_hbm.layers import (
    EMBEDDING, LINEAR, LayerKind, base_layer, find_layers, kind_names, kind_of, output_heads, prepare_model,
    stored_in, weight_readers,
)  # fmt: skip
from lightning_hbm.layers.linear import Fp32ComputeLinear
from lightning_hbm.layers.read_weight import readable, served_reader
from lightning_hbm.layers.embedding import QuantizedEmbedding, convertible, is_plain_embedding, tie_heads, tied_heads
from lightning_hbm.precision.gptq import gptq_round_, grid_of
from lightning_hbm.naming import name_matches, under
from lightning_hbm.precision.registry import QuantFormat, format_of, get_format, to_dtype

log = logging.getLogger(__name__)


def _ignored(name: str, patterns: Union[str, Sequence[str]]) -> bool:
    """Whether module ``name`` is (under) an ``ignore_modules`` entry.

    As LoRA's ``target_modules``: a string is a regex that must match the full name (of the module or of
    one of its parents); a list holds names (a name also matches as a suffix: ``dt_proj`` is
    ``backbone.layers.0.mixer.dt_proj``) and glob patterns (``*.mixer.*_proj``). Everything under a
    matching module is ignored too (:func:`lightning_hbm.naming.name_matches`, the rule LoRA's options use).
    """
    parts = name.split(".")
    return any(name_matches(".".join(parts[:i]), patterns) for i in range(1, len(parts) + 1))


def keep_in_fp32_names(module: nn.Module) -> set[str]:
    """Modules that Hugging Face models inside ``module`` declare must stay in fp32 (``_keep_in_fp32_modules``).

    T5 declares ``wo``: its feed-forward casts the hidden states to ``wo.weight.dtype``, which is
    ``uint8`` for a packed 4-bit weight (a crash deep inside dropout). transformers' own quantizers
    never convert them; here a Linear of them is stored in the mode and computes in fp32 (its weight reads as fp32:
    :class:`~lightning_hbm.layers.linear.Fp32ComputeLinear`). Matched as transformers does, by a component of the
    module name.
    """
    kept: set[str] = set()
    for root, sub in module.named_modules():
        declared = [*(getattr(sub, "_keep_in_fp32_modules", None) or ()), *(getattr(sub, "_keep_in_fp32_modules_strict", None) or ())]
        if not declared:
            continue
        prefix = root + "." if root else ""
        for name, _ in sub.named_modules(prefix=root):
            rel = name[len(prefix) :] if prefix else name
            if rel and any(entry in rel.split(".") or rel.endswith("." + entry) or rel == entry for entry in declared):
                kept.add(name)
    return kept


def _quantizable_linears(
    module: nn.Module,
    ignore_modules: Union[str, Sequence[str]],
    quantize_head: bool = False,
    keep_modules: Sequence[str] = (),
    quantize_embeddings: bool = False,
) -> tuple[list[tuple[str, nn.Module]], dict[str, tuple[str, bool]]]:
    """(name, layer) pairs to quantize, and the layers left alone with (reason, deliberate).

    Layers of every registered kind with a ``to_linear`` (:mod:`lightning_hbm.layers`): Linear,
    Conv1D, the projections of a prepared MultiheadAttention; the input embeddings too with
    ``quantize_embeddings``. ``keep_modules``: names (suffix match, as LoRA's ``modules_to_save``)
    kept in full precision.
    """
    owners: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    chosen, skipped = _listed_layers(module, ignore_modules, quantize_head, keep_modules, owners)
    if quantize_embeddings:
        embeddings, kept_wide = _quantizable_embeddings(module, ignore_modules, keep_modules, owners)
        chosen, skipped = chosen + embeddings, {**skipped, **kept_wide}
    return chosen, skipped


def _quantizable_embeddings(
    module: nn.Module, ignore_modules: Union[str, Sequence[str]], keep_modules: Sequence[str], owners: dict[int, int]
) -> tuple[list[tuple[str, nn.Module]], dict[str, tuple[str, bool]]]:
    """The input embeddings ``quantize_embeddings=True`` stores quantized, and those it keeps (reason, deliberate)."""
    kept = [n for n, _ in module.named_modules() if n and name_matches(n, list(keep_modules))]
    chosen: list[tuple[str, nn.Module]] = []
    skipped: dict[str, tuple[str, bool]] = {}
    for name, sub in module.named_modules():
        if not is_plain_embedding(sub):
            continue
        why = convertible(sub, owners, tied_ok=tied_heads(module, sub) is not None)
        if _ignored(name, ignore_modules):
            skipped[name] = ("QuantizedPrecision(ignore_modules=...)", True)
        elif under(name, kept):
            skipped[name] = ("LoRA modules_to_save: trained in full precision", True)
        elif why is not None:
            skipped[name] = (why, False)
        else:
            chosen.append((name, sub))
    return chosen, skipped


def _listed_layers(
    module: nn.Module, ignore_modules: Union[str, Sequence[str]], quantize_head: bool, keep_modules: Sequence[str],
    owners: dict[int, int],
) -> tuple[list[tuple[str, nn.Module]], dict[str, tuple[str, bool]]]:
    """:func:`_quantizable_linears` for the registered layer kinds."""
    heads = set() if quantize_head else output_heads(module)
    fp32 = keep_in_fp32_names(module)
    kept = [n for n, _ in module.named_modules() if n and name_matches(n, list(keep_modules))]
    readers = weight_readers(module)
    # a layer computed in fp32 (_keep_in_fp32_modules) shows its weight dequantized in fp32: a read of its dtype or
    # shape (T5's feed-forward casts to wo.weight.dtype) sees what it saw before
    users = weight_readers(module, uses_only=True) if fp32 else {}
    chosen: list[tuple[str, nn.Module]] = []
    skipped: dict[str, tuple[str, bool]] = {}
    for name, layer, kind in find_layers(module):
        if kind.to_linear is None or base_layer(layer) is not layer or kind.prepare is not None and kind.matches(layer):
            # not quantizable (reported by the coverage table), already adapted by LoRA, or not prepared
            # (an ignored MultiheadAttention)
            continue
        if stored_in(layer) is not None or not cast(Tensor, layer.weight).is_floating_point() or format_of(layer) is not None:
            continue  # already quantized (an integer weight, or a tensor-subclass weight a format owns)
        if _ignored(name, ignore_modules):
            skipped[name] = ("QuantizedPrecision(ignore_modules=...)", True)
        elif owners.get(id(layer.weight), 0) > 1:
            # e.g. lm_head tied to the embedding: quantizing would untie them
            skipped[name] = ("weight tied to another module", True)
        elif name in heads:
            skipped[name] = ("output head kept in full precision (quantize_head=True quantizes it)", True)
        elif name in fp32 and (kind is not LINEAR or record.counted_as(layer) is not None):
            # the fp32-computing wrapper is an nn.Linear: for a plain Linear only (T5's wo), others stay as they were
            skipped[name] = ("kept in fp32: the model's _keep_in_fp32_modules", True)
        elif under(name, kept):
            skipped[name] = ("LoRA modules_to_save: trained in full precision", True)
        elif _parametrized(layer) and not (kind.wrap is not None and _weight_normed(layer)):
            # other parametrizations (spectral_norm's power iteration, orthogonal) are part of what the layer computes;
            # a weight_norm is folded on convolutions only, whose wrapper maps its keys back to the factors (resume)
            skipped[name] = (_PARAMETRIZED if kind.wrap is not None else _PARAMETRIZED_LINEAR, False)
        elif name in (users if name in fp32 else readers):
            # the reader would get the packed integer weight (a low-level dtype/shape error): compute dtype
            skipped[name] = (f"weight read directly by {readers[name]}, not by calling the layer: kept in the compute dtype", False)
        else:
            chosen.append((name, layer))
    return chosen, skipped


_PARAMETRIZED = "weight computed by a parametrization other than weight_norm: kept in the compute dtype"
_PARAMETRIZED_LINEAR = (
    "weight computed by a parametrization (weight_norm is folded into one quantized weight on convolutions only): "
    "kept in the compute dtype"
)


def _parametrized(layer: nn.Module) -> bool:
    # torch.nn.utils.parametrizations.weight_norm (a parametrization) or the older hook-based weight_norm (weight_g/_v)
    return torch.nn.utils.parametrize.is_parametrized(layer) or isinstance(getattr(layer, "weight_g", None), nn.Parameter)


def _weight_normed(layer: nn.Module) -> bool:
    """Whether ``layer``'s only parametrization is a weight_norm of its weight (the new or the hook-based one)."""
    if not torch.nn.utils.parametrize.is_parametrized(layer):
        return _weight_norm_hook(layer) is not None
    listed = cast(nn.ModuleDict, layer.parametrizations)
    return list(listed.keys()) == ["weight"] and all(type(p).__name__ == "_WeightNorm" for p in cast(nn.ModuleList, listed["weight"]))


def _weight_norm_hook(layer: nn.Module) -> Any:
    """The hook-based weight_norm of ``layer``'s weight (``torch.nn.utils.weight_norm``), or ``None``."""
    hooks: list[Any] = list(layer._forward_pre_hooks.values())
    return next((h for h in hooks if type(h).__name__ == "WeightNorm" and h.name == "weight"), None)


def fold_weight_norm(layer: nn.Module) -> bool:
    """Make ``layer.weight`` the one plain weight its weight_norm computes now (the same numbers); ``False``: none.

    A weight_norm's factors (``g``, ``v``) only differ from that weight while they are trained; the layers a precision
    mode stores are frozen (LoRA adapts them from outside, ``modules_to_save`` and ``ignore_modules`` are no targets),
    so the weight is fixed and is quantized like any other (Wav2Vec2 / HuBERT's ``pos_conv_embed.conv``: 29 % of a
    small HuBERT, was kept in the compute dtype). The layer itself is replaced by its quantized form, factors and all.
    A parametrized weight is computed at each read: nothing to do (``remove_parametrizations`` would delete the
    property from the class that deep copies share: the planner's copy would break the user's model). The hook-based
    one sets a plain attribute at each forward, stale after a load of its factors: recomputed as its hook does.
    """
    if not _weight_normed(layer):
        return False
    if not torch.nn.utils.parametrize.is_parametrized(layer):
        setattr(layer, "weight", _weight_norm_hook(layer).compute_weight(layer))
    return True


def _validate(module: nn.Module, quant_mode: QuantFormat, compute_dtype: torch.dtype, ignore_modules: Union[str, Sequence[str]]) -> None:
    """Every check of :func:`quantize_model`, changing nothing (run before the first change of the surgery)."""
    quant_mode.check_dtype(compute_dtype)
    names = {n for n, _ in module.named_modules()}
    entries = [ignore_modules] if isinstance(ignore_modules, str) else list(ignore_modules)
    unknown = [ign for ign in entries if not any(_ignored(n, ign if isinstance(ignore_modules, str) else [ign]) for n in names if n)]
    if unknown:
        sample = sorted(n for n in names if n)[:12]
        raise ValueError(
            f"ignore_modules={ignore_modules if isinstance(ignore_modules, str) else list(ignore_modules)!r}: {unknown} match no "
            f"submodule of {type(module).__name__}. Use module names (a name matches itself, what is under it and as a "
            f"suffix), glob patterns ('*.mixer.dt_proj') or one regex string, such as {sample}."
        )
    if not any(kind.to_linear is not None or kind.prepare is not None for _, _, kind in find_layers(module)):
        raise ValueError(
            f"{type(module).__name__} has no layer of a kind a precision mode quantizes "
            f"({kind_names(quantized=True).replace('Embedding', 'Embedding with quantize_embeddings=True')}), "
            f"so precision mode {quant_mode.name!r} has nothing to quantize. Use Lightning's precision='bf16-true' (or '32-true') "
            "for this model instead."
        )
    for name, layer, kind in find_layers(module):
        if kind.to_linear is None and kind.prepare is None or _ignored(name, ignore_modules):
            continue
        if any(p.is_meta for p in layer.parameters()):
            raise ValueError(
                f"Cannot quantize {name} ({type(layer).__name__}) whose weight is on the meta device: load or "
                "initialize the weights before quantization (e.g. build them in configure_model)."
            )


def quantize_model(
    module: nn.Module,
    mode: Union[str, QuantFormat],
    dtype: Union[str, torch.dtype] = "bfloat16",
    ignore_modules: Union[str, Sequence[str]] = (),
    device: Optional[Union[str, torch.device]] = None,
    quantize_head: bool = False,
    keep_modules: Sequence[str] = (),
    layer_modes: Optional[Mapping[str, str]] = None,
    hessians: Optional[Mapping[str, Tensor]] = None,
    quantize_embeddings: bool = False,
    correct: Optional[Correct] = None,
) -> list[str]:
    """Replace the Linear-like layers of ``module`` in place by quantized frozen layers.

    Every layer kind of :mod:`lightning_hbm.layers` that can be quantized is (``nn.Linear`` and its
    subclasses, transformers ``Conv1D``, ``nn.MultiheadAttention`` through its projections), except:
    ``ignore_modules``, Linears tied to another module, the output head (:func:`~lightning_hbm.layers.output_heads`)
    (unless ``quantize_head``) and ``keep_modules`` (LoRA's ``modules_to_save``); the Linears a model declares in
    ``_keep_in_fp32_modules`` are stored in the mode and compute in fp32. Each layer left alone is tagged with the
    reason (the coverage table shows it). Works on a model that already holds its loaded weights.
    Validates everything before changing anything. ``layer_modes`` (``{layer name: mode name}``, e.g. a
    sensitivity-aware plan) overrides ``mode`` per layer; ``"none"`` keeps that layer in the compute
    dtype, frozen. ``hessians`` (``{layer name: 2 X^T X}``, :func:`~lightning_hbm.precision.gptq.input_hessians`)
    GPTQ-rounds the 4-bit layers it names instead of rounding to nearest. ``correct`` (a
    :class:`~lightning_hbm.precision.correction.CalibratedCorrection`) gives each quantized Linear-like layer its
    calibrated correction (on fake tensors, as the planner counts bytes: zero factors of their shapes). ``quantize_embeddings``:
    the input embeddings too (:mod:`lightning_hbm.layers.embedding`). Returns the names of the layers handled.
    """
    quant_mode = get_format(mode) if isinstance(mode, str) else mode
    compute_dtype = to_dtype(dtype)
    _validate(module, quant_mode, compute_dtype, ignore_modules)
    listing = prepare_targets(module, TargetRule(ignore_modules, quantize_head, tuple(keep_modules), quantize_embeddings), None)
    modes = _layer_modes(listing[0], quant_mode, layer_modes or {})
    return quantize_targets(module, listing, modes, compute_dtype, device, hessians, correct)


class Correct(Protocol):
    """What :func:`quantize_targets` calls for each quantized layer (:class:`~lightning_hbm.precision.correction.CalibratedCorrection`)."""

    hessians: Optional[dict[str, Tensor]]  # the probe's input statistics by layer name (None: not measured)

    def fit(self, name: str, layer: nn.Module, weight: Tensor) -> None: ...

    def skip(self, name: str, why: str) -> None: ...


#: what :func:`_quantizable_linears` returns: the targets ``(name, layer)``, the layers left alone ``{name: (reason, deliberate)}``
Listing = tuple[list[tuple[str, nn.Module]], dict[str, tuple[str, bool]]]


@dataclass(frozen=True)
class TargetRule:
    """Which layers of a model a precision mode stores quantized: the settings :func:`_quantizable_linears` reads.

    A value, compared as one: a listing made under an equal rule on the same model is still the model's.
    """

    ignore_modules: Union[str, Sequence[str]] = ()
    quantize_head: bool = False
    keep_modules: tuple[str, ...] = ()  # LoRA's modules_to_save: trained in full precision
    quantize_embeddings: bool = False

    def listing(self, module: nn.Module) -> Listing:
        """The targets of ``module`` under this rule, and the layers left alone with (reason, deliberate)."""
        return _quantizable_linears(module, self.ignore_modules, self.quantize_head, self.keep_modules, self.quantize_embeddings)


def prepare_targets(module: nn.Module, rule: TargetRule, listing: Optional[Listing]) -> Listing:
    """The first step of :func:`quantize_model` after its checks: prepare the layer kinds that need it
    (``nn.MultiheadAttention`` -> four Linears), then the targets of ``rule``.

    ``listing``: the targets listed on this model before (a ``Quantization``'s checks), returned as they are unless
    preparing replaced modules; ``None``: listed here, after preparing.
    """
    prepared = prepare_model(module, skip=lambda n: _ignored(n, rule.ignore_modules))
    return rule.listing(module) if prepared or listing is None else listing


def quantize_targets(
    module: nn.Module,
    listing: Listing,
    modes: Mapping[str, Optional[QuantFormat]],
    compute_dtype: torch.dtype,
    device: Optional[Union[str, torch.device]],
    hessians: Optional[Mapping[str, Tensor]],
    correct: Optional[Correct] = None,
) -> list[str]:
    """The last step of :func:`quantize_model`: each target of ``listing`` replaced in its mode of ``modes``
    (:func:`_layer_modes`), the layers left alone tagged with why, the rest cast to ``compute_dtype``; returns the
    names of the targets.

    ``correct`` (``QuantizedPrecision(correction_rank=...)``): called with each quantized Linear-like layer and the
    weight it was built from, after any GPTQ rounding, while that weight still exists; ``correct.skip`` with a
    convolution's name.
    """
    targets, skipped = listing
    for name, (reason, deliberate) in skipped.items():
        record.leave_alone(module.get_submodule(name), reason, deliberate)
    if skipped:
        log.info("lightning_hbm: not quantizing %s", {n: r for n, (r, _) in skipped.items()})
    target = torch.device(device) if device is not None else None
    for name, layer in targets:  # each format's own refusals, before the first layer changes
        if modes[name] is not None:
            kind = _target_kind(layer)
            cast(QuantFormat, modes[name]).check(name, cast(Callable[[nn.Module], nn.Linear], kind.to_linear)(layer) if kind.wrap is not None else layer)
    fp32 = keep_in_fp32_names(module)
    for name, layer in targets:
        if modes[name] is None:  # kept unquantized by the plan: frozen like every other base weight
            layer.weight.requires_grad_(False)
            continue
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = _replace_one(name, layer, cast(QuantFormat, modes[name]), compute_dtype, target, hessians, correct, name in fp32)
        setattr(parent, child_name, new)
        if isinstance(new, QuantizedEmbedding):  # a head tied to it computes with its one quantized copy
            tie_heads(module, layer, new)
    _cast_the_rest(module, compute_dtype, fp32)
    # peft picks its quantization-aware LoRA layers (mergeable) only when the model says so.
    kinds = {m.peft_kind for m in modes.values() if m is not None}
    peft_compat.mark_quantized(module, cast(set[str], kinds & {"4bit", "8bit"}))  # strings only: None is in neither
    return [name for name, _ in targets]


def _replace_one(
    name: str, layer: nn.Module, mode: QuantFormat, compute_dtype: torch.dtype, target: Optional[torch.device],
    hessians: Optional[Mapping[str, Tensor]], correct: Optional[Correct], fp32: bool,
) -> nn.Module:
    """The quantized replacement of the target ``layer`` in ``mode`` (``fp32``: one of the model's
    ``_keep_in_fp32_modules``, stored in ``mode`` and computed in fp32)."""
    kind = _target_kind(layer)
    if fold_weight_norm(layer):
        log.info("lightning_hbm: %s: weight_norm folded into one weight before quantization", name)
    linear = cast(Callable[[nn.Module], nn.Linear], kind.to_linear)(layer)
    new = mode.replace(linear, compute_dtype, target)
    if hessians is not None and name in hessians and grid_of(new) is not None:
        gptq_round_(new, linear.weight, hessians[name])
    if correct is not None and kind.wrap is None and not fp32:
        reader = served_reader(linear)
        if reader is not None and name not in (correct.hessians or {}):
            correct.skip(name, f"its weight is read directly by {reader or 'the model'}, which never calls the layer: "
                               "the probe saw none of its inputs")
        else:
            correct.fit(name, new, linear.weight)
    elif correct is not None:
        what = f"a {kind.name} layer" if kind.wrap is not None else "computed in fp32 (_keep_in_fp32_modules)"
        correct.skip(name, f"{what}: the correction is written for Linear-like layers computing in the compute dtype only")
    if kind.wrap is not None:  # a convolution: the mode's layer holds its weight matrix, the wrapper convolves
        new = kind.wrap(layer, new, mode.dequantize, compute_dtype)
        record.set_converted(new, kind.name)  # resume maps its storage's keys to the conv's weight
    elif fp32:  # the mode's layer holds the weight; the wrapper computes in fp32, as the fp32 layer did
        new = Fp32ComputeLinear.from_quantized(linear, new, mode.dequantize)
        record.set_converted(new, LINEAR.name)  # resume maps its storage's keys to the layer's weight
    else:  # a weight the model's code reads directly (the probe saw it): reads computed from the storage. Wrapped
        # after the rounding and the correction, which work on the mode's layer itself (wrapped first, both skipped it)
        new = readable(linear, new)
    if kind is not LINEAR:
        record.set_kind(new, kind.name)  # a quantized Conv1D is still counted as one
    elif record.counted_as(layer) is not None:
        record.set_kind(new, record.counted_as(layer))
    return new


def _cast_the_rest(module: nn.Module, compute_dtype: torch.dtype, fp32: set[str]) -> None:
    """Everything that is not quantized storage computes in the compute dtype and stays trainable, except what the
    model declares must stay in fp32, and BatchNorm: its running statistics are fp32 buffers, and batch_norm takes a
    16-bit input only with fp32 weights and statistics (as in Lightning's mixed precision); 16-bit weights beside fp32
    statistics fail at the first batch. ``fp32``: the model's ``_keep_in_fp32_modules`` (:func:`keep_in_fp32_names`)."""
    kept = fp32 | {n for n, m in module.named_modules() if isinstance(m, torch_compat.BatchNormBase)}
    for name, param in module.named_parameters():
        wanted = torch.float32 if under(name.rpartition(".")[0], kept) else compute_dtype
        if param.is_floating_point() and param.dtype != wanted:
            param.data = param.data.to(wanted)


def _target_kind(layer: nn.Module) -> LayerKind:
    """The kind of a target of :func:`_quantizable_linears` (a kind with ``to_linear``): a plain input embedding is
    one of :data:`~lightning_hbm.layers.EMBEDDING` once quantized."""
    return EMBEDDING if is_plain_embedding(layer) else cast(LayerKind, kind_of(layer))


def _layer_modes(
    targets: list[tuple[str, nn.Module]], quant_mode: QuantFormat, layer_modes: Mapping[str, str]
) -> dict[str, Optional[QuantFormat]]:
    """The mode of every target (``None``: kept unquantized); a plan naming other layers is an error."""
    names = [name for name, _ in targets]
    unknown = sorted(set(layer_modes) - set(names))
    if unknown:
        raise ValueError(
            f"layer_modes names {unknown}, which are not quantizable Linear layers of this model (quantizable: "
            f"{names[:12]}{' ...' if len(names) > 12 else ''}). Plan only those layers, by their module names."
        )
    # the planner's fake-tensor variant, or a fake model (int8-dynamic has no variant): plan with fake layers too
    fake = quant_mode != get_format(quant_mode.name) or any(
        isinstance(p, torch._subclasses.fake_tensor.FakeTensor) for _, layer in targets for p in layer.parameters()
    )

    def mode_of(name: str) -> Optional[QuantFormat]:
        chosen = layer_modes.get(name)
        if chosen is None:
            return quant_mode
        if chosen == "none":
            return None
        return get_format(chosen).for_fake_tensors() if fake else get_format(chosen)

    return {n: mode_of(n) for n in names}
