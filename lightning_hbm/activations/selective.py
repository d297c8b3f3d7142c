"""What ``ActivationCheckpointing("selective")`` keeps for backward: the outputs of the expensive matmuls.

torch's selective checkpointing asks a policy, for every operator the block's forward runs, whether to keep its
output or recompute it in backward. Kept here: attention kernels, and matmuls that contract at least
:data:`MIN_SAVED_CONTRACTION` features. That includes the quantized layers' own matmul operators
(``QuantFormat.matmul_ops``, e.g. bitsandbytes' ``gemm_4bit``), which are not aten's ``mm``.

Why both rules, measured: with an operator list of aten's matmuls alone, a 4-bit base's matmuls (one
``bitsandbytes::gemm_4bit`` each) were recomputed, so "selective" cost as much time as "full". And a LoRA adapter's
``lora_B`` product, rank ``r`` into ``out_features``, was kept: as many bytes as the base layer's output, for a
product that costs ``2 * r`` flops per element to recompute.
"""

from __future__ import annotations

from collections.abc import Iterable
from copy import deepcopy
from typing import Any, Optional

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import CheckpointPolicy

from lightning_hbm.activations.attention import blocked as _registers_the_op  # noqa: F401 - torch.ops.lightning_hbm below
from lightning_hbm.precision.registry import format_of

_aten = torch.ops.aten
# aten's matmuls -> the position of the left operand (its last dimension is the contracted one)
MATMULS: dict[Any, int] = {
    _aten.mm.default: 0,
    _aten.addmm.default: 1,
    _aten.bmm.default: 0,
    _aten.baddbmm.default: 1,
    _aten._scaled_mm.default: 0,
    _aten._int_mm.default: 0,
}
ATTENTION: frozenset[Any] = frozenset({
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.lightning_hbm.blocked_attention.default,  # lightning_hbm's own (AttentionKernel "blocked"/"auto")
})
# A matmul contracting fewer features (a LoRA adapter's rank-r product) is recomputed: 2 * 64 flops per output
# element is about what an attention score product over head dimension 64 costs, which is kept.
MIN_SAVED_CONTRACTION = 64


def _resolve(name: str) -> Any:
    """``"namespace::op"`` -> its default overload, or None while its library is not loaded."""
    namespace, _, op = name.partition("::")
    try:
        return getattr(getattr(torch.ops, namespace), op).default
    except (AttributeError, RuntimeError):
        return None


def format_matmuls(module: nn.Module) -> set[str]:
    """The matmul operators (``QuantFormat.matmul_ops``) of the quantized formats found in ``module``."""
    return {op for m in module.modules() for fmt in [format_of(m)] if fmt is not None for op in fmt.matmul_ops}


class SelectivePolicy:
    """The policy passed to ``torch.utils.checkpoint.create_selective_checkpoint_contexts``.

    Args:
        extra_matmuls: ``"namespace::op"`` names of further matmul operators (the quantized formats'
            ``matmul_ops``); their first argument is the input. Kept as names so that the policy pickles.
    """

    def __init__(self, extra_matmuls: Iterable[str] = ()) -> None:
        self.extra_matmuls = tuple(sorted(set(extra_matmuls)))
        #: matmul operator -> the position of its left operand (aten's and the loaded ``extra_matmuls``)
        self.ops = self._lookup()

    def _lookup(self) -> dict[Any, int]:
        ops = dict(MATMULS)
        ops.update({op: 0 for op in map(_resolve, self.extra_matmuls) if op is not None})
        return ops

    def __getstate__(self) -> dict[str, Any]:
        return {"extra_matmuls": self.extra_matmuls}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.extra_matmuls = state["extra_matmuls"]
        self.ops = self._lookup()

    def __call__(self, ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if func in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        index = self.ops.get(func)
        tensor = args[index] if index is not None and index < len(args) else None
        if isinstance(tensor, torch.Tensor) and tensor.shape[-1] >= MIN_SAVED_CONTRACTION:
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE


class _Operators(TorchDispatchMode):
    """Records the operators a forward runs."""

    def __init__(self) -> None:
        super().__init__()
        self.ran: set[Any] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        self.ran.add(func)
        return func(*args, **(kwargs or {}))


def _operators_of(layer: nn.Module, in_features: int, dtype: torch.dtype) -> Optional[set[Any]]:
    """The operators ``layer``'s forward runs on one fake row; None if it fails.

    It runs on a copy: a forward may change its layer (bitsandbytes' ``Linear8bitLt`` casts its bias to the input's
    dtype with ``bias.data = ...``, which under the fake mode left the real layer a fake bias).
    """
    recorder = _Operators()
    try:
        copy = deepcopy(layer)
        with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True) as mode, recorder:
            copy(mode.from_tensor(torch.zeros(1, in_features, dtype=dtype)))
    except Exception:  # noqa: BLE001 - a layer that needs another input shape: the check cannot tell, so it says nothing
        return None
    return recorder.ran


def unkept_formats(blocks: Iterable[nn.Module], policy: SelectivePolicy) -> dict[str, tuple[str, list[str]]]:
    """Quantized formats in ``blocks`` whose layers run no matmul operator ``policy`` keeps.

    Decided by running one layer of each format on a fake input: a format whose matmul is its own operator, not
    declared in ``QuantFormat.matmul_ops``, would have every matmul recomputed in backward, as ``"full"`` does.

    Returns:
        {layer class name: (one such layer's name in its block, the non-aten operators it ran)}.
    """
    found: dict[str, tuple[str, list[str]]] = {}
    checked: set[str] = set()
    for block in blocks:
        for name, layer in block.named_modules():
            fmt = format_of(layer)
            if fmt is None or fmt.name in checked:
                continue
            checked.add(fmt.name)
            floats = [t.dtype for t in (*layer.parameters(), *layer.buffers()) if t.is_floating_point()]
            dtype = fmt.compute_dtype(layer) or (floats[0] if floats else torch.float32)  # what the plugin feeds it
            ran = _operators_of(layer, fmt.weight_shape(layer)[-1], dtype)
            if ran is not None and not any(op in policy.ops for op in ran):
                own = sorted(str(op) for op in ran if op.namespace not in ("aten", "prims", "prim"))
                found[type(layer).__qualname__] = (name, own)
    return found
