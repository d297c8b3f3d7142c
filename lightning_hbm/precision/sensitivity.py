"""Sensitivity-aware mixed precision: which Linear layers to keep in a wider mode under a byte budget.

What it shrinks: the **parameters** term, at a chosen quality. Quantizing every Linear the same
way gives exactly the quality of plain bitsandbytes; on pretrained models a few layers carry most
of the error. This module measures, on a probe batch, what each layer's quantization costs at the
model's *output* (the metric :class:`~lightning_hbm.QuantizationQuality` logs: mean cosine
similarity of output rows), then chooses per layer between the base mode (e.g. ``nf4-dq``) and a
wider ``sensitive_mode`` (``int8`` by default, or ``"none"``: the compute dtype) so as to meet a
byte budget (``max_bytes_per_param``) and/or a quality target (``min_cosine``).

How it chooses (better than ranking layers by the error each causes alone):

1. sensitivity: one forward of the probe batch per layer, with only that layer in the base mode
   (the end-to-end error it causes alone; weight SQNR or per-layer output error misses how much
   of it reaches the output);
2. the candidates are ranked by error removed *per extra byte* (a 384x1536 feed-forward matrix
   costs four times the bytes of a 384x384 attention matrix), and the best few are re-measured on
   the current plan before each choice (errors of several layers do not simply add up);
3. under a byte budget, the plain ranking by error alone (the top layers that fit) is measured too
   and kept if it is better on the probe: neither ranking wins on every model.

The plan is a ``{layer name: mode name}`` map; :func:`predict_parameter_bytes` turns it into the
exact parameter bytes of the quantized model (what :func:`lightning_hbm.memory.parameter_bytes`
measures afterwards), for a planner to call before any quantization.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Optional

import torch
from torch import nn

from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.registry import get_mode, to_dtype

#: ``sensitive_mode`` (and plan entry) that keeps a layer unquantized in the compute dtype, frozen.
UNQUANTIZED = "none"


@lru_cache(maxsize=256)
def weight_bytes(mode: str, in_features: int, out_features: int, dtype: torch.dtype) -> int:
    """Exact bytes of one frozen ``Linear(in_features, out_features)`` weight stored in ``mode``.

    Quantization constants are included, the bias is not. Measured by quantizing a zero weight of
    that shape once on CPU (storage sizes depend on the shape only), so it is exact for every mode,
    registered ones included.
    """
    if mode == UNQUANTIZED:
        return in_features * out_features * dtype.itemsize
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(torch.zeros(out_features, in_features), requires_grad=False)
    return parameter_bytes(get_mode(mode).replace(linear, dtype, torch.device("cpu")))


def predict_parameter_bytes(module: nn.Module, plan: Mapping[str, str], dtype: Any = "bfloat16") -> int:
    """Parameter bytes of ``module`` once quantized with ``plan``, computed on the unquantized model.

    Every planned Linear weight takes :func:`weight_bytes` of its mode; every other floating
    parameter (biases, embeddings, norms) is cast to ``dtype``, as ``QuantizedPrecision`` does.
    """
    dtype = to_dtype(dtype)
    planned = {id(module.get_submodule(name).weight) for name in plan}
    total = 0
    for param in module.parameters():  # deduplicated: a tied weight is counted once
        if id(param) not in planned:
            total += param.numel() * (dtype.itemsize if param.is_floating_point() else param.element_size())
    for name, mode in plan.items():
        layer = module.get_submodule(name)
        # transformers' Conv1D (GPT-2) has no in/out_features: its weight is stored transposed, [nx, nf]
        features = (layer.nx, layer.nf) if hasattr(layer, "nf") else (layer.in_features, layer.out_features)
        total += weight_bytes(mode, *features, dtype)
    return total


@dataclass
class SensitivityPlan:
    """The chosen per-layer plan and what was measured to choose it (probe-batch figures)."""

    modes: dict[str, str]
    #: output cosine with every layer in the base mode ("before") and with the plan ("after")
    uniform_cosine: float
    cosine: float
    #: bytes of the quantizable weights per quantizable parameter: uniform base mode, and the plan
    uniform_bytes_per_param: float
    bytes_per_param: float
    #: ``name -> 1 - cosine`` with only that layer quantized in the base mode (its sensitivity)
    solo_error: dict[str, float] = field(default_factory=dict)

    def summary(self, base: str, sensitive: str) -> str:
        kept = [name for name, mode in self.modes.items() if mode == sensitive]
        return (
            f"{len(kept)} of {len(self.modes)} Linear layers in {sensitive}, the rest in {base}: "
            f"{self.bytes_per_param:.4f} B/param (uniform {base}: {self.uniform_bytes_per_param:.4f}); probe output "
            f"cosine {self.uniform_cosine:.5f} -> {self.cosine:.5f}. Kept: {kept}"
        )


class _SameDtype(nn.Module):
    """A quantized layer inside the model as built (e.g. fp32) that computes in the plan's dtype (e.g. bf16)."""

    def __init__(self, layer: nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.layer, self.dtype = layer, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the layer sees the compute dtype, as under QuantizedPrecision; the model as built gets its dtype back
        return self.layer(x.to(self.dtype)).to(x.dtype)


class _Swapper:
    """Puts quantized copies of chosen layers into the model for one probe forward, then the originals back."""

    def __init__(self, module: nn.Module, layers: dict[str, nn.Linear], dtype: torch.dtype) -> None:
        self.module, self.layers, self.dtype = module, layers, dtype
        self._variants: dict[tuple[str, str], nn.Module] = {}

    def variant(self, name: str, mode: str) -> nn.Module:
        if mode == UNQUANTIZED:
            return self.layers[name]  # the probe runs the model as built: unquantized is the reference
        key = (name, mode)
        if key not in self._variants:
            linear = self.layers[name]
            # a copy holding a clone of the bias: bitsandbytes casts its layer's bias in place at the first
            # forward, and the mode's replace() shares the bias with the model's own Linear
            source = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
            source.weight = linear.weight
            if linear.bias is not None:
                source.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
            self._variants[key] = _SameDtype(get_mode(mode).replace(source, self.dtype, None), self.dtype)
        return self._variants[key]

    def _put(self, name: str, layer: nn.Module) -> None:
        parent_name, _, child = name.rpartition(".")
        setattr(self.module.get_submodule(parent_name) if parent_name else self.module, child, layer)

    def output(self, plan: Mapping[str, str], probe: Any) -> torch.Tensor:
        from lightning_hbm.callbacks.quality import probe_output

        try:
            for name, mode in plan.items():
                self._put(name, self.variant(name, mode))
            return probe_output(self.module, probe).float()
        finally:
            for name in plan:
                self._put(name, self.layers[name])


def _check_budget(
    max_bytes_per_param: Optional[float], uniform: float, widest: float, base: str, sensitive: str
) -> None:
    if max_bytes_per_param is not None and max_bytes_per_param < uniform:
        raise ValueError(
            f"max_bytes_per_param={max_bytes_per_param} cannot be met: storing every quantizable Linear in {base!r} "
            f"already takes {uniform:.4f} bytes per parameter, the least reachable with this mode (every layer in "
            f"{sensitive!r}: {widest:.4f}). Raise max_bytes_per_param to at least {uniform:.4f}, or pick a smaller mode."
        )


def greedy_plan(
    solo: Mapping[str, float], cost: Mapping[str, Mapping[str, int]], base: str, sensitive: str, budget: float
) -> tuple[dict[str, str], int]:
    """The baseline: the layers with the largest error alone in ``sensitive`` while ``budget`` bytes allow."""
    plan, used = {n: base for n in solo}, sum(c[base] for c in cost.values())
    for name in sorted(solo, key=lambda n: (-solo[n], n)):
        extra = cost[name][sensitive] - cost[name][base]
        if used + extra > budget:
            break
        plan[name], used = sensitive, used + extra
    return plan, used


def choose_plan(
    module: nn.Module,
    names: Sequence[str],
    base: str,
    sensitive: str,
    dtype: Any,
    probe: Any,
    max_bytes_per_param: Optional[float] = None,
    min_cosine: Optional[float] = None,
    remeasure: int = 3,
) -> SensitivityPlan:
    """Choose ``base`` or ``sensitive`` for each Linear in ``names`` of ``module`` (changed back afterwards).

    With ``max_bytes_per_param`` alone the budget is filled; with ``min_cosine`` the choice stops as
    soon as the probe output cosine reaches it. A budget that cannot be met raises a ``ValueError``
    naming the best reachable figure, before anything changes. Deterministic for a fixed probe batch.
    """
    from lightning_hbm.callbacks.quality import compare_outputs, eval_no_grad

    dtype = to_dtype(dtype)
    layers = {name: module.get_submodule(name) for name in names}
    params = {n: layer.in_features * layer.out_features for n, layer in layers.items()}
    cost = {n: {m: weight_bytes(m, lay.in_features, lay.out_features, dtype) for m in (base, sensitive)} for n, lay in layers.items()}
    total_params = sum(params.values())
    uniform_bytes = sum(c[base] for c in cost.values())
    _check_budget(max_bytes_per_param, uniform_bytes / total_params, sum(c[sensitive] for c in cost.values()) / total_params, base, sensitive)
    budget = math.inf if max_bytes_per_param is None else max_bytes_per_param * total_params
    swapper = _Swapper(module, layers, dtype)
    with eval_no_grad(module):
        reference = swapper.output({}, probe)

        def cosine(plan: Mapping[str, str]) -> float:
            return compare_outputs(swapper.output(plan, probe), reference, lm=False)["quant/cosine_similarity"]

        # The sensitive mode's own error is second order (int8 ~50x below 4-bit on the layers we measured):
        # not measured alone, which halves the cost; the re-measurement below sees it.
        solo = {n: 1 - cosine({n: base}) for n in names}
        plan = {n: base for n in names}
        used, current = uniform_bytes, cosine(plan)
        uniform_cosine, pending = current, sorted(names)
        while pending and (min_cosine is None or current < min_cosine):
            extra = {n: cost[n][sensitive] - cost[n][base] for n in pending}
            affordable = [n for n in pending if used + extra[n] <= budget]
            if not affordable:
                break
            # error removed per extra byte, by the solo measurements; ties by name (deterministic)
            ranked = sorted(affordable, key=lambda n: (-solo[n] / max(extra[n], 1), n))
            # re-measure the best few on the current plan: layer errors interact
            trials = {n: cosine({**plan, n: sensitive}) for n in ranked[:remeasure]}
            best = max(ranked[:remeasure], key=lambda n: (trials[n] - current) / max(extra[n], 1))
            plan[best], used, current = sensitive, used + extra[best], trials[best]
            pending.remove(best)
        if min_cosine is None and max_bytes_per_param is not None:
            # one more forward: the plain ranking by error alone, kept if it measures better on the probe
            # (it did on all-MiniLM-L6-v2 held-out sentences, where a few large layers dominate)
            greedy, greedy_used = greedy_plan(solo, cost, base, sensitive, budget)
            greedy_cosine = cosine(greedy)
            if greedy_cosine > current:
                plan, used, current = greedy, greedy_used, greedy_cosine
    result = SensitivityPlan(
        dict(sorted(plan.items())), uniform_cosine, current, uniform_bytes / total_params, used / total_params, solo
    )
    if min_cosine is not None and current < min_cosine:
        reach = f"within max_bytes_per_param={max_bytes_per_param}" if max_bytes_per_param is not None else f"with every layer in {sensitive!r}"
        wider = "" if sensitive == UNQUANTIZED else ", or use sensitive_mode='none' (the compute dtype for the sensitive layers)"
        raise ValueError(
            f"min_cosine={min_cosine} cannot be met: the best probe output cosine reachable {reach} is {current:.5f} "
            f"at {result.bytes_per_param:.4f} bytes per parameter. Lower min_cosine or raise max_bytes_per_param{wider}."
        )
    return result


def check_plan_args(
    mode: str,
    max_bytes_per_param: Any,
    min_cosine: Any,
    sensitive_mode: Any,
    probe_batch: Any,
    layer_modes: Any,
) -> None:
    """``QuantizedPrecision``'s checks of the mixed-precision arguments, at construction."""
    for name, value in (("max_bytes_per_param", max_bytes_per_param), ("min_cosine", min_cosine)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"QuantizedPrecision({name}={value!r}): pass a finite number, or None for no target.")
    if max_bytes_per_param is not None and max_bytes_per_param <= 0:
        raise ValueError(f"QuantizedPrecision(max_bytes_per_param={max_bytes_per_param}): must be > 0 (bf16 is 2.0).")
    if min_cosine is not None and not -1.0 < min_cosine <= 1.0:
        raise ValueError(f"QuantizedPrecision(min_cosine={min_cosine}): must be in (-1, 1], e.g. 0.99.")
    if sensitive_mode != UNQUANTIZED:
        get_mode(sensitive_mode)  # unknown name: ValueError listing the valid ones
    if sensitive_mode == mode and (max_bytes_per_param is not None or min_cosine is not None):
        raise ValueError(
            f"QuantizedPrecision(mode={mode!r}, sensitive_mode={sensitive_mode!r}): the sensitive layers need a wider "
            "mode than the others, e.g. sensitive_mode='int8' or 'none' (16-bit)."
        )
    if probe_batch is not None and not isinstance(probe_batch, (torch.Tensor, tuple, list, Mapping)):
        raise TypeError(
            f"QuantizedPrecision(probe_batch=...) must be a tensor, an (inputs, targets) tuple/list or a dict of "
            f"tensors, got {type(probe_batch).__name__}. Pass None to use the datamodule's first training batch."
        )
    if layer_modes is not None:
        if max_bytes_per_param is not None or min_cosine is not None:
            raise ValueError(
                "QuantizedPrecision: pass either layer_modes (a fixed plan) or a target (max_bytes_per_param / "
                "min_cosine) to choose one, not both."
            )
        if not isinstance(layer_modes, Mapping):
            raise TypeError(f"layer_modes must be a dict {{layer name: mode name}}, got {type(layer_modes).__name__}.")
        for layer_mode in layer_modes.values():
            if layer_mode != UNQUANTIZED:
                get_mode(layer_mode)
