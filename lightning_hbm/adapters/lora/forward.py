"""The forward of a plain peft LoRA layer: the adapter term added inside one ``addmm``, and in a recompute first.

Why by hand: peft computes ``result = base(x)`` (its 4-bit layer then clones ``result``), ``lora_B(lora_A(x))``,
multiplies that by ``scaling`` and adds it: three passes over the layer's output besides the two matmuls, and their
backward passes. On the real SmolLM2-135M in bf16 those passes were ~8 % of a QLoRA step with full recompute
(benchmarks/README.md). Here the sum is ``torch.addmm(base(x), a, B.T, alpha=scaling)``: one op that reads the base
output, adds ``scaling * a @ B.T`` and writes once. It saves the same tensors for backward as peft's layer (``lora_A``'s
input and weight, ``a`` and ``lora_B``'s weight), so memory is unchanged; the sum is rounded once instead of three times,
so in bf16 it is not peft's to the bit (``tests/adapters/lora/test_lora_forward.py`` compares it to peft's within that
rounding, and to an fp64 reference; in fp32 the real SmolLM2 fine-tune still gave the Hugging Face recipe's floats).

Only where it adds up to the same function: one plain adapter (no DoRA or other variant), not merged or disabled, no
extra arguments, no autocast, a ``lora_B`` that is a bias-free ``nn.Linear`` with no hooks (hooks that only observe,
:func:`lightning_hbm.running.observing`, aside: the profiler's detailed step hooks every submodule, and must measure the
path an unwatched step runs), and input, adapter compute and base output in one dtype (``lora_B``'s fp32 weight is cast
to a bf16 input's dtype, as :class:`~lightning_hbm.adapters.lora.compute.Bf16ComputeLinear` computes it). Anything else
runs peft's sum.

In a checkpointed block's recompute (:func:`recomputing`, entered by ``ActivationCheckpointing``) a layer marked
``first`` (the block's last adapted layer, :mod:`~lightning_hbm.adapters.lora.order`) computes its adapter term before
its base layer: the term's saved tensors are then the block's last ones, torch's checkpoint stops there (early stop), and
the base matmul is not run again. Should the recompute go on (layers after it save tensors: JetMoE's attention and
experts after its ``kv_proj``), the base output and the sum follow with the same values, requiring grad as in the forward.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_hbm._compat import peft as peft_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.adapters.lora.compute import Bf16ComputeLinear
from lightning_hbm.running import changing_hooks

_RECOMPUTING: ContextVar[bool] = ContextVar("lightning_hbm_recomputing", default=False)


@contextlib.contextmanager
def recomputing(active: bool = True) -> Iterator[None]:
    """Mark the code inside as a checkpointed block's recompute (``ActivationCheckpointing`` enters it there)."""
    token = _RECOMPUTING.set(active)
    try:
        yield
    finally:
        _RECOMPUTING.reset(token)


