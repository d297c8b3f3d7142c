"""peft's internals that lightning_hbm relies on (peft 0.21; ``tests/_compat/test_peft.py`` checks each)."""

from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch
from torch import Tensor, nn


@contextlib.contextmanager
def exact_targets(model: nn.Module) -> Iterator[None]:
    """Inside, peft injects into ``model`` the targets it is given, verbatim.

    peft 0.21 (transformers >= 5) rewrites the ``LoraConfig`` of a model whose root has ``config.model_type`` of an MoE
    family it converts from transformers v4 (DeepSeek-V2, Ernie-4.5-MoE, Mixtral, ...): our anchored regex of exact
    names becomes their last parts (``{'0', '1', 'q_proj', ...}``) and ``target_parameters``, so ``'0'`` matched the
    dense first decoder layer ``model.layers.0``: "Target module DeepseekV2DecoderLayer(...) is not supported" (where
    the names do not reach such a module, other layers than those selected would be adapted). The names are resolved
    here already, so the root's config is hidden for the injection, as in a Trainer (the root is the LightningModule).
    """
    config = model.__dict__.get("config")
    if config is None or not hasattr(config, "model_type"):
        yield
        return
    del model.__dict__["config"]
    try:
        yield
    finally:
        model.__dict__["config"] = config


def mark_quantized(model: nn.Module, kinds: Iterable[str]) -> None:
    """Tell peft that ``model`` holds bitsandbytes layers (``kinds``: ``"4bit"``, ``"8bit"``).

    peft picks its bitsandbytes-aware LoRA layers (which can merge) only when the model it is given carries
    transformers' ``is_loaded_in_4bit`` / ``is_loaded_in_8bit`` flags; otherwise it wraps the quantized layer
    in the generic LoRA ``Linear`` and merging fails. The flags are plain attributes (``nn.Module`` keeps a bool in
    its ``__dict__``), the ones transformers sets on a model it loaded quantized.
    """
    for kind in kinds:
        setattr(model, f"is_loaded_in_{kind}", True)


def keep_input_dtype(layer: nn.Module) -> None:
    """Stop one peft LoRA layer from casting its input to the adapter's dtype before ``lora_A``.

    peft's ``LoraLayer._cast_input_dtype`` reads the layer attribute ``cast_input_dtype_enabled`` (what
    ``peft.helpers.disable_input_dtype_casting`` sets for the duration of a context; no per-layer public switch).
    """
    setattr(layer, "cast_input_dtype_enabled", False)  # a plain bool attribute (nn.Module keeps it in __dict__)


def cast_input(layer: nn.Module, x: Tensor, dtype: torch.dtype) -> Tensor:
    """peft's ``LoraLayer._cast_input_dtype``: ``x`` as its forward casts it for ``lora_A`` (it honours
    :func:`keep_input_dtype`). :class:`~lightning_hbm.adapters.lora.forward.LoRAForward` reproduces peft's forward."""
    return layer._cast_input_dtype(x, dtype)  # type: ignore[operator]  # a method of peft's LoraLayer


def is_4bit_lora(layer: nn.Module) -> bool:
    """Whether ``layer`` is peft's bitsandbytes 4-bit LoRA layer (``peft.tuners.lora.bnb.Linear4bit``)."""
    from peft.tuners.lora import bnb as lora_bnb

    cls = getattr(lora_bnb, "Linear4bit", None)  # defined only where bitsandbytes imports
    return cls is not None and type(layer) is cls


def is_plain_lora_linear(layer: nn.Module) -> bool:
    """Whether ``layer`` is exactly peft's plain LoRA ``Linear`` or its 4-bit one: the two forwards
    :class:`~lightning_hbm.adapters.lora.forward.LoRAForward` reproduces (``tests/_compat/test_peft.py`` compares them
    with the installed peft's to the bit)."""
    from peft.tuners.lora.layer import Linear

    return type(layer) is Linear or is_4bit_lora(layer)
