"""``int8-dynamic``: frozen INT8 base weights, activations quantized per token at run time.

What it shrinks: the **parameters** term. Each frozen ``nn.Linear`` weight is stored as symmetric
per-output-channel INT8 plus one fp32 scale per output row (1 + 4/in_features bytes per
parameter, half of bf16). Activations get no calibration: every forward quantizes each token
(row) of the input with the scale ``absmax(row) / 127`` of the data actually flowing, multiplies
in integer arithmetic with int32 accumulation and rescales to the input's dtype.

Why written here (small) instead of taken from a library:

* torchao 0.18's ``Int8DynamicActivationInt8WeightConfig`` is inference-only (no backward).
* torchao's ``prototype.quantized_training`` either keeps the weights in high precision and
  quantizes them every step (``Int8MixedPrecisionTraining``: no memory saved) or trains the INT8
  weight itself with float activations (``Int8WeightOnlyQuantizedTraining``); neither is a
  frozen INT8 base with dynamic activation quantization. torchao is also not a core dependency.
* bitsandbytes' ``Linear8bitLt`` (mode ``int8``) is LLM.int8 with outlier decomposition, not
  per-token dynamic quantization.

The integer matmul is ``torch._int_mm`` (int8 x int8 -> int32), on CUDA (cuBLASLt INT8 tensor
cores) and on CPU (torch's CPU kernel, used by the CPU tests, same arithmetic). CUDA's kernel
requires ``in_features`` and ``out_features`` to be multiples of 8 and more than 16 rows: shorter
inputs are zero-padded to 17 rows; layers with other widths compute the same integer products in
fp32 (exact while ``in_features * 127**2 < 2**24``, i.e. in_features < 1040; above, rounding of
fp32 sums), which is stated, not hidden: :func:`uses_integer_kernel` says which path a layer takes.

Backward: the base is frozen, so only the gradient to the input is computed:
``grad_input = grad_output @ (W_int8 * scale)``, the dequantized weight the forward really used,
in the gradient's dtype (in fp32 for float16 gradients, whose range cannot hold ``grad_output * scale``).
The activation rounding is passed straight through (its derivative is zero almost everywhere, which
would stop every gradient): the straight-through estimator. Nothing
of the input is saved for backward (no weight gradient is needed), so the layer keeps no
activation memory of its own.

``int8-dynamic-smooth``: the same layer with SmoothQuant-style per-input-channel smoothing
(:mod:`lightning_hbm.precision.smoothing` measures the factors on a probe batch). Per-token
activation scales are set by the largest channel of each token; a few outlier channels (BERT's
LayerNorm outputs, GELU outputs) then leave the other channels only a few of the 255 levels. Input
channel ``j`` is divided by ``s_j`` and weight column ``j`` multiplied by it before quantization, so
``x @ W.T`` is unchanged in exact arithmetic while the activation range moves into the weights,
whose per-row scales absorb it better. ``s_j`` is a power of two stored as its int8 exponent
``input_shift`` (one byte per input channel, i.e. ``1/out_features`` B per weight): dividing by
a power of two is exact in floating point, so the only change to the arithmetic is the rounding.
The division happens at run time inside the layer rather than folded into a preceding LayerNorm:
folding costs nothing but only exists where a norm (with nothing else reading its output) feeds
the Linear, and LoRA adapters around the layer would then see the smoothed input; the run-time
division works for every Linear, costs one elementwise product of the input, and keeps what the
layer's callers see (LoRA included) exactly the unsmoothed input and its gradient. The factors come from
``QuantizedPrecision("int8-dynamic-smooth")``, which measures them; ``quantize_model(model,
"int8-dynamic-smooth")`` alone stores zero exponents (no smoothing, same bytes) unless they are attached with
:func:`lightning_hbm.precision.smoothing.attached`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union, cast

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import override

from lightning_hbm import record
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.precision.registry import QuantFormat, register_format
from lightning_hbm.probe import Probe

log = logging.getLogger(__name__)

# Smoothing exponents are clamped to +-24: 2**24 ~ 1.7e7 keeps W * s and x / s far inside bf16/fp32 range for any sane
# weight and activation, and factors beyond it only appear for channels that are (almost) always zero.
MAX_SHIFT = 24

_QMAX = 127  # symmetric range [-127, 127]: -128 is never used, so scales are the same both signs
# The smallest normal fp32: an all-zero row gets this scale (stays zero instead of dividing by 0), and any
# non-zero row keeps its own scale (a larger floor, e.g. 1e-12, would quantize rows below ~1e-10 coarsely).
_EPS = torch.finfo(torch.float32).tiny


def quantize_rowwise(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT8 per row: ``(int8 values, fp32 scales)`` with ``tensor ~= values * scales[:, None]``."""
    tensor = tensor.float()
    scale = tensor.abs().amax(dim=1) / _QMAX
    scale = scale.clamp(min=_EPS)
    values = torch.round(tensor / scale[:, None]).clamp_(-_QMAX, _QMAX).to(torch.int8)
    return values, scale


