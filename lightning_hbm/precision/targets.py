"""The targets of a precision mode: which layers of a model it stores quantized, which it leaves alone and why.

The first step of the quantization, and where it starts (:func:`quantize_model`, ``Quantization.convert``): each
layer's reasons read once, the model's names matched against the settings once (:func:`~lightning_hbm.naming.selected`),
and the result handed on as one value, a :class:`Listing`, to the checks (:func:`_validate`), to the preparation of
the layer kinds that need it (:func:`prepare_targets`), then to the layer modes and the replacement
(:mod:`lightning_hbm.precision.quantize`). One way: nothing here is called back by the later steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple, Optional, Sequence, Union, cast

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor  # as precision/quantization.py: no public home

from lightning_hbm import record
from lightning_hbm.layers import CONV, LINEAR, base_layer, embedding_readers, find_layers, kind_names, output_heads, prepare_model, stored_in, weight_readers
from lightning_hbm.layers.embedding import convertible, is_plain_embedding, tied_heads, too_small
from lightning_hbm.naming import selected
from lightning_hbm.precision.quantize import Correct, _parametrized, _weight_normed, quantize_targets
from lightning_hbm.precision.registry import QuantFormat, available_precisions, format_of, get_format, to_dtype

#: why a layer is left alone, by name: ``(reason, deliberate)``
Reason = tuple[str, bool]
_IGNORED: Reason = ("QuantizedPrecision(ignore_modules=...)", True)
_KEPT: Reason = ("LoRA modules_to_save: trained in full precision", True)


def _parametrized_reason(layer: nn.Module, convolution: bool) -> str:
    """Why a parametrized layer is kept in the compute dtype, naming its parametrizations (the coverage table's reason)."""
    listed = cast(nn.ModuleDict, layer.parametrizations) if torch.nn.utils.parametrize.is_parametrized(layer) else nn.ModuleDict()
    names = sorted({type(p).__name__ for chain in listed.values() for p in cast(nn.ModuleList, chain)}) or ["weight_norm"]
    if "_SpectralNorm" in names:
        # not a function of frozen tensors: folding it would freeze its estimate of the largest singular value
        why = "spectral_norm's power iteration (its buffers u, v) changes the weight at each training forward"
    else:
        why = "only a weight_norm alone is folded into one quantized weight" + ("" if convolution else ", on convolutions")
    return f"weight computed by a parametrization ({', '.join(names)}): {why}; kept in the compute dtype"


class Listing(NamedTuple):
    """The targets of a model under a :class:`TargetRule`, and what the later steps read of the same pass."""

    #: ``(name, layer)`` of every layer to store quantized
    targets: list[tuple[str, nn.Module]]
    #: the layers left alone ``{name: (reason, deliberate)}`` (the coverage table shows them)
    skipped: dict[str, Reason]
    #: the modules the model declares in ``_keep_in_fp32_modules`` (:func:`keep_in_fp32_names`)
    fp32: set[str]
    #: every module name under an ``ignore_modules`` entry
    ignored: set[str]
    #: every module name under a ``modules_to_save`` entry
    kept: set[str]
    #: the ``ignore_modules`` entries that match no module (an error of :func:`_validate`)
    unmatched: list[str]
    #: the input embeddings' part of ``targets`` and ``skipped`` (``quantize_embeddings``; a preparation keeps it)
    embeddings: tuple[list[tuple[str, nn.Module]], dict[str, Reason]]
    #: every plain input embedding's tied heads (:func:`~lightning_hbm.layers.embedding.tied_heads`, ``[]``: none or
    #: not plain Linears), read in the same pass (``quantize_embeddings``; empty without): the FSDP units check reads them
    tied: Mapping[str, list[str]] = {}


#: ``quantize_embeddings="auto"``: the default of ``QuantizedPrecision`` (``quantize_model`` takes it too)
EMBEDDINGS_AUTO = "auto"
#: the mode ``quantize_embeddings="auto"`` stores them in: int8 costs under 0.3 % where measured (SmolLM2-135M held-out
#: loss -0.01 % before training, no worse after 150 steps on two seeds; all-MiniLM-L6-v2 sentence cosine, two seeds:
#: benchmarks/README.md), where the 4-bit table costs +3.5 % after training
DEFAULT_EMBEDDINGS_MODE = "int8"
#: tables of fewer values ``quantize_embeddings="auto"`` keeps in the compute dtype (an explicit ``True`` or mode
#: converts them): under 32 KiB of fp32, where int8 saves under 24 KiB a table while each converted table costs a
#: quantized layer (its module, row scales, a gather per lookup) and its rounding. It catches the bias and type tables
#: (T5's relative_attention_bias, 32 x heads: 256 values in t5-small, 4096 in T5-11B; BERT-large's token types,
#: 2 x 1024) and no token or position table of a real model (the smallest seen, BERT-tiny's 512 x 128 positions, is
#: 8x over it).
SMALL_EMBEDDING_VALUES = 8192


@dataclass(frozen=True)
class TargetRule:
    """Which layers of a model a precision mode stores quantized: the settings a :class:`Listing` is made under.

    A value, compared as one: a listing made under an equal rule on the same model is still the model's.
    """

    ignore_modules: Union[str, Sequence[str]] = ()
    quantize_head: bool = False
    keep_modules: tuple[str, ...] = ()  # LoRA's modules_to_save: trained in full precision
    #: ``True``: the input embeddings in the mode; a mode name: in that mode (:func:`checked_embeddings`)
    quantize_embeddings: Union[bool, str] = False
    #: input embeddings of fewer values are kept in the compute dtype (``quantize_embeddings="auto"``:
    #: :data:`SMALL_EMBEDDING_VALUES`; 0: every one converted)
    min_embedding_values: int = 0

    def embedding_modes(self, listing: Listing, layer_modes: Mapping[str, str]) -> dict[str, str]:
        """``layer_modes`` with the mode of each input embedding ``listing`` quantizes when ``quantize_embeddings``
        names one (``"int8"``): the per-layer modes the quantization stores them in, as if ``layer_modes`` named them.

        Raises:
            ValueError: ``layer_modes`` names one of them in another mode (changing nothing).
        """
        if not isinstance(self.quantize_embeddings, str):
            return dict(layer_modes)
        chosen = {name: self.quantize_embeddings for name, _ in listing.embeddings[0]}
        clash = {n: m for n, m in layer_modes.items() if n in chosen and m != self.quantize_embeddings}
        if clash:
            raise ValueError(
                f"quantize_embeddings={self.quantize_embeddings!r} stores the input embeddings in {self.quantize_embeddings}, "
                f"but layer_modes names {clash}: drop them from layer_modes, or pass quantize_embeddings=True to take "
                "each embedding's mode from layer_modes."
            )
        return {**chosen, **layer_modes}

    def listing(self, module: nn.Module) -> Listing:
        """The targets of ``module`` under this rule (Linear-like layers of every registered kind with a
        ``to_linear``: Linear, Conv1D, the projections of a prepared MultiheadAttention, convolutions; the input
        embeddings too with ``quantize_embeddings``), and the layers left alone with (reason, deliberate)."""
        owners = _owners(module)
        listing = _linear_listing(module, self, owners)
        if not self.quantize_embeddings:
            return listing
        chosen: list[tuple[str, nn.Module]] = []
        skipped: dict[str, Reason] = {}
        tied: dict[str, list[str]] = {}
        read = embedding_readers(module)
        for name, sub in module.named_modules():
            if not is_plain_embedding(sub):
                continue
            heads = tied_heads(module, sub)
            tied[name] = heads or []
            why = convertible(sub, owners, tied_ok=heads is not None)
            if why is None and name in read:
                why = f"weight read directly by {read[name]}, not by calling the embedding: kept in the compute dtype"
            small = too_small(sub, self.min_embedding_values)  # deliberate: said in the coverage table, not warned
            if name in listing.ignored:
                skipped[name] = _IGNORED
            elif name in listing.kept:
                skipped[name] = _KEPT
            elif small is not None:
                skipped[name] = (small, True)
            elif why is not None:
                skipped[name] = (why, False)
            else:
                chosen.append((name, sub))
        return listing._replace(targets=listing.targets + chosen, skipped={**listing.skipped, **skipped}, embeddings=(chosen, skipped), tied=tied)


def checked_embeddings(value: Union[bool, str], mode: str, dtype: torch.dtype, owner: str = "QuantizedPrecision") -> Union[bool, str]:
    """``quantize_embeddings`` as a rule holds it: ``True``/``False`` as given, a mode name checked (``mode`` itself:
    ``True``, the same setting).

    Raises:
        ValueError: a string that is not a mode name (``"none"`` included: ``False`` keeps them), or a mode that
            cannot compute in ``dtype``; the message names the value and the allowed ones.
    """
    if isinstance(value, bool):
        return value
    if value not in available_precisions():
        raise ValueError(
            f"{owner}(quantize_embeddings={value!r}): pass " + ("'auto' (the default: int8), " if owner == "QuantizedPrecision" else "'auto' (int8, as QuantizedPrecision's default), ")
            + "True (the input embeddings stored in the run's mode), False "
            + f"(kept in the compute dtype) or the mode to store them in, one of {available_precisions()} (e.g. 'int8', "
            "beside 4-bit Linears)."
        )
    get_format(value).check_dtype(dtype)
    return True if value == mode else value


def _owners(module: nn.Module) -> dict[int, int]:
    """How many modules hold each parameter (a tied weight has two)."""
    owners: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    return owners


def _linear_listing(module: nn.Module, rule: TargetRule, owners: dict[int, int]) -> Listing:
    """The Linear-like part of :meth:`TargetRule.listing`: each layer's reasons read, then the names matched once."""
    fp32 = keep_in_fp32_names(module)
    reasons = _linear_reasons(module, rule.quantize_head, owners, fp32)
    names = [n for n, _ in module.named_modules()]
    ignored, kept = selected(names, rule.ignore_modules), selected([n for n in names if n], list(rule.keep_modules))
    entries = [rule.ignore_modules] if isinstance(rule.ignore_modules, str) else list(rule.ignore_modules)
    unmatched = [e for e in entries if not selected([n for n in names if n], e if isinstance(rule.ignore_modules, str) else [e])]
    chosen: list[tuple[str, nn.Module]] = []
    skipped: dict[str, Reason] = {}
    for name, layer, before, after in reasons:
        # in the order the reasons are said: ignored, tied / head / fp32, modules_to_save, parametrized / read directly
        why = _IGNORED if name in ignored else before or (_KEPT if name in kept else after)
        if why is None:
            chosen.append((name, layer))
        else:
            skipped[name] = why
    return Listing(chosen, skipped, fp32, ignored, kept, unmatched, ([], {}))


def _linear_reasons(
    module: nn.Module, quantize_head: bool, owners: dict[int, int], fp32: set[str]
) -> list[tuple[str, nn.Module, Optional[Reason], Optional[Reason]]]:
    """``(name, layer, reason before modules_to_save, reason after it)`` of every quantizable layer not quantized yet
    (``None``: no reason of that rank); the reasons that depend on names given to the settings are decided after."""
    heads = set() if quantize_head else output_heads(module)
    readers = weight_readers(module)
    # a layer computed in fp32 (_keep_in_fp32_modules) shows its weight dequantized in fp32: a read of its dtype or
    # shape (T5's feed-forward casts to wo.weight.dtype) sees what it saw before
    users = weight_readers(module, uses_only=True) if fp32 or readers else {}
    # not in the planner's trace: a module it runs for real on zeros reads its weights' shapes (fallbacks.py), and a
    # bitsandbytes layer's quantization state stays fake there (the real run then fails): kept as before
    planning = any(isinstance(p, FakeTensor) for p in module.parameters())
    found: list[tuple[str, nn.Module, Optional[Reason], Optional[Reason]]] = []
    for name, layer, kind in find_layers(module):
        if kind.to_linear is None or base_layer(layer) is not layer or kind.prepare is not None and kind.matches(layer):
            # not quantizable (reported by the coverage table), already adapted by LoRA, or not prepared
            # (an ignored MultiheadAttention)
            continue
        if stored_in(layer) is not None or not cast(Tensor, layer.weight).is_floating_point() or format_of(layer) is not None:
            continue  # already quantized (an integer weight, or a tensor-subclass weight a format owns)
        before: Optional[Reason] = None
        if owners.get(id(layer.weight), 0) > 1:
            before = ("weight tied to another module", True)  # e.g. lm_head tied to the embedding: quantizing would untie them
        elif name in heads:
            before = ("output head kept in full precision (quantize_head=True quantizes it)", True)
        elif name in fp32 and (kind is not LINEAR or record.counted_as(layer) is not None):
            # the fp32-computing wrapper is an nn.Linear: for a plain Linear only (T5's wo), others stay as they were
            before = ("kept in fp32: the model's _keep_in_fp32_modules", True)
        after: Optional[Reason] = None
        if _parametrized(layer) and not (kind.wrap is not None and _weight_normed(layer)):
            # other parametrizations (spectral_norm's power iteration, orthogonal) are part of what the layer computes;
            # a weight_norm is folded on convolutions only, whose wrapper maps its keys back to the factors (resume)
            after = (_parametrized_reason(layer, kind.wrap is not None), False)
        elif name in (users if name in fp32 or kind is CONV and not planning else readers):
            # a quantized convolution's weight reads as its dequantized weight in the compute dtype (``layers/conv.py``):
            # a read of its dtype or shape alone (Qwen2-VL's patch embedding casts to ``proj.weight.dtype``) sees what
            # it saw before, so only a use of its values keeps it (issue 53: was kept, "weight read directly")
            # the reader would get the packed integer weight (a low-level dtype/shape error): compute dtype
            after = (f"weight read directly by {readers[name]}, not by calling the layer: kept in the compute dtype", False)
        found.append((name, layer, before, after))
    return found


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
    quantize_embeddings: Union[bool, str] = False,
) -> tuple[list[tuple[str, nn.Module]], dict[str, Reason]]:
    """(name, layer) pairs to quantize, and the layers left alone with (reason, deliberate): :meth:`TargetRule.listing`
    under these settings. ``keep_modules``: names (suffix match, as LoRA's ``modules_to_save``) kept in full precision."""
    listing = TargetRule(ignore_modules, quantize_head, tuple(keep_modules), quantize_embeddings).listing(module)
    return listing.targets, listing.skipped


