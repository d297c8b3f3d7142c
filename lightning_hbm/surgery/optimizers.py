"""What the surgery spine asks of whoever replaces an optimizer the user's ``configure_optimizers`` returned (a
transform's ``transform_optimizers``, e.g. ``MemoryEfficientOptimizer``; a strategy's setup, e.g.
``CPUOffloadStrategy``): the LR schedulers that drove the old optimizer drive the new one."""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from lightning_hbm._compat import torch as torch_compat


def repoint_lr_schedulers(lr_scheduler_configs: list[Any], old: Optimizer, new: Optimizer) -> None:
    """Make every LR scheduler that drives ``old`` drive ``new`` (a transform's ``transform_optimizers``, ``CPUOffloadStrategy``).

    A torch ``LRScheduler`` keeps ``self.optimizer`` and, at construction, wraps
    ``optimizer.step`` to record that it ran (it warns when ``scheduler.step()`` comes first or
    when ``step`` was replaced). Both are redone for ``new``; ``SequentialLR``/``ChainedScheduler``
    hold their children in ``_schedulers``.
    """
    for config in lr_scheduler_configs:
        scheduler = getattr(config, "scheduler", config)
        if _repoint(scheduler, old, new):
            torch_compat.track_step_called(new)


def _repoint(scheduler: Any, old: Optimizer, new: Optimizer) -> bool:
    found = False
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = new
        found = True
    for child in torch_compat.child_schedulers(scheduler):
        found = _repoint(child, old, new) or found
    return found


__all__ = ["repoint_lr_schedulers"]
