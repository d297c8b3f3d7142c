"""The sensitivity plan's view of layers whose weight the model's code reads directly (session 24).

torchvision Swin's attention never calls ``self.qkv`` / ``self.proj``: it passes their weights to ``F.linear``
(stored as a :class:`~lightning_hbm.layers.read_weight.ReadableLinear`, whose reads call the storage). The plan
(:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`) measures a layer by swapping a quantized copy in: a copy with
no ``weight`` failed the plan on such a model (``AttributeError: '_SameDtype' object has no attribute 'weight'``), and
its forward hooks, which measure each layer's own output error, never fire for a read layer. Here:

* :func:`read_variant`: the quantized copy of a read layer, a ``ReadableLinear`` whose reads and calls compute in the
  plan's dtype and give the caller's dtype back (as ``_SameDtype`` does for a called layer);
* :func:`read_local_errors`: a read layer's own output error in each mode on its probe inputs, from the inputs of its
  reads (:func:`~lightning_hbm.precision.gptq.input_statistics`, one forward for all of them):
  ``|X (W_m - W)^T|^2 = tr((W_m - W) X^T X (W_m - W)^T)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

import torch
from torch import nn

from lightning_hbm.layers.read_weight import ReadableLinear, served_reader
from lightning_hbm.precision.gptq import input_statistics


class _ReadSameDtype(ReadableLinear):
    """A read layer's quantized copy inside the model as built (e.g. fp32) computing in the plan's dtype (e.g. bf16)."""

    def read(self, x: torch.Tensor, bias: Any, adapted: bool, dtype: torch.dtype) -> torch.Tensor:
        return super().read(x, bias, adapted, dtype).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.to(self.weight_dtype())).to(x.dtype)


class _SameDtype(nn.Module):
    """A called layer's quantized copy (a quantized layer inside the model as built (e.g. fp32) that computes in the plan's dtype (e.g. bf16)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        # held, not registered: its parameters (a bias in the plan's dtype) stay out of the model's, whose code may
        # take its dtype from them (diffusers' ``ModelMixin.dtype``, the first float parameter: UNet2DModel cast its
        # timestep embedding to bf16 for its fp32 Linear, "mat1 and mat2 must have the same dtype", issue 53)
        self._held, self.dtype = (layer.eval(),), dtype

    @property
    def layer(self) -> nn.Module:
        return cast(nn.Module, self.__dict__["_held"][0])

    def __getattr__(self, name: str) -> Any:
        # the layer's own attributes, as the model's code reads them beside the call (transformers MobileNetV2's "SAME"
        # padding reads the conv's stride, kernel_size and dilation): was AttributeError, the fit stopped at its start
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_held"][0], name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the layer sees the compute dtype, as under QuantizedPrecision; the model as built gets its dtype back
        return self.layer(x.to(self.dtype)).to(x.dtype)


def swapped_copy(layer: nn.Module, source: nn.Linear, quantized: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The quantized copy the plan swaps in for the model's ``layer`` (``quantized``, the mode's layer built from
    ``source``): served reads (:func:`read_variant`) when the model's code reads its weight, else computing in
    ``dtype`` (:class:`_SameDtype`), in eval mode as the probe model (bitsandbytes' int8 layer computes LLM.int8 in eval)."""
    return read_variant(source, quantized) if is_read(layer) else _SameDtype(quantized, dtype).eval()


def is_read(layer: nn.Module) -> bool:
    """Whether the probe step saw the model's code read ``layer``'s weight (a plain Linear, as built), so that its
    quantized copy must serve reads (:func:`read_variant`)."""
    return isinstance(layer, nn.Linear) and not isinstance(layer, ReadableLinear) and served_reader(layer) is not None


def read_variant(source: nn.Linear, quantized: nn.Module) -> nn.Module:
    """``quantized`` (the mode's layer built from ``source``, a copy of the model's layer) as the model's code reads it:
    ``weight`` computed from the storage, reads and calls in the storage's compute dtype, outputs in the caller's."""
    return cast(nn.Module, _ReadSameDtype.from_quantized(source, quantized)).eval()


def read_local_errors(
    module: nn.Module, layers: Mapping[str, nn.Module], modes: Sequence[str], probe: Any, variant: Callable[[str, str], nn.Module]
) -> dict[str, dict[str, float]]:
    """``name -> mode -> |X (W_mode - W)^T|^2`` of the ``layers`` the probe forward never called (their weight is read
    instead), ``X`` the inputs of their reads on ``probe``; a layer neither called nor read: its weight error alone
    (its error at the output, measured alone, is then nothing anyway). ``variant(name, mode)``: the plan's quantized
    copy (the model's own layer for ``"none"``)."""
    read = {name: layer for name, layer in layers.items() if is_read(layer)}
    hessians = input_statistics(module, list(read), probe)[0] if read else {}
    errors: dict[str, dict[str, float]] = {}
    for name, layer in layers.items():
        if name not in read:  # never called nor read on the probe: no input, and its error alone is nothing
            errors[name] = {mode: 1.0 for mode in modes}
            continue
        weight, gram = cast(torch.Tensor, layer.weight).detach().float().cpu(), hessians.get(name)
        errors[name] = {}
        for mode in modes:
            copy = variant(name, mode)
            if copy is layer:  # "none": the layer as built
                errors[name][mode] = 0.0
                continue
            delta = cast(ReadableLinear, copy).dense(adapted=False).float().cpu() - weight
            errors[name][mode] = float((delta @ gram * delta).sum()) if gram is not None else float(delta.square().sum())
    return errors


__all__ = ["is_read", "read_local_errors", "read_variant", "swapped_copy"]
