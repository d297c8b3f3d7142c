"""Whether a layer treats each token on its own, decided on fake tensors (the planner's trace) by following its ops.

:func:`lightning_hbm.activations.token_chunks.decide` tells a token-wise layer by changing one token's input and
comparing every other token's output, bit for bit. A fake tensor has no values, so the planner could only plan the
whole recompute (an upper bound). Here the layer runs on the fake input under a dispatch mode that follows which
tensors still hold one row per token. Every operator that touches them must be one that keeps rows apart:
elementwise, a matmul with the rows on the left and a weight on the right (a quantized format's own matmul
operator too), a reduction, softmax or norm over features only, a view that keeps the tokens as the leading
dimensions. Anything else (attention's products of two token tensors, a convolution, an index over tokens, a
random draw) refuses, with the operator's name.

Conservative by construction: a layer refused here may still be chunked by the real run (Mixtral's experts gather
tokens by index), so the plan stays an upper bound there. A layer accepted here computes every output row from its
own input row, which is what the real test checks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Optional

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

from lightning_hbm.activations.selective import SelectivePolicy, format_matmuls

_aten = torch.ops.aten
# reshapes in logical order (and copies): the output's rows are found again as a prefix of its shape
_RESHAPES = {"view", "_unsafe_view", "reshape", "alias", "detach", "clone", "contiguous", "_to_copy", "squeeze",
             "unsqueeze", "expand", "flatten", "unflatten", "empty_like", "zeros_like", "ones_like", "full_like", "copy"}
# ops whose dimension arguments (dim, dim0, dim1, dims) must all be feature dimensions
_ALONG_FEATURES = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "var_mean", "linalg_vector_norm", "norm",
                   "_softmax", "_log_softmax", "softmax", "log_softmax", "topk", "sort", "argmax", "argmin", "cumsum",
                   "prod", "logsumexp", "any", "all", "slice", "select", "narrow", "split", "split_with_sizes",
                   "chunk", "unbind", "cat", "stack", "transpose", "flip", "roll", "glu"}
_NORMS = {"native_layer_norm", "_fused_rms_norm", "rms_norm", "layer_norm"}  # normalized over trailing dims
_DIM_ARGS = ("dim", "dim0", "dim1", "dims")


class _Rows(TorchDispatchMode):
    """Follows the tensors holding one row per token (``rows[t]``: how many leading dimensions are tokens)."""

    def __init__(self, x: Tensor, matmuls: dict[Any, int]) -> None:
        super().__init__()
        self.tokens = math.prod(x.shape[:-1])
        self.rows: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        self.rows[x] = x.dim() - 1
        self.matmuls = {op: i for op, i in matmuls.items() if op not in (_aten.bmm.default, _aten.baddbmm.default)}
        self.refused = ""
        #: rows gathered by an index over the tokens (a mixture of experts' ``hidden[token_idx]``): tensor -> the index.
        #: Each is in :attr:`rows` too (lead 1: one gathered row per index entry), so the row-wise rules apply to them.
        self.gathered: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def _lead(self, t: Tensor) -> int:
        """The smallest number of leading dimensions holding exactly the tokens, 0 if none."""
        count = 1
        for i, size in enumerate(t.shape):
            count *= size
            if count == self.tokens:
                return i + 1
            if count > self.tokens:
                break
        return 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.refused:
            flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
            rows = [t for t in flat if t in self.rows]
            if torch.Tag.nondeterministic_seeded in func.tags:
                self.refused = f"draws random numbers ({func})"
            elif func is _aten._local_scalar_dense.default and rows:
                self.refused = "reads a value of its tokens (.item())"
            elif rows and not _tensors(out):
                pass  # metadata: a device, a size, a stride
            elif rows:
                self.refused = self._gather(func, args, out, rows) if self._gathers(func, args, rows) else (
                    self._check(func, args, kwargs, flat, rows, out) or self._mark(func, out, rows))
        return out

    def _gathers(self, func: Any, args: tuple, rows: list[Tensor]) -> bool:
        """Whether ``func`` gathers token rows by an index (``x[idx]``, ``w[idx, pos]``) or adds gathered rows back to
        the tokens they came from (``final.index_add_(0, idx, rows)``): a mixture of experts' routing loop
        (transformers' eager experts, :class:`~lightning_hbm.layers.experts.LinearExperts`)."""
        name = func.overloadpacket.__name__.removesuffix("_")
        if name == "index" and len(args) > 1 and isinstance(args[1], (list, tuple)) and args[1]:
            first = args[1][0]
            return (args[0] in self.rows and args[0] not in self.gathered and self.rows[args[0]] == 1
                    and isinstance(first, Tensor) and first.dim() == 1 and not first.is_floating_point()
                    and not any(isinstance(i, Tensor) and i in self.rows for i in args[1]))
        return name == "index_add" and len(args) >= 4 and args[1] == 0 and args[3] in self.gathered

    def _gather(self, func: Any, args: tuple, out: Any, rows: list[Tensor]) -> str:
        """Mark the output of a gather (:meth:`_gathers`) as gathered by its index; an ``index_add`` must put the rows
        back by the index that gathered them, into token rows (each token's output then comes from its own row)."""
        if func.overloadpacket.__name__.removesuffix("_") == "index":
            self.rows[out], self.gathered[out] = 1, args[1][0]
            return ""
        target, index, source = args[0], args[2], args[3]
        if self.gathered[source] is not index or target in self.gathered or target not in self.rows or self.rows[target] != 1 or target.dim() != 2:
            return f"adds rows to tokens other than those they were gathered from ({func})"
        self.rows[out] = 1
        return ""

    def _check(self, func: Any, args: tuple, kwargs: dict, flat: list[Tensor], rows: list[Tensor], out: Any) -> str:
        """Why ``func`` may mix the tokens of ``rows`` (the token tensors among its arguments), ``""`` if it cannot."""
        name = func.overloadpacket.__name__.removesuffix("_")  # in-place forms: the same rule
        lead = max(self.rows[t] for t in rows)
        if func in self.matmuls:
            if not self._rows_on_the_left(func, args, kwargs):
                return f"multiplies across its tokens ({func})"
        elif name in _NORMS:
            shape = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()
            if len(shape) > args[0].dim() - lead:
                return f"normalizes across tokens ({func})"
        elif name == "permute":
            if [d % args[0].dim() for d in args[1]][:lead] != list(range(lead)):
                return f"moves the token dimensions ({func})"
        elif name in _ALONG_FEATURES:
            if not self._features_only(func, args, kwargs, lead):
                return f"runs {func} across tokens"
        elif torch.Tag.pointwise in func.tags or name in _RESHAPES:
            first = next(iter(_tensors(out)), None)
            width = first.dim() - self._lead(first) if first is not None else 0
            for t in flat:  # a tensor the layer made itself (positions, a mask) must not vary along the tokens
                if t not in self.rows and torch.Tag.pointwise in func.tags and any(s != 1 for s in t.shape[: max(t.dim() - width, 0)]):
                    return f"combines its tokens with a tensor of shape {tuple(t.shape)} along them ({func})"
        else:
            return f"runs {func} on its tokens (not known to keep tokens apart)"
        return ""

    def _rows_on_the_left(self, func: Any, args: tuple, kwargs: dict) -> bool:
        """Whether the matmul ``func`` holds token rows only in its left operand, all of them as leading dimensions,
        or (``addmm``) also in its accumulator (argument 0, added elementwise: LoRA's fused sum adds its term into the
        base output, ``adapters/lora/forward.py``) as a 2-D matrix of one row per token."""
        left = self.matmuls[func]
        accumulator = 0 if func is _aten.addmm.default and left == 1 else None
        if any(t in self.rows for t in tree_flatten(kwargs)[0] if isinstance(t, Tensor)):
            return False
        for i, arg in enumerate(args):
            if not isinstance(arg, Tensor) or arg not in self.rows:
                continue
            if i == left:
                if self.rows[arg] != arg.dim() - 1:
                    return False
            elif i != accumulator or arg.dim() != 2 or self.rows[arg] != 1:
                return False
        return True

    def _features_only(self, func: Any, args: tuple, kwargs: dict, lead: int) -> bool:
        ndim = next(t.dim() for t in tree_flatten(args)[0] if isinstance(t, Tensor))
        dims: list[int] = []
        for i, arg in enumerate(func._schema.arguments):
            if arg.name not in _DIM_ARGS:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name, arg.default_value if arg.has_default_value() else None)
            if value is None or value == []:
                return False  # over every dimension
            dims += list(value) if isinstance(value, (list, tuple)) else [value]
        return all(d % max(ndim, 1) >= lead for d in dims)

    def _mark(self, func: Any, out: Any, rows: list[Tensor]) -> str:
        """Mark the outputs that hold the rows; refuse an output that lost them. Gathered rows (:attr:`gathered`, all
        by one index, with no token rows beside them) stay gathered: one leading row per index entry."""
        indices = {id(self.gathered[t]): self.gathered[t] for t in rows if t in self.gathered}
        if indices:
            if len(indices) > 1 or any(t not in self.gathered for t in rows):
                return f"combines rows gathered by different indices or with its tokens ({func})"
            index = next(iter(indices.values()))
            for t in _tensors(out):
                if t.dim() < 2 or t.shape[0] != index.shape[0]:
                    return f"loses the gathered rows in {func} (output shape {tuple(t.shape)})"
                self.rows[t], self.gathered[t] = 1, index
            return ""
        for t in _tensors(out):
            lead = self._lead(t)
            if not lead:
                return f"loses the tokens' rows in {func} (output shape {tuple(t.shape)})"
            self.rows[t] = lead
        return ""


def _tensors(out: Any) -> Iterable[Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, Tensor)]


def fake_rowwise_reason(layer: nn.Module, inner: Callable[[Tensor], Any], x: Tensor) -> str:
    """``""`` if ``inner(x)``, the forward of ``layer`` run here on ``x`` (a fake tensor), computes each output row
    from its own input row only, else which operator may not (the first one).

    The matmul operators of the quantized formats inside ``layer`` (``QuantFormat.matmul_ops``) count as matmuls.
    """
    mode = _Rows(x, SelectivePolicy(format_matmuls(layer)).ops)  # aten's matmuls and the formats'
    with torch.no_grad(), mode:
        out = inner(x)
    if mode.refused:
        return mode.refused
    if not isinstance(out, Tensor) or out not in mode.rows or mode.rows[out] != x.dim() - 1:
        return "its output does not keep the input's tokens"
    return ""


__all__ = ["fake_rowwise_reason"]
