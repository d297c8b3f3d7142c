"""LoRA on a convolution whose own forward computes with its weight (issue 53, session 31).

transformers BiT's ``WeightStandardizedConv2d`` standardizes its weight and pads its input itself ("SAME") before
``F.conv2d``: it is kept as built (never quantized: :func:`~lightning_hbm.layers.weight_readers` names it), and until
now LoRA left it out too, since peft's convolution adapter adds ``lora_B(lora_A(x))`` to the output: an unpadded term
beside a padded output (a shape error, or where shapes agree another function), and one that merging would change
(``LoRA.merge`` adds the delta to the weight, which the layer then standardizes). BiT, every convolution such a
layer, could not be trained with LoRA at all.

Here the adapter is what LoRA is, a low-rank delta of the weight: the peft layer's forward runs the layer's own forward
with ``weight + scaling * B @ A`` (peft's ``get_delta_weight``) in place of its weight, so the padding and the
standardization apply to the adapted weight, and ``LoRA.merge`` (peft's merge, the same delta added to the weight) gives
that very function. The cost: the delta, one weight-sized tensor per adapted layer, is built in each forward (these
layers are kept wide, so it is no larger than the weight). Without dropout only (dropout acts on the input, which a
weight delta cannot): with ``LoRA(dropout>0)`` such layers are left out as before, with their reason.

A plain convolution that is dilated or pads other than with zeros gets the same forward: peft builds its ``lora_A``
without the dilation and padding mode, so its term was another function, or another length (descript DAC's dilated
residual convolutions: "The size of tensor a (256) must match the size of tensor b (268)"; issue 53, session 31).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers import own_forward
from lightning_hbm.layers.finding import base_layer, find_layers

CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


def own_forward_convs(module: nn.Module) -> set[str]:
    """Names of the convolutions of ``module`` whose own forward computes with their weight (not a plain convolution)."""
    return {n for n, layer, _ in find_layers(module) if isinstance(base_layer(layer), CONVS) and own_forward(base_layer(layer))}


@contextlib.contextmanager
def as_plain_convolutions(module: nn.Module, names: set[str]) -> Iterator[None]:
    """Inside, the convolutions ``names`` are of their torch class: peft builds its adapter's ``lora_A``/``lora_B`` as
    ``type(base_layer)(in, r, kernel, stride, padding, bias=False)``, which a subclass's own ``__init__`` may refuse
    (diffusers Wan's ``WanCausalConv3d``: "unexpected keyword argument 'bias'") or build as something else."""
    changed: list[tuple[nn.Module, type]] = []
    try:
        for name in sorted(names):
            layer = module.get_submodule(name)
            plain = next((c for c in CONVS if isinstance(layer, c)), None)
            if plain is not None and type(layer) is not plain:
                changed.append((layer, type(layer)))
                layer.__class__ = plain
        yield
    finally:
        for layer, cls in changed:
            layer.__class__ = cls


class WeightDeltaForward:
    """The ``forward`` of a peft LoRA convolution around such a layer: its own forward on the adapted weight."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer: Any = layer  # a peft LoraLayer

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        layer = self.layer
        base = layer.get_base_layer()
        if layer.disable_adapters or layer.merged:
            return base(x, *args, **kwargs)  # type: ignore[no-any-return]
        weight = base.weight
        for name in layer.active_adapters:
            if name in layer.lora_A:
                weight = weight + layer.get_delta_weight(name).to(weight.dtype)
        if not own_forward(base):  # dilated or other padding: the convolution itself (a quantized one's weight dequantized)
            plain: Tensor = base._conv_forward(x, weight, base.bias)
            return plain
        out: Tensor = torch.func.functional_call(base, {"weight": weight}, (x, *args), kwargs)
        return out


def weight_delta_forward(layer: nn.Module) -> bool:
    """Give a peft LoRA convolution whose base layer has its own forward :class:`WeightDeltaForward`; False (nothing
    changed) for any other layer."""
    base = getattr(layer, "base_layer", None)
    if not isinstance(base, CONVS) or not hasattr(layer, "get_delta_weight"):
        return False
    if isinstance(torch_compat.forward_override(layer), WeightDeltaForward):
        return True
    peft_layer: Any = layer
    dropout = any(not isinstance(d, nn.Identity) for d in peft_layer.lora_dropout.values())
    if dropout or not (own_forward(base) or _peft_term_differs(base)):
        return False
    torch_compat.override_forward(layer, WeightDeltaForward(layer))
    return True


def _peft_term_differs(conv: nn.Module) -> bool:
    """Whether peft's term ``lora_B(lora_A(x))`` is not the convolution of ``x`` by the delta weight: peft builds
    ``lora_A`` with the layer's kernel, stride and padding but not its dilation nor padding mode (descript DAC's
    dilated residual convolutions: "The size of tensor a (256) must match the size of tensor b (268)")."""
    return any(d != 1 for d in conv.dilation) or conv.padding_mode != "zeros"  # type: ignore[union-attr]


__all__ = ["WeightDeltaForward", "as_plain_convolutions", "own_forward_convs", "weight_delta_forward"]
