"""``MemoryProfile``: a run's memory, step after step, without a Trainer: which steps are measured, their rows and
logged figures, the CUDA memory history, and the report and its picture written at the end or on out-of-memory.

The domain object under :class:`~lightning_hbm.profiling.profiler.HBMProfiler`, as Lightning's ``Throughput`` is under
``ThroughputMonitor``: the callback only translates Lightning's hooks into its calls (and resolves what a Trainer knows:
the cadence, the report's directory, the ranks). It drives :class:`~lightning_hbm.profiling.steps.StepMemory` (one
step measured term by term) by the run's cadence: the first :data:`FIRST_STEPS` steps, every ``every_n_steps``-th,
and the ``detailed_steps`` (light mode: the forward's activations; detailed: the whole step's peak, per module and op
by op), and renders through :class:`~lightning_hbm.memory.report.MemoryReport` and :mod:`~lightning_hbm.profiling.figure`.

Example (a training loop of one's own)::

    profile = MemoryProfile(every_n_steps=10, detailed_steps=[1])
    for step, batch in enumerate(loader):
        profile.start_step(step, step, model, [optimizer], batch)
        loss = model(batch)
        profile.forward_ended("zero_grad", model, [optimizer])
        optimizer.zero_grad()  # Lightning's order: the step's gradients alive at end_step, where they are counted
        profile.enter_phase("backward")
        loss.backward()
        profile.enter_phase("optimizer")
        optimizer.step()
        metrics = profile.end_step(model, [optimizer])  # hbm/<term> in MiB, or None for a step not measured
    profile.write_report("hbm_report", "hbm_profile")

The gradients are told from other tensors at :meth:`end_step`: zeroed before it (``zero_grad()`` after
``optimizer.step()``), the step peak's gradients were counted as ``other`` (session 36); that is warned, once.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Callable, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.memory.categories import CATEGORIES
from lightning_hbm.memory.report import MemoryReport
from lightning_hbm.memory.terms import side_terms, term
from lightning_hbm.profiling.figure import (
    PeakPrediction,
    ProfileFigure,
    draw_figure,
    figure_path,
    prediction_bytes,
    write_figure,
)
from lightning_hbm.profiling.steps import CUDA_FIELDS, StepMemory, columns, cuda_device

_MIB = 2**20
#: Steps measured whatever the cadence, so that a short run still draws a curve: memory settles here
#: (optimizer states appear after step 0, the previous gradients are alive from step 1 on).
FIRST_STEPS = 5
#: what a fit writes into its report directory: the report and its figure data (``_oom``/``_oom_rank{r}`` on
#: out-of-memory) and CUDA snapshots; another run's are named at fit start, never deleted
REPORT_FILES = re.compile(r"hbm_(profile(_oom(_rank\d+)?)?\.(csv|json|png)|figure(_oom(_rank\d+)?)?\.json|snapshot(_oom)?(_rank\d+)?\.pickle)")
#: The files a fit's report writes into its directory (``{stem}.csv/json/png`` and the figure's data).
REPORT_NAMES = ("hbm_profile.csv", "hbm_profile.json", "hbm_profile.png", "hbm_figure.json")


def _gradients_zeroed(module: nn.Module) -> bool:
    """Whether ``module`` has trainable parameters and none holds a gradient (``zero_grad(set_to_none=True)``)."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    return bool(trainable) and all(p.grad is None for p in trainable)


