"""Attention without the full score matrix: :class:`AttentionKernel` (``kernel``: picks the kernel each attention
call runs) and lightning_hbm's own ``blocked`` kernel (chunks of query positions, an op of its own)."""

from lightning_hbm.activations.attention.kernel import AttentionKernel

__all__ = ["AttentionKernel"]
