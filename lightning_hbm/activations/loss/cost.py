"""How large the fused loss's chunks are."""

from __future__ import annotations

from typing import Optional

import torch

#: Bytes one chunk's logits may take, with the fp32 rows being softmaxed: tokens per chunk follow the vocabulary,
#: so the loss costs about the same at 32k and 256k. 16 MiB is 132 tokens of a 32k bf16 head (8 MiB of them the
#: fp32 rows). Memory first: at 32 MiB the loss set the step's peak of bf16 QLoRA + full recompute on SmolLM2-135M
#: (1.15x its floor; 16 MiB: 1.05x, the recompute's own peak) and on a 100M Llama with MLP chunks (1.16x; 1.11x),
#: for a step time within the run-to-run spread (1.01-1.02x, benchmarks/README.md). A 128k-vocabulary step with
#: 256-token chunks peaked at 2.23x its floor.
CHUNK_BYTES = 16 * 2**20
#: Bytes of fp32 logits alive at once when the head's output is narrower (bf16): the softmax runs on that many rows
#: at a time and writes its gradient back into the chunk's own storage, so a bf16 chunk costs 2 bytes per logit,
#: not 2 + 4 for a whole fp32 copy. 8 MiB is 65 rows at a 32k vocabulary, 16 at 128k.
SOFTMAX_BYTES = 8 * 2**20
#: Fewest tokens per chunk (fewer only when the batch is smaller): each chunk's forward and backward matmuls read
#: the whole ``[vocab, hidden]`` head weight, so tiny chunks spend the step re-reading it. Measured (128k vocabulary,
#: fp32, CPU): 65-token chunks made the whole step 1.13x the 256-token one, 96-token chunks 1.07x.
MIN_CHUNK_TOKENS = 96


def softmax_rows(vocab: int, dtype: torch.dtype) -> Optional[int]:
    """Rows softmaxed at once in fp32 for logits of ``dtype``; ``None`` for fp32 logits (softmaxed in place, whole)."""
    if torch.empty((), dtype=dtype).element_size() >= 4:
        return None
    return max(1, SOFTMAX_BYTES // (vocab * 4))


def chunk_tokens(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16, chunk_size: Optional[int] = None) -> int:
    """Tokens per chunk of the fused loss: ``chunk_size`` if given, else as many as fit :data:`CHUNK_BYTES` (beside
    the fp32 rows of :func:`softmax_rows`), at least :data:`MIN_CHUNK_TOKENS` (or the whole batch, if smaller).

    ``dtype`` is the head's output dtype. The one rule, used by the loss (the planner runs the loss itself).
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, tokens))
    rows = softmax_rows(vocab, dtype) or 0
    fit = (CHUNK_BYTES - rows * vocab * 4) // (vocab * torch.empty((), dtype=dtype).element_size())
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, fit)))
