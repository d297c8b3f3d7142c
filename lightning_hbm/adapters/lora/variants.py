"""peft's LoRA variants (DoRA, rsLoRA, PiSSA/OLoRA/Gaussian init, bias, per-layer rank/alpha): checks and refusals.

Every variant is peft's own implementation, passed through ``LoraConfig``. What lives here is what peft does not
check (or checks only after it changed the model): which variant works on which layer kind and quantized format,
the per-layer patterns matching the targets, and the two places where a variant changes the arithmetic LoRA's export
and merge do (DoRA's magnitude, PiSSA/OLoRA's rewritten base).
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping, Optional, Union, cast

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_hbm.precision.registry import format_of

_BNB_MODES = ("nf4", "nf4-dq", "nf4-b32", "nf4-dq-b32", "fp4", "fp4-dq", "int8")
#: init_lora_weights values that rewrite the base weight (W -> W - scaling * B A): they need it in full precision
REWRITES_BASE = ("pissa", "olora")
#: formats whose layer peft's DoRA cannot read a correct weight norm from (why: see ``_dora_refusal``)
_DORA_BROKEN = {
    "int8-dynamic": "peft's DoRA reads the raw int8 weight without its per-row scales (peft dequantizes only "
    "bitsandbytes, HQQ and torchao layers), so the magnitude would be computed on unscaled integers",
    "int8-dynamic-smooth": "peft's DoRA reads the raw int8 weight without its per-row scales and smoothing factors "
    "(peft dequantizes only bitsandbytes, HQQ and torchao layers), so the magnitude would be wrong",
    "int4-g32": "peft's DoRA reads the raw packed uint8 codes without their group scales and minima (peft dequantizes "
    "only bitsandbytes, HQQ and torchao layers), so the magnitude would be computed on packed bytes",
    "nf4-torchao": "peft's DoRA calls the torchao weight's dequantize() without the arguments torchao's NF4Tensor "
    "needs (TypeError in peft 0.21)",
}


def check_init(init_lora_weights: Union[bool, str]) -> None:
    """Refuse the initialisations that cannot run at lightning_hbm's surgery point, with what to use instead."""
    if init_lora_weights == "eva":
        raise ValueError(
            "LoRA(init_lora_weights='eva'): EVA initialises the adapters from the SVD of activations of training "
            "batches (peft's initialize_lora_eva_weights runs the model over a dataloader), but LoRA injects the "
            "adapters at the surgery point, before Lightning has drawn any batch. Not supported: use "
            "init_lora_weights=True (default), 'gaussian', or 'pissa'/'olora' on a full-precision base."
        )
    if init_lora_weights == "loftq":
        raise ValueError(
            "LoRA(init_lora_weights='loftq'): peft's LoftQ quantizes the full-precision weight itself (a LoftQConfig; "
            "CUDA only in peft 0.21) and writes a dequantized float base back, while here QuantizedPrecision "
            "quantizes the base before the adapters exist, so there is no full-precision weight left to start from. "
            "Not supported: benchmarks/loftq.py runs the LoftQ iteration on an nf4-dq base with bitsandbytes' own "
            "quantizer; or use init_lora_weights='pissa' on a full-precision base."
        )


def check_pattern(arg: str, pattern: Optional[Mapping[str, Any]], integer: bool) -> Optional[dict[str, Any]]:
    """``rank_pattern`` / ``alpha_pattern``: keys valid regexes, values positive (ints for ranks)."""
    if pattern is None:
        return None
    what = "a positive int (a rank)" if integer else "a positive number (an alpha)"
    example = "{'q_proj': 16}" if integer else "{'q_proj': 32.0}"
    for key, value in pattern.items():
        try:
            re.compile(key)
        except re.error as err:
            raise ValueError(f"LoRA({arg}={pattern!r}): the key {key!r} is not a valid regex ({err}); e.g. {arg}={example}.") from err
        bad_type = isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int))
        if bad_type or not math.isfinite(value) or value <= 0:
            raise ValueError(f"LoRA({arg}={pattern!r}): the value of {key!r} must be {what}, got {value!r}; e.g. {arg}={example}.")
    return {k: (int(v) if integer else float(v)) for k, v in pattern.items()}


def pattern_matches(key: str, name: str) -> bool:
    """peft's rule for a rank/alpha pattern key (``peft.utils.other.get_pattern_key``): a regex matching a name's tail."""
    return re.match(rf"(.*\.)?({key})$", name) is not None


def check_patterns_match(arg: str, pattern: Optional[Mapping[str, Any]], targets: list[str]) -> None:
    """A pattern key that matches no adapted layer is a typo: an error, not a silently uniform rank."""
    for key in pattern or {}:
        if not any(pattern_matches(key, t) for t in targets):
            shown = ", ".join(targets[:8]) + (" ..." if len(targets) > 8 else "")
            raise ValueError(
                f"LoRA({arg}={pattern!r}): the key {key!r} matches none of the {len(targets)} adapted layers, so it "
                f"would change nothing. Keys are regexes matched against the end of a module name (peft's rule), e.g. "
                f"'q_proj' or 'layers\\.0\\.self_attn\\.q_proj'. Adapted layers: {shown}."
            )


def layer_rank(r: int, rank_pattern: Optional[Mapping[str, int]], name: str) -> int:
    """The rank peft gives layer ``name``: the first matching ``rank_pattern`` key's, else ``r``."""
    for key, value in (rank_pattern or {}).items():
        if pattern_matches(key, name):
            return value
    return r


