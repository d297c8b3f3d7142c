"""The **optimizer states** term: :class:`MemoryEfficientOptimizer` (``optimizer``: the user's Adam/AdamW swapped
for its bitsandbytes 8-bit or paged twin), and the helpers the strategies share (``repoint_lr_schedulers``,
``optimizer_state_bytes``)."""

from lightning_hbm.optim.optimizer import (
    OPTIMIZER_KINDS,
    MemoryEfficientOptimizer,
    OptimizerKind,
    optimizer_state_bytes,
    repoint_lr_schedulers,
)

__all__ = ["OPTIMIZER_KINDS", "MemoryEfficientOptimizer", "OptimizerKind", "optimizer_state_bytes", "repoint_lr_schedulers"]
