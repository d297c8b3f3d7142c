"""Lightning's progress bar and model summary, showing lightning_hbm runs as they are.

Lightning's defaults get three things wrong for these runs:

* the model summary counts ``numel()``: a bitsandbytes 4-bit weight packs two values per uint8 element, so a
  139.4M-parameter QLoRA model shows 86.3M; and it prints a FLOPs column of zeros (and "Total FLOPs: 0") for every
  model without an ``example_input_array`` (Lightning measures nothing then);
* the rich progress bar titles a run bounded by ``max_steps`` alone "Epoch 0/-2";
* a run resumed mid-epoch shows "30/9": the bar's position is the batch index in the epoch, its total only the
  steps left (and both ignore ``accumulate_grad_batches``).

The subclasses here fix that and change nothing else. :func:`adopt_display` swaps the Trainer's stock instances for
them (same object, same settings); :func:`lightning_hbm.surgery.install` calls it, so every Trainer that uses
lightning_hbm (a :class:`~lightning_hbm.SurgeryCallback`, ``QuantizedPrecision``, ``AutoFit``) gets them, built in
Python or by the CLI. A progress bar or summary of any other class is left as it is.
"""

from __future__ import annotations

import logging
from typing import Any, Union, cast

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelSummary, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.strategies.deepspeed import DeepSpeedStrategy
from lightning.pytorch.utilities.model_summary.model_summary import ModelSummary as SummaryTable
from lightning.pytorch.utilities.model_summary.model_summary import get_formatted_model_size, get_human_readable_count
from typing_extensions import override

from lightning_hbm._compat import _RICH_AVAILABLE
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.memory.storage import parameter_bytes, parameter_count

log = logging.getLogger("lightning.pytorch.callbacks.model_summary")  # where Lightning's own summary goes


class LogicalSummary(SummaryTable):
    """Lightning's model summary table, counting parameters the way lightning_hbm does.

    Counts are logical (:func:`~lightning_hbm.memory.storage.parameter_count`: a packed 4-bit weight counts its
    unpacked elements), the size is the bytes the parameters really take (quantization constants included).
    """

    @property
    @override
    def param_nums(self) -> list[int]:
        return [parameter_count(layer._module) for layer in self._layer_summary.values()]

    @property
    @override
    def total_parameters(self) -> int:
        return parameter_count(self._model)

    @property
    @override
    def trainable_parameters(self) -> int:
        return parameter_count(self._model, trainable=True)

    @property
    @override
    def model_size(self) -> float:
        return parameter_bytes(self._model) / 1e6  # MB, as Lightning's estimate is given


class _LogicalCounts:
    """The summary callbacks' table: :class:`LogicalSummary` (DeepSpeed ZeRO-3 keeps Lightning's: only it knows the
    sizes of sharded parameters)."""

    def _summary(self, trainer: pl.Trainer, pl_module: Any) -> Any:
        if isinstance(trainer.strategy, DeepSpeedStrategy) and trainer.strategy.zero_stage_3:
            return super()._summary(trainer, pl_module)  # type: ignore[misc]
        return LogicalSummary(pl_module, max_depth=self._max_depth)  # type: ignore[attr-defined]


class HBMModelSummary(_LogicalCounts, ModelSummary):
    """Lightning's ``ModelSummary`` with logical parameter counts, and no FLOPs of zeros when none were measured."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            args = (total_parameters, trainable_parameters, model_size, total_training_modes, total_flops)
            return ModelSummary.summarize(summary_data, *args, **summarize_kwargs)
        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = lightning_compat.format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, columns)
        log.info("\n" + table)


class HBMRichModelSummary(_LogicalCounts, RichModelSummary):
    """Lightning's ``RichModelSummary`` with logical parameter counts, and no FLOPs of zeros when none were measured."""

    @staticmethod
    @override
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        args = (total_parameters, trainable_parameters, model_size, total_training_modes, total_flops)
        if total_flops:
            return RichModelSummary.summarize(summary_data, *args, **summarize_kwargs)
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, justify="right" if name.startswith("Params") else "left", no_wrap=name == "Name")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*map(str, row))
        console = get_console()
        console.print(table)
        counts = (trainable_parameters, total_parameters - trainable_parameters, total_parameters)
        trainable, frozen, total = (get_human_readable_count(int(n)).strip() for n in counts)
        size = get_formatted_model_size(model_size)
        console.print(f"Params: {trainable} trainable, {frozen} frozen, {total} total (4-bit weights counted unpacked); "
                      f"stored in {size} MB", highlight=False)  # fmt: skip


