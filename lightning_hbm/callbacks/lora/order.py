"""The adapter term before the base layer's output, for the last adapted layer of a recomputed block.

Why: under full recompute, torch's checkpoint stops recomputing a block once every tensor its forward saved has been
saved again (``early_stop``). peft computes ``base(x)`` first and then the adapter, whose ``lora_A`` and ``lora_B``
save their inputs. So in the block's last adapted layer (a Llama's ``mlp.down_proj``) the recompute still runs the
base matmul, with its 4-bit dequantize, and drops the result: no backward needs a base output (the base is frozen).
With the adapter term computed first, the recompute ends before it: one base matmul less per block and step.

Same values as peft's forward, to the bit, where the layer's input has no user but the base layer and ``lora_A``
(``tests/callbacks/lora/test_order.py``): floating-point addition is commutative, so ``base + adapter`` is
``adapter + base``, and so is the sum of the input's two gradients in whichever order autograd adds them. With a
third user of the input, autograd may add the three gradients in another order (a last-bit difference, not an error).

Only peft's plain LoRA ``Linear`` and its bitsandbytes ``Linear4bit`` with one plain adapter; anything else (DoRA and
the other variants, several adapters, merged or disabled adapters, extra arguments) runs peft's own forward.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.callbacks.lora.base import _PEFT_AVAILABLE, _lora_layer_cls


class AdapterFirst:
    """The ``forward`` of one peft LoRA layer: the adapter term, then the base layer's output, then their sum."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer: Any = layer  # a peft LoraLayer (peft's classes are looked up at run time)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = self.layer
        names = [a for a in layer.active_adapters if a in layer.lora_A]
        if args or kwargs or layer.disable_adapters or layer.merged or len(names) != 1 or names[0] in layer.lora_variant:
            return type(layer).forward(layer, x, *args, **kwargs)  # peft's own forward
        name = names[0]
        four_bit = peft_compat.is_4bit_lora(layer)
        # peft's bitsandbytes layers cast the input (and the term back) only outside autocast; its plain Linear always
        convert = not four_bit or not torch.is_autocast_enabled()
        lora_input = peft_compat.cast_input(layer, x, layer.lora_A[name].weight.dtype) if convert else x
        term = layer.lora_B[name](layer.lora_A[name](layer.lora_dropout[name](lora_input))) * layer.scaling[name]
        result = layer.base_layer(x)
        if four_bit:
            # peft clones the 4-bit output ("defensively", bitsandbytes' advice) and casts the term to its dtype
            return result.clone() + (term.to(result.dtype) if convert else term)
        return (result + term).to(result.dtype)


def adapter_first(layer: nn.Module) -> bool:
    """Give ``layer`` :class:`AdapterFirst`; False (nothing changed) if it is not a layer it reproduces or already has
    another instance ``forward``."""
    if not peft_compat.is_plain_lora_linear(layer) or torch_compat.forward_override(layer) is not None:
        return False
    torch_compat.override_forward(layer, AdapterFirst(layer))
    return True


def is_adapter_first(layer: nn.Module) -> bool:
    return isinstance(torch_compat.forward_override(layer), AdapterFirst)


class LastAdapted:
    """The last peft LoRA layer each block calls in its forward, found by running one training step's forward.

    Forward pre-hooks on the blocks' LoRA layers, from construction to :meth:`stop` (call it before the backward: a
    recompute may stop early and so is not the forward's order). :meth:`apply` gives those layers
    :class:`AdapterFirst`.
    """

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        self.last: dict[str, str] = {}  # block name -> the last LoRA layer it called
        self._handles: list[RemovableHandle] = []
        if not _PEFT_AVAILABLE:
            return
        lora_cls: Any = _lora_layer_cls()  # Any: an isinstance against it keeps the nn.Module type
        for block_name in blocks:
            layers = [(n, m) for n, m in model.get_submodule(block_name).named_modules() if isinstance(m, lora_cls)]
            for name, layer in layers:
                seen = functools.partial(self._seen, block_name, f"{block_name}.{name}" if name else block_name)
                self._handles.append(layer.register_forward_pre_hook(seen))

    def _seen(self, block: str, layer: str, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # the training forward, not an evaluation inside the step
            self.last[block] = layer

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def apply(self, model: nn.Module) -> list[str]:
        """Give each block's last LoRA layer :class:`AdapterFirst`; the names of those changed."""
        self.stop()
        return [name for name in self.last.values() if adapter_first(model.get_submodule(name))]


__all__ = ["AdapterFirst", "LastAdapted", "adapter_first", "is_adapter_first"]