class MemoryProfile:
    """The measured steps of one run, and what is made of them (the arguments are ``HBMProfiler``'s, checked here).

    Args:
        every_n_steps: measure every n-th step, and always the first :data:`FIRST_STEPS`; None: every step until
            :meth:`new_run` is given a cadence (``HBMProfiler`` gives the Trainer's ``log_every_n_steps``).
        detailed_steps: steps measured in detailed mode (whole-step peak, per-module breakdown, the picture).
        max_rows: measured steps kept (:class:`~lightning_hbm.profiling.steps.StepMemory`).
        snapshot_steps: ``(start, stop)``: CUDA memory history recorded over these steps (ignored off CUDA).
        snapshot_max_entries: allocation events kept by the CUDA history recorder.
        summary: :meth:`finish` prints the summary table.
        prediction, budget: drawn as lines on the picture (bytes; a prediction also as a planner ``Prediction``).

    A step: :meth:`start_step`, :meth:`forward_ended` (its activations), :meth:`enter_phase` (marks on the picture),
    :meth:`end_step` (its row kept, its metrics returned); on failure :meth:`abandon_step`. Then :meth:`finish`
    (the report and the summary) or :meth:`write_oom_report`. :meth:`new_run` forgets the rows.
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        detailed_steps: Sequence[int] = (1,),
        max_rows: int = 10_000,
        snapshot_steps: Optional[tuple[int, int]] = None,
        snapshot_max_entries: int = 100_000,
        summary: bool = True,
        prediction: Union[int, PeakPrediction, None] = None,
        budget: Optional[int] = None,
    ) -> None:
        _check_settings(every_n_steps, detailed_steps, max_rows, snapshot_steps, snapshot_max_entries, prediction, budget)
        self.every_n_steps = every_n_steps or 1
        self.detailed_steps = frozenset(detailed_steps)
        self.max_rows = max_rows
        self.snapshot_steps = tuple(snapshot_steps) if snapshot_steps is not None else None
        self.snapshot_max_entries = snapshot_max_entries
        self.summary = summary
        self.prediction = prediction_bytes(prediction)
        self.budget = budget
        #: the measured steps (rows, per-module breakdowns, the picture's step)
        self.steps = StepMemory(max_rows)
        self.used: dict[str, Any] = {}  # what the run used (transforms, optimizers): the diagnosis advises from it
        self.snapshot_path: Optional[str] = None
        self.recording_history = False
        self.said_no_gradients = False  # end_step's warning: gradients zeroed before it, said once

    # -- the measured steps -----------------------------------------------------------------------------------
    @property
    def rows(self) -> list[dict[str, Any]]:
        """The measured steps' rows (bytes, columns :data:`~lightning_hbm.profiling.steps.COLUMNS`)."""
        return self.steps.rows

    @property
    def modules(self) -> dict[int, dict[str, dict[str, int]]]:
        """Per detailed step: module -> category -> bytes."""
        return self.steps.modules

    @property
    def figure(self) -> Optional[ProfileFigure]:
        """The detailed step with the largest peak (or the one that ran out of memory), drawn in the PNG."""
        return self.steps.figure

    @property
    def dropped_rows(self) -> int:
        """Forward-end rows dropped past ``max_rows``."""
        return self.steps.dropped_rows

    def new_run(self, every_n_steps: Optional[int] = None) -> None:
        """Forget the rows, what the run used and its snapshot: a new fit starts a new report (at ``every_n_steps``,
        when given)."""
        if every_n_steps is not None:
            self.every_n_steps = every_n_steps
        self.steps.reset()
        self.used, self.snapshot_path = {}, None

    def measured(self, step: int) -> bool:
        """Whether step ``step`` is measured: one of the first :data:`FIRST_STEPS`, on the cadence, or detailed."""
        return step < FIRST_STEPS or step % self.every_n_steps == 0 or step in self.detailed_steps

    # -- one step ---------------------------------------------------------------------------------------------
    def start_step(
        self, step: int, batch_idx: int, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer], batch: Any
    ) -> None:
        """Step ``step`` starts: the CUDA history from its first snapshot step, the step measured when it is due."""
        history_starts = self.snapshot_steps is not None and step == self.snapshot_steps[0]
        if history_starts and not self.recording_history and cuda_device(module) is not None:
            torch_compat.record_memory_history(max_entries=self.snapshot_max_entries)
            self.recording_history = True
        if self.measured(step):
            self.steps.start(step, batch_idx, module, optimizers, batch, detailed=step in self.detailed_steps)

    def enter_phase(self, phase: str) -> None:
        """The step enters ``phase`` (``zero_grad``, ``backward``, ``optimizer``): a mark on the picture."""
        self.steps.enter_phase(phase)

    def forward_ended(self, phase: str, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        """The forward has run and ``phase`` (``zero_grad`` or ``backward``) begins: its activations are taken."""
        self.steps.enter_phase(phase)
        self.steps.at_forward_end(module, optimizers)

    def end_step(
        self, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer],
        reduce: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None,
    ) -> Optional[dict[str, float]]:  # fmt: skip
        """The step's row kept (``reduce``: e.g. the max over ranks) and its metrics returned, ``hbm/<key>`` in MiB
        (:func:`metrics`); None when the step was not measured."""
        row = self.steps.finish(module, optimizers)
        if row is None:
            return None
        if not self.said_no_gradients and _gradients_zeroed(module):
            self.said_no_gradients = True
            rank_zero_warn(
                f"lightning_hbm: MemoryProfile.end_step found no gradient on {type(module).__name__}'s trainable "
                "parameters: they were zeroed before it, and the step's gradients are counted as 'other'. Fix: call "
                "optimizer.zero_grad() after the forward (before backward), as Lightning does, not after optimizer.step()."
            )
        if reduce is not None:
            row = reduce(row)
        self.steps.append(row)
        return metrics(row)

    def abandon_step(self) -> None:
        """The step failed: stop measuring now (the dispatch modes must not outlive it)."""
        self.steps.abandon()

    def history_due(self, step: int) -> bool:
        """Whether the CUDA history is recorded and its last step (``snapshot_steps[1] - 1``) is done by ``step``."""
        return self.recording_history and self.snapshot_steps is not None and step >= self.snapshot_steps[1]

    def dump_history(self, directory: str, suffix: str = "") -> None:
        """Write the recorded CUDA history to ``{directory}/hbm_snapshot{suffix}.pickle`` and stop recording."""
        if not self.recording_history:
            return
        self.snapshot_path = _dump_snapshot(os.path.join(directory, f"hbm_snapshot{suffix}.pickle"))
        torch_compat.record_memory_history(enabled=None)
        self.recording_history = False

    # -- what is made of them ---------------------------------------------------------------------------------
    def report(self) -> MemoryReport:
        """The measured steps as a :class:`~lightning_hbm.memory.report.MemoryReport` (what is written and printed)."""
        return MemoryReport(self.rows, columns(), self.modules, self.snapshot_path, self.used)

    def diagnosis(self) -> str:
        """The category that dominated the last measured step, and the feature that shrinks it."""
        return self.report().diagnosis()

    def peak_row(self) -> Optional[dict[str, Any]]:
        """The measured step with the largest category total."""
        return self.report().peak_row()

    def print_summary(self, paths: dict[str, str]) -> None:
        """Console table: each category at the largest forward-end step and at the step peak (detailed step)."""
        self.report().print_summary(paths)

    def figure_data(self) -> Optional[ProfileFigure]:
        """The picture's data: the detailed step with the largest peak (or the one that ran out of memory), with the
        planner's prediction and the budget (given here, else AutoFit's); None when no detailed step ran."""
        if self.figure is None:
            return None
        prediction = self.prediction if self.prediction is not None else self.used.get("predicted_peak")
        budget = self.budget if self.budget is not None else self.used.get("budget")
        return replace(self.figure, prediction=prediction, budget=budget)

    def write_report(self, directory: str, stem: str) -> dict[str, str]:
        """Write ``{stem}.csv``, ``{stem}.json`` and (matplotlib installed) ``{stem}.png``; return their paths.

        With a detailed step measured, the PNG is that step's picture (:func:`~lightning_hbm.profiling.figure.
        draw_figure`: every term over its ops, the phases, the peak attributed, prediction and budget) and its data is
        written beside it as ``hbm_figure{suffix}.json`` (``figure`` in the returned paths); without one, the PNG is the
        forward ends over the steps (:func:`lightning_hbm.memory.report.plot`).
        """
        paths = self.report().write(directory, stem)
        figure = self.figure_data()
        if figure is not None:
            paths["figure"] = write_figure(figure, figure_path(paths["json"]))
            if "png" in paths:  # matplotlib is installed: the report drew its figure; this one replaces it
                draw_figure(figure, paths["png"])
        return paths

    def finish(self, directory: str) -> None:
        """The run's report into ``directory`` (when a step was measured) and, with ``summary``, its table printed.
        A report that cannot be written is given up, said once: the run it reports on is complete."""
        if not self.rows:
            return
        try:
            paths = self.write_report(directory, "hbm_profile")
        except OSError as err:
            # was: the OSError ended fit() after training (a full disk): the user's next line (saving the
            # adapters, the model) never ran. The report is what failed, so it is what is given up, said once.
            paths = {}
            rank_zero_warn(
                f"HBMProfiler could not write its report into {directory} ({err.strerror or err}); the training is "
                "complete and not affected, and the table below is the report. Free space there, or pass "
                "HBMProfiler(dirpath=<another folder>) next time."
            )
        if self.summary:
            self.print_summary(paths)

    def write_oom_report(
        self, directory: str, suffix: str, module: nn.Module, optimizers: Sequence[torch.optim.Optimizer]
    ) -> dict[str, str]:
        """The step ran out of memory: the report ``hbm_profile{suffix}`` (the failed step kept when its forward had
        run), a CUDA snapshot on CUDA, and the diagnosis printed; returns the paths."""
        self.steps.keep_failed_step(module, optimizers)  # died after the forward: keep what it saw
        paths = self.write_report(directory, "hbm_profile" + suffix)
        if cuda_device(module) is not None:
            path = os.path.join(directory, f"hbm_snapshot{suffix}.pickle")
            torch_compat.dump_memory_snapshot(path)
            paths["snapshot"] = path
        print(f"HBMProfiler: out of memory. {self.diagnosis()}\nReport: {paths}")
        return paths


