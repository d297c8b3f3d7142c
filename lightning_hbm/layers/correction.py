"""The frozen low-rank correction a quantized layer may carry: ``out += (x @ A.T) @ B.T``, declared here only.

``QuantizedPrecision(correction_rank=r)`` fits, per quantized layer, the rank-``r`` term that minimises the layer's
output error on the probe batch (:mod:`lightning_hbm.precision.correction`) and attaches it with
:func:`attach_correction`: a :class:`LowRankCorrection` child named :data:`CORRECTION` (``right`` = A ``[r, in]``,
``left`` = B ``[out, r]``, frozen Parameters stored in the compute dtype, :func:`storage_dtype`) and one forward hook that adds its
output to the layer's. The layer itself is unchanged (its class, its packed weight, its format), so peft wraps it as any quantized
layer (the correction then sits under ``base_layer``) and every reader of the format still reads the weight.

Everything that knows a quantized layer asks here for its correction: the storage count (frozen Parameters of the
layer: the **parameters** term, in the coverage table's bytes of the layer), the planner (zero factors of the same
shapes on fake tensors), ``QuantizationQuality``'s weight SQNR and ``LoRA.merge`` (:func:`correction_weight`),
checkpoints (the factors are saved with the changed tensors, :data:`KEY_MARK`) and the adapter export for the
quantized base.

Why a custom autograd Function: the factors are frozen, so the backward needs only them (``grad @ B @ A``), never the
input. torch's own matmuls would save ``A.T`` and ``B.T`` for backward; under activation checkpointing those saved
tensors would move the order of the ones LoRA's adapter-first recompute relies on
(:mod:`lightning_hbm.adapters.lora.forward`). Held on the Function's context like bitsandbytes' ``MatMul4Bit`` holds its
weight: nothing is saved, so the activations term is unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, cast

import torch
from torch import Tensor, nn

#: the child module name of a layer's correction (its state_dict keys: ``<layer>.lowrank_correction.left/right``)
CORRECTION = "lowrank_correction"
#: a part of every state_dict key of a correction (a checkpoint keeps these tensors with the changed ones)
KEY_MARK = f".{CORRECTION}."


def storage_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype a correction's factors are stored in under the ``compute`` dtype: the compute dtype itself (bf16 under
    the default bf16 compute, fp32 under fp32 compute). They are computed in the input's dtype, so a checkpoint
    holding factors of another dtype resumes with them as saved.

    Why not 16 bits under fp32 compute (session 41 stored them in bf16 there: 0.626 instead of 0.718 bytes per weight
    for ``nf4-dq-b32`` + GPTQ + rank 16 on SmolLM2-135M): the same before training, worse as trained, and the harm grows
    with the rounding. SmolLM2, fp32 compute, 150 LoRA steps, gap to 16-bit LoRA, seeds 0 / 1: fp32 factors +0.75 /
    +0.41 %, fp16 +1.10 / +0.61 %, bf16 +1.40 / +2.15 % (fp32 factors perturbed by 1e-5 relative noise, seed 0:
    +0.93 %, the run-to-run scale); benchmarks/README.md, "The correction's factors in 16 bits". At equal bytes,
    fewer fp32 factors: ``accurate_4bit`` counts the factors in this dtype and picks the rank from them.
    """
    return compute


class _LowRankProduct(torch.autograd.Function):
    """``(x @ right.T) @ left.T`` with frozen factors, in ``x``'s dtype: nothing saved for backward (module docstring)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, right: Tensor, left: Tensor) -> Tensor:
        ctx.factors = (right, left)  # frozen Parameters of the layer: alive anyway, not saved tensors
        # computed in the input's dtype (a resumed checkpoint's factors may be narrower): a widened copy is a temporary
        return (x @ right.to(x.dtype).t()) @ left.to(x.dtype).t()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None]:
        right, left = ctx.factors
        return (grad @ left.to(grad.dtype)) @ right.to(grad.dtype), None, None


class LowRankCorrection(nn.Module):
    """A frozen rank-``r`` term ``x -> (x @ right.T) @ left.T`` added to a quantized layer's output.

    Args:
        right: ``A``, ``[r, in_features]``.
        left: ``B``, ``[out_features, r]``.

    Raises:
        ValueError: factors whose shapes do not chain (``right.shape[0] != left.shape[1]``).
    """

    def __init__(self, right: Tensor, left: Tensor) -> None:
        super().__init__()
        if right.dim() != 2 or left.dim() != 2 or right.shape[0] != left.shape[1]:
            raise ValueError(
                f"LowRankCorrection: right must be [r, in] and left [out, r], got {tuple(right.shape)} and {tuple(left.shape)}."
            )
        self.right = nn.Parameter(right, requires_grad=False)
        self.left = nn.Parameter(left, requires_grad=False)

    @property
    def rank(self) -> int:
        return int(self.right.shape[0])

    def forward(self, x: Tensor) -> Tensor:
        """The term for ``x`` (``[..., in]``), in ``x``'s dtype (the compute dtype; the factors are widened to it)."""
        flat = x.reshape(-1, x.shape[-1])
        return cast(Tensor, _LowRankProduct.apply(flat, self.right, self.left)).reshape(*x.shape[:-1], self.left.shape[0])

    def weight(self) -> Tensor:
        """``left @ right`` (``[out, in]``, fp32): the term as a weight, added to the layer's dequantized one."""
        return self.left.detach().float() @ self.right.detach().float()

    def extra_repr(self) -> str:
        return f"rank={self.rank}, in={self.right.shape[1]}, out={self.left.shape[0]}, dtype={self.right.dtype}, frozen"


