"""bitsandbytes' internals that lightning_hbm relies on (bitsandbytes 0.50; ``tests/_compat/test_bitsandbytes.py`` checks each).

bitsandbytes is imported on first use (its import loads native libraries): callers have imported it already.
"""

from __future__ import annotations

from torch import nn


def disable_cpu_repack(layer: nn.Module) -> None:
    """Keep a ``Linear4bit`` off its AVX512-BF16 CPU kernel.

    On CPUs with AVX512-BF16 the first no-grad eval forward repacks the weight for a kernel that bypasses
    autograd; training forwards after it give upstream layers no gradient. The instance flag bitsandbytes
    reads (``support_avx512bf16_for_cpu``) is the only switch. A weight repacked already (a model evaluated before
    lightning_hbm saw it) is unpacked as bitsandbytes' own ``state_dict`` does.
    """
    layer.support_avx512bf16_for_cpu = False
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)


def disable_cpu_repacks(module: nn.Module) -> int:
    """:func:`disable_cpu_repack` on every ``Linear4bit`` in ``module``, whoever made it; returns how many."""
    layers = [m for m in module.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for layer in layers:
        disable_cpu_repack(layer)
    return len(layers)


def ensure_nested_code() -> None:
    """Build double quantization's code book into bitsandbytes' module-wide cache, as its first real call would.

    ``quantize_4bit(compress_statistics=True)`` fills ``bitsandbytes.functional.name2qmap["dynamic"]`` from
    Python floats on first use; under a FakeTensorMode that first use would cache a fake tensor.
    """
    import bitsandbytes.functional as F

    if "dynamic" not in F.name2qmap:
        F.name2qmap["dynamic"] = F.create_dynamic_map()
