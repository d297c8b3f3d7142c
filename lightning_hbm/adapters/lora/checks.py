"""What ``LoRA`` refuses before it changes anything: a model that already carries peft adapters, the variants the
target layers cannot take (which depends on what the Trainer's ``QuantizedPrecision`` is about to quantize, and in
which mode), a rank wider than a target layer."""

from __future__ import annotations

from typing import Optional

from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import adapted_layers, smaller_side
from lightning_hbm.adapters.lora.config import LoRAConfig
from lightning_hbm.precision.plugin import QuantizedPrecision
from lightning_hbm.precision.sensitivity import UNQUANTIZED


def refuse_present_adapters(module: nn.Module) -> None:
    """``ValueError`` when ``module`` already carries peft adapters (a second set would go on top)."""
    present = list(adapted_layers(module))
    if present or getattr(module, "peft_config", None):
        raise ValueError(
            f"{type(module).__name__} already carries peft adapters ({present[:3]}{' ...' if len(present) > 3 else ''}): "
            "lightning_hbm's LoRA would put a second set on top. Build the model without peft "
            "(drop get_peft_model / inject_adapter_in_model) and let the LoRA callback add them, or train the "
            "peft model without the LoRA callback."
        )


def quantized_modes(module: nn.Module) -> dict[str, Optional[str]]:
    """``{name: mode}`` of the Linears the Trainer's QuantizedPrecision is about to quantize (its ``layer_modes``
    first, else its mode); empty without one. A layer pinned to ``"none"`` stays as built: not listed (session 37:
    ``init_lora_weights="pissa"`` on it was refused as "quantized (none)")."""
    trainer = lightning_compat.attached_trainer(module)
    plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
    if not isinstance(plugin, QuantizedPrecision):
        return {}
    pinned = getattr(plugin, "layer_modes", None) or {}
    modes = {name: pinned.get(name, plugin.mode.name) for name, _ in plugin.quantization_targets(module)}
    return {name: mode for name, mode in modes.items() if mode != UNQUANTIZED}


def refuse_variants(module: nn.Module, config: LoRAConfig, targets: list[str], modes: dict[str, Optional[str]]) -> None:
    """Refuse the variants the target layers cannot take (``modes``: the layers about to be quantized, as
    :func:`quantized_modes`), and pattern keys that match no target; changes nothing."""
    variants.check_patterns_match("rank_pattern", config.rank_pattern, targets)
    variants.check_patterns_match("alpha_pattern", config.alpha_pattern, targets)
    named = dict(module.named_modules())
    strategy = getattr(lightning_compat.attached_trainer(module), "strategy", None)
    device = getattr(strategy, "root_device", None)  # where QuantizedPrecision is about to quantize
    layers = {t: named.get(t) for t in targets}
    reasons = variants.refusals(layers, modes, config.use_dora, config.init_lora_weights, device)
    if reasons:
        raise ValueError(
            f"LoRA cannot apply its variants to {len(reasons)} target layer(s): " + "; ".join(reasons[:3])
            + (" ..." if len(reasons) > 3 else "") + ". Leave those layers out (exclude_modules=[...] or "
            "QuantizedPrecision(ignore_modules=[...])), or drop the option (use_dora=False / "
            "init_lora_weights=True or 'gaussian')."
        )


def refuse_wide_ranks(module: nn.Module, config: LoRAConfig, targets: list[str]) -> None:
    """``ValueError`` naming the target layers narrower than their rank (``r``, or ``rank_pattern``'s)."""
    named = dict(module.named_modules())
    narrow = []
    for name in targets:
        layer = named.get(name)  # None: a projection a layer-kind conversion creates (MultiheadAttention, experts)
        rank = variants.layer_rank(config.r, config.rank_pattern, name)
        width = smaller_side(layer, rank)
        if rank > width:
            narrow.append(f"{name} ({width}{'' if rank == config.r else f', rank_pattern r={rank}'})")
    if narrow:
        raise ValueError(
            f"LoRA r={config.r} is larger than the width of {len(narrow)} target layer(s): {narrow[:5]}. A rank above "
            "a layer's smaller dimension adds parameters without adding capacity: use r <= the narrowest width, "
            "or exclude those layers with exclude_modules=[...]."
        )