class LoRAForward:
    """The ``forward`` of one peft LoRA ``Linear`` (plain or bitsandbytes 4-bit).

    Args:
        layer: the peft layer.
        fuse: add the adapter term inside one ``addmm`` where that is the same function (module docstring); False:
            peft's own forward, except in a recompute of a ``first`` layer.
    """

    def __init__(self, layer: nn.Module, fuse: bool) -> None:
        self.layer: Any = layer  # a peft LoraLayer (peft's classes are looked up at run time)
        self.fuse = fuse
        self.four_bit = peft_compat.is_4bit_lora(layer)  # its class: fixed for the layer's life
        #: compute the adapter term before the base layer in a recompute (set by ``order.adapter_first``)
        self.first = False
        self._fused_last = False  # whether the last forward outside a recompute fused: its recompute does the same

    def __call__(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        layer = self.layer
        recompute = self.first and _RECOMPUTING.get()
        if not recompute:
            self._fused_last = False  # until this forward fuses: a recompute must save what this forward saved
            if not self.fuse:  # peft's forward, nothing else looked at
                return type(layer).forward(layer, x, *args, **kwargs)
        name = _one_plain_adapter(layer) if not (args or kwargs) else None
        if name is None:
            return type(layer).forward(layer, x, *args, **kwargs)
        lora_a, lora_b, scaling = layer.lora_A[name], layer.lora_B[name], layer.scaling[name]
        four_bit = self.four_bit
        # peft's bitsandbytes layers cast the input (and the term back) only outside autocast; its plain Linear always
        convert = not four_bit or not torch.is_autocast_enabled()
        term_input = peft_compat.cast_input(layer, x, lora_a.weight.dtype) if convert else x
        if recompute:  # the term first: its saved tensors are then the block's last ones
            a = lora_a(layer.lora_dropout[name](term_input))
            weight = _fused_weight(lora_b, a, a.dtype) if self._fused_last else None  # as this step's forward
            if weight is None:
                term = lora_b(a) * scaling
                return _peft_sum(layer.base_layer(x), term, four_bit, convert)
            a2, wt = a.reshape(-1, a.shape[-1]), weight.t()
            term = torch.addmm(a2.new_zeros(()), a2, wt, alpha=scaling)  # saves what the forward's addmm saved
            result = layer.base_layer(x)  # reached only if the recompute goes on: the forward's values, nothing saved
            fused = torch.addmm(result.reshape(-1, result.shape[-1]), a2.detach(), wt.detach(), alpha=scaling)
            # and requiring grad as the forward's output did (term - term.detach() is exactly 0; neither op saves):
            # what the block computes after this layer saves its tensors again (transformers JetMoE: kv_proj is the
            # last adapted layer, its attention and experts follow; was "a different number of tensors was saved")
            return (fused + (term - term.detach())).view(result.shape)
        result = layer.base_layer(x)  # peft's order: the base layer first
        a = lora_a(layer.lora_dropout[name](term_input))
        weight = None if torch.is_autocast_enabled() else _fused_weight(lora_b, a, result.dtype)
        if weight is None:
            return _peft_sum(result, lora_b(a) * scaling, four_bit, convert)
        self._fused_last = True
        return torch.addmm(result.reshape(-1, result.shape[-1]), a.reshape(-1, a.shape[-1]), weight.t(),
                           alpha=scaling).view(result.shape)


def _peft_sum(result: Tensor, term: Tensor, four_bit: bool, convert: bool) -> Tensor:
    """peft's sum of the base output and the adapter term."""
    if four_bit:
        # peft clones the 4-bit output ("defensively", bitsandbytes' advice) and casts the term to its dtype
        return result.clone() + (term.to(result.dtype) if convert else term)
    return (result + term).to(result.dtype)


def _one_plain_adapter(layer: Any) -> Optional[str]:
    """The name of ``layer``'s one active plain adapter; None where peft's forward does something else."""
    if layer.disable_adapters or layer.merged:
        return None
    names = [a for a in layer.active_adapters if a in layer.lora_A]
    return names[0] if len(names) == 1 and names[0] not in layer.lora_variant else None


def _fused_weight(lora_b: nn.Module, a: Tensor, out_dtype: torch.dtype) -> Optional[Tensor]:
    """``lora_B``'s weight as its forward would multiply ``a`` by it, or None where an ``addmm`` into an ``out_dtype``
    output would not be that forward and peft's sum."""
    # hooks that only observe (the profiler's) are not called on a fused lora_B: it must not change the path it measures
    if type(lora_b) is not nn.Linear or lora_b.bias is not None or changing_hooks(lora_b):
        return None
    override = torch_compat.forward_override(lora_b)
    if override is not None and not isinstance(override, Bf16ComputeLinear):
        return None
    # Bf16ComputeLinear casts an fp32 weight to a bf16 input (or the input to the weight: then the dtypes differ below)
    weight = override.operands(a)[1] if override is not None else lora_b.weight
    return weight if weight.dtype == a.dtype == out_dtype else None


def lora_forward(layer: nn.Module, fuse: bool = True) -> Optional[LoRAForward]:
    """Give a plain peft LoRA ``Linear`` (or its 4-bit one) :class:`LoRAForward`, or return the one it has; None
    (nothing changed) for other layers and for a layer with another instance ``forward``."""
    current = torch_compat.forward_override(layer)
    if isinstance(current, LoRAForward):
        return current
    if current is not None or not peft_compat.is_plain_lora_linear(layer):
        return None
    forward = LoRAForward(layer, fuse)
    torch_compat.override_forward(layer, forward)
    return forward


__all__ = ["LoRAForward", "lora_forward", "recomputing"]
