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

The callback is a thin Lightning adapter: what it measures, keeps and writes is its
:class:`~lightning_hbm.profiling.memory_profile.MemoryProfile` (``profiler.profile``), usable without a Trainer; the
callback resolves what the Trainer knows (the cadence, the report's directory, the ranks) and checks the directories at
fit start. Reports (CSV, JSON, console summary) are rendered by :mod:`lightning_hbm.memory.report`, which
``lightning-hbm report`` uses as well. The PNG is the picture of a detailed step: a
:class:`~lightning_hbm.profiling.timeline.StepRecorder` runs on top of its tracker and
:mod:`lightning_hbm.profiling.figure` builds and draws every term over the step's ops (``hbm_figure.json``).

On CUDA the allocator's own figures are added, so what the categories do not explain (CUDA
context, allocator caching, fragmentation) is shown, not hidden.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Sequence
from typing import Any, Callable, Generic, Optional, TypeVar, Union, overload

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.memory.categories import CATEGORIES
from lightning_hbm.memory.report import REMEDIES, MemoryReport
from lightning_hbm.memory.terms import side_terms
from lightning_hbm.profiling.figure import PeakPrediction, ProfileFigure
from lightning_hbm.profiling.memory_profile import FIRST_STEPS, REPORT_FILES, REPORT_NAMES, MemoryProfile
from lightning_hbm.profiling.run_facts import run_facts
from lightning_hbm.profiling.steps import COLUMNS, CUDA_FIELDS, StepMemory, columns
from lightning_hbm.resume.io import gather_from_ranks
from lightning_hbm.surgery import applied_transforms

log = logging.getLogger(__name__)

_T = TypeVar("_T")