def _validate(module: nn.Module, rule: TargetRule, listing: Listing, quant_mode: QuantFormat, compute_dtype: torch.dtype) -> None:
    """Every check of :func:`quantize_model`, changing nothing (run before the first change of the surgery), on the
    ``listing`` of ``module`` under ``rule``."""
    quant_mode.check_dtype(compute_dtype)
    ignore_modules = rule.ignore_modules
    if listing.unmatched:
        sample = sorted(n for n, _ in module.named_modules() if n)[:12]
        raise ValueError(
            f"ignore_modules={ignore_modules if isinstance(ignore_modules, str) else list(ignore_modules)!r}: {listing.unmatched} match no "
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
        if kind.to_linear is None and kind.prepare is None or name in listing.ignored:
            continue
        if any(p.is_meta for p in layer.parameters()):
            raise ValueError(
                f"Cannot quantize {name} ({type(layer).__name__}) whose weight is on the meta device: load or "
                "initialize the weights before quantization (e.g. build them in configure_model)."
            )


def prepare_targets(module: nn.Module, rule: TargetRule, listing: Listing) -> Listing:
    """The step after the checks: prepare the layer kinds that need it (``nn.MultiheadAttention`` -> four Linears),
    then the targets of ``rule``: ``listing`` (made on this model before) as it is unless preparing replaced modules;
    else the Linear-like layers listed again, beside the input embeddings ``listing`` holds (no preparation changes
    one)."""
    if not prepare_model(module, skip=listing.ignored.__contains__):
        return listing
    owners = _owners(module)
    relisted = _linear_listing(module, rule, owners)
    chosen, skipped = listing.embeddings
    return relisted._replace(targets=relisted.targets + chosen, skipped={**relisted.skipped, **skipped}, embeddings=listing.embeddings)


def layer_modes_of(
    targets: list[tuple[str, nn.Module]], quant_mode: QuantFormat, layer_modes: Mapping[str, str],
    skipped: Optional[Mapping[str, tuple[str, bool]]] = None,
) -> dict[str, Optional[QuantFormat]]:
    """The mode of every target (``None``: kept unquantized); a plan naming other layers is an error, with the reason
    each named layer the listing left alone has (``skipped``: was left out, so a table ``"auto"`` keeps wide as too
    small read as "not quantizable", session 32). Each mode named in ``layer_modes`` is looked up once."""
    names = [name for name, _ in targets]
    unknown = sorted(set(layer_modes) - set(names))
    if unknown:
        why = "; ".join(f"{n}: {skipped[n][0]}" for n in unknown if skipped is not None and n in skipped)
        raise ValueError(
            f"layer_modes names {unknown}, which are not quantizable Linear layers of this model (quantizable: "
            f"{names[:12]}{' ...' if len(names) > 12 else ''}{f'; left alone: {why}' if why else ''}). Plan only those "
            "layers, by their module names (an input embedding is one with quantize_embeddings=True; "
            "quantize_embeddings='int8' stores each one in int8, the tables 'auto' keeps wide as too small included)."
        )
    # the planner's fake-tensor variant, or a fake model (int8-dynamic has no variant): plan with fake layers too
    fake = quant_mode != get_format(quant_mode.name) or any(
        isinstance(p, torch._subclasses.fake_tensor.FakeTensor) for _, layer in targets for p in layer.parameters()
    )
    formats: dict[Any, Optional[QuantFormat]] = {None: quant_mode, "none": None}
    for chosen in dict.fromkeys(layer_modes.values()):
        if chosen not in formats:
            formats[chosen] = get_format(chosen, fake)
    return {n: formats[layer_modes.get(n)] for n in names}


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
    quantize_embeddings: Union[bool, str] = False,
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
    the input embeddings too (:mod:`lightning_hbm.layers.embedding`): ``True`` in ``mode``, or a mode name (``"int8"``)
    they are stored in, or ``"auto"``: what ``QuantizedPrecision`` does by default (int8, tables under
    :data:`SMALL_EMBEDDING_VALUES` values kept). The default here stays ``False``, unlike the plugin's: this function is
    the building block whose every caller passes what it wants (the plugin its own resolved setting), and the byte
    counts built on its default (``planner.quantized_parameter_bytes``, ``quantization_constant_bytes``) and the
    benchmark figures recorded with it count the Linear-like layers alone. Returns the names of the layers handled.
    """
    quant_mode = get_format(mode) if isinstance(mode, str) else mode
    compute_dtype = to_dtype(dtype)
    auto = quantize_embeddings == EMBEDDINGS_AUTO  # the plugin's default: int8, the tiny tables kept wide
    quantize_embeddings = checked_embeddings(DEFAULT_EMBEDDINGS_MODE if auto else quantize_embeddings, quant_mode.name, compute_dtype, owner="quantize_model")
    rule = TargetRule(ignore_modules, quantize_head, tuple(keep_modules), quantize_embeddings, SMALL_EMBEDDING_VALUES if auto else 0)
    return quantize_listed(module, rule, rule.listing(module), quant_mode, compute_dtype, layer_modes or {}, device, hessians, correct)


def quantize_listed(
    module: nn.Module, rule: TargetRule, listing: Listing, quant_mode: QuantFormat, compute_dtype: torch.dtype,
    layer_modes: Mapping[str, str], device: Optional[Union[str, torch.device]], hessians: Optional[Mapping[str, Tensor]],
    correct: Optional[Correct] = None,
) -> list[str]:
    """The quantization of :func:`quantize_model` from the ``listing`` of ``module`` under ``rule`` (a
    ``Quantization``'s checks made it), one way: the checks (:func:`_validate`), the preparation
    (:func:`prepare_targets`), each target's mode (:func:`layer_modes_of`), then the
    replacement (:func:`~lightning_hbm.precision.quantize.quantize_targets`). Returns the names of the targets."""
    _validate(module, rule, listing, quant_mode, compute_dtype)
    layer_modes = rule.embedding_modes(listing, layer_modes)  # a preparation changes no embedding: resolved before it
    listing = prepare_targets(module, rule, listing)
    modes = layer_modes_of(listing.targets, quant_mode, layer_modes, listing.skipped)
    return quantize_targets(module, listing.targets, listing.skipped, listing.fp32, modes, compute_dtype, device, hessians, correct)


__all__ = ["DEFAULT_EMBEDDINGS_MODE", "EMBEDDINGS_AUTO", "SMALL_EMBEDDING_VALUES", "Listing", "TargetRule", "checked_embeddings", "keep_in_fp32_names", "layer_modes_of", "prepare_targets", "quantize_listed", "quantize_model"]
