"""In a block's recompute, the adapter term before the base layer's output, for the block's last adapted layer.

Why: under full recompute, torch's checkpoint stops recomputing a block once every tensor its forward saved has been
saved again (``early_stop``). peft computes ``base(x)`` first and then the adapter, whose ``lora_A`` and ``lora_B``
save their inputs. So in the block's last adapted layer (a Llama's ``mlp.down_proj``) the recompute still runs the
base matmul, with its 4-bit dequantize, and drops the result: no backward needs a base output (the base is frozen).
With the adapter term computed first in the recompute, the recompute ends before it: one base matmul less per block
and step.

Only in the recompute (:func:`recomputing`, set by ``ActivationCheckpointing`` around it; the layer's forward is
:class:`~lightning_hbm.adapters.lora.forward.LoRAForward`): the forward keeps its order, so its graph, its peak and the
order autograd adds gradients in are unchanged, and the recompute only re-creates
the same saved tensors, in the same order, with the same values. That holds because the base layer saves nothing for
backward (checked by running it once, :func:`adapter_first`: bitsandbytes' 4-bit matmul keeps its weight outside
autograd's saved tensors; a dense ``F.linear`` saves its weight, so there the recompute could not stop before it
anyway and the layer is left alone). Same training to the bit (``tests/adapters/lora/test_lora_order.py``).

Only peft's plain LoRA ``Linear`` and its bitsandbytes ``Linear4bit`` with one plain adapter; anything else (DoRA and
the other variants, several adapters, merged or disabled adapters, extra arguments) runs peft's own forward.
"""

from __future__ import annotations

import functools
from typing import Any, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.adapters.lora.base import _PEFT_AVAILABLE, adapted_layers
from lightning_hbm.adapters.lora.forward import LoRAForward, lora_forward, recomputing


def adapter_first(layer: nn.Module) -> bool:
    """Mark ``layer`` to compute its adapter term first in a recompute (:class:`LoRAForward`, given to it if it has none:
    peft's forward otherwise); False (nothing changed) if it is not a layer :class:`LoRAForward` reproduces, has
    another instance ``forward``, or its base layer saves a tensor for backward (run once on one row of zeros). True
    again for a layer marked already (a later Trainer's callback on the same model)."""
    if is_adapter_first(layer):
        return True
    current = torch_compat.forward_override(layer)
    if not peft_compat.is_plain_lora_linear(layer) or not (current is None or isinstance(current, LoRAForward)):
        return False
    if _saves_for_backward(cast(Any, layer).base_layer):
        return False
    forward = lora_forward(layer, fuse=False)  # a layer LoRA did not adapt keeps peft's forward outside a recompute
    assert forward is not None  # a plain layer with no other override, checked above
    forward.first = True
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
    forward = torch_compat.forward_override(layer)
    return isinstance(forward, LoRAForward) and forward.first


def _sharded(weight: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(weight, DTensor)


class LastAdapted:
    """The last peft LoRA layer each block calls in its forward, found by running one training step's forward.

    Forward pre-hooks on the blocks' LoRA layers, from construction to :meth:`stop` (call it before the backward: a
    recompute may stop early and so is not the forward's order). :meth:`apply` gives those layers
    :class:`LoRAForward` marked ``first``.
    """

    def __init__(self, model: nn.Module, blocks: list[str]) -> None:
        self.last: dict[str, str] = {}  # block name -> the last LoRA layer it called
        self._handles: list[RemovableHandle] = []
        if not _PEFT_AVAILABLE:
            return
        for block_name in blocks:
            for name, layer in adapted_layers(model.get_submodule(block_name)).items():
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
        """Mark each block's last LoRA layer to compute its adapter term first; the names of those marked."""
        self.stop()
        return [name for name in self.last.values() if adapter_first(model.get_submodule(name))]


__all__ = ["LastAdapted", "adapter_first", "is_adapter_first", "recomputing"]
