"""Step peaks measured by torch's own ``MemTracker`` (independent of lightning_hbm's tracker).

Used by tests and benchmarks that must not grade lightning_hbm with its own ruler. ``MemTracker``
(``torch.distributed._tools.mem_tracker``, private API) registers a gradient hook on every parameter
of every module it sees, which torch refuses for frozen parameters ("cannot register a hook on a
tensor that doesn't require gradient"): QLoRA models are mostly frozen. :class:`FrozenSafeMemTracker`
marks frozen parameters as already hooked, so only trainable ones get hooks; what is counted does
not change (frozen parameters get no gradient to count).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from lightning_hbm._compat import torch as torch_compat


class _NoHandle:
    def remove(self) -> None:
        pass


class FrozenSafeMemTracker(MemTracker):
    """torch's ``MemTracker`` that accepts modules with frozen parameters."""

    def _track_module_params_and_buffers(self, module: torch.nn.Module, install_grad_hooks: bool = True) -> tuple[int, int]:
        for param in module.parameters():
            if not param.requires_grad:
                self._param_to_grad_hook_handles.setdefault(param, (_NoHandle(), _NoHandle()))
        return super()._track_module_params_and_buffers(module, install_grad_hooks)


def torch_peak_bytes(step: Callable[[], Any], *track: Any, device: torch.device = torch.device("cpu")) -> int:
    """Peak bytes on ``device`` during ``step()`` by ``MemTracker``; ``track``: modules/optimizers alive before it."""
    tracker = FrozenSafeMemTracker()
    torch_compat.total_peak_only(tracker)  # only the total is read: torch's per-module peaks cost O(ops x modules)
    tracker.track_external(*track)
    with tracker:
        step()
    return int(tracker.get_tracker_snapshot("peak")[device]["Total"])


__all__ = ["FrozenSafeMemTracker", "torch_peak_bytes"]
