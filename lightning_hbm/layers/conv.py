"""Convolutions (``nn.Conv1d``/``2d``/``3d``): adapted by peft's Conv LoRA, never quantized.

bitsandbytes (and int8-dynamic) have no convolution kernel, so no precision mode shrinks them: they stay in the
compute dtype, frozen, named in the coverage table and warned about above 5 % of the parameters. Grouped and
depthwise convolutions are not LoRA targets: peft needs ``r`` divisible by ``groups`` and cannot merge them.
"""

from __future__ import annotations

from torch import nn

from lightning_hbm.layers.base import LayerKind, itself, register_kind


def _is_conv(module: nn.Module) -> bool:
    return isinstance(module, (nn.Conv1d, nn.Conv2d, nn.Conv3d)) and module.weight.is_floating_point()


def _adaptable(conv: nn.Module) -> list[str]:
    return [] if conv.groups > 1 else itself(conv)  # grouped/depthwise: see the module docstring


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
        modules="`nn.Conv1d`/`2d`/`3d`",
        found_in="ResNet, ConvNeXt, ViT/SigLIP patch embeddings, Mamba",
        planned_as="its weight in the compute dtype (frozen unless adapted)",
        adaptable_names=_adaptable,
        not_adapted="not adapted: LoRA skips grouped/depthwise convolutions (peft needs r divisible by groups and "
        "cannot merge them). To train them: LoRA(modules_to_save=[their names]) trains them fully; else they stay "
        "frozen",
    )
)

__all__ = ["CONV"]
