"""One autograd Function for every layer whose frozen weight is dequantized from its storage when it computes.

A quantized layer's weight is frozen, so its backward needs the weight only for the input's gradient, never the
input. Written with ``F.linear`` / ``F.conv2d`` on the dequantized weight, autograd saved both until the backward:
the whole weight in the compute dtype per layer, the bytes its 4-bit storage saved (two frozen 256->256 3x3
convolutions: 4,849,668 saved bytes against 131,076 unquantized; T5's fp32-computed ``wo`` at width 256, nf4-dq:
14.6 -> 20.9 MB saved by one training forward). Here nothing is saved: the backward dequantizes the weight again, as
bitsandbytes' 4-bit matmul does. The layer kinds differ only in the operation and its input gradient
(:class:`~lightning_hbm.layers.conv.QuantizedConv2d` and the transposed convolutions: ``aten.convolution_backward``;
:class:`~lightning_hbm.layers.linear.Fp32ComputeLinear`: ``grad @ W``), handed in as functions.

A second derivative (a gradient penalty: ``autograd.grad(..., create_graph=True)``) is right: under
``create_graph`` autograd records this backward, and both input gradients are differentiable in the gradient they
take (equal to the dequantized weight's reference on CPU, ``tests/layers/test_double_backward.py``).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

#: ``(x, weight, bias) -> output``: the layer's operation on the dequantized weight
Operation = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor]], torch.Tensor]


class InputGradient(NamedTuple):
    """What a layer's backward is asked: the output's gradient, the weight dequantized again, the input's shape, and
    which of the input's and the bias's gradients autograd needs."""

    grad: torch.Tensor
    weight: torch.Tensor
    x_shape: torch.Size
    needs_x: bool
    needs_bias: bool


#: ``InputGradient -> (grad_x or None, grad_bias or None)``
Backward = Callable[[InputGradient], tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


class FrozenWeight(torch.autograd.Function):
    """``operation(x, weight_of(), bias)`` with a frozen weight that ``weight_of()`` dequantizes from its storage, in
    the forward and again in the backward: neither the dequantized weight nor the input is saved for backward.
    ``backward_of`` gives the input's (and a trained bias's) gradient; the weight gets none."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, bias: Optional[torch.Tensor], weight_of: Callable[[], torch.Tensor],
        operation: Operation, backward_of: Backward,
    ) -> torch.Tensor:  # fmt: skip
        ctx.weight_of, ctx.backward_of, ctx.x_shape, ctx.x_dtype = weight_of, backward_of, x.shape, x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return operation(x, weight_of(), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor], None, None, None]:
        needs_x, needs_bias = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # the forward ran in grad's dtype (autocast may have cast x and the weight): the weight is cast to it
        grad_x, grad_bias = ctx.backward_of(InputGradient(grad, ctx.weight_of().to(grad.dtype), ctx.x_shape, needs_x, needs_bias))
        grad_x = grad_x.to(ctx.x_dtype) if needs_x and grad_x is not None else None
        grad_bias = grad_bias.to(ctx.bias_dtype) if needs_bias and grad_bias is not None else None
        return grad_x, grad_bias, None, None, None


__all__ = ["Backward", "FrozenWeight", "InputGradient", "Operation"]
