"""``HBMProfiler``: where every byte of a training step goes, logged, plotted and explained on OOM.

What it shrinks: nothing. It measures the five terms every other lightning_hbm feature shrinks
(:data:`lightning_hbm.memory.CATEGORIES`), by what each tensor *is*:

- light mode (the first 5 steps, then every ``every_n_steps`` steps, by default the Trainer's
  ``log_every_n_steps``): a :class:`~lightning_hbm.memory.LiveStorageTracker` runs during the
  forward only. At the forward's end (Lightning's ``on_before_zero_grad``, else
  ``on_before_backward``) the graph holds every activation and the previous step's gradients are
  still alive (Lightning zeroes them after the forward); activations are taken there. This is not
  the step's peak (backward adds gradients and temporaries): detailed mode measures that.
  Parameters, gradients and optimizer states are counted by owner there and again after the
  optimizer step (their larger value is kept: on the first step gradients and states only exist
  after it).
- detailed mode (only the steps in ``detailed_steps``): the tracker runs over the whole step, seeded
  with everything that already exists (the batch included), and reports the categories at the step's true tracked peak
  (backward and optimizer temporaries included, as ``other``) and a per-module breakdown. Step 1
  by default: its peak is what :func:`lightning_hbm.plan` predicts, so the two are comparable.

Reports (CSV, JSON, console summary) are rendered by :mod:`lightning_hbm.memory.report`, which
``lightning-hbm report`` uses as well. The PNG is the picture of a detailed step: a
:class:`~lightning_hbm.profiling.timeline.StepRecorder` runs on top of its tracker and
:mod:`lightning_hbm.profiling.figure` builds and draws every term over the step's ops (``hbm_figure.json``).

On CUDA the allocator's own figures are added, so what the categories do not explain (CUDA
context, allocator caching, fragmentation) is shown, not hidden.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.memory.categories import (
    CATEGORIES,
)
from lightning_hbm.memory.report import REMEDIES, MemoryReport
from lightning_hbm.memory.terms import side_terms, term
from lightning_hbm.profiling.figure import (
    PeakPrediction,
    ProfileFigure,
    draw_figure,
    figure_path,
    prediction_bytes,
    write_figure,
)
from lightning_hbm.profiling.run_facts import run_facts
from lightning_hbm.profiling.steps import COLUMNS, CUDA_FIELDS, StepMemory, columns, cuda_device
from lightning_hbm.resume.io import gather_from_ranks
from lightning_hbm.surgery import applied_transforms

log = logging.getLogger(__name__)

_MIB = 2**20
#: Steps measured whatever the cadence, so that a short run still draws a curve: memory settles here
#: (optimizer states appear after step 0, the previous gradients are alive from step 1 on).
FIRST_STEPS = 5
#: what a fit writes into its report directory: the report and its figure data (``_oom``/``_oom_rank{r}`` on
#: out-of-memory) and CUDA snapshots; another run's are named at fit start, never deleted
REPORT_FILES = re.compile(r"hbm_(profile(_oom(_rank\d+)?)?\.(csv|json|png)|figure(_oom(_rank\d+)?)?\.json|snapshot(_oom)?(_rank\d+)?\.pickle)")

class HBMProfiler(Callback):
    """Per-step memory breakdown by category, with a report at the end of fit and on out-of-memory.

    Args:
        every_n_steps: measure every n-th optimizer step (``global_step % every_n_steps == 0``), and
            always the first :data:`FIRST_STEPS` (5) steps, so that a short run has a curve.
            Default (None): the Trainer's ``log_every_n_steps``, when Lightning writes logs anyway.
            A light measurement costs a fixed ~3 ms on the CPU dev machine (within noise for a ~200 ms
            step, +17 % for a ~20 ms one; benchmarks/README.md): ``1`` suits short or large-step runs.
        detailed_steps: global steps measured in detailed mode (whole-step peak, per-module
            breakdown; ~2x slower for that step). Default ``(1,)``: the first step where gradients and
            optimizer states already exist, so the summary shows the step peak the planner predicts.
            Empty: none.
        dirpath: directory of the report; default: the Trainer's ``log_dir`` (its
            ``default_root_dir`` without a logger).
        snapshot_steps: ``(start, stop)``: CUDA memory history is recorded from the start of global
            step ``start`` to the end of step ``stop - 1``, then dumped to ``hbm_snapshot.pickle``
            (``_rank{r}`` per rank under DDP; open it at pytorch.org/memory_viz; path printed).
            Ignored with a warning off CUDA.
        snapshot_max_entries: allocation events kept by the CUDA history recorder.
        summary: print the summary table at the end of fit (with rich when installed).
        max_rows: measured steps kept (the CSV/JSON/PNG rows). Past it the oldest forward-end rows are
            dropped (detailed rows are kept), once announced, so a long run's profiler memory and files
            stay bounded: 10,000 rows (~3 MB of JSON) is 500,000 steps at the default cadence of 50.
        prediction: the planner's predicted step peak, drawn as a line on the picture: bytes, or a
            :class:`~lightning_hbm.planner.Prediction` (``plan(...).chosen``). Default: AutoFit's, when it ran.
        budget: the memory budget in bytes, drawn as a line on the picture. Default: AutoFit's, when it ran.

    Logged keys (MiB, per measured step, max over ranks under DDP):
        ``hbm/parameters``, ``hbm/gradients``, ``hbm/optimizer_states``, ``hbm/activations``,
        ``hbm/other``, ``hbm/total`` (their sum); on detailed steps ``hbm/tracked_peak`` and ``hbm/loss`` (bytes
        at the peak that ``FusedLoss`` allocated: chunk logits, fp32 rows, dequantized head; a term inside the
        categories, not added to the total; 0 without FusedLoss); on CUDA
        also ``hbm/cuda_allocated``, ``hbm/cuda_reserved``, ``hbm/cuda_peak_allocated`` (reset
        every measured step), ``hbm/cuda_fragmentation`` (reserved - allocated),
        ``hbm/cuda_capacity``, ``hbm/cuda_headroom`` (capacity - peak reserved) and
        ``hbm/cuda_unattributed`` (peak allocated - total: CUDA context, workspaces, buffers of
        the strategy). Under ``CPUOffloadStrategy`` also ``hbm/host_offload``: host memory its optimizer
        holds (master copies, gradient buffers, states; none of it in the five terms, whose optimizer
        states read 0 for an offloaded run), also the ``host_offload`` column of the CSV and JSON rows. What each term
        is, when it is alive and what shrinks it: :data:`lightning_hbm.memory.terms.TERMS`.

    Summary printed at the end of fit: each category at the largest forward-end step (light mode)
    and at the step peak (the largest detailed step), each labelled with its step and what it is.

    Files written by global rank 0 into ``dirpath``: ``hbm_profile.csv`` (one row per measured
    step, bytes, columns :data:`COLUMNS`), ``hbm_profile.json`` (rows, peak step, per-module
    breakdown of detailed steps, what the run used, diagnosis), ``hbm_profile.png`` and its data
    ``hbm_figure.json``: the detailed step with the largest peak op by op (every term stacked over its
    ops, ``other`` and ``activations`` in their parts, the phases forward / loss / zero_grad / backward /
    optimizer, the peak marked with its op and module, each term at each phase's peak, the prediction and
    budget as lines; :mod:`lightning_hbm.profiling.figure`). Without a detailed step the PNG is the
    forward ends over steps and no ``hbm_figure.json`` is written. Each ``fit`` starts a new
    report: an instance reused for a second fit does not mix the runs. Another run's report files already in
    ``dirpath`` are named in a warning at fit start (with the fix: a fresh ``dirpath``); nothing is deleted, and this
    fit's report replaces them when it is written. On ``torch.OutOfMemoryError``/``MemoryError`` the rank that failed writes the
    same files with an ``_oom`` suffix (``_oom_rank{r}`` when there are several ranks), a CUDA
    snapshot, and the diagnosis; the error is re-raised by Lightning.

    Example::

        trainer = Trainer(callbacks=[HBMProfiler(detailed_steps=[3])])
    """

    def __init__(
        self,
        every_n_steps: Optional[int] = None,
        detailed_steps: Sequence[int] = (1,),
        dirpath: Optional[str] = None,
        snapshot_steps: Optional[tuple[int, int]] = None,
        snapshot_max_entries: int = 100_000,
        summary: bool = True,
        max_rows: int = 10_000,
        prediction: Union[int, PeakPrediction, None] = None,
        budget: Optional[int] = None,
    ) -> None:
        check_args(HBMProfiler.__init__, locals())
        if every_n_steps is not None:
            _check_int("every_n_steps", every_n_steps, minimum=1)
        _check_int("snapshot_max_entries", snapshot_max_entries, minimum=1)
        _check_int("max_rows", max_rows, minimum=1)
        for name, value in (("budget", budget), ("prediction", prediction)):
            if isinstance(value, int):
                _check_int(name, value, minimum=1)
        if isinstance(detailed_steps, (str, int)):
            raise TypeError(
                f"detailed_steps must be a list of global steps, got {detailed_steps!r}; e.g. detailed_steps=[3]."
            )
        for step in detailed_steps:
            _check_int("each of detailed_steps", step, minimum=0)
        if snapshot_steps is not None:
            if len(snapshot_steps) != 2:
                raise ValueError(f"snapshot_steps must be (start, stop), got {snapshot_steps!r}.")
            start, stop = snapshot_steps
            _check_int("snapshot_steps start", start, minimum=0)
            _check_int("snapshot_steps stop", stop, minimum=0)
            if stop <= start:
                raise ValueError(
                    f"snapshot_steps={tuple(snapshot_steps)!r}: stop must be after start, e.g. ({start}, {start + 2})."
                )
        self.every_n_steps = every_n_steps
        self.detailed_steps = frozenset(detailed_steps)
        self.dirpath = dirpath
        self.snapshot_steps = tuple(snapshot_steps) if snapshot_steps is not None else None
        self.snapshot_max_entries = snapshot_max_entries
        self.summary = summary
        self.max_rows = max_rows
        self.prediction = prediction_bytes(prediction)
        self.budget = budget
        #: the measured steps (rows, per-module breakdowns, the picture's step): the domain object under this callback
        self.steps = StepMemory(max_rows)
        self.used: dict[str, Any] = {}  # what the run used (transforms, optimizers): the diagnosis advises from it
        self.snapshot_path: Optional[str] = None
        self._recording = False
        self._every = every_n_steps or 1  # resolved in setup when None

    # -- measuring -------------------------------------------------------------------------------
    def _measured(self, step: int) -> bool:
        return step < FIRST_STEPS or step % self._every == 0 or step in self.detailed_steps

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        step = trainer.global_step
        self._maybe_start_history(pl_module, step)
        if self._measured(step):
            self.steps.start(step, batch_idx, pl_module, trainer.optimizers, batch, detailed=step in self.detailed_steps)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.steps.enter_phase("zero_grad")
        self.steps.at_forward_end(pl_module, trainer.optimizers)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.steps.enter_phase("backward")
        self.steps.at_forward_end(pl_module, trainer.optimizers)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.steps.enter_phase("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        row = self.steps.finish(pl_module, trainer.optimizers)
        if row is not None:
            row = self._reduce_over_ranks(trainer, row)
            self.steps.append(row)
            metrics = {f"hbm/{k}": row[k] / _MIB for k in (*CATEGORIES, "total", *CUDA_FIELDS) if row[k] is not None}
            if row["mode"] == "detailed":
                metrics["hbm/tracked_peak"] = row["tracked_peak"] / _MIB
            for name in side_terms():  # loss: measured on detailed steps; a host term: when memory moved there
                if row[name] is not None and (row[name] or term(name).kind != "host"):
                    metrics[f"hbm/{name}"] = row[name] / _MIB
            # Straight to the loggers, as DeviceStatsMonitor does: self.log would cost more than the
            # measurement and would only reach the loggers every log_every_n_steps anyway.
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=lightning_compat.batches_that_stepped(trainer))
        self._maybe_stop_history(trainer, pl_module, trainer.global_step)

    # the measured steps, read as the profiler's own (``profiler.rows``, ``profiler.modules[1]``)
    @property
    def rows(self) -> list[dict[str, Any]]:
        """The measured steps' rows (bytes, columns :data:`COLUMNS`)."""
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

    def _reduce_over_ranks(self, trainer: pl.Trainer, row: dict[str, Any]) -> dict[str, Any]:
        if trainer.world_size <= 1:
            return row
        # every rank measures the same steps, so this collective is matched on all ranks
        keys = [k for k in (*CATEGORIES, "total", "tracked_peak", *side_terms(), *CUDA_FIELDS) if row[k] is not None]
        local = torch.tensor([row[k] for k in keys], dtype=torch.int64, device=trainer.strategy.root_device)
        gathered = trainer.strategy.all_gather(local)
        maxima = gathered.reshape(-1, len(keys)).max(dim=0).values.tolist()
        return {**row, **dict(zip(keys, (int(v) for v in maxima)))}

    # -- CUDA memory history -----------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._every = self.every_n_steps or max(int(trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's LoggerConnector sets it)
        if stage == "fit":  # one report per fit: a reused instance would otherwise mix two runs' rows
            directory = self._check_directories(trainer)
            if trainer.is_global_zero:
                self._warn_earlier_report(directory)
            self.steps.reset()
            self.used, self.snapshot_path = {}, None
        if self.snapshot_steps is not None and trainer.strategy.root_device.type != "cuda":
            rank_zero_warn("HBMProfiler: snapshot_steps records CUDA memory history; this run is not on CUDA, so no snapshot.")

    def _check_directories(self, trainer: pl.Trainer) -> str:
        """The report's and the checkpoints' directories must be writable: refused at fit start (before the model
        is changed), not at the report after training or at the first checkpoint. Checked on every rank and the
        results gathered, so every rank raises the same error naming the rank(s) that cannot write (was: that rank
        raised alone, the others waited in the next collective, session 31). Returns the report's directory."""
        report_dir = self._dir(trainer)  # broadcast inside: called on every rank
        try:
            self._check_local_directories(trainer, report_dir)
            failure = None
        except ValueError as err:
            failure = str(err)
            if trainer.world_size < 2:
                raise
        failures = gather_from_ranks(trainer, failure)  # a collective: every rank gets here
        if failures is None:  # no process group (yet): this rank's answer alone
            if failure is not None:
                raise ValueError(failure)
            return report_dir
        refused = [rank for rank, f in enumerate(failures) if f is not None]
        if refused:
            ranks = f"rank{'s' if len(refused) > 1 else ''} {', '.join(map(str, refused))} of {len(failures)}"
            raise ValueError(f"HBMProfiler: on {ranks}: {failures[refused[0]]}")
        return report_dir

    def _check_local_directories(self, trainer: pl.Trainer, report_dir: str) -> None:
        _check_writable(report_dir, "HBMProfiler(dirpath=...): the report directory",
                        "Pass a writable directory, e.g. HBMProfiler(dirpath='hbm_report').")  # fmt: skip
        _check_report_names(report_dir)
        for callback in [] if getattr(trainer, "fast_dev_run", False) else trainer.checkpoint_callbacks:  # it saves none
            if not isinstance(callback, ModelCheckpoint) or (callback.save_top_k == 0 and not callback.save_last):
                continue  # saves nothing
            # dirpath None: ModelCheckpoint.setup (after this hook) puts it under the logger's save_dir
            logger_dir = getattr(trainer.loggers[0], "save_dir", None) if trainer.loggers else None
            directory = callback.dirpath or logger_dir or trainer.default_root_dir
            _check_writable(str(directory), "ModelCheckpoint(dirpath=...): the checkpoint directory",
                            "Pass ModelCheckpoint(dirpath=<a writable directory>) or Trainer(default_root_dir=...).")  # fmt: skip

    def _warn_earlier_report(self, directory: str) -> None:
        """Another run's report in ``directory`` (an earlier fit, this instance's included): named with the fix, as
        Lightning's ModelCheckpoint warns of a checkpoint directory that is not empty. Nothing is deleted; this fit's
        report replaces those files when it is written (the ``_oom`` ones only if this fit runs out of memory)."""
        if "://" in directory or not os.path.isdir(directory):
            return  # remote (fsspec) storage: not listed; a directory still to be created holds nothing
        found = sorted(name for name in os.listdir(directory) if REPORT_FILES.fullmatch(name))
        if not found:
            return
        if self.dirpath is not None:
            fix = f"pass a fresh directory, e.g. HBMProfiler(dirpath={os.path.join(self.dirpath, 'run2')!r})"
        else:
            fix = "pass HBMProfiler(dirpath=<a fresh directory>) or use a logger (each run gets its own version_N folder)"
        rank_zero_warn(
            f"HBMProfiler: the report directory {directory!r} already holds another run's report: {', '.join(found)}. "
            f"This fit replaces them when it writes its own (the _oom files only if it runs out of memory, snapshots only "
            f"with snapshot_steps on CUDA); nothing was deleted. To keep them, {fix}, or move them away before fitting."
        )

    def _maybe_start_history(self, pl_module: pl.LightningModule, step: int) -> None:
        if self.snapshot_steps is None or self._recording or step != self.snapshot_steps[0]:
            return
        if cuda_device(pl_module) is None:
            return
        torch_compat.record_memory_history(max_entries=self.snapshot_max_entries)
        self._recording = True

    def _maybe_stop_history(self, trainer: pl.Trainer, pl_module: pl.LightningModule, step: int) -> None:
        if not self._recording or self.snapshot_steps is None or step < self.snapshot_steps[1]:
            return
        self.snapshot_path = self._dump_snapshot(trainer, "hbm_snapshot")
        torch_compat.record_memory_history(enabled=None)
        self._recording = False

    def _dump_snapshot(self, trainer: pl.Trainer, stem: str) -> Optional[str]:
        if not torch.cuda.is_available():
            return None
        suffix = f"_rank{trainer.global_rank}" if trainer.world_size > 1 else ""
        path = os.path.join(self._dir(trainer), f"{stem}{suffix}.pickle")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        torch_compat.dump_memory_snapshot(path)
        print(f"HBMProfiler: CUDA memory snapshot written to {path} (open it at https://pytorch.org/memory_viz)")
        return path

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.used = run_setup(trainer, pl_module)

    # -- report ----------------------------------------------------------------------------------
    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._recording:
            self.snapshot_path = self._dump_snapshot(trainer, "hbm_snapshot")
            torch_compat.record_memory_history(enabled=None)
            self._recording = False
        directory = self._dir(trainer)  # broadcast inside: call on every rank
        if trainer.is_global_zero and self.rows:
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

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.steps.abandon()  # the dispatch modes must not outlive the failed step
        if not isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
            return
        try:
            self.steps.keep_failed_step(pl_module, trainer.optimizers)  # died after the forward: keep what it saw
            suffix = f"_oom_rank{trainer.global_rank}" if trainer.world_size > 1 else "_oom"
            # no collective here: the other ranks may not have failed; trainer.log_dir would broadcast
            directory = self.dirpath or trainer.default_root_dir
            if trainer.loggers and self.dirpath is None:
                directory = getattr(trainer.loggers[0], "log_dir", None) or directory
            paths = self.write_report(directory, "hbm_profile" + suffix)
            if cuda_device(pl_module) is not None:
                path = os.path.join(directory, f"hbm_snapshot{suffix}.pickle")
                torch_compat.dump_memory_snapshot(path)
                paths["snapshot"] = path
            print(f"HBMProfiler: out of memory. {self.diagnosis()}\nReport: {paths}")
        except Exception as err:  # the report must never hide the out-of-memory error itself
            log.error("HBMProfiler could not write the out-of-memory report: %s", err)

    def report(self) -> MemoryReport:
        """The measured steps as a :class:`~lightning_hbm.memory.report.MemoryReport` (what is written and printed)."""
        return MemoryReport(self.rows, columns(), self.modules, self.snapshot_path, self.used)

    def diagnosis(self) -> str:
        """The category that dominated the last measured step, and the feature that shrinks it."""
        return self.report().diagnosis()

    def peak_row(self) -> Optional[dict[str, Any]]:
        """The measured step with the largest category total."""
        return self.report().peak_row()

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

    def figure_data(self) -> Optional[ProfileFigure]:
        """The picture's data: the detailed step with the largest peak (or the one that ran out of memory), with the
        planner's prediction and the budget (given here, else AutoFit's); None when no detailed step ran."""
        if self.figure is None:
            return None
        prediction = self.prediction if self.prediction is not None else self.used.get("predicted_peak")
        budget = self.budget if self.budget is not None else self.used.get("budget")
        return replace(self.figure, prediction=prediction, budget=budget)

    def print_summary(self, paths: dict[str, str]) -> None:
        """Console table: each category at the largest forward-end step and at the step peak (detailed step)."""
        self.report().print_summary(paths)

    def _dir(self, trainer: pl.Trainer) -> str:
        return self.dirpath or trainer.log_dir or trainer.default_root_dir