def metrics(row: dict[str, Any]) -> dict[str, float]:
    """A measured row's logged figures, ``hbm/<key>`` in MiB: the categories and their total, the CUDA figures (on
    CUDA), ``hbm/tracked_peak`` on a detailed step, and the side terms when measured (a host term: when memory moved
    there)."""
    logged = {f"hbm/{k}": row[k] / _MIB for k in (*CATEGORIES, "total", *CUDA_FIELDS) if row[k] is not None}
    if row["mode"] == "detailed":
        logged["hbm/tracked_peak"] = row["tracked_peak"] / _MIB
    for name in side_terms():  # loss: measured on detailed steps; a host term: when memory moved there
        if row[name] is not None and (row[name] or term(name).kind != "host"):
            logged[f"hbm/{name}"] = row[name] / _MIB
    return logged


def _dump_snapshot(path: str) -> Optional[str]:
    if not torch.cuda.is_available():
        return None
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch_compat.dump_memory_snapshot(path)
    print(f"HBMProfiler: CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)")
    return path


def _check_settings(
    every_n_steps: Optional[int], detailed_steps: Sequence[int], max_rows: int, snapshot_steps: Optional[tuple[int, int]],
    snapshot_max_entries: int, prediction: Union[int, PeakPrediction, None], budget: Optional[int],
) -> None:  # fmt: skip
    """Each value in range, before anything is stored (the types: ``check_args`` in ``HBMProfiler``)."""
    if every_n_steps is not None:
        _check_int("every_n_steps", every_n_steps, minimum=1)
    _check_int("snapshot_max_entries", snapshot_max_entries, minimum=1)
    _check_int("max_rows", max_rows, minimum=1)
    for name, value in (("budget", budget), ("prediction", prediction)):
        if isinstance(value, int):
            _check_int(name, value, minimum=1)
    if isinstance(detailed_steps, (str, int)):
        raise TypeError(f"detailed_steps must be a list of global steps, got {detailed_steps!r}; e.g. detailed_steps=[3].")
    for step in detailed_steps:
        _check_int("each of detailed_steps", step, minimum=0)
    if snapshot_steps is not None:
        if len(snapshot_steps) != 2:
            raise ValueError(f"snapshot_steps must be (start, stop), got {snapshot_steps!r}.")
        start, stop = snapshot_steps
        _check_int("snapshot_steps start", start, minimum=0)
        _check_int("snapshot_steps stop", stop, minimum=0)
        if stop <= start:
            raise ValueError(f"snapshot_steps={tuple(snapshot_steps)!r}: stop must be after start, e.g. ({start}, {start + 2}).")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HBMProfiler: {name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"HBMProfiler: {name} must be >= {minimum}, got {value}.")


__all__ = ["FIRST_STEPS", "REPORT_FILES", "REPORT_NAMES", "MemoryProfile", "metrics"]
