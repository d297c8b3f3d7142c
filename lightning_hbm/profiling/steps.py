"""``StepMemory``: one training step's memory measured, term by term, and the measured steps kept as rows.

The step-level domain object under :class:`~lightning_hbm.profiling.memory_profile.MemoryProfile` (and so under
:class:`~lightning_hbm.profiling.profiler.HBMProfiler`), as Lightning's ``Throughput`` is under
``ThroughputMonitor``: it knows trackers, terms and rows, not Trainers. Its caller decides which steps are measured
and when a step's forward ends; this module measures them (light: the forward's activations; detailed: the whole
step's tracked peak, a per-module breakdown and, op by op, the picture) and keeps at most ``max_rows`` rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.memory.categories import (
    CATEGORIES,
    MemoryBreakdown,
    classify,
    classify_records,
    light_values,
    owned_storages,
    owned_tensors,
    tensor_bytes,
)
from lightning_hbm.memory.storage import module_parameter_tensors
from lightning_hbm.memory.terms import SIDE_TERMS, host_terms, scope_terms, side_terms
from lightning_hbm.memory.tracker import LiveStorageTracker, scope_term_bytes
from lightning_hbm.profiling.figure import ProfileFigure, build_figure
from lightning_hbm.profiling.timeline import RecordedStep, StepRecorder

log = logging.getLogger(__name__)

CUDA_FIELDS = (
    "cuda_allocated",
    "cuda_reserved",
    "cuda_peak_allocated",
    "cuda_fragmentation",
    "cuda_capacity",
    "cuda_headroom",
    "cuda_unattributed",
)
#: Columns of the per-step CSV (bytes; CUDA columns empty on other devices).
#: The terms outside the sum (``loss``, ``host_offload``: :data:`~lightning_hbm.memory.terms.SIDE_TERMS`) follow ``tracked_peak``.
COLUMNS = ("step", "batch_idx", "mode", *CATEGORIES, "total", "tracked_peak", *SIDE_TERMS, *CUDA_FIELDS)


def columns() -> tuple[str, ...]:
    """The CSV's columns now: :data:`COLUMNS` with the terms registered since (``register_term``) beside the sum."""
    return ("step", "batch_idx", "mode", *CATEGORIES, "total", "tracked_peak", *side_terms(), *CUDA_FIELDS)


