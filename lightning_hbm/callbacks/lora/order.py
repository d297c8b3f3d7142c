"""In a block's recompute, the adapter term before the base layer's output, for the block's last adapted layer.

Why: under full recompute, torch's checkpoint stops recomputing a block once every tensor its forward saved has been
saved again (``early_stop``). peft computes ``base(x)`` first and then the adapter, whose ``lora_A`` and ``lora_B``
save their inputs. So in the block's last adapted layer (a Llama's ``mlp.down_proj``) the recompute still runs the
base matmul, with its 4-bit dequantize, and drops the result: no backward needs a base output (the base is frozen).
With the adapter term computed first in the recompute, the recompute ends before it: one base matmul less per block
and step.

Only in the recompute (:func:`recomputing`, set by ``ActivationCheckpointing`` around it): the forward keeps peft's
order, so its graph, its peak and the order autograd adds gradients in are peft's, and the recompute only re-creates
the same saved tensors, in the same order, with the same values. That holds because the base layer saves nothing for
backward (checked by running it once, :func:`adapter_first`: bitsandbytes' 4-bit matmul keeps its weight outside
autograd's saved tensors; a dense ``F.linear`` saves its weight, so there the recompute could not stop before it
anyway and the layer is left alone). Same training to the bit (``tests/callbacks/test_lora_order.py``).

Only peft's plain LoRA ``Linear`` and its bitsandbytes ``Linear4bit`` with one plain adapter; anything else (DoRA and
the other variants, several adapters, merged or disabled adapters, extra arguments) runs peft's own forward.
"""

from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from typing import Any, Iterator, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.callbacks.lora.base import _PEFT_AVAILABLE, _lora_layer_cls


_RECOMPUTING: ContextVar[bool] = ContextVar("lightning_hbm_recomputing", default=False)


@contextlib.contextmanager
def recomputing(active: bool = True) -> Iterator[None]:
    """Mark the code inside as a checkpointed block's recompute (``ActivationCheckpointing`` enters it there)."""
    token = _RECOMPUTING.set(active)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class AdapterFirst:
    """The ``forward`` of one peft LoRA layer: peft's own, but in a recompute the adapter term first, then the base
    layer's output, then their sum (the same values)."""

    def __init__(self, layer: nn.Module) -> None:
        self.layer: Any = layer  # a peft LoraLayer (peft's classes are looked up at run time)

    def __call__(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        layer = self.layer
        if not _RECOMPUTING.get():  # the forward (every step's hot path): peft's own, nothing else looked at
            return type(layer).forward(layer, x, *args, **kwargs)
        names = [a for a in layer.active_adapters if a in layer.lora_A]
        plain = not (args or kwargs or layer.disable_adapters or layer.merged) and len(names) == 1
        if not plain or names[0] in layer.lora_variant:
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
    """Give ``layer`` :class:`AdapterFirst`; False (nothing changed) if it is not a layer it reproduces, already has
    another instance ``forward``, or its base layer saves a tensor for backward (run once on one row of zeros).
    True again for a layer that has it already (a later Trainer's callback on the same model)."""
    if is_adapter_first(layer):
        return True
    if not peft_compat.is_plain_lora_linear(layer) or torch_compat.forward_override(layer) is not None:
        return False
    if _saves_for_backward(cast(Any, layer).base_layer):
        return False
    torch_compat.override_forward(layer, AdapterFirst(layer))
    return True


def _saves_for_backward(base: Any) -> bool:
    """Whether the Linear-like ``base`` saves any tensor for backward on one row of zeros (in its compute dtype: a
    bitsandbytes layer's ``compute_dtype``, else its weight's), run once under saved-tensor hooks."""
    saved: list[int] = []
    weight = base.weight
    if _sharded(weight):  # FSDP2 gathers it in the block's forward only: not run here, so treated as saving
        return True
    dtype = getattr(base, "compute_dtype", None) or (weight.dtype if weight.is_floating_point() else torch.float32)
    row = torch.zeros(1, base.in_features, dtype=dtype, device=weight.device, requires_grad=True)

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.numel())
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        base(row * 1)  # a non-leaf input, as inside a model
    return bool(saved)


def is_adapter_first(layer: nn.Module) -> bool:
    return isinstance(torch_compat.forward_override(layer), AdapterFirst)


def _sharded(weight: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


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
