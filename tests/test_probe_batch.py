"""The probe step's batch (issue 55): drawn once and trained first, so a loader read once loses nothing.

Before, the probe step drew its batch from a pass of its own: a one-pass stream (a ``DataLoader`` over an
``IterableDataset`` reading a socket or a queue) lost its first batch to the probe, and a module's own iterator was
not probed at all (the model's source decided alone). Now the batch the probe drew is the loop's first, followed by
the rest of the same pass.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Iterator

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

sys.path.insert(0, str(Path(__file__).resolve().parent / "layers"))  # the probe-step models of test_readers

from test_readers import Reads, Wrapped, tokens  # noqa: E402

from lightning_hbm import LoRA, QuantizedPrecision  # noqa: E402
from lightning_hbm._compat import torch as torch_compat  # noqa: E402
from lightning_hbm.layers import readers  # noqa: E402


def item(i: int) -> torch.Tensor:
    """A batch that says which item it is (its first token)."""
    batch = tokens(i + 10)
    batch[0, 0] = i + 1
    return batch


class Stream(IterableDataset):
    """A one-pass stream: each item is read once; a second ``iter`` continues where the first stopped (a socket)."""

    def __init__(self, n: int) -> None:
        self.items: Iterator[int] = iter(range(n))
        self.opened = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        self.opened += 1
        for i in self.items:
            yield item(i)


class Again(IterableDataset):
    """A stream read anew at every ``iter`` (files read from the start each epoch)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (item(i) for i in range(self.n))


class Recorded(Wrapped):
    """Records the item of every batch the loop trains (``on_train_batch_start``: the probe step never calls it)."""

    def __init__(self, loader: Any) -> None:
        super().__init__(Reads(), causal=False)
        self.loader, self.requested, self.trained = loader, 0, []

    def train_dataloader(self) -> Any:
        self.requested += 1
        return self.loader() if callable(self.loader) else self.loader

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.trained.append(int(batch[0, 0]) - 1)


def fit(module: pl.LightningModule, tmp_path: Path, epochs: int = 1, plugin: Any = None) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[plugin or QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)],
    )  # fmt: skip
    trainer.fit(module)
    return trainer


def test_a_one_pass_stream_loses_no_item_and_is_opened_once(tmp_path: Path) -> None:
    """Was: the probe's own pass read item 0 from the stream, and the loop's pass began at item 1."""
    stream = Stream(4)
    module = Recorded(DataLoader(stream, batch_size=None))
    fit(module, tmp_path)
    assert module.trained == [0, 1, 2, 3] and stream.opened == 1 and module.requested == 1
    assert readers.observation(module) is not None  # the probe step ran, on item 0


@pytest.mark.parametrize("settings", [{"rounding": "gptq"}, {"correction_rank": 2}], ids=["gptq", "correction"])
@pytest.mark.parametrize("kind", ["stream", "generator", "map-style"])
def test_the_quantization_probe_is_the_loaders_first_batch_and_loses_no_item(kind: str, settings: dict, tmp_path: Path) -> None:
    """The batches GPTQ and the correction are fitted on come from the train dataloader whatever gives it (was: only a
    datamodule; ``fit(model)`` with the module's own loader raised "found no probe batch"). Requested once; a loader
    read once gives its first batch only, trained first; a map-style one is read in a pass left as it was."""
    loaders = {
        "stream": lambda: DataLoader(Stream(4), batch_size=None),
        "generator": lambda: (item(i) for i in range(4)),
        "map-style": lambda: DataLoader([item(i) for i in range(4)], batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(0)),
    }
    class Forward(Recorded):  # the quantization probe runs the model's forward
        def forward(self, batch: torch.Tensor) -> torch.Tensor:
            return self.model(batch)

    module, plain = Forward(loaders[kind]), Forward(loaders[kind])
    fit(module, tmp_path, plugin=QuantizedPrecision("nf4-dq", dtype="float32", **settings))
    fit(plain, tmp_path)
    assert module.requested == 1 and sorted(module.trained) == [0, 1, 2, 3]
    assert module.trained == plain.trained  # the same order as a run whose quantization draws nothing


def test_a_modules_own_iterator_is_probed_and_loses_no_item(tmp_path: Path) -> None:
    """Was: a generator returned by ``train_dataloader()`` was not probed (drawing from it would have lost a batch):
    the model's source decided alone. Now its first batch is probed and trained first."""
    module = Recorded(lambda: (item(i) for i in range(3)))
    fit(module, tmp_path)
    assert module.trained == [0, 1, 2] and module.requested == 1
    assert readers.observation(module) is not None