class _StepBoundTotal:
    """The train bar's total in the bar's own units (``batch_idx + 1`` in the epoch), for runs bounded by ``max_steps``.

    Lightning's total is ``min(batches per epoch, steps left)``, only when ``max_epochs == -1``: a run resumed at
    batch 21 of 40 with 9 steps left counts 22..30 against a total of 9, and with gradient accumulation a step is
    several batches. Here: the bar's position plus the batches the steps left take, re-set after every batch (where
    the hook's ``batch_idx`` is the position; at an epoch's start the epoch is assumed to start at batch 0).
    """

    _position = 0  # batch_idx + 1 of the last batch shown; 0 at an epoch's start

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._position = 0
        super().on_train_epoch_start(trainer, pl_module)  # type: ignore[misc]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._position = batch_idx + 1
        self._set_train_total(self.total_train_batches)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)  # type: ignore[misc]

    def _set_train_total(self, total: Union[int, float]) -> None:
        """Give the bar already drawn for this epoch its new total (none drawn yet: nothing to do)."""

    @property
    def total_train_batches(self) -> Union[int, float]:
        trainer: pl.Trainer = self.trainer  # type: ignore[attr-defined]
        batches, position = trainer.num_training_batches, self._position
        if trainer.max_steps is None or trainer.max_steps < 0:
            return max(batches, position)  # never n > total (a resumed loader Lightning restarts: it warns)
        accumulate = max(int(trainer.accumulate_grad_batches), 1)
        left = max(trainer.max_steps - trainer.global_step, 0) * accumulate - position % accumulate  # a step under way
        return max(position, min(batches, position + left))


class HBMRichProgressBar(_StepBoundTotal, RichProgressBar):
    """Lightning's ``RichProgressBar``: "Epoch 0", not "Epoch 0/-2", under ``max_steps``; a resumed bar's right total."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        if self.trainer.max_epochs is not None and self.trainer.max_epochs < 0:  # max_steps bounds the run
            return f"Epoch {current_epoch}".ljust(len(self.validation_description))
        return super()._get_train_description(current_epoch)

    def _set_train_total(self, total: Union[int, float]) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=total)


class HBMTQDMProgressBar(_StepBoundTotal, TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` with the right total under ``max_steps``, on resumed runs too."""

    def _set_train_total(self, total: Union[int, float]) -> None:
        if self.is_disabled:
            return
        bar = self.train_progress_bar
        if bar.total is None:  # resumed mid-epoch: Lightning ran no on_train_epoch_start, the bar is "Training: 0/?"
            bar.set_description(f"Epoch {self.trainer.current_epoch}")
        bar.total = None if total == float("inf") else total  # tqdm takes no inf


# Lightning's stock classes (what the Trainer adds by default) -> the subclass that replaces them
_REPLACEMENTS: dict[type, type] = {
    ModelSummary: HBMModelSummary,
    RichModelSummary: HBMRichModelSummary,
    RichProgressBar: HBMRichProgressBar,
    TQDMProgressBar: HBMTQDMProgressBar,
}


def adopt_display(trainer: pl.Trainer) -> None:
    """Turn the Trainer's stock progress bar and model summary into the subclasses above (idempotent).

    Only instances whose class is exactly Lightning's are changed, and in place (``__class__``): every setting the
    user or Lightning gave them stays, and ``trainer.callbacks`` holds the same objects. Must run before
    ``on_fit_start`` (the summary prints there): ``Callback.setup`` does.
    """
    for callback in cast(Any, trainer).callbacks:  # set by Lightning's connector: not declared on the class
        replacement = _REPLACEMENTS.get(type(callback))
        if replacement is not None:
            callback.__class__ = replacement


def default_progress_bar() -> Union[HBMRichProgressBar, HBMTQDMProgressBar]:
    """The progress bar Lightning would add (rich if installed, else tqdm), as its lightning_hbm subclass."""
    return HBMRichProgressBar() if _RICH_AVAILABLE else HBMTQDMProgressBar()


def default_model_summary(max_depth: int = 1) -> Union[HBMModelSummary, HBMRichModelSummary]:
    """The model summary Lightning would add (rich if installed), as its lightning_hbm subclass."""
    return HBMRichModelSummary(max_depth) if _RICH_AVAILABLE else HBMModelSummary(max_depth)


__all__ = [
    "HBMModelSummary",
    "HBMRichModelSummary",
    "HBMRichProgressBar",
    "HBMTQDMProgressBar",
    "LogicalSummary",
    "adopt_display",
    "default_model_summary",
    "default_progress_bar",
]
