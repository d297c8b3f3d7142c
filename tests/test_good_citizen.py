"""Installing lightning_hbm leaves every other Trainer as Lightning made it; a Trainer that uses it still pickles."""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from lightning.pytorch.trainer.connectors import callback_connector

from lightning_hbm import ActivationCheckpointing, HBMProfiler, LoRA, QuantizedPrecision


def test_the_callbacks_factory_entry_point_gives_only_plugin_alone_trainers_a_callback(trainer_factory: Callable) -> None:
    """QuantizedPrecision alone gets ``PluginAttach`` (its checkpoint checks run before Lightning restores); a plain
    Trainer or one that has a lightning_hbm callback gets nothing, and a plain one never imports the surgery."""
    names = [ep.value for ep in entry_points(group="lightning.pytorch.callbacks_factory")]
    assert [v for v in names if v.startswith("lightning_hbm")] == ["lightning_hbm._factory:plugin_callbacks"], names
    kinds = lambda trainer: [type(cb).__name__ for cb in trainer.callbacks]  # noqa: E731
    assert "PluginAttach" not in kinds(trainer_factory())
    assert kinds(trainer_factory(plugins=[QuantizedPrecision("nf4-dq")])).count("PluginAttach") == 1
    assert "PluginAttach" not in kinds(trainer_factory(plugins=[QuantizedPrecision("nf4-dq")], callbacks=[LoRA()]))
    code = "import sys, lightning.pytorch as pl; pl.Trainer(logger=False); print('lightning_hbm.surgery' in sys.modules)"
    assert subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


def test_a_plain_trainer_has_the_callbacks_lightning_gives_it(trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    installed = [type(cb) for cb in trainer_factory(enable_checkpointing=True, enable_progress_bar=True).callbacks]
    monkeypatch.setattr(callback_connector, "_load_external_callbacks", lambda group: [])  # Lightning without any plugin package
    bare = [type(cb) for cb in trainer_factory(enable_checkpointing=True, enable_progress_bar=True).callbacks]
    assert installed == bare


def test_a_plain_trainer_keeps_its_plugin_objects_and_pickles(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable
) -> None:
    trainer = trainer_factory(max_steps=1, precision="bf16-true")
    trainer.fit(gpt_factory(), datamodule_factory())
    plugin = trainer.strategy.precision_plugin
    assert "convert_module" not in vars(plugin) and "connect" not in vars(plugin)
    assert not [k for k in vars(plugin) if "lightning_hbm" in k]
    torch.save(trainer, io.BytesIO())
    copy.deepcopy(trainer)


@pytest.mark.parametrize("precision", ["nf4-dq", "bf16-true"])
def test_a_trainer_with_every_feature_pickles_and_deep_copies_after_fit(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, precision: str
) -> None:
    plugins: dict[str, Any] = (
        {"plugins": [QuantizedPrecision(precision, dtype="float32")]} if precision == "nf4-dq" else {"precision": precision}
    )
    callbacks = [LoRA(r=2), ActivationCheckpointing(), HBMProfiler(every_n_steps=1, dirpath=str(tmp_path), summary=False)]
    trainer = trainer_factory(max_steps=2, callbacks=callbacks, **plugins)
    model = gpt_factory()
    trainer.fit(model, datamodule_factory())
    buffer = io.BytesIO()
    torch.save(trainer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    copied = copy.deepcopy(trainer)
    for other in (loaded, copied):
        assert [type(cb) for cb in other.callbacks] == [type(cb) for cb in trainer.callbacks]
        batch = next(iter(datamodule_factory().train_dataloader()))
        # the copy computes what the original computes: same loss, and gradients through the checkpointed blocks
        loss = other.lightning_module.loss(batch)
        torch.testing.assert_close(loss, model.loss(batch))
        loss.backward()
        assert all(p.grad is not None for n, p in other.lightning_module.named_parameters() if "lora_" in n)


@pytest.mark.parametrize("profiler", [False, True], ids=["library", "with-profiler"])
def test_a_fitted_model_is_collected(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, tmp_path: Path, profiler: bool
) -> None:
    """Issue 55: 200 fits in one process left 200 models alive (the plugin -> Trainer map held the Trainer strongly,
    and the Trainer holds the plugin: its weak key never died)."""
    import gc
    import weakref

    def fit() -> tuple[weakref.ref, weakref.ref]:
        callbacks: list[Any] = [LoRA(r=2), ActivationCheckpointing()]
        if profiler:
            callbacks.append(HBMProfiler(summary=False, dirpath=str(tmp_path)))
        trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks)
        model = gpt_factory()
        trainer.fit(model, datamodule_factory())
        return weakref.ref(model), weakref.ref(trainer)

    model, trainer = fit()
    gc.collect()
    assert model() is None and trainer() is None