def test_a_stream_with_persistent_workers_trains_every_epoch_whole(tmp_path: Path) -> None:
    """The pass kept for the loop is its first epoch's; persistent workers reset that same pass for the next."""
    module = Recorded(DataLoader(Again(3), batch_size=None, num_workers=1, persistent_workers=True))
    fit(module, tmp_path, epochs=2)
    assert module.trained == [0, 1, 2] * 2 and module.requested == 1
    assert readers.observation(module) is not None


def test_the_kept_pass_leaves_the_rngs_where_a_fresh_pass_leaves_them() -> None:
    """Creating a pass draws its workers' base seed: undone at the probe's draw, made again when the loop takes the
    pass, so every later draw (dropout, LoRA's initial values) is the one a run without the probe makes."""
    torch.manual_seed(0)
    start = torch.get_rng_state()
    loader = DataLoader(Again(3), batch_size=None)
    first, given = torch_compat.draw_keeping_the_pass(loader)  # type: ignore[misc]
    assert torch.equal(torch.get_rng_state(), start) and given is loader
    ours = [int(b[0, 0]) - 1 for b in loader]
    after_ours = torch.get_rng_state()
    torch.set_rng_state(start)
    plain = [int(b[0, 0]) - 1 for b in DataLoader(Again(3), batch_size=None)]
    assert ours == plain == [0, 1, 2] and int(first[0, 0]) == 1
    assert torch.equal(torch.get_rng_state(), after_ours)
    assert [int(b[0, 0]) - 1 for b in loader] == [0, 1, 2]  # the next pass is a fresh one


def test_a_step_that_changes_its_batch_in_place_does_not_change_what_trains(tmp_path: Path) -> None:
    """The probe step gets a copy of the batch the loop trains first."""

    class Shifts(Recorded):
        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            loss = super().training_step(batch, batch_idx)
            batch.add_(1)  # after the forward: the next call of this step would see other tokens
            return loss

    module = Shifts(DataLoader(Stream(2), batch_size=None))
    fit(module, tmp_path)
    assert module.trained == [0, 1]


@pytest.mark.parametrize("kind", ["map-style", "stateful"])
def test_loaders_read_again_or_restored_are_not_kept(kind: str) -> None:
    """A map-style loader's second pass reads the same indices (the probe's pass is separate, the order exact), and a
    stateful loader may be restored before its loop iterates: neither keeps the probe's pass."""
    from lightning_hbm.data import ResumableDataLoader

    loader = DataLoader([item(i) for i in range(3)], batch_size=None) if kind == "map-style" else ResumableDataLoader(
        [item(i) for i in range(3)], batch_size=None)  # fmt: skip
    assert not torch_compat.passes_once(loader)
    assert torch_compat.passes_once(DataLoader(Again(2), batch_size=None)) and torch_compat.passes_once(iter([1]))


@pytest.mark.parametrize("kind", ["map-style", "stream"])
def test_autofit_requests_the_loader_once_and_loses_no_item(kind: str, tmp_path: Path) -> None:
    """Was: AutoFit drew its planning batch from a ``train_dataloader()`` call of its own (the hook ran twice per fit)
    and from a pass of its own (a one-pass stream lost item 0)."""
    from lightning_hbm import AutoFit

    data = [item(i) for i in range(3)]
    stream = Stream(3)
    module = Recorded(lambda: DataLoader(data if kind == "map-style" else stream, batch_size=None))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[AutoFit(budget="1GiB", precisions=["nf4-dq"], lora_ranks=[4], checkpointing=["none"], optimizers=["user"])],
    )  # fmt: skip
    trainer.fit(module)
    assert module.requested == 1 and module.trained == [0, 1, 2]
    assert readers.observation(module) is not None


def test_predict_probes_its_own_step_never_training_step(tmp_path: Path) -> None:
    """Issue 55: ``trainer.predict`` ran the user's ``training_step`` on a predict batch ("could not run one step ...
    ValueError: not enough values to unpack"). It runs ``predict_step``, silently and once."""
    import warnings

    class Pairs(Wrapped):
        def __init__(self) -> None:
            super().__init__(Reads(), causal=False)
            self.calls: list[str] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.calls.append("training_step")
            inputs, targets = batch  # trains on (inputs, targets) pairs; predicts on inputs alone
            return super().training_step(inputs, batch_idx)

        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            self.calls.append("predict_step")
            return self.model(batch)

    module = Pairs()
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not run one step.*")
        out = trainer.predict(module, DataLoader([tokens(1), tokens(2)], batch_size=None))
    assert len(out) == 2 and "training_step" not in module.calls
    assert module.calls.count("predict_step") == 3  # the probe's (on fake tensors), then one per batch
    seen = readers.observation(module)
    assert seen is not None and "Pairs.predict_step on" in seen.ran