def _int_mm_ok(device: torch.device, in_features: int, out_features: int) -> bool:
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return in_features % 8 == 0 and out_features % 8 == 0
    return False


def _int8_matmul(x_q: torch.Tensor, w_q: torch.Tensor) -> torch.Tensor:
    """``x_q @ w_q.T`` for int8 ``x_q`` (M, K) and ``w_q`` (N, K), as int32 (or exact-ish fp32)."""
    m, k = x_q.shape
    n = w_q.shape[0]
    if not _int_mm_ok(x_q.device, k, n):
        # No integer kernel for this shape/device: the same integer products, summed in fp32.
        return x_q.float() @ w_q.float().t()
    if x_q.device.type == "cuda" and m <= 16:
        # cuBLASLt's INT8 GEMM needs more than 16 rows: pad with zero rows, drop them after.
        x_q = F.pad(x_q, (0, 0, 0, 17 - m))
        return torch_compat.int_mm(x_q, w_q.t())[:m]
    # w_q.t() is a column-major view of the row-major weight: the layout cuBLASLt wants for B.
    return torch_compat.int_mm(x_q, w_q.t())


class _DynamicInt8Matmul(torch.autograd.Function):
    """``x @ dequant(W).T`` with ``x`` quantized per row at run time; gradient to ``x`` only."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, factor: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        shape = x.shape
        x2d = x.reshape(-1, shape[-1])
        if factor is not None:  # smoothing: x / s with s a power of two, exact (the fp32 copy is made anyway)
            x2d = x2d.float() * factor
        x_q, x_scale = quantize_rowwise(x2d)
        out = _int8_matmul(x_q, weight).float()
        # Weight scales first, in place: ``acc * w_scale`` is bounded by 127 * in_features * max|W| (frozen,
        # moderate weights), and only the last factor brings the activations' magnitude. The other order
        # overflows fp32 for activations around 1e36 (acc ~1e6 times x_scale ~1e34) where nn.Linear is finite.
        out.mul_(scale[None, :]).mul_(x_scale[:, None])
        ctx.save_for_backward(weight, scale, factor)  # module storage and a vector: no new memory
        return out.to(x.dtype).reshape(*shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None]:
        weight, scale, factor = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # Straight-through for the activation rounding; the dequantized weight the forward used:
        # grad_out @ (W_q * s[:, None]) == (grad_out * s) @ W_q. Scaling the gradient instead of the
        # weight keeps the transient copy of W_q at the compute dtype's size (int8 values are exact in
        # bf16/fp16/fp32). bf16 and fp32 have fp32's exponent range, so ``grad_out * s`` fits them. fp16 does
        # not: a gradient of 1e-5 times a weight scale of ~5e-4 is below fp16's smallest subnormal (6e-8) and
        # became exactly 0 (every LoRA adapter below got no gradient), so fp16 computes in fp32 and rounds the
        # result once, like nn.Linear's fp32 accumulation.
        compute = torch.float32 if grad_out.dtype == torch.float16 else grad_out.dtype
        scaled = grad_out.to(compute) * scale.to(compute)
        grad = scaled @ weight.to(compute)
        if factor is not None:  # d(x / s)/dx = 1 / s (a power of two: exact)
            grad = grad * factor.to(compute)
        return grad.to(grad_out.dtype), None, None, None


class Int8DynamicLinear(nn.Linear):
    """A frozen ``nn.Linear`` stored as INT8 per output channel, computing with dynamic INT8 activations.

    A subclass of ``nn.Linear`` (``in_features``, ``out_features``, ``weight``, ``bias``) so that peft
    wraps it with its standard LoRA ``Linear`` and Linear-aware tools keep working; ``weight`` is the
    frozen int8 ``Parameter`` and ``weight_scale`` an fp32 buffer (both in the ``state_dict``). The bias
    is the original, trainable ``Parameter``. Build it with :meth:`from_linear`. A smoothed layer
    (``smoothed=True``, mode ``int8-dynamic-smooth``) also holds ``input_shift``, an int8 buffer of
    per-input-channel exponents ``e``: it stores ``W * 2**e`` and divides its input by ``2**e``.
    """

    weight_scale: torch.Tensor
    input_shift: Optional[torch.Tensor]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        device: Optional[Union[str, torch.device]] = None,
        smoothed: bool = False,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, device="meta")
        target = torch.device("cpu") if device is None else torch.device(device)
        self.weight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.int8, device=target), requires_grad=False
        )
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=target))
        self.register_buffer("weight_scale", torch.ones(out_features, dtype=torch.float32, device=target))
        shift = torch.zeros(in_features, dtype=torch.int8, device=target) if smoothed else None
        self.register_buffer("input_shift", shift)  # a None buffer: not in the state_dict

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, device: Optional[torch.device] = None, input_shift: Optional[torch.Tensor] = None
    ) -> Int8DynamicLinear:
        """Quantize ``linear``'s weight (on ``device``, default: where it is); keep its bias Parameter.

        ``input_shift``: int8 exponents ``e`` (one per input channel) of the smoothing factors ``2**e``
        folded into the weight's columns before quantization; ``None``: a plain (unsmoothed) layer.
        """
        if linear.weight.is_meta:
            raise ValueError(
                f"Cannot quantize a Linear({linear.in_features}, {linear.out_features}) whose weight is on the meta "
                "device: load or initialize the weights before quantization (e.g. build them in configure_model)."
            )
        target = linear.weight.device if device is None else torch.device(device)
        layer = cls(linear.in_features, linear.out_features, bias=False, device=target, smoothed=input_shift is not None)
        weight = linear.weight.detach().to(target)
        if input_shift is not None:
            if input_shift.shape != (linear.in_features,) or input_shift.dtype != torch.int8:
                raise ValueError(
                    f"input_shift must be an int8 tensor of shape ({linear.in_features},) (one exponent per input "
                    f"channel), got {input_shift.dtype} of shape {tuple(input_shift.shape)}."
                )
            layer.input_shift = input_shift.to(target)
            weight = weight.float() * torch.exp2(layer.input_shift.float())[None, :]  # W * s: exact (powers of two)
        values, scale = quantize_rowwise(weight)
        layer.weight.data = values
        layer.weight_scale = scale
        if linear.bias is not None:
            layer.bias = linear.bias  # same Parameter: stays trainable (the plugin casts it to the compute dtype)
        return layer

    @override
    def reset_parameters(self) -> None:
        pass  # the weight is quantized from a loaded Linear, never initialized here

    def _input_factor(self) -> Optional[torch.Tensor]:
        # 1 / s = 2**-e, exact in fp32 for the clamped exponents
        return None if self.input_shift is None else torch.exp2(-self.input_shift.float())

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32, ``int8 * scale`` (divided by the smoothing factors of a smoothed layer: the
        weight of the unsmoothed input, e.g. to export or merge LoRA weights in float)."""
        weight = self.weight.float() * self.weight_scale[:, None]
        factor = self._input_factor()
        return weight if factor is None else weight * factor[None, :]

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _DynamicInt8Matmul.apply(x, self.weight, self.weight_scale, self._input_factor())
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @override
    def extra_repr(self) -> str:
        smooth = ", smoothed per input channel" if self.input_shift is not None else ""
        return super().extra_repr() + f", weight=int8 per-channel, activations=int8 per-token (dynamic){smooth}"


