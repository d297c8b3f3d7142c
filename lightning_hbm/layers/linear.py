"""``nn.Linear`` and its subclasses: the kind every precision mode and peft's LoRA were written for.

Subclasses included: ``nn.MultiheadAttention``'s ``out_proj`` is a ``NonDynamicallyQuantizableLinear`` (an exact
type check skips it), and a quantized layer (bitsandbytes ``Linear4bit``/``Linear8bitLt``, ``Int8DynamicLinear``)
is still a Linear, counted here unless ``quantize_model`` tagged it with the kind it came from (a Conv1D).
"""

from __future__ import annotations

from torch import nn

from lightning_hbm.layers.base import LayerKind, register_kind


def _is_linear(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear)


def _as_linear(module: nn.Module) -> nn.Linear:
    return module  # type: ignore[return-value]


LINEAR = register_kind(
    LayerKind(
        name="Linear",
        matches=_is_linear,
        to_linear=_as_linear,
        quantized_as="the mode's layer (bitsandbytes `Linear4bit` / `Linear8bitLt`, `Int8DynamicLinear`)",
        adapted_as="the Linear (peft's LoRA Linear around it)",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
        modules="`nn.Linear` (and subclasses)",
        found_in="Llama, BERT, T5, ViT heads, ...",
        planned_as="the mode's layer built from the fake weight (`QuantFormat.for_fake_tensors`)",
    )
)

__all__ = ["LINEAR"]