@pytest.mark.parametrize("data", ["empty-stream", "no-batches"])
def test_a_stage_without_a_batch_probes_nothing_and_says_no_wrong_advice(tmp_path: Path, data: str) -> None:
    """A stage that reads no batch (an empty stream, ``limit_val_batches=0``) has no step to probe: the model's source
    decides, without running the user's step on ``None`` and telling them to fix it."""
    import warnings

    class Validated(Recorded):
        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.model(batch)

    module = Validated(DataLoader(Stream(0), batch_size=None))
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)],
        limit_val_batches=0 if data == "no-batches" else 1.0,
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*could not run one step.*")
        warnings.filterwarnings("ignore", message=".*(empty|no .*batches|num_workers|limit_val_batches).*")
        if data == "empty-stream":
            trainer.validate(module, DataLoader(Stream(0), batch_size=None))
        else:
            trainer.validate(module, DataLoader([tokens(1)], batch_size=None))
    assert readers.observation(module) is None


def test_predict_on_a_one_pass_stream_loses_no_item(tmp_path: Path) -> None:
    """``trainer.predict`` rebuilds every DataLoader (Lightning's index-recording batch sampler): a pass kept on the
    user's loader would never be iterated, and a one-pass stream would lose the probe's batch. The probe leaves such a
    stream alone (the model's source decides)."""

    class Predicts(Recorded):
        def predict_step(self, batch: torch.Tensor, batch_idx: int) -> int:
            return int(batch[0, 0]) - 1

    module = Predicts(None)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4, alpha=8)],
    )  # fmt: skip
    assert trainer.predict(module, DataLoader(Stream(3), batch_size=None)) == [0, 1, 2]


def test_a_loader_autofit_handed_over_in_a_run_that_stopped_is_not_given_to_the_next_run(tmp_path: Path) -> None:
    """AutoFit requests the train dataloader at ``Callback.setup``; a run that stops before its loop leaves that
    hand-over behind. A next run without a lightning_hbm surgery (a plain Trainer reusing the data source's object)
    calls the hook itself, as Lightning would."""
    from lightning_hbm._compat import lightning as lightning_compat

    class Stops(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            lightning_compat.train_dataloader(trainer)  # what AutoFit does at its setup
            raise RuntimeError("stopped in setup")

    module = Recorded(lambda: DataLoader([item(i) for i in range(2)], batch_size=None))
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        callbacks=[Stops()],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="stopped in setup"):
        trainer.fit(module)
    first = vars(trainer.fit_loop._data_source)["dataloader"].loaders  # the hand-over left behind
    assert module.requested == 1
    trainer.callbacks = [c for c in trainer.callbacks if not isinstance(c, Stops)]
    trainer.fit(module)
    assert module.requested == 2 and trainer.train_dataloader is not first and module.trained == [0, 1]


def test_the_probe_batch_has_its_own_module_and_keeps_its_former_import_paths() -> None:
    """Drawing the probe batch moved out of ``lightning_hbm.probe`` (running a model on it) into
    ``lightning_hbm.probe_batch`` (issue 54: the quantization's walk entered probe.py once per job); the former paths
    still import the same functions."""
    from lightning_hbm import probe, probe_batch, quality

    assert probe.first_batch is probe_batch.first_batch is quality.first_batch
    assert probe.first_batches is probe_batch.first_batches
    assert {"first_batch", "first_batches"} <= set(probe.__all__)


def test_the_probe_steps_stand_ins_moved_out_of_probe_and_are_still_public_there() -> None:
    """What a probe step lends the user's step (no-op logging, optimizer stand-ins read from source) moved from
    ``lightning_hbm.probe`` into ``lightning_hbm.probe_stand_ins`` (session 40, issue 54: one job per module); the
    names other modules import from ``probe`` are the same objects."""
    from lightning_hbm import probe, probe_stand_ins

    assert probe.quiet_logging is probe_stand_ins.quiet_logging
    assert probe.source_tree is probe_stand_ins.source_tree
    assert {"quiet_logging", "source_tree"} <= set(probe.__all__)
