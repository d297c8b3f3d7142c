"""The ``nn.MultiheadAttention`` kind: prepared into ``ProjectedMultiheadAttention``, four ``nn.Linear`` projections.

Why a replacement module: ``nn.MultiheadAttention`` computes through
``F.multi_head_attention_forward``, which reads the raw ``in_proj_weight`` Parameter (no Linear at
all) and ``out_proj.weight``/``out_proj.bias`` directly, never calling ``out_proj``. So nothing can
quantize the input projection, and a LoRA layer put around ``out_proj`` is never called: its
adapters silently get no gradient. Here the projections are called as modules (``q_proj``,
``k_proj``, ``v_proj``, ``out_proj``), so a quantized layer or a peft LoRA layer put in their place
really computes. Outputs and gradients equal the original's (tests/layers/test_multihead_attention.py checks masks,
``batch_first``, ``kdim``/``vdim``, attention weights). Not supported (a clear error): ``add_bias_kv``
and ``add_zero_attn``, which append learned / zero key-value rows (rare, none of torch's, timm's or
torchvision's transformer layers use them).

The class sets ``in_proj_weight = in_proj_bias = None``: ``nn.TransformerEncoderLayer`` and
``nn.TransformerEncoder`` then skip their fused inference fast path (which would read the raw
weights again) and call this module.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.layers.kinds import LayerKind, register_kind


def _float_mask(mask: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    """A boolean mask (True = not allowed) as an additive float mask; float masks as they are."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


class ProjectedMultiheadAttention(nn.Module):
    """Multi-head attention whose projections are ``nn.Linear`` modules; same call as ``nn.MultiheadAttention``.

    Build it with :meth:`from_torch`, which takes over the weights of an ``nn.MultiheadAttention``.
    """

    in_proj_weight = None  # see module docstring: turns off torch's fused fast paths
    in_proj_bias = None
    _qkv_same_embed_dim = True
    _separate_weights = False  # the original kept q/k/v_proj_weight (kdim/vdim != embed_dim), not in_proj_weight

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        kdim: Optional[int] = None,
        vdim: Optional[int] = None,
        batch_first: bool = False,
    ) -> None:
        super().__init__()
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.head_dim = embed_dim // num_heads
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.k_proj = nn.Linear(self.kdim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(self.vdim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

    @classmethod
    def from_torch(cls, mha: nn.MultiheadAttention) -> ProjectedMultiheadAttention:
        """The equivalent of ``mha``: its weights split into the four projections (copies; ``out_proj`` shared)."""
        if mha.bias_k is not None or mha.add_zero_attn:
            raise ValueError(
                f"nn.MultiheadAttention(add_bias_kv={mha.bias_k is not None}, add_zero_attn={mha.add_zero_attn}) is not "
                "supported by lightning_hbm's projection rewrite (needed to quantize or adapt its projections). "
                "Keep the module as it is with QuantizedPrecision(ignore_modules=[<its name>]) and "
                "LoRA(exclude_modules=[<its name>])."
            )
        with torch.device("meta"):
            new = cls(mha.embed_dim, mha.num_heads, mha.dropout, mha.in_proj_bias is not None, mha.kdim, mha.vdim, mha.batch_first)
        if torch_compat.packed_qkv(mha):
            weights = mha.in_proj_weight.detach().chunk(3)
        else:
            weights = (mha.q_proj_weight.detach(), mha.k_proj_weight.detach(), mha.v_proj_weight.detach())
        biases = mha.in_proj_bias.detach().chunk(3) if mha.in_proj_bias is not None else (None, None, None)
        trainable = (mha.in_proj_weight if torch_compat.packed_qkv(mha) else mha.q_proj_weight).requires_grad
        for proj, weight, bias in zip((new.q_proj, new.k_proj, new.v_proj), weights, biases):
            proj.weight = nn.Parameter(weight.clone(), requires_grad=trainable)
            if bias is not None:
                proj.bias = nn.Parameter(bias.clone(), requires_grad=mha.in_proj_bias.requires_grad)
        new.out_proj.weight = mha.out_proj.weight  # the same Parameters: no copy
        new._separate_weights = not torch_compat.packed_qkv(mha)
        new.out_proj.bias = mha.out_proj.bias
        new.train(mha.training)
        return new

    def as_built_keys(self) -> dict[str, str]:
        """q/k/v come from ``in_proj_weight``/``in_proj_bias`` (or ``q_proj_weight``, ...); see ``LayerKind.as_built_keys``."""
        keys = {f"out_proj.{p}": f"out_proj.{p}" for p in ("weight", "bias")}
        for proj in ("q", "k", "v"):
            keys[f"{proj}_proj.weight"] = f"{proj}_proj_weight" if self._separate_weights else "in_proj_weight"
            keys[f"{proj}_proj.bias"] = "in_proj_bias"
        return keys

    def _heads(self, x: Tensor) -> Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)

    def _mask(
        self, attn_mask: Optional[Tensor], key_padding_mask: Optional[Tensor], is_causal: bool, shape: tuple[int, ...], dtype: torch.dtype
    ) -> Optional[Tensor]:
        """One additive mask broadcastable to (batch, heads, L, S), as torch merges them."""
        batch, _, length, source = shape
        if is_causal and attn_mask is None:
            attn_mask = torch.ones(length, source, dtype=torch.bool).triu(1)
        mask = _float_mask(attn_mask, dtype)
        if mask is not None and mask.dim() == 3:  # (batch * heads, L, S)
            mask = mask.view(batch, self.num_heads, length, source)
        padding = _float_mask(key_padding_mask, dtype)
        if padding is not None:
            padding = padding.view(batch, 1, 1, source)
            mask = padding if mask is None else mask + padding
        return mask

    @override
    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        unbatched = query.dim() == 2
        if unbatched:  # (L, E): one sequence, computed as a batch of one
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = None if key_padding_mask is None else key_padding_mask.unsqueeze(0)
        elif not self.batch_first:  # (L, N, E) -> (N, L, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        q, k, v = self._heads(self.q_proj(query)), self._heads(self.k_proj(key)), self._heads(self.v_proj(value))
        mask = self._mask(attn_mask, key_padding_mask, is_causal, (q.shape[0], self.num_heads, q.shape[2], k.shape[2]), q.dtype)
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:
            scores = (q * (1.0 / math.sqrt(self.head_dim))) @ k.transpose(-2, -1)
            if mask is not None:
                scores = scores + mask
            weights = F.dropout(scores.softmax(dim=-1), p=dropout)
            context = weights @ v
            if average_attn_weights:
                weights = weights.mean(dim=1)
        else:
            context = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        batch, _, length, _ = context.shape
        out = self.out_proj(context.transpose(1, 2).reshape(batch, length, self.embed_dim))
        if unbatched:
            out, weights = out.squeeze(0), None if weights is None else weights.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)
        return out, weights

    @override
    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, batch_first={self.batch_first}, dropout={self.dropout}"


