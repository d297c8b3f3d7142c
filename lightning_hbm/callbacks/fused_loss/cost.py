"""How large the fused loss's chunks are: the one rule, used by the loss and by the planner's arithmetic."""

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

    ``dtype`` is the head's output dtype. The one rule, used by the loss and by the planner's arithmetic.
    """
    if chunk_size is not None:
        return max(1, min(chunk_size, tokens))
    return max(1, min(tokens, max(MIN_CHUNK_TOKENS, CHUNK_BYTES // (vocab * logit_element_bytes(dtype)))))


def loss_bytes(tokens: int, vocab: int, hidden: int, fused: bool, logits_dtype: torch.dtype = torch.bfloat16,
               chunk_size: Optional[int] = None, quantized_head: bool = False) -> int:
    """Bytes the head + cross-entropy add at the step's peak, with or without ``FusedLoss`` (for the planner).

    Unfused (transformers' ``ForCausalLMLoss``, or ``F.cross_entropy(logits.float())``): about 12 bytes per
    ``tokens x vocab`` element whatever the logits dtype: bf16 logits (2, kept by the model output) + the fp32
    log-softmax saved for backward (4) + its fp32 gradient (4) + the gradient's bf16 cast (2); in fp32, logits,
    log-softmax and gradient (4 each). Measured with torch's MemTracker on a 32k vocabulary: 12.2 (bf16), 12.3 (fp32).
    Fused: one chunk (:func:`chunk_tokens`, :func:`logit_element_bytes`), the hidden-state gradient kept from
    forward to backward, and for a 4-bit head its weight dequantized once.
    """
    itemsize = torch.empty((), dtype=logits_dtype).element_size()
    if not fused:
        return tokens * vocab * 12
    chunk = chunk_tokens(tokens, vocab, logits_dtype, chunk_size)
    head = vocab * hidden * itemsize if quantized_head else 0
    return chunk * vocab * logit_element_bytes(logits_dtype) + tokens * hidden * itemsize + head

