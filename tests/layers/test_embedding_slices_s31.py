"""A head tied to an int8 embedding unpacks its table in slices sized from the call's output (a fused-loss chunk's
logits), not a fixed 32 MiB (issue 51 residue, session 31)."""

from __future__ import annotations

import torch
from torch import nn

from lightning_hbm.layers.embedding import MIN_SLICE_BYTES, SLICE_BYTES, SLICE_SHARE, TiedHead, slice_rows
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.registry import get_format

VOCAB, HIDDEN, TOKENS = 49152, 64, 96  # SmolLM2's vocabulary; a 96-token chunk's fp32 logits are 18 MiB


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.embed.weight


def test_the_tied_heads_slice_transient_is_a_share_of_the_chunks_logits() -> None:
    """Before: one 32 MiB slice held the whole 12 MiB fp32 table (twice: the cast and the scaled product) beside the
    chunk's 18 MiB of logits; now at most 1/SLICE_SHARE of the logits per slice."""
    torch.manual_seed(0)
    model = _Tied()
    quantize_model(model, "int8", "float32", quantize_embeddings=True)
    head = model.head
    assert isinstance(head, TiedHead)
    x = torch.randn(TOKENS, HIDDEN)
    logits_bytes = TOKENS * VOCAB * 4
    kept: list[torch.Tensor] = []
    with torch.no_grad():
        peak = torch_peak_bytes(lambda: kept.append(head(x)), model, x)
    table = get_format("int8").dequantize(head.__dict__["embedding"].storage(), torch.float32)
    torch.testing.assert_close(kept[0], x @ table.t())
    stored = VOCAB * HIDDEN + VOCAB * 4  # the int8 table and its fp32 row scales
    transient = peak - logits_bytes - stored - x.numel() * 4
    assert transient <= logits_bytes // SLICE_SHARE * 1.25  # the int8 rows gathered beside their fp32 copy


def test_slice_rows_follow_the_output_within_their_bounds() -> None:
    f32 = torch.float32
    assert slice_rows(576, f32, 96, 49152) * (576 + 96) * 4 <= 96 * 49152 * 4 // SLICE_SHARE  # SmolLM2's fused chunk
    assert slice_rows(576, f32, 1, 49152) == MIN_SLICE_BYTES // (577 * 4)  # one token: not thousands of tiny slices
    assert slice_rows(4096, torch.bfloat16, 10**6, 128256) == SLICE_BYTES // (4096 * 2)  # never over SLICE_BYTES
    assert slice_rows(576, f32) == SLICE_BYTES // (576 * 4)