def _is_mha(module: nn.Module) -> bool:
    return isinstance(module, nn.MultiheadAttention)


def _adaptable(layer: nn.Module) -> list[str]:
    # not yet prepared: the q/k/v projections it will get (its out_proj is a Linear, found as one);
    # prepared: each projection is a Linear of this kind, adapted as it is
    return ["q_proj", "k_proj", "v_proj"] if isinstance(layer, nn.MultiheadAttention) else [""]


def _no_nested_tensor(model: nn.Module) -> None:
    # nn.TransformerEncoder decided at init whether to use its nested-tensor fast path, which reads the
    # attention's raw in_proj weights: off, the replacement has none.
    for sub in model.modules():
        if isinstance(sub, nn.TransformerEncoder):
            sub.use_nested_tensor = False


MULTIHEAD_ATTENTION = register_kind(
    LayerKind(
        name="MultiheadAttention",
        matches=_is_mha,
        # prepare() first turns the module into four Linears tagged with this kind; those are quantized
        to_linear=lambda linear: cast(nn.Linear, linear),
        prepare=cast(Callable[[nn.Module], Optional[nn.Module]], ProjectedMultiheadAttention.from_torch),  # called on the modules it matches
        after_prepare=_no_nested_tensor,
        as_built_keys=lambda new: cast(ProjectedMultiheadAttention, new).as_built_keys(),
        adaptable_names=_adaptable,
        quantized_as="replaced by `ProjectedMultiheadAttention`: equal outputs and gradients (masks, `batch_first`, "
        "`kdim`/`vdim`, attention weights), four Linear projections, each quantized",
        adapted_as="`q_proj`, `k_proj`, `v_proj`, `out_proj` of the replacement",
        option="QuantizedPrecision(...) and/or LoRA(target_modules='all-linear')",
        modules="`nn.MultiheadAttention`",
        found_in="`nn.Transformer*`, torchvision ViT, Lightning's demo Transformer",
        planned_as="the replacement's four projections, each as a Linear",
    )
)

__all__ = ["MULTIHEAD_ATTENTION", "ProjectedMultiheadAttention"]
