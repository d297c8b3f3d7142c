"""Input embeddings (``nn.Embedding``) stored quantized: ``QuantizedPrecision(quantize_embeddings=...)``, int8 by default
(``"auto"``, since session 30), ``True`` for the run's own mode.

What it shrinks: the **parameters** term. A language model's token embedding is ``vocabulary x hidden`` weights: 0.53 B
of Llama-3-8B's 8.03 B, 21 % of SmolLM2-135M. The weight, a ``[num_embeddings, embedding_dim]`` matrix, is stored by
the mode's own Linear layer (every mode, its constants, checkpoints, resume and the planner included, as a quantized
convolution's); a lookup unpacks only the rows it reads (:meth:`~lightning_hbm.precision.registry.QuantFormat.gather_rows`:
bitsandbytes 4-bit and int8 gather the packed rows and their scales; other formats dequantize the whole table first).

Only what is exactly ``nn.Embedding`` is converted: a subclass has a forward of its own (Gemma's scaled embedding
multiplies by ``sqrt(hidden)``) that a replacement would drop; it stays in the compute dtype with that reason. A head
tied to the embedding (a plain ``nn.Linear`` holding the same weight: SmolLM2, GPT-2) becomes a :class:`TiedHead` that
computes with the embedding's one quantized copy, a vocabulary slice at a time; a weight shared with anything else
keeps the embedding in the compute dtype. The layers are not LoRA targets. A layer of this kind exists only once quantized: a plain embedding is counted with the
other parameters (embeddings, norms) in the coverage table.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers.correction import LowRankCorrection, correction_of
from lightning_hbm.layers.kinds import LayerKind, no_names, register_kind
from lightning_hbm.memory.storage import quantized_format

#: most bytes of one unpacked slice of a quantized head's weight (the transient a sliced head adds beside its output)
SLICE_BYTES = 32 * 2**20
#: a slice's unpacked weight is at most this share of the output it computes (the call's logits: one fused-loss chunk's,
#: or the whole batch's): a fixed 32 MiB slice beside a 96-token chunk of SmolLM2's 49k vocabulary (18 MiB of fp32
#: logits) made the loss term 82.8 MiB where the fp32 head's was 18.6 (planned, Dec 5 2026)
SLICE_SHARE = 8
#: fewest bytes of a slice (unless :data:`SLICE_BYTES` is smaller): a few tokens' call (a 16-token chunk, one token
#: generated) would otherwise loop over thousands of tiny slices; 1 MiB is 455 rows of a 576-wide fp32 table
MIN_SLICE_BYTES = 2**20


def slice_rows(in_features: int, dtype: torch.dtype, tokens: Optional[int] = None, out_features: int = 0) -> int:
    """Output rows (vocabulary entries) per unpacked slice, for a call on ``tokens`` rows of input: what one slice
    holds (its unpacked weight and its ``[tokens, rows]`` product, both in ``dtype``) at most 1/:data:`SLICE_SHARE` of
    the ``[tokens, out_features]`` output (at least :data:`MIN_SLICE_BYTES`), its weight never over
    :data:`SLICE_BYTES` (``tokens=None``: that alone)."""
    size = dtype.itemsize
    rows = SLICE_BYTES // (in_features * size)
    if tokens is not None:
        share = max(MIN_SLICE_BYTES, tokens * out_features * size // SLICE_SHARE)
        rows = min(rows, share // ((in_features + tokens) * size))
    return max(1, rows)


class SlicedLinear(torch.autograd.Function):
    """``x @ W.T`` of a frozen quantized layer, ``W`` unpacked a slice of output rows at a time, in the forward and
    again in the backward (``QuantFormat.gather_range``: views of the stored rows where the format can): never the whole ``[vocab, hidden]`` weight (1 GiB in bf16 for
    Llama-3-8B's head). ``FusedLoss`` computes a 4-bit head this way; a head tied to a quantized embedding always does."""

    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, layer: nn.Module, fmt: Any, dtype: torch.dtype, correction: Optional[LowRankCorrection] = None
    ) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1]).to(dtype)
        vocab = int(fmt.weight_shape(layer)[0])
        rows = slice_rows(flat.shape[1], dtype, flat.shape[0], vocab)
        # returned as allocated, not as a view: FusedLoss writes the gradient into the logits' storage in place
        out = torch.empty(*x.shape[:-1], vocab, dtype=dtype, device=x.device)
        rows_of_out = out.view(-1, vocab)
        for start in torch_compat.chunk_starts(vocab, rows, flat):
            stop = min(vocab, start + rows)
            weight = _slice(layer, fmt, correction, start, stop, dtype, x.device)
            rows_of_out[:, start:stop] = flat @ weight.t()
            del weight  # not beside the next slice's
        ctx.layer, ctx.fmt, ctx.dtype, ctx.rows, ctx.x_dtype, ctx.x_shape = layer, fmt, dtype, rows, x.dtype, x.shape
        ctx.correction = correction  # frozen Parameters of the embedding: alive anyway, not saved tensors
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Optional[torch.Tensor], None, None, None, None]:
        flat = grad.reshape(-1, grad.shape[-1])
        vocab = flat.shape[1]
        # fp32 sum over slices: each slice's product is accumulated in fp32 by the matmul, rounded once to the
        # compute dtype, and the slices are added in fp32 (one bf16 sum would round once per slice)
        total = torch.zeros(flat.shape[0], ctx.x_shape[-1], dtype=torch.float32, device=grad.device)
        for start in torch_compat.chunk_starts(vocab, ctx.rows, flat):
            stop = min(vocab, start + ctx.rows)
            weight = _slice(ctx.layer, ctx.fmt, ctx.correction, start, stop, ctx.dtype, grad.device)
            total += flat[:, start:stop].to(ctx.dtype) @ weight
            del weight
        return total.to(ctx.x_dtype).view(ctx.x_shape), None, None, None, None


