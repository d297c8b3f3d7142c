"""transformers' ``Conv1D`` (GPT-2): ``x @ W + b`` with the weight stored transposed, ``[in, out]``.

Not to be confused with ``nn.Conv1d`` (a convolution, :mod:`lightning_hbm.layers.conv`). Quantized as the
``nn.Linear`` with weight ``W.T`` (what transformers' bitsandbytes integration does); peft adapts it with its own
Conv1D LoRA layer (``fan_in_fan_out=True``) and, once quantized, with its Linear one.
"""

from __future__ import annotations

from typing import Optional, cast

from torch import Tensor, nn

from lightning_hbm.layers.kinds import LayerKind, register_kind


def _conv1d_class() -> Optional[type]:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _is_conv1d(module: nn.Module) -> bool:
    cls = _conv1d_class()
    return cls is not None and isinstance(module, cls) and cast(Tensor, module.weight).is_floating_point()


def _as_linear(conv: nn.Module) -> nn.Linear:
    # Conv1D computes x @ W + b with W stored [in, out]: the Linear with weight W.T is the same map.
    # The transposed copy is transient (the mode quantizes it); the bias Parameter is shared.
    in_features, out_features = cast(Tensor, conv.weight).shape
    linear = nn.Linear(in_features, out_features, bias=conv.bias is not None, device="meta")
    linear.weight = nn.Parameter(cast(Tensor, conv.weight).detach().t().contiguous(), requires_grad=False)
    if conv.bias is not None:
        linear.bias = cast(nn.Parameter, conv.bias)
    return linear


def _features(layer: nn.Module) -> tuple[int, int]:
    # an unquantized Conv1D's weight is [in, out]; a quantized one is the mode's Linear (tagged Conv1D)
    return (layer.in_features, layer.out_features) if isinstance(layer, nn.Linear) else cast(tuple[int, int], tuple(cast(Tensor, layer.weight).shape))  # a 2-D weight


CONV1D = register_kind(
    LayerKind(
        name="Conv1D",
        matches=_is_conv1d,
        to_linear=_as_linear,
        quantized_as="the weight transposed into the mode's Linear layer (as transformers' bitsandbytes integration does)",
        adapted_as="the layer (peft's Conv1D LoRA, or its Linear LoRA once quantized)",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
        modules="transformers `Conv1D`",
        found_in="GPT-2",
        planned_as="the mode's layer built from the transposed fake weight",
        features=_features,
    )
)

__all__ = ["CONV1D"]
