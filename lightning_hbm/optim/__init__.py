"""The **optimizer states** term: :class:`MemoryEfficientOptimizer` (``optimizer``: the user's Adam/AdamW swapped
for its bitsandbytes 8-bit or paged twin).

``repoint_lr_schedulers`` (now :mod:`lightning_hbm.surgery.optimizers`) and ``optimizer_state_bytes`` (now
:mod:`lightning_hbm.memory.storage`) lived here: re-exported so that imports from ``lightning_hbm.optim`` keep working.
"""

from lightning_hbm.memory.storage import optimizer_state_bytes
from lightning_hbm.optim.optimizer import OPTIMIZER_KINDS, MemoryEfficientOptimizer, OptimizerKind
from lightning_hbm.surgery import repoint_lr_schedulers

__all__ = ["OPTIMIZER_KINDS", "MemoryEfficientOptimizer", "OptimizerKind", "optimizer_state_bytes", "repoint_lr_schedulers"]