def _slice(
    layer: nn.Module, fmt: Any, correction: Optional[LowRankCorrection], start: int, stop: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Rows ``start:stop`` of ``layer``'s weight unpacked in ``dtype``, plus those of the embedding's calibrated
    correction ``left[start:stop] @ right`` (a head tied to a corrected embedding multiplies with ``Q + L R``, the table
    its lookups read): added to the slice, so the head's output and gradient cost one slice more, never a second
    ``[tokens, vocab]`` product."""
    weight = fmt.gather_range(layer, start, stop, dtype, device)
    if correction is None:
        return cast(torch.Tensor, weight)
    return cast(torch.Tensor, weight + correction.left[start:stop].to(device, dtype) @ correction.right.to(device, dtype))


def sliced_linear(
    x: torch.Tensor, layer: nn.Module, fmt: Any, dtype: torch.dtype, bias: Optional[torch.Tensor],
    correction: Optional[LowRankCorrection] = None,
) -> torch.Tensor:  # fmt: skip
    """``x @ W.T + bias`` of the frozen quantized ``layer`` (format ``fmt``) by :class:`SlicedLinear`, in ``x``'s dtype:
    what a 4-bit head computes under ``FusedLoss`` and what a :class:`TiedHead` always computes (``correction``: the
    tied embedding's calibrated correction, added to each slice of ``W``)."""
    out = cast(torch.Tensor, SlicedLinear.apply(x, layer, fmt, dtype, correction))
    if bias is not None:
        out = out + bias.to(dtype)
    return out.to(x.dtype)


class QuantizedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose frozen weight a precision mode stores (module docstring); built by :meth:`from_quantized`."""

    compute_dtype: torch.dtype

    def storage(self) -> nn.Module:
        """The mode's layer holding the table as a ``[num_embeddings, embedding_dim]`` matrix."""
        return cast(nn.Module, self._modules["quantized"])

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # the table as a lookup reads it (its calibrated correction included), dequantized on each read, never stored:
        # for code that reads its shape, dtype or device (a whole-table transient, which the lookup itself never
        # makes) and for LoRA.merge, which merges what the model computed with
        storage = self.storage()
        with torch.no_grad():
            table = cast(Any, quantized_format(storage)).dequantize(storage, self.compute_dtype)
            correction = correction_of(self)
            if correction is not None:
                table = table + correction.weight().to(table.device, table.dtype)
            return cast(torch.Tensor, table)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        storage = self.storage()
        ids = input.reshape(-1)
        rows = cast(Any, quantized_format(storage)).gather_rows(storage, ids, self.compute_dtype)
        correction = correction_of(self)  # QuantizedPrecision(correction_rank=r): row i of L R added to row i
        if correction is not None:
            rows = rows + F.embedding(ids, correction.left).to(rows.dtype) @ correction.right.to(rows.dtype)
        return rows.view(*input.shape, self.embedding_dim)

    @classmethod
    def from_quantized(cls, embedding: nn.Embedding, quantized: nn.Module, dequantize: Any, dtype: torch.dtype) -> QuantizedEmbedding:
        """``embedding``'s replacement around ``quantized`` (the mode's layer built from :func:`_as_linear`)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)  # not nn.Embedding's: it would allocate a weight the storage holds
        for attribute in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"):
            setattr(new, attribute, getattr(embedding, attribute))
        new.quantized = quantized
        new.compute_dtype = dtype
        # the hooks the user put on the embedding go on with it (transformers' enable_input_require_grads() hooks the
        # input embedding's output: Reformer's reversible layers need it to reach their adapters): the same dicts, not
        # copies, so that a handle taken before (disable_input_require_grads()) still removes its hook (session 31)
        for hooks in _MODULE_HOOKS:
            new.__dict__[hooks] = getattr(embedding, hooks)
        new._is_full_backward_hook = embedding._is_full_backward_hook
        return new


#: the per-module hook dicts of ``nn.Module`` (forward, forward pre-, backward and backward pre-hooks)
_MODULE_HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
                 "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks")


class TiedHead(nn.Module):
    """An output head whose weight was tied to an embedding now quantized: it computes with that embedding's one
    quantized copy (:class:`SlicedLinear`, a vocabulary slice at a time), never a copy of its own. The embedding is
    not a child (its table is saved once, under the embedding)."""

    def __init__(self, embedding: QuantizedEmbedding, head: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = head.in_features, head.out_features
        self.bias = head.bias
        self.__dict__["embedding"] = embedding  # not registered: the table belongs to the embedding

    @property
    def weight(self) -> torch.Tensor:
        # the table as the head multiplies with it, dequantized on each read (for code reading its shape or dtype)
        return cast(torch.Tensor, self.__dict__["embedding"].weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        embedding = self.__dict__["embedding"]
        storage = embedding.storage()
        return sliced_linear(x, storage, quantized_format(storage), embedding.compute_dtype, cast(Optional[torch.Tensor], self.bias),
                             correction_of(embedding))  # fmt: skip


def tied_heads(module: nn.Module, embedding: nn.Module) -> Optional[list[str]]:
    """Names of the modules besides ``embedding`` holding its weight, if every one is a plain ``nn.Linear`` (a tied
    head that :class:`TiedHead` can replace); ``None`` if any other module holds it."""
    holders = [(n, m) for n, m in module.named_modules() if m is not embedding and m._parameters.get("weight") is embedding.weight]
    return [n for n, _ in holders] if all(type(m) is nn.Linear for _, m in holders) else None


def too_small(table: nn.Module, below: int) -> Optional[str]:
    """Why a table of fewer than ``below`` values is kept in the compute dtype (``None``: it is not that small)."""
    weight = cast(torch.Tensor, table.weight)
    if weight.numel() >= below:
        return None
    size = weight.numel() * weight.element_size() / 2**10
    return f"too small to gain: {size:.1f} KiB (quantize_embeddings='auto' keeps tables under {below:,} values wide)"


def tie_heads(module: nn.Module, embedding: nn.Module, quantized: QuantizedEmbedding) -> list[str]:
    """Replace the plain Linear heads tied to ``embedding`` (before its quantization) by :class:`TiedHead` s of
    ``quantized``; returns their names."""
    names = tied_heads(module, embedding) or []
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, TiedHead(quantized, cast(nn.Linear, module.get_submodule(name))))
    return names


def convertible(embedding: nn.Module, owners: dict[int, int], tied_ok: bool = False) -> Optional[str]:
    """Why the input embedding ``embedding`` cannot be stored quantized (``None``: it can).

    Args:
        embedding: an ``nn.Embedding`` (or subclass) with a floating weight.
        owners: how many modules hold each parameter (``id`` -> count): a tied weight is held twice.
        tied_ok: every other holder of its weight is a plain ``nn.Linear`` head (:func:`tied_heads`): it computes with
            the embedding's quantized copy (:class:`TiedHead`).
    """
    if type(embedding) is not nn.Embedding:
        return f"{type(embedding).__name__} has a forward of its own (not a plain nn.Embedding): kept in the compute dtype"
    if owners.get(id(embedding.weight), 0) > 1 and not tied_ok:
        return "weight shared with a module that is not a plain nn.Linear head: kept in the compute dtype"
    if embedding.max_norm is not None:
        return "nn.Embedding(max_norm=...) renormalises its rows in place at each lookup: kept in the compute dtype"
    return None


def is_plain_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is an embedding a precision mode could store (a floating table, not quantized yet)."""
    return isinstance(module, nn.Embedding) and not isinstance(module, QuantizedEmbedding) and module.weight.is_floating_point()


def _as_linear(embedding: nn.Module) -> nn.Linear:
    weight = cast(torch.Tensor, embedding.weight).detach()  # [num_embeddings, embedding_dim]: out x in, as a Linear's
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _stored_in(layer: nn.Module) -> Optional[nn.Module]:
    return layer.storage() if isinstance(layer, QuantizedEmbedding) else None


EMBEDDING = register_kind(
    LayerKind(
        name="Embedding",
        matches=lambda module: isinstance(module, QuantizedEmbedding),
        to_linear=_as_linear,
        quantized_as="the table as its [vocabulary, hidden] matrix in the mode's Linear layer; a lookup unpacks only "
        "the rows it reads (QuantizedPrecision(quantize_embeddings=...): int8 by default)",
        adapted_as="not adapted (frozen; LoRA adapts the Linear-like layers)",
        option="QuantizedPrecision stores them in int8 by default (quantize_embeddings='auto'; True: in the run's mode)",
        modules="`nn.Embedding` (int8 by default: `quantize_embeddings`)",
        found_in="every language model's token embedding",
        planned_as="the mode's layer built from the fake table's matrix",
        adaptable_names=no_names,
        features=lambda layer: (cast(int, layer.embedding_dim), cast(int, layer.num_embeddings)),
        as_built_keys=lambda layer: {"quantized.weight": "weight"} if _stored_in(layer) is not None else {},
        wrap=QuantizedEmbedding.from_quantized,
        stored_in=_stored_in,
    )
)

__all__ = ["EMBEDDING", "SLICE_BYTES", "QuantizedEmbedding", "SlicedLinear", "TiedHead", "convertible", "is_plain_embedding", "slice_rows", "sliced_linear", "tie_heads", "tied_heads", "too_small"]