def _add_correction(layer: nn.Module, args: tuple, output: Any) -> Any:
    """The forward hook: the layer's output plus its correction of the layer's input (a module-level function:
    a model with corrections pickles and deep-copies)."""
    correction = correction_of(layer)
    if correction is None or not args or not isinstance(output, Tensor):
        return None
    term = correction(args[0])  # a 4-bit layer's input was flattened by its pre-hook: the term follows its shape
    return output + term.reshape(output.shape).to(output.dtype)


def attach_correction(layer: nn.Module, right: Tensor, left: Tensor) -> LowRankCorrection:
    """Give the quantized ``layer`` the frozen correction ``(right, left)`` (module docstring); returns it.

    Raises:
        ValueError: ``layer`` already has one, or the factors' shapes are not ``[r, in]`` and ``[out, r]``.
    """
    correction = _carry(layer, right, left)
    layer.register_forward_hook(_add_correction)
    return correction


def attach_weight_correction(layer: nn.Module, right: Tensor, left: Tensor) -> LowRankCorrection:
    """Give the quantized convolution ``layer`` the frozen correction ``(right, left)`` (``right`` = A ``[r, in / groups
    x kernel]``, ``left`` = B ``[out, r]``, the weight matrix's shapes) without a forward hook: the convolution adds
    ``B A`` to the weight it dequantizes at each forward (:meth:`lightning_hbm.layers.conv._Quantized.dequantized`).

    Why in the weight rather than as a rank-``r`` convolution and a 1x1 one beside it: a convolution is linear in its
    weight, so both compute the same output, but the sum costs ``out x r x in x kernel`` multiplications per forward
    against ``r x (in x kernel + out)`` per output position, and nothing more is saved for backward (the weight is
    dequantized again there). Every reader of the conv's ``weight`` (``LoRA.merge``, ``QuantizationQuality``) then sees
    the weight it computes with, correction included.

    Raises:
        ValueError: ``layer`` already has one, or the factors' shapes are not ``[r, in]`` and ``[out, r]``.
    """
    return _carry(layer, right, left)


def _carry(layer: nn.Module, right: Tensor, left: Tensor) -> LowRankCorrection:
    """``layer`` holds the correction ``(right, left)`` as its child (what both ways of applying it share)."""
    if correction_of(layer) is not None:
        raise ValueError(f"{type(layer).__name__} already carries a low-rank correction: attach one per layer.")
    correction = LowRankCorrection(right, left)
    layer.add_module(CORRECTION, correction)
    return correction


def correction_of(layer: nn.Module) -> Optional[LowRankCorrection]:
    """The correction ``layer`` carries (``None``: none)."""
    found = getattr(layer, "_modules", {}).get(CORRECTION)
    return found if isinstance(found, LowRankCorrection) else None


def correction_weight(layer: nn.Module) -> Optional[Tensor]:
    """The correction of ``layer`` as an ``[out, in]`` fp32 weight (``None``: none), to add to its dequantized weight."""
    correction = correction_of(layer)
    return None if correction is None else correction.weight()


def saved_factors(state_dict: Mapping[str, Any]) -> Optional[dict[str, tuple[Tensor, Tensor]]]:
    """The factors ``{layer name: (right, left)}`` a checkpoint's ``state_dict`` holds under :data:`KEY_MARK` (a layer
    wrapped by peft under its own name: the key's ``.base_layer.`` left out); ``None``: none."""
    found: dict[str, dict[str, Tensor]] = {}
    for key, tensor in state_dict.items():
        if KEY_MARK in key and isinstance(tensor, Tensor):
            layer, _, factor = key.replace(".base_layer.", ".").rpartition(KEY_MARK)  # peft's wrapper, saved with it
            found.setdefault(layer, {})[factor] = tensor
    return {name: (f["right"], f["left"]) for name, f in found.items() if {"right", "left"} <= set(f)} or None


__all__ = ["CORRECTION", "KEY_MARK", "LowRankCorrection", "attach_correction", "attach_weight_correction", "correction_of", "correction_weight", "saved_factors", "storage_dtype"]
