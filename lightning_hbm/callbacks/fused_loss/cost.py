"""How large the fused loss's chunks are."""

from __future__ import annotations

from typing import Optional

import torch

#: Bytes one chunk's logits may take (the head's output, its fp32 copy; the gradient reuses both): tokens per
#: chunk follow the vocabulary, so the loss costs about the same at 32k and 256k. 32 MiB is 174 tokens of a 32k
#: bf16 head; a 128k-vocabulary step with 256-token chunks peaked at 2.23x its floor (benchmarks/README.md).
CHUNK_BYTES = 32 * 2**20
#: Fewest tokens per chunk (fewer only when the batch is smaller): each chunk's forward and backward matmuls read
#: the whole ``[vocab, hidden]`` head weight, so tiny chunks spend the step re-reading it. Measured (128k vocabulary,
#: fp32, CPU): 65-token chunks made the whole step 1.13x the 256-token one, 96-token chunks 1.07x.
MIN_CHUNK_TOKENS = 96


def logit_element_bytes(dtype: torch.dtype) -> int:
    """Bytes one chunk holds per logits element: the head's output, plus its fp32 copy when it is narrower.

    The softmax and its gradient are computed in place in the fp32 copy and written back into the output's
    storage (:func:`_chunks`): no third copy.
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    return itemsize + (4 if itemsize < 4 else 0)


def chunk_tokens(tokens: int, vocab: int, dtype: torch.dtype = torch.bfloat16, chunk_size: Optional[int] = None) -> int:
    """Tokens per chunk of the fused loss: ``chunk_size`` if given, else as many as fit :data:`CHUNK_BYTES`, at
    least :data:`MIN_CHUNK_TOKENS` (or the whole batch, if smaller).

    ``dtype`` is the head's output dtype. The one rule, used by the loss (the planner runs the loss itself).
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, tokens))
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, CHUNK_BYTES // (vocab * logit_element_bytes(dtype)))))

