"""lightning_hbm._compat.lightning against the installed Lightning: each test fails when Lightning changes the internal."""

from __future__ import annotations

import copy
import inspect
import pickle
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from lightning_hbm._compat import lightning as compat


class _Record(pl.Callback):
    """What the compat functions return at each hook of a run."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.seen["setup_batch"] = next(iter(compat.train_dataloader(trainer)))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["fit_start"] = compat.loaded_checkpoint(trainer)
        self.seen["attached"] = compat.attached_trainer(pl_module)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.seen["train_start"] = compat.loaded_checkpoint(trainer)


def test_attached_trainer(gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any],
                          trainer_factory: Callable[..., pl.Trainer]) -> None:
    model = gpt_factory()
    with pytest.raises(RuntimeError, match="not attached"):
        model.trainer  # noqa: B018 - the public property refuses: the reason for reading the field
    assert compat.attached_trainer(model) is None
    assert compat.attached_trainer(nn.Linear(2, 2)) is None
    record, trainer = _Record(), trainer_factory(max_steps=1)
    trainer.callbacks.append(record)
    trainer.fit(model, datamodule=datamodule_factory())
    assert record.seen["attached"] is trainer


def test_loaded_checkpoint_lives_from_restore_to_setup_end(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer], tmp_path: Any
) -> None:
    trainer = trainer_factory(max_steps=2)
    trainer.fit(gpt_factory(), datamodule=datamodule_factory())
    path = tmp_path / "a.ckpt"
    trainer.save_checkpoint(path)
    assert compat.loaded_checkpoint(trainer) is None  # no resume: nothing pending

    record = _Record()
    trainer = trainer_factory(max_steps=3, callbacks=[record])
    trainer.fit(gpt_factory(), datamodule=datamodule_factory(), ckpt_path=path)
    pending = record.seen["fit_start"]
    assert pending is not None and pending["global_step"] == 2 and "state_dict" in pending
    assert record.seen["train_start"] is None  # dropped once the training state is restored
    assert compat.loaded_checkpoint(None) is None


def test_batches_that_stepped_and_train_dataloader(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    record, data = _Record(), datamodule_factory()
    trainer = trainer_factory(max_steps=3, callbacks=[record])
    trainer.fit(gpt_factory(), datamodule=data)
    assert compat.batches_that_stepped(trainer) == 3
    expected = next(iter(data.train_dataloader()))
    torch.testing.assert_close(record.seen["setup_batch"], expected)


def test_stage_dataloader_hands_its_loader_to_the_loop(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    """The loader requested in setup is the one the fit loop trains on: Lightning's ``setup_data`` asks the source's
    ``dataloader`` (an instance attribute shadows the dataclass's method) through ``_request_dataloader``."""
    data = datamodule_factory()
    calls: list[Any] = []
    own = data.train_dataloader
    data.train_dataloader = lambda: calls.append(own()) or calls[-1]  # type: ignore[method-assign]

    class Request(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            calls.append(compat.stage_dataloader(trainer))

    trainer = trainer_factory(max_steps=1, callbacks=[Request()])
    trainer.fit(gpt_factory(), datamodule=data)
    assert len(calls) == 2 and calls[1] is calls[0]  # one hook call; what it returned, as the probe saw it
    assert trainer.train_dataloader is calls[0] and "dataloader" not in vars(trainer.fit_loop._data_source)
    assert hasattr(calls[0], "__pl_saved_args")  # recorded as Lightning records it (re-instantiation with a sampler)
    compat.drop_handed_over(trainer)


def test_unwrap_optimizer() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    assert compat.unwrap_optimizer(LightningOptimizer(optimizer)) is optimizer
    assert compat.unwrap_optimizer(optimizer) is optimizer


class _Calls:
    """A picklable stand-in hook that records its calls and runs the plugin's own method."""

    def __init__(self, plugin: Any, name: str) -> None:
        self.plugin, self.name, self.calls = plugin, name, 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        return getattr(type(self.plugin), self.name)(self.plugin, *args)


def test_override_plugin_hooks_reach_the_strategy_setup(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    trainer = trainer_factory(max_steps=1)
    plugin = trainer.strategy.precision_plugin
    assert compat.plugin_hook_override(plugin, "convert_module") is None
    convert, connect = _Calls(plugin, "convert_module"), _Calls(plugin, "connect")
    compat.override_plugin_hooks(plugin, convert, connect)
    assert compat.plugin_hook_override(plugin, "convert_module") is convert
    trainer.fit(gpt_factory(), datamodule=datamodule_factory())
    assert (convert.calls, connect.calls) == (1, 1)  # Lightning looks both up on the instance
    pickle.dumps(plugin)


def test_detached_copy_leaves_the_trainer_behind(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    model, trainer = gpt_factory(), trainer_factory(max_steps=1)
    trainer.fit(model, datamodule=datamodule_factory())
    assert compat.attached_trainer(model) is trainer
    with compat.detached(model):
        copied = copy.deepcopy(model)
    assert compat.attached_trainer(copied) is None and compat.attached_trainer(model) is trainer


def test_format_summary_table_is_lightnings_text_summary_without_its_flops_line() -> None:
    columns = [(" ", ["0"]), ("Name", ["layer"]), ("Type", ["Linear"]), ("Params", ["1.0 K"]), ("Mode", ["train"])]
    table = compat.format_summary_table(1000, 10, 0.004, {"train": 1, "eval": 0}, columns)
    lines = table.splitlines()
    assert "| Name" in lines[0] and "Linear" in lines[2] and lines[-3].startswith("0.004") and "model params size (MB)" in lines[-3]
    assert lines[-1].endswith("Modules in eval mode") and "Flops" not in table  # the last line Lightning writes is dropped


def test_device_mesh_hidden_clears_the_field_model_parallel_writes() -> None:
    # ModelParallelStrategy puts its mesh on the LightningModule through the private field behind device_mesh
    source = inspect.getsource(ModelParallelStrategy.setup_environment)
    assert "self.lightning_module._device_mesh = self._device_mesh" in source
    model, mesh = pl.LightningModule(), object()
    model._device_mesh = mesh
    assert model.device_mesh is mesh  # the public property reads that field
    with compat.device_mesh_hidden(model):
        assert model.device_mesh is None
    assert model.device_mesh is mesh
    with pytest.raises(KeyError), compat.device_mesh_hidden(model):
        raise KeyError  # put back when the block raises too
    assert model.device_mesh is mesh


def test_each_run_attaches_a_new_data_hook_selector_and_predict_rebuilds_its_loader(
    gpt_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer]
) -> None:
    """``drop_handed_over`` tells this run's hand-over from an earlier run's by ``_DataConnector._datahook_selector``
    (new at each ``attach_data``); the predict loop iterates a rebuilt copy of the DataLoader it is given."""
    from torch.utils.data import DataLoader

    seen: list[Any] = []

    class Runs(pl.Callback):
        def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
            seen.append(compat._run_of(trainer))
            seen.append(compat.rebuilds_its_dataloader(trainer))

    model = gpt_factory()
    tokens = [torch.randint(0, 64, (1, 8)) for _ in range(2)]
    trainer = trainer_factory(max_steps=1, callbacks=[Runs()])
    trainer.fit(model, DataLoader([(t, t) for t in tokens], batch_size=None))
    loader = DataLoader(tokens, batch_size=None)
    trainer.predict(model, loader)
    assert seen[0] is not None and seen[2] is not None and seen[0] is not seen[2]
    assert seen[1] is False and seen[3] is True and trainer.predict_dataloaders is not loader


def test_logged_values_puts_back_what_a_discarded_step_logged_and_counted() -> None:
    import torchmetrics
    from lightning.pytorch.trainer.connectors.logger_connector.result import _ResultCollection

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.mean = torchmetrics.MeanMetric()

    module = Module()
    results = _ResultCollection(training=True)
    results.log("training_step", "kept", torch.tensor(1.0), batch_size=2)
    module._trainer = type("Trainer", (), {"_results": results})()  # what attached_trainer and trainer._results read
    module.mean(torch.tensor(3.0))
    restore = compat.logged_values(module)
    results.log("training_step", "kept", torch.tensor(5.0), batch_size=2)
    results.log("training_step", "new", torch.tensor(5.0), batch_size=2)
    module.mean(torch.tensor(7.0))
    restore()
    assert set(results) == {"training_step.kept"}
    assert float(results["training_step.kept"].compute()) == 1.0 and float(module.mean.compute()) == 3.0


def test_optimizers_are_lent_through_the_strategy_and_put_back() -> None:
    """``optimizers_lent`` reads Lightning's private ``LightningModule._trainer`` and ``Strategy._optimizers``:
    ``trainer.optimizers`` shows the lent ones inside, the strategy's own (empty) list is the same object after, also
    when the body raises; a module without a trainer is left alone."""
    import lightning.pytorch as pl

    from lightning_hbm._compat.lightning import optimizers_lent

    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False)
    module = pl.LightningModule()
    module.trainer = trainer
    own = trainer.strategy._optimizers
    lent = [object()]
    with optimizers_lent(module, lambda: lent):
        assert trainer.optimizers is lent
    assert trainer.strategy._optimizers is own and own == []
    with pytest.raises(RuntimeError, match="step failed"), optimizers_lent(module, lambda: lent):
        raise RuntimeError("step failed")
    assert trainer.strategy._optimizers is own
    with optimizers_lent(pl.LightningModule(), lambda: lent):
        pass  # no trainer: nothing lent, nothing raised