class _OfProfile(Generic[_T]):
    """``profiler.<name>`` is its :class:`MemoryProfile`'s ``<name>``, read and written there (the callback's
    attributes and methods before the domain object was split out, kept: ``profiler.rows``, ``profiler.report()``)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, profiler: None, owner: type) -> _OfProfile[_T]: ...
    @overload
    def __get__(self, profiler: HBMProfiler, owner: type) -> _T: ...
    def __get__(self, profiler: Optional[HBMProfiler], owner: type) -> Union[_OfProfile[_T], _T]:
        return self if profiler is None else getattr(profiler.profile, self.name)  # type: ignore[no-any-return]

    def __set__(self, profiler: HBMProfiler, value: _T) -> None:
        setattr(profiler.profile, self.name, value)


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
        #: the run's measured steps and their report: the domain object this callback drives
        self.profile = MemoryProfile(
            every_n_steps, detailed_steps, max_rows, snapshot_steps, snapshot_max_entries, summary, prediction, budget
        )
        self.every_n_steps = every_n_steps  # None: the Trainer's log_every_n_steps, resolved in setup
        self.dirpath = dirpath

    # the profile's, read (and written) as the profiler's own: ``profiler.rows``, ``profiler.modules[1]``, ...
    rows: _OfProfile[list[dict[str, Any]]] = _OfProfile()
    modules: _OfProfile[dict[int, dict[str, dict[str, int]]]] = _OfProfile()
    figure: _OfProfile[Optional[ProfileFigure]] = _OfProfile()
    dropped_rows: _OfProfile[int] = _OfProfile()
    steps: _OfProfile[StepMemory] = _OfProfile()
    used: _OfProfile[dict[str, Any]] = _OfProfile()
    snapshot_path: _OfProfile[Optional[str]] = _OfProfile()
    detailed_steps: _OfProfile[frozenset[int]] = _OfProfile()
    snapshot_steps: _OfProfile[Optional[tuple[int, ...]]] = _OfProfile()
    snapshot_max_entries: _OfProfile[int] = _OfProfile()
    summary: _OfProfile[bool] = _OfProfile()
    max_rows: _OfProfile[int] = _OfProfile()
    prediction: _OfProfile[Optional[int]] = _OfProfile()
    budget: _OfProfile[Optional[int]] = _OfProfile()
    report: _OfProfile[Callable[[], MemoryReport]] = _OfProfile()
    diagnosis: _OfProfile[Callable[[], str]] = _OfProfile()
    peak_row: _OfProfile[Callable[[], Optional[dict[str, Any]]]] = _OfProfile()
    write_report: _OfProfile[Callable[[str, str], dict[str, str]]] = _OfProfile()
    figure_data: _OfProfile[Callable[[], Optional[ProfileFigure]]] = _OfProfile()
    print_summary: _OfProfile[Callable[[dict[str, str]], None]] = _OfProfile()

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        every = self.every_n_steps or max(int(trainer.log_every_n_steps), 1)  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's LoggerConnector sets it)
        if stage == "fit":  # one report per fit: a reused instance would otherwise mix two runs' rows
            directory = _check_directories(trainer, self.dirpath)
            if trainer.is_global_zero:
                _warn_earlier_report(directory, self.dirpath)
            self.profile.new_run(every)
        else:
            self.profile.every_n_steps = every
        if self.profile.snapshot_steps is not None and trainer.strategy.root_device.type != "cuda":
            rank_zero_warn("HBMProfiler: snapshot_steps records CUDA memory history; this run is not on CUDA, so no snapshot.")

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.profile.used = run_setup(trainer, pl_module)
        # Lightning zeroes the gradients before the backward: none at a step's end means a strategy keeps them elsewhere
        # (CPUOffloadStrategy's on the host), not a loop zeroing them early (MemoryProfile.end_step's warning)
        self.profile.said_no_gradients = True

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.profile.start_step(trainer.global_step, batch_idx, pl_module, trainer.optimizers, batch)

    @override
    def on_before_zero_grad(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.profile.forward_ended("zero_grad", pl_module, trainer.optimizers)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: torch.Tensor) -> None:
        self.profile.forward_ended("backward", pl_module, trainer.optimizers)

    @override
    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer) -> None:
        self.profile.enter_phase("optimizer")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        metrics = self.profile.end_step(pl_module, trainer.optimizers, reduce=lambda row: _max_over_ranks(trainer, row))
        # Straight to the loggers, as DeviceStatsMonitor does: self.log would cost more than the
        # measurement and would only reach the loggers every log_every_n_steps anyway.
        if metrics is not None:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=lightning_compat.batches_that_stepped(trainer))
        if self.profile.history_due(trainer.global_step):
            self.profile.dump_history(_report_dir(trainer, self.dirpath), _rank_suffix(trainer, ""))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        directory = _report_dir(trainer, self.dirpath)  # broadcast inside: call on every rank
        self.profile.dump_history(directory, _rank_suffix(trainer, ""))  # still recording: the history to the end
        if trainer.is_global_zero:
            self.profile.finish(directory)

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self.profile.abandon_step()  # the dispatch modes must not outlive the failed step
        if not isinstance(exception, (torch.OutOfMemoryError, MemoryError)):
            return
        try:
            # no collective here: the other ranks may not have failed; trainer.log_dir would broadcast
            directory = self.dirpath or trainer.default_root_dir
            if trainer.loggers and self.dirpath is None:
                directory = getattr(trainer.loggers[0], "log_dir", None) or directory
            self.profile.write_oom_report(directory, _rank_suffix(trainer, "_oom"), pl_module, trainer.optimizers)
        except Exception as err:  # the report must never hide the out-of-memory error itself
            log.error("HBMProfiler could not write the out-of-memory report: %s", err)


def _report_dir(trainer: pl.Trainer, dirpath: Optional[str]) -> str:
    """The report's directory: ``dirpath``, else the Trainer's ``log_dir`` (a broadcast: call it on every rank)."""
    return dirpath or trainer.log_dir or trainer.default_root_dir


def _rank_suffix(trainer: pl.Trainer, suffix: str) -> str:
    """``suffix``, with ``_rank{r}`` when there are several ranks (each writes its own file)."""
    return f"{suffix}_rank{trainer.global_rank}" if trainer.world_size > 1 else suffix


def _max_over_ranks(trainer: pl.Trainer, row: dict[str, Any]) -> dict[str, Any]:
    """The row with each measured figure at its maximum over the ranks (a collective: every rank measures the same
    steps, so it is matched on all ranks)."""
    if trainer.world_size <= 1:
        return row
    keys = [k for k in (*CATEGORIES, "total", "tracked_peak", *side_terms(), *CUDA_FIELDS) if row[k] is not None]
    local = torch.tensor([row[k] for k in keys], dtype=torch.int64, device=trainer.strategy.root_device)
    gathered = trainer.strategy.all_gather(local)
    maxima = gathered.reshape(-1, len(keys)).max(dim=0).values.tolist()
    return {**row, **dict(zip(keys, (int(v) for v in maxima)))}


# -- fit start: the directories checked, another run's report named ---------------------------------------------
def _check_directories(trainer: pl.Trainer, dirpath: Optional[str]) -> str:
    """The report's and the checkpoints' directories must be writable: refused at fit start (before the model
    is changed), not at the report after training or at the first checkpoint. Checked on every rank and the
    results gathered, so every rank raises the same error naming the rank(s) that cannot write (was: that rank
    raised alone, the others waited in the next collective, session 31). Returns the report's directory."""
    report_dir = _report_dir(trainer, dirpath)  # broadcast inside: called on every rank
    try:
        _check_local_directories(trainer, report_dir)
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


def _check_local_directories(trainer: pl.Trainer, report_dir: str) -> None:
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


def _warn_earlier_report(directory: str, dirpath: Optional[str]) -> None:
    """Another run's report in ``directory`` (an earlier fit, this instance's included): named with the fix, as
    Lightning's ModelCheckpoint warns of a checkpoint directory that is not empty. Nothing is deleted; this fit's
    report replaces those files when it is written (the ``_oom`` ones only if this fit runs out of memory)."""
    if "://" in directory or not os.path.isdir(directory):
        return  # remote (fsspec) storage: not listed; a directory still to be created holds nothing
    found = sorted(name for name in os.listdir(directory) if REPORT_FILES.fullmatch(name))
    if not found:
        return
    if dirpath is not None:
        fix = f"pass a fresh directory, e.g. HBMProfiler(dirpath={os.path.join(dirpath, 'run2')!r})"
    else:
        fix = "pass HBMProfiler(dirpath=<a fresh directory>) or use a logger (each run gets its own version_N folder)"
    rank_zero_warn(
        f"HBMProfiler: the report directory {directory!r} already holds another run's report: {', '.join(found)}. "
        f"This fit replaces them when it writes its own (the _oom files only if it runs out of memory, snapshots only "
        f"with snapshot_steps on CUDA); nothing was deleted. To keep them, {fix}, or move them away before fitting."
    )


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


__all__ = ["COLUMNS", "FIRST_STEPS", "REMEDIES", "REPORT_NAMES", "HBMProfiler", "MemoryProfile", "columns"]