def run_setup(trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
    """What the run used, for advice that is not already followed: transforms, optimizers, budget, plan."""
    used: dict[str, Any] = {
        "transforms": applied_transforms(pl_module),
        "optimizers": [type(lightning_compat.unwrap_optimizer(opt)).__name__ for opt in trainer.optimizers],
        "precision": str(trainer.precision),
        "facts": run_facts(trainer, pl_module).as_dict(),  # what the advice reads (lightning_hbm.memory.facts.RunFacts)
    }
    # AutoFit: its budget and the chosen candidate's predicted step peak. Found by duck typing: the planner
    # sits above the callbacks (tests/test_layering.py).
    for callback in trainer.callbacks:  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        if hasattr(callback, "budget") and hasattr(callback, "chosen"):
            used["budget"] = int(callback.budget)
            if callback.chosen is not None:
                used["predicted_peak"] = int(callback.chosen.peak)
    return used


def _check_writable(directory: str, what: str, fix: str) -> None:
    """``ValueError`` unless ``directory`` is, or can be created as, a directory this process can write to.

    Nothing is left behind: the nearest existing ancestor is checked (``os.access``, then a probe file created and
    removed, which also catches read-only mounts and root-owned paths that ``os.access`` misjudges).
    """
    if "://" in directory:
        return  # remote (fsspec) storage: no local permission to read
    existing = os.path.abspath(os.path.expanduser(directory))
    while not os.path.lexists(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{what} {directory!r} cannot be created: {existing!r} is a file, not a directory. {fix}")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {directory!r} is not writable: {existing!r} is read-only for this user. {fix}")
    try:
        handle, probe = tempfile.mkstemp(prefix=".hbm_write_check_", dir=existing)
        os.close(handle)
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"{what} {directory!r} is not writable: creating a file in {existing!r} failed ({err}). {fix}") from err


#: The files a fit's report writes into its directory (``{stem}.csv/json/png`` and the figure's data).
REPORT_NAMES = ("hbm_profile.csv", "hbm_profile.json", "hbm_profile.png", "hbm_figure.json")


def _check_report_names(directory: str) -> None:
    """A ``ValueError`` at fit start when a name the report writes is taken by a folder (a file cannot replace it).
    Was: the run trained, then ``IsADirectoryError`` ended ``fit()`` at its report."""
    if "://" in directory:
        return
    for name in REPORT_NAMES:
        path = os.path.join(directory, name)
        if os.path.isdir(path) and not os.path.islink(path):
            raise ValueError(
                f"HBMProfiler(dirpath=...): {path!r} is a folder, where the report's file of that name goes. Move or "
                "rename it, or pass another folder, e.g. HBMProfiler(dirpath='hbm_report')."
            )


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"HBMProfiler: {name} must be an int, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"HBMProfiler: {name} must be >= {minimum}, got {value}.")


__all__ = ["COLUMNS", "FIRST_STEPS", "REMEDIES", "HBMProfiler", "columns"]
