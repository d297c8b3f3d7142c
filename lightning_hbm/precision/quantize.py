"""The replacement step of the quantization: each target replaced by its quantized layer, in its mode.

What it shrinks: the **parameters** term. :func:`quantize_targets` is the one place a model's layers become quantized
storage; it takes the targets as a value (a :class:`~lightning_hbm.precision.targets.Listing`'s parts: the targets,
the layers left alone with why, the model's fp32 modules) and each target's mode
(:func:`~lightning_hbm.precision.targets.layer_modes_of`), and ends with
the record: each layer left alone tagged with its reason for the coverage table. The flow that leads here, the same
for :func:`~lightning_hbm.precision.quantize_model` and ``QuantizedPrecision``, is
:func:`~lightning_hbm.precision.targets.quantize_listed`.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Protocol, Union, cast

import torch
from torch import Tensor, nn

from lightning_hbm import record
from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers import EMBEDDING, LINEAR, LayerKind, kind_of
from lightning_hbm.layers.correction import KEY_MARK as CORRECTION_MARK
from lightning_hbm.layers.embedding import QuantizedEmbedding, is_plain_embedding, tie_heads
from lightning_hbm.layers.linear import Fp32ComputeLinear
from lightning_hbm.layers.read_weight import readable, served_reader
from lightning_hbm.naming import under
from lightning_hbm.precision.conv_correction import correct_conv, is_conv
from lightning_hbm.precision.embedding_correction import correct_embedding
from lightning_hbm.precision.gptq import gptq_round_, grid_of
from lightning_hbm.precision.registry import QuantFormat

log = logging.getLogger(__name__)


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


class Correct(Protocol):
    """What :func:`quantize_targets` calls for each quantized layer (:class:`~lightning_hbm.precision.correction.CalibratedCorrection`)."""

    hessians: Optional[dict[str, Tensor]]  # the probe's input statistics by layer name (None: not measured)

    def fit(self, name: str, layer: nn.Module, weight: Tensor, holder: Optional[nn.Module] = None) -> None: ...

    def skip(self, name: str, why: str) -> None: ...


def quantize_targets(
    module: nn.Module,
    targets: list[tuple[str, nn.Module]],
    skipped: Mapping[str, tuple[str, bool]],
    fp32: set[str],
    modes: Mapping[str, Optional[QuantFormat]],
    compute_dtype: torch.dtype,
    device: Optional[Union[str, torch.device]],
    hessians: Optional[Mapping[str, Tensor]],
    correct: Optional[Correct] = None,
) -> list[str]:
    """The last step of the quantization: each of ``targets`` replaced in its mode of ``modes`` (:func:`~lightning_hbm.precision.targets.layer_modes_of`),
    the rest cast to ``compute_dtype``, then the record: the layers left alone (``skipped``: ``{name: (reason,
    deliberate)}``) tagged with why. Returns the names of the targets.

    ``fp32``: the model's ``_keep_in_fp32_modules`` (stored in the mode, computed in fp32; kept in fp32 by the cast).
    ``correct`` (``QuantizedPrecision(correction_rank=...)``): called with each quantized Linear-like layer and the
    weight it was built from, after any GPTQ rounding, while that weight still exists; ``correct.skip`` with a
    convolution's name.
    """
    target = torch.device(device) if device is not None else None
    for name, layer in targets:  # each format's own refusals, before the first layer changes
        if modes[name] is not None:
            kind = _target_kind(layer)
            cast(QuantFormat, modes[name]).check(name, cast(Callable[[nn.Module], nn.Linear], kind.to_linear)(layer) if kind.wrap is not None else layer)
    embeddings: list[tuple[nn.Module, QuantizedEmbedding]] = []
    for name, layer in targets:
        if modes[name] is None:  # kept unquantized by the plan: frozen like every other base weight
            layer.weight.requires_grad_(False)
            continue
        parent_name, _, child_name = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        new = _replace_one(name, layer, cast(QuantFormat, modes[name]), compute_dtype, target, hessians, correct, name in fp32)
        setattr(parent, child_name, new)
        if isinstance(new, QuantizedEmbedding):
            embeddings.append((layer, new))
    for name, (reason, deliberate) in skipped.items():
        record.leave_alone(module.get_submodule(name), reason, deliberate)
    if skipped:
        log.info("lightning_hbm: not quantizing %s", {n: r for n, (r, _) in skipped.items()})
    for layer, new in embeddings:  # a head tied to it computes with its one quantized copy (the heads are no targets)
        tie_heads(module, layer, new)
    cast_the_rest(module, fp32, compute_dtype, stored={name for name, _ in targets if modes[name] is not None})
    # peft picks its quantization-aware LoRA layers (mergeable) only when the model says so.
    kinds = {m.peft_kind for m in modes.values() if m is not None}
    peft_compat.mark_quantized(module, cast(set[str], kinds & {"4bit", "8bit"}))  # strings only: None is in neither
    return [name for name, _ in targets]


def cast_the_rest(module: nn.Module, fp32: set[str], compute_dtype: torch.dtype, stored: Optional[set[str]] = None) -> None:
    """Everything that is not quantized storage computes in ``compute_dtype`` (parameters stay trainable), except what
    the model declares must stay in fp32 (``fp32``), the calibrated correction's factors (stored as they were
    fitted, :func:`~lightning_hbm.layers.correction.storage_dtype`, or as a resumed checkpoint holds them), and BatchNorm: its running statistics are fp32 buffers, and
    batch_norm takes a 16-bit input only with fp32 weights and statistics (as in Lightning's mixed precision); 16-bit
    weights beside fp32 statistics fail at the first batch.

    Float32 buffers take the compute dtype too, as ``model.to(dtype)`` and Lightning's true precisions cast them, and
    as ``from_pretrained(dtype=...)`` builds those the model makes in the default dtype. Left fp32, they turned the
    activations fp32 at their first use: NLLB-MoE's and Kosmos-2's sinusoidal position tables, Swin2SR's
    ``relative_coords_table`` (its code casts it to "the same dtype as mlp weight" when built) and input ``mean``,
    diffusers ``ConsistencyDecoderVAE``'s latent ``means``/``stds``: each stopped at its first step under bf16 (issue
    53). Kept as built: the quantized layers' own (``stored``: their names; ``int8-dynamic``'s fp32 row scales),
    float64 buffers (a deliberate choice), and the frequencies of rotary embeddings (a module whose class name has
    "Rotary", transformers' own convention: their code computes the angles from them in fp32, and a bf16 frequency
    moves the angle at position p by up to p * 2**-9 radians)."""
    wide = fp32 | {n for n, m in module.named_modules() if isinstance(m, torch_compat.BatchNormBase)}
    for name, param in module.named_parameters():
        if CORRECTION_MARK in name:  # a calibrated correction's factors: part of the stored weight, 16-bit by design
            continue
        wanted = torch.float32 if under(name.rpartition(".")[0], wide) else compute_dtype
        if param.is_floating_point() and param.dtype != wanted:
            param.data = param.data.to(wanted)
    if compute_dtype == torch.float32:
        return
    kept = wide | (stored or set())
    for owner_name, owner in module.named_modules():
        if under(owner_name, kept) or "Rotary" in type(owner).__name__:
            continue
        for buffer in owner.buffers(recurse=False):
            if buffer.dtype == torch.float32:
                buffer.data = buffer.data.to(compute_dtype)


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
    rounded = hessians is not None and name in hessians and grid_of(new) is not None
    if rounded:
        gptq_round_(new, linear.weight, cast(Mapping[str, Tensor], hessians)[name])
    record.set_quantized_as(new, mode.name, "gptq" if rounded else "nearest")  # the export for the quantized base reads it
    if correct is not None and kind.wrap is None and not fp32:
        reader = served_reader(linear)
        if reader is not None and name not in (correct.hessians or {}):
            correct.skip(name, f"its weight is read directly by {reader or 'the model'}, which never calls the layer: "
                               "the probe saw none of its inputs")
        else:
            correct.fit(name, new, linear.weight)
    elif correct is not None and not is_conv(layer) and kind is not EMBEDDING:  # those: once wrapped, below
        what = f"a {kind.name} layer" if kind.wrap is not None else "computed in fp32 (_keep_in_fp32_modules)"
        correct.skip(name, f"{what}: the correction is written for Linear-like layers computing in the compute dtype only")
    if kind.wrap is not None:  # a convolution: the mode's layer holds its weight matrix, the wrapper convolves
        new = kind.wrap(layer, new, mode.dequantize, compute_dtype)
        record.set_converted(new, kind.name)  # resume maps its storage's keys to the conv's weight
        if correct is not None and is_conv(layer):  # carried by the convolution, added to the weight it dequantizes
            correct_conv(correct, name, new, linear.weight)
        elif correct is not None and isinstance(new, QuantizedEmbedding):  # carried by the embedding, added to its rows
            correct_embedding(correct, name, new, linear.weight)
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


def _target_kind(layer: nn.Module) -> LayerKind:
    """The kind of a target (:mod:`lightning_hbm.precision.targets`: a kind with ``to_linear``): a plain input embedding is
    one of :data:`~lightning_hbm.layers.EMBEDDING` once quantized."""
    return EMBEDDING if is_plain_embedding(layer) else cast(LayerKind, kind_of(layer))


