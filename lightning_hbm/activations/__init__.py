"""The **activations** term: what the forward keeps alive for the backward, and the kernels that keep less.

One job per module, the callback class as the package's face:

- ``checkpointing``: :class:`ActivationCheckpointing` (recompute the repeated blocks in backward, optionally
  offloading what they save), the Lightning face over ``recompute`` (the blocks chosen and wrapped, what the first
  step tells) and ``block_forward`` (one block's checkpointed forward); ``offload`` (the hooks that move what the
  blocks save off the device and back); ``selective`` (the matmuls a selective recompute keeps), ``token_chunks`` and
  ``token_rows`` (running a block's token-wise layers in chunks of tokens, and telling which layers are token-wise)
- ``attention/``: :class:`AttentionKernel` (``kernel``: which attention kernel runs) and lightning_hbm's own
  ``blocked`` attention
- ``loss/``: :class:`FusedLoss` (the output head and the cross-entropy without the full logits)
"""

from lightning_hbm.activations.attention import AttentionKernel
from lightning_hbm.activations.checkpointing import ActivationCheckpointing
from lightning_hbm.activations.offload import OffloadSavedTensors, host_footprint, pinned_footprint
from lightning_hbm.activations.loss import FusedLoss

__all__ = ["ActivationCheckpointing", "AttentionKernel", "FusedLoss", "OffloadSavedTensors", "host_footprint",
           "pinned_footprint"]
