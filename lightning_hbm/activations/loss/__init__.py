"""``FusedLoss``: the output head and the cross-entropy without the full ``[tokens, vocab]`` logits.

What it shrinks: the **activations** (and temporaries) of the loss. A causal LM's head turns
``tokens x hidden`` into ``tokens x vocab`` logits; with a 32k-128k vocabulary that tensor is the
largest of the step: Hugging Face's ``ForCausalLMLoss`` upcasts it to fp32, the cross-entropy keeps
its log-softmax for backward and the backward builds a gradient of the same size, i.e. several
``tokens x vocab`` copies at the peak (3.9 GiB of fp32 for Llama-3.1-8B at batch 2 x 2048).

How: at the surgery point (stage ``KERNELS``, after quantization and adapters) the head's
``forward`` is replaced by one that returns a :class:`LazyLogits`: a tensor subclass that holds the
hidden states and the head, reports the logits' shape/dtype/device, and records what the code does
with it as long as it only touches the token dimensions (slices such as ``logits[..., :-1, :]``,
``view``/``reshape``/``flatten`` keeping the vocabulary last, ``contiguous``, ``float()``/``to(dtype)``), and the
elementwise ops real heads apply (``tanh`` soft-capping, ``+ - * /`` by a number or a tensor along the vocabulary such
as BART's ``final_logits_bias``), replayed on each chunk.
``F.cross_entropy`` (and so ``nn.CrossEntropyLoss`` and transformers' ``loss_function``) on a
``[N, vocab]`` lazy tensor runs :func:`fused_linear_cross_entropy`: the head is applied to chunks of
the hidden states, each chunk's loss and gradient are computed in fp32 and the chunk is freed, so the
step holds ``chunk x vocab`` instead of ``tokens x vocab``. The head is called as a function, so a
quantized head (bitsandbytes) or a LoRA-adapted head (peft) works, and its trainable parameters get
their gradients. Any other use of the logits (``argmax``, metrics, printing, returning them)
computes the full logits, with a ``UserWarning`` (once per head) naming the operation and the model: the
results are correct, the saving is lost for that tensor, and the profiler's ``loss`` term shows the full logits.

On CUDA, with ``liger-kernel`` installed (``pip install lightning-hbm[fused]``) and a plain
``nn.Linear`` head, Liger's fused linear cross-entropy kernel is used instead of the chunked loop
(not yet run on GPU in this repository). The chunked path is the portable one (CPU and GPU).

The package, one job per module: ``cost`` (chunk size), ``chunked`` (the loss), ``dequantize`` (a 4-bit head
dequantized once), ``lazy`` (``LazyLogits``), ``callback`` (``FusedLoss``).
"""

from lightning_hbm.activations.loss.callback import FusedLoss, default_heads
from lightning_hbm.activations.loss.chunked import fused_linear_cross_entropy
from lightning_hbm.activations.loss.cost import CHUNK_BYTES, MIN_CHUNK_TOKENS, SOFTMAX_BYTES, chunk_tokens, softmax_rows
from lightning_hbm.activations.loss.lazy import LazyLogits

__all__ = ["CHUNK_BYTES", "MIN_CHUNK_TOKENS", "SOFTMAX_BYTES", "FusedLoss", "LazyLogits", "chunk_tokens", "default_heads",
           "fused_linear_cross_entropy", "softmax_rows"]
