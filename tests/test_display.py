"""Lightning's progress bar and model summary under the Python API: a Trainer that uses lightning_hbm shows 4-bit
weights unpacked and the right bar totals (max_steps, resumed runs); a plain Trainer keeps Lightning's classes."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, ModelSummary, ProgressBar, RichModelSummary, RichProgressBar, TQDMProgressBar

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.display import (
    HBMModelSummary,
    HBMRichModelSummary,
    HBMRichProgressBar,
    HBMTQDMProgressBar,
    adopt_display,
)
from lightning_hbm.memory.storage import parameter_count

pytest.importorskip("rich")  # Lightning's default bar and summary are the rich ones when rich is installed


def _bar_state(bar: ProgressBar) -> tuple[float, float, str]:
    """``(position, total, title)`` of the train bar as last drawn."""
    if isinstance(bar, RichProgressBar):
        task = next(t for t in bar.progress.tasks if t.id == bar.train_progress_bar_id)
        return task.completed, task.total, task.description.strip()
    tqdm_bar = bar.train_progress_bar
    return tqdm_bar.n, tqdm_bar.total, tqdm_bar.desc.strip().rstrip(":")  # tqdm adds ": "


def _qlora_trainer(trainer_factory: Callable, **kwargs: Any) -> Any:
    plugins = [QuantizedPrecision("nf4-dq", dtype="float32")]
    callbacks = [LoRA(r=2), *kwargs.pop("callbacks", [])]
    kwargs = {"enable_progress_bar": True, "enable_model_summary": True, **kwargs}
    return trainer_factory(plugins=plugins, callbacks=callbacks, **kwargs)


def test_qlora_trainer_summary_counts_logical_parameters_and_bar_shows_max_steps(
    llama_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    printed: dict[str, Any] = {}
    original = HBMRichModelSummary.summarize

    def record(data: Any, total: int, trainable: int, size: float, modes: Any, total_flops: int, **kw: Any) -> None:
        printed.update(total=total, trainable=trainable, columns=[name for name, _ in data])
        original(data, total, trainable, size, modes, total_flops, **kw)

    monkeypatch.setattr(HBMRichModelSummary, "summarize", staticmethod(record))
    model, trainer = llama_factory(), _qlora_trainer(trainer_factory, max_steps=3)
    assert type(trainer.progress_bar_callback) is RichProgressBar  # Lightning's own until the run starts
    trainer.fit(model, datamodule_factory())

    assert type(trainer.progress_bar_callback) is HBMRichProgressBar
    assert [type(c) for c in trainer.callbacks if isinstance(c, ModelSummary)] == [HBMRichModelSummary]
    assert printed["total"] == parameter_count(model) > sum(p.numel() for p in model.parameters())  # 4-bit unpacked
    assert printed["trainable"] == parameter_count(model, trainable=True)
    position, total, title = _bar_state(trainer.progress_bar_callback)
    assert (position, total) == (3, 3) and title == "Epoch 0"  # not "Epoch 0/-2"


@pytest.mark.parametrize("bar_class", [RichProgressBar, TQDMProgressBar])
def test_resumed_bar_counts_to_the_max_steps_total(
    bar_class: type, llama_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path
) -> None:
    """Resumed at batch 3 of the epoch with 2 steps left: the bar ends at 5/5, not 5/2."""
    saver = ModelCheckpoint(dirpath=tmp_path, filename="mid", every_n_train_steps=3)  # saved at batch 3 of 64
    trainer = _qlora_trainer(trainer_factory, max_steps=3, enable_model_summary=False, enable_checkpointing=True, callbacks=[saver])
    trainer.fit(llama_factory(), datamodule_factory())

    bar = bar_class(refresh_rate=3)  # a stock class the user configured: swapped, its settings kept
    trainer = _qlora_trainer(trainer_factory, max_steps=5, enable_model_summary=False, callbacks=[bar])
    trainer.fit(llama_factory(), datamodule_factory(), ckpt_path=tmp_path / "mid.ckpt")
    assert trainer.progress_bar_callback is bar and type(bar) is {RichProgressBar: HBMRichProgressBar}.get(bar_class, HBMTQDMProgressBar)
    assert bar.refresh_rate == 3
    position, total, title = _bar_state(bar)
    assert (position, total) == (5, 5) and title == "Epoch 0"


def _bar_total(bar_class: type, position: int = 0, **trainer: Any) -> float:
    """The total ``bar_class`` gives at ``position`` (``batch_idx + 1``) of a run in the state ``trainer``."""
    fields = dict(num_training_batches=40, max_steps=30, max_epochs=-1, global_step=0, accumulate_grad_batches=1)
    bar = bar_class()
    bar._trainer = SimpleNamespace(**{**fields, **trainer})
    bar._position = position
    return bar.total_train_batches


def test_bar_total_counts_batches_of_the_epoch() -> None:
    assert _bar_total(RichProgressBar, 22, global_step=22) == 8  # Lightning's: the steps left, against batch 22..30
    assert _bar_total(HBMRichProgressBar, 22, global_step=22) == 30
    assert _bar_total(HBMRichProgressBar, 0, global_step=21) == 9  # an epoch's start: it starts at batch 0
    assert _bar_total(HBMRichProgressBar, 21, global_step=10, accumulate_grad_batches=2, num_training_batches=99) == 60  # a step under way
    assert _bar_total(HBMTQDMProgressBar, 20, global_step=10, accumulate_grad_batches=2) == 40  # the epoch ends first
    assert _bar_total(HBMRichProgressBar, 5, max_steps=-1, max_epochs=3) == 40  # epochs bound the run
    assert _bar_total(HBMRichProgressBar, 45, max_steps=-1, max_epochs=3) == 45  # never n > total
    assert _bar_total(HBMRichProgressBar, 0, max_steps=50, max_epochs=3, global_step=45) == 5  # both: steps first


def test_plain_trainer_keeps_lightnings_classes(gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable) -> None:
    trainer = trainer_factory(max_steps=1, enable_progress_bar=True, enable_model_summary=True)
    trainer.fit(gpt_factory(), datamodule_factory())
    assert type(trainer.progress_bar_callback) is RichProgressBar
    assert [type(c) for c in trainer.callbacks if isinstance(c, ModelSummary)] == [RichModelSummary]


def test_only_stock_classes_are_swapped() -> None:
    class MyBar(RichProgressBar):
        pass

    class MySummary(ModelSummary):
        pass

    callbacks = [MyBar(), MySummary(max_depth=3), ModelSummary(max_depth=2), TQDMProgressBar(refresh_rate=4)]
    trainer = SimpleNamespace(callbacks=list(callbacks))
    adopt_display(trainer)
    adopt_display(trainer)  # idempotent
    assert [type(c) for c in trainer.callbacks] == [MyBar, MySummary, HBMModelSummary, HBMTQDMProgressBar]
    assert trainer.callbacks == callbacks and callbacks[2]._max_depth == 2 and callbacks[3].refresh_rate == 4


def test_text_summary_without_flops_hides_them(caplog: pytest.LogCaptureFixture) -> None:
    data = [(" ", ["0"]), ("Name", ["model"]), ("Type", ["Linear"]), ("Params", ["1.0 K"]), ("Mode", ["train"]), ("FLOPs", ["0"])]
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.callbacks.model_summary"):
        HBMModelSummary.summarize(data, 1000, 10, 0.004, {"train": 1, "eval": 0}, total_flops=0)
        HBMModelSummary.summarize(data, 1000, 10, 0.004, {"train": 1, "eval": 0}, total_flops=7)
    without, measured = (r.getMessage() for r in caplog.records)
    assert "FLOPs" not in without and "Flops" not in without and "1.0 K     Total params" in without
    assert "990       Non-trainable params" in without
    assert "FLOPs" in measured and "Total Flops" in measured  # measured: Lightning's table as it is
