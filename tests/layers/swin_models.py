"""A small Swin-like image classifier whose attention passes its layers' weights to a function, as torchvision's does.

torchvision is not installable here. The attention below follows the forward path of torchvision's
``ShiftedWindowAttention`` / ``ShiftedWindowAttentionV2`` and ``shifted_window_attention``
(https://github.com/pytorch/vision/blob/main/torchvision/models/swin_transformer.py): the module never calls
``self.qkv`` or ``self.proj``; it hands ``self.qkv.weight``, ``self.proj.weight`` and their biases to a function that
pads and cyclically shifts the feature map, cuts it into windows, runs ``F.linear(x, qkv_weight, qkv_bias)``, adds a
relative position bias (and the shifted windows' mask), and projects with ``F.linear(x, proj_weight, proj_bias)``.
The V2 flavour (cosine attention, ``v2_logit_scale``) zeroes the key's third of a *copy* of the qkv bias first, so the
bias ``F.linear`` gets is not the layer's own. Patch merging, the MLP and the head call their layers.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

CLASSES, IMAGE, CHANNELS = 10, 8, 3


def window_attention(
    x: torch.Tensor, qkv_weight: torch.Tensor, proj_weight: torch.Tensor, position_bias: torch.Tensor, window: int,
    heads: int, shift: int, qkv_bias: Optional[torch.Tensor], proj_bias: Optional[torch.Tensor],
    logit_scale: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """torchvision's ``shifted_window_attention`` path for square windows, no dropout (see the module docstring)."""
    b, h, w, c = x.shape
    pad_h, pad_w = (window - h % window) % window, (window - w % window) % window
    x = F.pad(x, (0, 0, 0, pad_w, 0, pad_h))
    hp, wp = h + pad_h, w + pad_w
    shift = 0 if window >= hp else shift
    if shift:
        x = torch.roll(x, shifts=(-shift, -shift), dims=(1, 2))
    n_win = (hp // window) * (wp // window)
    x = x.view(b, hp // window, window, wp // window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(b * n_win, window * window, c)
    if logit_scale is not None and qkv_bias is not None:  # V2: the key gets no bias (a copy is changed)
        qkv_bias = qkv_bias.clone()
        third = qkv_bias.numel() // 3
        qkv_bias[third : 2 * third].zero_()
    qkv = F.linear(x, qkv_weight, qkv_bias)
    q, k, v = qkv.reshape(x.size(0), x.size(1), 3, heads, c // heads).permute(2, 0, 3, 1, 4)
    if logit_scale is not None:  # cosine attention
        attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
        attn = attn * torch.clamp(logit_scale, max=math.log(100.0)).exp()
    else:
        attn = (q * (c // heads) ** -0.5).matmul(k.transpose(-2, -1))
    attn = attn + position_bias
    if shift:
        attn = attn.view(b, n_win, heads, x.size(1), x.size(1)) + _shift_mask(x, hp, wp, window, shift)
        attn = attn.view(-1, heads, x.size(1), x.size(1))
    x = F.softmax(attn, dim=-1).matmul(v).transpose(1, 2).reshape(x.size(0), x.size(1), c)
    x = F.linear(x, proj_weight, proj_bias)
    x = x.view(b, hp // window, wp // window, window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(b, hp, wp, c)
    if shift:
        x = torch.roll(x, shifts=(shift, shift), dims=(1, 2))
    return x[:, :h, :w, :].contiguous()


def _shift_mask(x: torch.Tensor, hp: int, wp: int, window: int, shift: int) -> torch.Tensor:
    # regions of the shifted map get distinct labels; windows mixing regions mask each other's tokens with -100
    mask = x.new_zeros((hp, wp))
    count = 0
    for hs in ((0, -window), (-window, -shift), (-shift, None)):
        for ws in ((0, -window), (-window, -shift), (-shift, None)):
            mask[hs[0] : hs[1], ws[0] : ws[1]] = count
            count += 1
    mask = mask.view(hp // window, window, wp // window, window).permute(0, 2, 1, 3).reshape(-1, window * window)
    mask = mask.unsqueeze(1) - mask.unsqueeze(2)
    return mask.masked_fill(mask != 0, -100.0).masked_fill(mask == 0, 0.0).unsqueeze(1).unsqueeze(0)


class ShiftedWindowAttention(nn.Module):
    """torchvision's ``ShiftedWindowAttention`` (``v2=True``: ``ShiftedWindowAttentionV2``'s logit scale and zeroed
    key bias; its continuous position bias MLP is left out, a learned table is kept)."""

    def __init__(self, dim: int, window: int, shift: int, heads: int, v2: bool = False) -> None:
        super().__init__()
        self.window, self.shift, self.heads = window, shift, heads
        self.qkv, self.proj = nn.Linear(dim, dim * 3), nn.Linear(dim, dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.02)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + window - 1
        self.register_buffer("relative_position_index", relative[..., 0] * (2 * window - 1) + relative[..., 1])
        self.v2_logit_scale = nn.Parameter(torch.log(10 * torch.ones((heads, 1, 1)))) if v2 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = self.window * self.window
        bias = self.relative_position_bias_table[self.relative_position_index].view(n, n, -1).permute(2, 0, 1).unsqueeze(0)
        return window_attention(
            x, self.qkv.weight, self.proj.weight, bias, self.window, self.heads, self.shift,
            qkv_bias=self.qkv.bias, proj_bias=self.proj.bias, logit_scale=self.v2_logit_scale,
        )


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, shift: int, v2: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ShiftedWindowAttention(dim, 2, shift, heads, v2)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm, self.reduction = nn.LayerNorm(4 * dim), nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], -1)
        return self.reduction(self.norm(x))


class SmallSwin(pl.LightningModule):
    """Two stages of (W-MSA, SW-MSA) blocks with patch merging between them; the second stage is V2-flavoured."""

    def __init__(self, dim: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.patch = nn.Linear(CHANNELS, dim)  # 1x1 patches: the attention is what is under test
        self.stage1 = nn.Sequential(SwinBlock(dim, heads, 0, False), SwinBlock(dim, heads, 1, False))
        self.merge = PatchMerging(dim)
        self.stage2 = nn.Sequential(SwinBlock(2 * dim, heads, 0, True), SwinBlock(2 * dim, heads, 1, True))
        self.norm, self.head = nn.LayerNorm(2 * dim), nn.Linear(2 * dim, CLASSES)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self.stage2(self.merge(self.stage1(self.patch(images))))
        return self.head(self.norm(x).mean((1, 2)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self(images), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def batch(seed: int = 0, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(size, IMAGE, IMAGE, CHANNELS, generator=generator), torch.randint(0, CLASSES, (size,), generator=generator)


def read_layers(module: nn.Module) -> list[str]:
    """The names of the attention layers whose weights the attention passes to the function."""
    return [n for n, _ in module.named_modules() if n.endswith((".attn.qkv", ".attn.proj"))]