def is_quantized(module: nn.Module) -> bool:
    """Whether ``module`` holds quantized weights (cannot be trained in full)."""
    # its format says so (torchao's NF4Tensor looks floating); packed integer weights of a layer no format owns too
    return any(format_of(m) is not None for m in module.modules()) or any(not p.is_floating_point() for p in module.parameters())


def refusals(
    layers: dict[str, Optional[nn.Module]],
    to_be_quantized: dict[str, Optional[str]],
    use_dora: bool,
    init: Union[bool, str],
    quantize_device: Optional[torch.device] = None,
) -> list[str]:
    """Why each target layer cannot take the variants asked for (``[]``: all can). ``to_be_quantized``: name -> the
    mode QuantizedPrecision is about to quantize it in (on ``quantize_device``). Checked before any change: peft raises
    only mid-injection, or at the first forward."""
    reasons = []
    for name, layer in layers.items():
        conv = isinstance(layer, (nn.Conv1d, nn.Conv2d, nn.Conv3d))  # lightning_hbm's quantized ones subclass these
        mode = to_be_quantized.get(name) if name in to_be_quantized else _format_name(layer)
        quantized = name in to_be_quantized or (layer is not None and is_quantized(layer))
        if init in REWRITES_BASE and conv:
            reasons.append(f"{name}: init_lora_weights={init!r} is not implemented by peft for convolutions")
        elif init in REWRITES_BASE and quantized:
            reasons.append(
                f"{name}: init_lora_weights={init!r} rewrites the base weight to W - B A from its full-precision "
                f"values, and this layer is quantized ({mode or 'quantized'}): peft refuses it or re-quantizes the "
                "residual, so the base would no longer be the one the adapters were fitted to"
            )
        if use_dora and not conv and mode in _DORA_BROKEN:
            reasons.append(f"{name}: use_dora=True on {mode}: {_DORA_BROKEN[mode]}")
        # read only where a DoRA check needs it: a quantized convolution's weight dequantizes at each read
        weight = getattr(layer, "weight", None) if use_dora and not conv and name not in to_be_quantized else None
        if use_dora and not conv and isinstance(weight, FakeTensor) and mode in _BNB_MODES:
            reasons.append(
                f"{name}: use_dora=True on {mode} in the planner's trace: peft finds a bitsandbytes weight to dequantize "
                "for DoRA's norm by its class, and the planner's fake 4-bit/8-bit weights are plain tensors. Plan with "
                "use_dora=False and add one trainable element per output channel (fp32: 4 bytes + 8 of AdamW states)"
            )
        device = quantize_device if name in to_be_quantized else getattr(weight, "device", None)
        if use_dora and not conv and mode == "int8" and getattr(device, "type", "cpu") == "cpu":
            reasons.append(
                f"{name}: use_dora=True on int8 (bitsandbytes Linear8bitLt) on CPU: peft's DoRA dequantizes the weight "
                "and moves it back, which drops the layer's scales (state.SCB), and the first forward fails "
                "(peft 0.21, bitsandbytes 0.50); on CUDA peft supports it, on CPU use nf4/nf4-dq (QDoRA)"
            )
    return reasons


def _format_name(layer: Optional[nn.Module]) -> Optional[str]:
    fmt = format_of(layer) if layer is not None else None
    return None if fmt is None else fmt.name


def cast_adapters(layer: nn.Module, dtype: torch.dtype) -> None:
    """The adapter weights of one peft LoRA layer in ``dtype``: A, B and DoRA's magnitude vector."""
    for container in (layer.lora_A, layer.lora_B, getattr(layer, "lora_magnitude_vector", {})):
        if isinstance(container, nn.Module):
            container.to(dtype)


@torch.no_grad()
def merged_weight(layer: nn.Module, adapter: str, weight: torch.Tensor) -> torch.Tensor:
    """The base ``weight`` (fp32, the base layer's own layout) with ``adapter`` folded in, as peft merges it.

    Plain LoRA: ``W + delta``. DoRA: ``m / ||W + delta|| * (W + delta)``, the norm by peft's own DoRA layer
    (per output channel; a transformers Conv1D stores ``[in, out]``, so its norm runs over the transposed weight).
    """
    delta = cast(Callable[[str], torch.Tensor], layer.get_delta_weight)(adapter).float()  # a peft LoRA layer's method
    magnitudes = getattr(layer, "lora_magnitude_vector", {})
    if adapter not in magnitudes:
        return weight + delta
    dora = magnitudes[adapter]
    transposed = bool(getattr(layer, "fan_in_fan_out", False))
    w, d = (weight.T, delta.T) if transposed else (weight, delta)
    norm = dora.get_weight_norm(w, d, scaling=1).detach()  # peft detaches it too (DoRA paper, section 4.3)
    factor = (dora.weight.float() / norm).view(-1, *([1] * (w.dim() - 1)))
    out = factor * (w + d)
    return out.T if transposed else out


def export_patterns(adapted: dict[str, nn.Module], adapter: str, r: int, alpha: float) -> tuple[dict[str, int], dict[str, float]]:
    """``rank_pattern``/``alpha_pattern`` for ``adapter_config.json``: one exact entry per layer that differs from
    ``r``/``alpha``, keyed by its name relative to the exported model (the user's keys are relative to the
    LightningModule and may not match there)."""
    ranks, alphas = {}, {}
    for name, layer in adapted.items():
        key = re.escape(name)
        if cast(dict[str, int], layer.r)[adapter] != r:  # peft's per-adapter dicts (r, lora_alpha)
            ranks[key] = int(cast(dict[str, int], layer.r)[adapter])
        if float(cast(dict[str, float], layer.lora_alpha)[adapter]) != float(alpha):
            alphas[key] = float(cast(dict[str, float], layer.lora_alpha)[adapter])
    return ranks, alphas