def uses_integer_kernel(layer: Int8DynamicLinear, device: Optional[torch.device] = None) -> bool:
    """Whether ``layer`` multiplies with ``torch._int_mm`` on ``device`` (default: where it is)."""
    device = layer.weight.device if device is None else torch.device(device)
    return _int_mm_ok(device, layer.in_features, layer.out_features)


@dataclass(frozen=True)
class Int8DynamicFormat(QuantFormat):
    """:class:`Int8DynamicLinear`: int8 weight, fp32 ``weight_scale`` per row (+ int8 ``input_shift`` when smoothed)."""

    ladder: tuple[str, ...] = ("none",)
    cost: float = 0.5

    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, Int8DynamicLinear)

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        weight = cast(Int8DynamicLinear, module).dequantize()
        return weight if dtype is None else weight.to(dtype)

    def constants(self, module: nn.Module) -> list[torch.Tensor]:
        layer = cast(Int8DynamicLinear, module)
        return [t for t in (layer.weight_scale, layer.input_shift) if t is not None]


def _int8_dynamic(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    # ``dtype`` is not needed here: outputs come back in the input's dtype (the plugin casts inputs,
    # biases and every other parameter to the compute dtype).
    return Int8DynamicLinear.from_linear(linear, device)


def _int8_dynamic_smooth(linear: nn.Linear, dtype: torch.dtype, device: Optional[torch.device]) -> nn.Module:
    # The exponents travel with the weight Parameter (attached to it in lightning_hbm.record while QuantizedPrecision
    # quantizes: the Parameter, unlike its module, reaches replace in every code path, and the sensitivity plan's
    # copies share it). None attached (e.g. the planner's shape-only layers, or
    # weight_bytes): zeros, the same storage.
    shift = record.input_shift(linear.weight)
    if shift is None:
        shift = torch.zeros(linear.in_features, dtype=torch.int8, device=linear.weight.device)
    return Int8DynamicLinear.from_linear(linear, device, input_shift=shift)


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
register_format(Int8DynamicFormat(
    "int8-dynamic", _int8_dynamic, _DTYPES,
    "INT8 per-channel weights + fp32 scales, INT8 per-token activations at run time (int32 matmul)",
))
register_format(Int8DynamicFormat(
    "int8-dynamic-smooth", _int8_dynamic_smooth, _DTYPES,
    "int8-dynamic with SmoothQuant per-input-channel smoothing measured on a probe batch (+1 byte per input channel)",
))


# ------------------------------------------------------------------ the exponents of int8-dynamic-smooth
# (chosen by lightning_hbm.precision.smoothing: the layer's own measures live with the layer, so that the smoothing's
# choice calls here once and hands the values on, instead of going back and forth between its module and this one)


def shifts_for(input_absmax: torch.Tensor, weight: torch.Tensor, alpha: float) -> torch.Tensor:
    """int8 exponents of ``s = max|X_j|**alpha / max|W[:, j]|**(1 - alpha)`` rounded to powers of two."""
    weight_absmax = weight.detach().abs().amax(dim=0).float()
    x_absmax = input_absmax.float().to(weight_absmax.device)
    log_s = alpha * torch.log2(x_absmax) - (1 - alpha) * torch.log2(weight_absmax)
    # a channel that is always zero (or a zero weight column) says nothing: left alone
    log_s = torch.where((x_absmax > 0) & (weight_absmax > 0), log_s, torch.zeros_like(log_s))
    return torch.round(log_s).clamp(-MAX_SHIFT, MAX_SHIFT).to(torch.int8)


def candidate_errors(
    probe: Probe, layers: Mapping[str, nn.Linear], candidates: Mapping[str, Mapping[Optional[float], torch.Tensor]], dtype: torch.dtype
) -> dict[str, dict[Optional[float], float]]:
    """Squared error of each layer's own output (bias left out) stored with each candidate's exponents, on its real
    inputs over one forward of ``probe`` (the model and its batch; each candidate layer built and dropped inside the
    hook: no activation kept)."""
    errors: dict[str, dict[Optional[float], float]] = {name: {} for name in layers}

    def measure(name: str) -> Any:
        def hook(layer: nn.Linear, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            reference = (x.float() @ layer.weight.detach().float().t()).float()
            source = nn.Linear(layer.in_features, layer.out_features, bias=False, device="meta")
            source.weight = layer.weight
            for alpha, shift in candidates[name].items():
                # the layer the mode builds, computing in the compute dtype: the arithmetic of training
                quantized = Int8DynamicLinear.from_linear(source, input_shift=None if alpha is None else shift)
                error = (quantized(x.to(dtype)).float() - reference).pow(2).sum().item()
                errors[name][alpha] = errors[name].get(alpha, 0.0) + error

        return hook

    handles = [layer.register_forward_pre_hook(measure(name)) for name, layer in layers.items()]
    try:
        probe.output()
    finally:
        for handle in handles:
            handle.remove()
    return errors


def report_unsmoothed(module: nn.Module, quantized: Sequence[str], shifts: Optional[Mapping[str, torch.Tensor]]) -> None:
    """Warn about layers stored in ``int8-dynamic-smooth`` that got no exponents in ``shifts`` (only ``nn.Linear``
    inputs are measured); an empty ``shifts``: the planner's shape-only model, nothing measured, nothing said."""
    missed = [
        name for name in quantized
        if isinstance(module.get_submodule(name), Int8DynamicLinear)
        and module.get_submodule(name).input_shift is not None and name not in (shifts or {})
    ]
    if missed and shifts:
        log.warning(
            "lightning_hbm: %d layers stored as int8-dynamic-smooth without smoothing (only nn.Linear inputs are "
            "measured; these are other layer kinds, e.g. Conv1D or MultiheadAttention projections): %s. They cost "
            "1 byte per input channel for nothing: pin them with layer_modes={name: 'int8-dynamic'}.",
            len(missed), missed,
        )


__all__ = ["MAX_SHIFT", "Int8DynamicLinear", "candidate_errors", "quantize_rowwise", "report_unsmoothed", "shifts_for", "uses_integer_kernel"]