class StepMemory:
    """Measures one step at a time and keeps the rows.

    Args:
        max_rows: measured steps kept. Past it the oldest forward-end rows are dropped (detailed rows are kept),
            announced once.

    A step: :meth:`start`, then :meth:`at_forward_end` once the forward has run (:meth:`enter_phase` names the phases
    of the picture), then :meth:`finish` (its row) or, when the step failed, :meth:`abandon` (and :meth:`keep_failed_step`).
    """

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self.rows: list[dict[str, Any]] = []
        self.modules: dict[int, dict[str, dict[str, int]]] = {}  # detailed step -> module -> category -> bytes
        self.figure: Optional[ProfileFigure] = None  # the detailed step with the largest peak, drawn in the PNG
        self.dropped_rows = 0  # forward-end rows dropped past max_rows
        self._tracker: Optional[LiveStorageTracker] = None
        self._tracking = False  # the tracker's dispatch mode is entered
        self._recorder: Optional[StepRecorder] = None
        self._forward_end: Optional[MemoryBreakdown] = None
        self._forward_modules: dict[str, int] = {}
        self._failed: Optional[tuple[LiveStorageTracker, Optional[RecordedStep]]] = None  # abandon -> keep_failed_step
        self._step = 0
        self._batch_idx = 0

    def reset(self) -> None:
        """Forget every row: a new fit starts a new report."""
        self.rows, self.modules, self.figure, self.dropped_rows = [], {}, None, 0

    def start(
        self, step: int, batch_idx: int, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch: Any,
        detailed: bool,
    ) -> None:  # fmt: skip
        """Start measuring step ``step``: light (the forward only) or ``detailed`` (the whole step, seeded with every
        tensor that exists before it, the batch included)."""
        self._step, self._batch_idx, self._forward_end = step, batch_idx, None
        device = cuda_device(module)
        if device is not None:
            torch.cuda.reset_peak_memory_stats(device)
        tracker = LiveStorageTracker(track_peak=detailed)
        if detailed:
            # Everything that exists before the step counts towards its peak, by what it is now.
            for category, tensors in owned_tensors(module, optimizers).items():
                tracker.seed(tensors, phase=category)
            # the batch too (in ``other``): it is on the device through the step, and only a tensor an op reads
            # through a view would be seen otherwise (the targets, not the input ids: 2 KiB short at 4 x 64 tokens)
            tracker.seed(_tensors(batch), phase="batch")
            tracker.attach_modules(module)
        self._tracker = tracker
        tracker.__enter__()  # exited at the forward's end (light) or the step's end (detailed)
        self._tracking = True
        if detailed:  # the step op by op, on top of the tracker: the picture (figure.py)
            self._recorder = StepRecorder(tracker, module, optimizers, cuda_device=device)
            self._recorder.start()

    def enter_phase(self, phase: str) -> None:
        """The step enters ``phase`` (``zero_grad``, ``backward``, ``optimizer``): a mark on the picture."""
        if self._recorder is not None:
            self._recorder.enter_phase(phase)

    def at_forward_end(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The forward has run: its activations are taken now (once a step); a light step stops measuring here."""
        tracker = self._tracker
        if tracker is None or self._forward_end is not None:
            return
        detailed = tracker.track_peak
        if not detailed:
            self._stop_tracking()  # light mode: the forward is all it pays for
        activations = tracker.live_storages(phase="forward")
        self._forward_end = classify(module, optimizers, activations=activations, device=module_device(module))
        if detailed:
            tracker.phase = "after_forward"
            owned = owned_storages(module, optimizers)
            per_module: dict[str, int] = {}
            for key, record in tracker.live_records().items():
                if record.phase == "forward" and key not in owned:
                    per_module[record.module] = per_module.get(record.module, 0) + record.nbytes
            self._forward_modules = per_module

    def finish(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> Optional[dict[str, Any]]:
        """The measured step's row (not kept yet: :meth:`append`), or None when this step is not measured."""
        tracker = self._tracker
        if tracker is None:
            return None
        recorded = self._stop_tracking()  # exits the tracker: before it is let go
        self._tracker = None
        return self._row(module, optimizers, tracker, recorded)

    def abandon(self) -> None:
        """The step failed: stop measuring now (the dispatch modes must not outlive it); what it saw after its forward
        is kept for :meth:`keep_failed_step`."""
        recorded = self._stop_tracking()
        tracker, self._tracker = self._tracker, None
        self._failed = (tracker, recorded) if tracker is not None and self._forward_end is not None else None

    def keep_failed_step(self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """Keep the abandoned step as an ``oom`` row (the step ran out of memory after its forward)."""
        failed, self._failed = self._failed, None
        if failed is not None:
            self.rows.append(self._row(module, optimizers, failed[0], failed[1], mode="oom"))

    def append(self, row: dict[str, Any]) -> None:
        """Keep ``row``; past ``max_rows``, drop the oldest forward-end row (announced once)."""
        self.rows.append(row)
        if len(self.rows) <= self.max_rows:
            return
        oldest_light = next((i for i, r in enumerate(self.rows) if r["mode"] == "light"), 0)
        del self.rows[oldest_light]
        if self.dropped_rows == 0:
            log.warning(
                "HBMProfiler: more than max_rows=%d measured steps; dropping the oldest forward-end rows from now on "
                "(detailed rows are kept). Raise max_rows or every_n_steps to keep them all.", self.max_rows
            )  # fmt: skip
        self.dropped_rows += 1

    def _stop_tracking(self) -> Optional[RecordedStep]:
        """Exit the recorder (a detailed step), then the tracker; return what the recorder recorded."""
        recorder, self._recorder = self._recorder, None
        recorded = recorder.stop() if recorder is not None else None
        if self._tracking and self._tracker is not None:
            self._tracker.__exit__(None, None, None)
            self._tracker.detach_modules()
        self._tracking = False
        return recorded

    def _row(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], tracker: LiveStorageTracker,
        recorded: Optional[RecordedStep] = None, mode: Optional[str] = None,
    ) -> dict[str, Any]:  # fmt: skip
        """The measured step's row: every term of the registry, the total, the tracked peak, the CUDA figures.

        ``recorded``: the detailed step op by op (:class:`StepRecorder`), kept as :attr:`figure` when its peak is the
        run's largest so far (always for an out-of-memory step, ``mode="oom"``).
        """
        device = module_device(module)
        end = classify(module, optimizers, device=device)
        forward_end = self._forward_end if self._forward_end is not None else end
        detailed = tracker.track_peak
        side: dict[str, Optional[int]] = {t.name: None for t in scope_terms()}  # measured on detailed steps
        # host terms: memory a feature moved off the device, not in the total
        side.update({t.name: t.host(module, optimizers) for t in host_terms() if t.host is not None})
        tracked_peak: Optional[int] = None
        if detailed:
            tracker.finish_peak()
            owned = owned_storages(module, optimizers)
            values = classify_records(tracker.peak_records, owned, device)
            # scope terms (the loss: FusedLoss's chunk, fp32 rows, dequantized head) at the peak, inside the categories
            side.update(scope_term_bytes(tracker.peak_records, owned))
            self.modules[self._step] = _module_breakdown(module, optimizers, self._forward_modules)
            tracked_peak = tracker.peak_bytes
        else:
            values = light_values(forward_end, end)  # activations at the forward's end, owned terms at both ends
        total = sum(values.values())
        row: dict[str, Any] = {
            "step": self._step,
            "batch_idx": self._batch_idx,
            "mode": mode or ("detailed" if detailed else "light"),
            **values,
            "total": total,
            "tracked_peak": tracked_peak,
            **{name: side[name] for name in side_terms()},
        }
        row.update(_cuda_stats(module, total))
        if detailed and recorded is not None and recorded.samples:
            self._keep_figure(recorded, owned, row, str(device))
        return row

    def _keep_figure(self, recorded: RecordedStep, owned: Any, row: dict[str, Any], device: str) -> None:
        """Keep the step's figure if it is the one to draw: the largest peak so far, or the step that ran out."""
        host = {t.name: row[t.name] or 0 for t in host_terms()}
        figure = build_figure(recorded, owned, step=self._step, device=device, host=host)
        if row["mode"] == "oom" or self.figure is None or figure.peak.bytes > self.figure.peak.bytes:
            self.figure = figure


def module_device(module: nn.Module) -> torch.device:
    """The device the LightningModule runs on."""
    return getattr(module, "device")  # noqa: B009 - a LightningModule's property, not nn.Module's


def cuda_device(module: nn.Module) -> Optional[torch.device]:
    """The CUDA device ``module`` runs on, or None (never ask the allocator otherwise)."""
    # On the CPU build torch.cuda.memory_allocated() silently returns 0: never ask unless on CUDA.
    device = module_device(module)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return device


def _tensors(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    apply_to_collection(batch, torch.Tensor, found.append)
    return found


def _cuda_stats(module: nn.Module, total: int) -> dict[str, Optional[int]]:
    device = cuda_device(module)
    if device is None:
        return dict.fromkeys(CUDA_FIELDS)
    allocated = torch.cuda.memory_allocated(device)
    reserved = torch.cuda.memory_reserved(device)
    peak = torch.cuda.max_memory_allocated(device)
    capacity = torch.cuda.get_device_properties(device).total_memory
    return {
        "cuda_allocated": allocated,
        "cuda_reserved": reserved,
        "cuda_peak_allocated": peak,
        "cuda_fragmentation": reserved - allocated,
        "cuda_capacity": capacity,
        "cuda_headroom": capacity - torch.cuda.max_memory_reserved(device),
        "cuda_unattributed": peak - total,
    }


def _module_breakdown(
    root: nn.Module, optimizers: Sequence[torch.optim.Optimizer], activations: dict[str, int]
) -> dict[str, dict[str, int]]:
    """Per submodule: its own (non-recursive) parameters, gradients, optimizer states, and the activations
    created while it was the innermost module running."""
    states = [lightning_compat.unwrap_optimizer(opt).state for opt in optimizers]
    result: dict[str, dict[str, int]] = {}
    for name, module in root.named_modules():
        label = name or "<root>"
        params = list(module.parameters(recurse=False))
        entry = {
            "parameters": tensor_bytes(module_parameter_tensors(module, recurse=False)),
            "gradients": tensor_bytes(p.grad for p in params if p.grad is not None),
            "optimizer_states": tensor_bytes(t for state in states for p in params for t in _state_tensors(state.get(p))),
            "activations": activations.get(label, 0),
        }
        if any(entry.values()):
            result[label] = entry
    return result


def _state_tensors(state: Optional[dict[str, Any]]) -> list[torch.Tensor]:
    """The tensors of one parameter's optimizer state (None: the parameter has no state yet)."""
    return [v for v in (state or {}).values() if isinstance(v, torch.Tensor)]


__all__ = ["COLUMNS", "CUDA_FIELDS", "StepMemory", "columns", "cuda_device", "module_device"]
