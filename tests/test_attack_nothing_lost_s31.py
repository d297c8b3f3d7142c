"""Session 30's new behaviour attacked from outside (session 31, issue 55): the surgery leaves the global RNGs as they
were (also when it fails half-way, when the fit is interrupted, with the probe step off, over two fits), the probe
step's switch refuses values it does not know, a checkpoint saved with wide embeddings meets explicit settings, an
export from a callback while training runs changes nothing of the run, and a plain Lightning ``Trainer`` after a
lightning_hbm fit behaves as without us. A case that failed on session 30's code says what it did ("Was: ...");
the ones that held are kept as guards.
"""

from __future__ import annotations

import logging
import random
import re
import warnings
from pathlib import Path
from typing import Any, Optional

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, applied_transforms
from lightning_hbm.surgery import Stage, SurgeryCallback

WIDTH = 16


def _rngs() -> tuple[Any, ...]:
    """Python's, NumPy's and torch's global RNG states, comparable with ``==``."""
    numpy_state = np.random.get_state()
    return random.getstate(), numpy_state[1].tobytes(), numpy_state[2], bytes(torch.get_rng_state().numpy())


class Net(pl.LightningModule):
    """Each step draws from every global RNG (as a user's noise, dropout or augmentation would)."""

    def __init__(self, embed: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, WIDTH) if embed else None
        self.body = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        x = self.emb(batch % 32).mean(1) if self.emb is not None else batch
        noise = torch.randn_like(x) * random.random() * float(np.random.rand())
        return self.body(x + noise).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Recorder(pl.Callback):
    """The RNG states at the start of training and of each batch, each loss; ``interrupt_at``: Ctrl-C there."""

    def __init__(self, interrupt_at: Optional[int] = None) -> None:
        self.states: list[tuple[Any, ...]] = []
        self.losses: list[float] = []
        self.interrupt_at = interrupt_at

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.states.append(_rngs())

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self.states.append(_rngs())
        if batch_idx == self.interrupt_at:
            raise KeyboardInterrupt

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _data(embed: bool = False) -> DataLoader:
    # shuffled, no generator of its own: its order is drawn from torch's global RNG at the loop's first iter
    items = [torch.arange(4) + i if embed else torch.randn(WIDTH, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    return DataLoader(items, batch_size=2, shuffle=True)


def _fit(root: Path, ours: bool, steps: int = 3, extra: tuple[pl.Callback, ...] = (), model: Optional[Net] = None,
         plugins: Any = None, ckpt: Any = None, **trainer_options: Any) -> tuple[pl.Trainer, Net, Recorder, tuple[Any, ...]]:  # fmt: skip
    """A fit from ``seed_everything(0)``: with LoRA on a quantized base (``ours``) or plain Lightning; the Trainer, the
    model, what the recorder saw and the RNGs after the fit."""
    pl.seed_everything(0, verbose=False)
    model = model if model is not None else Net()
    recorder = Recorder(trainer_options.pop("interrupt_at", None))
    trainer_options.setdefault("enable_checkpointing", False)
    lightning_hbm = [LoRA(r=2)] if ours else []
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=root,
        plugins=plugins if plugins is not None else ([QuantizedPrecision("nf4", dtype="float32")] if ours else None),
        callbacks=[*lightning_hbm, recorder, *extra], **trainer_options,
    )  # fmt: skip
    trainer.fit(model, _data(model.emb is not None), ckpt_path=ckpt)
    return trainer, model, recorder, _rngs()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> tuple[Recorder, tuple[Any, ...]]:
    """The plain Lightning run every case is compared with: its recorder and the RNGs after it."""
    _, _, recorder, after = _fit(tmp_path_factory.mktemp("plain"), ours=False)
    return recorder, after


# -------- the global RNGs


class Boom(SurgeryCallback):
    """A user's transform of a late stage whose change fails: the surgery stops after LoRA has drawn its adapters."""

    stage = Stage.KERNELS

    def transform_model(self, module: nn.Module) -> None:
        raise RuntimeError("boom: the user's late transform")


def test_a_surgery_that_fails_half_way_leaves_every_rng_as_it_was(tmp_path: Path) -> None:
    pl.seed_everything(0, verbose=False)
    before = _rngs()
    with pytest.raises(RuntimeError, match="boom"):
        _fit(tmp_path, ours=True, extra=(Boom(),))
    pl.seed_everything(0, verbose=False)
    assert before == _rngs()  # (the seed's state: what _fit started from)
    model = Net()
    with pytest.raises(RuntimeError, match="boom"):
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, callbacks=[LoRA(r=2), Boom()],
                             plugins=[QuantizedPrecision("nf4", dtype="float32")])  # fmt: skip
        pl.seed_everything(0, verbose=False)
        trainer.fit(model, _data())
    assert _rngs() == before, "the failed surgery consumed the user's random draws"


def test_a_change_that_fails_after_others_says_what_the_model_keeps(tmp_path: Path) -> None:
    """Was: the user's error alone, with the model quantized and adapted without a word (the weights as built are gone:
    quantization cannot be undone without a copy)."""
    model = Net()
    with pytest.raises(RuntimeError, match="boom") as info:
        _fit(tmp_path, ours=True, model=model, extra=(Boom(),))
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert applied_transforms(model) == ["QuantizedPrecision(nf4)", "LoRA"]
    assert re.search(r"Boom failed while changing the model, after QuantizedPrecision\(nf4\), LoRA changed it: the model "
                     r"keeps those changes .*Rebuild the model", notes, re.S), notes  # fmt: skip


def test_the_rngs_of_each_step_are_a_plain_runs(tmp_path: Path, plain: Any) -> None:
    recorder, after = plain
    _, _, ours, ours_after = _fit(tmp_path, ours=True)
    assert ours.states == recorder.states and ours_after == after


def _interrupted(root: Path, ours: bool) -> tuple[list[Any], tuple[Any, ...]]:
    recorder = Recorder(interrupt_at=1)
    with pytest.raises(SystemExit):  # Lightning 2.6 ends the process after a Ctrl-C's graceful shutdown
        _fit(root, ours=ours, extra=(recorder,))
    return recorder.states, _rngs()


@pytest.mark.slow  # ~1.5 s: two fits
def test_an_interrupted_fit_leaves_the_rngs_of_a_plain_interrupted_fit(tmp_path: Path) -> None:
    assert _interrupted(tmp_path / "ours", True) == _interrupted(tmp_path / "plain", False)


def test_the_probe_step_switched_off_leaves_the_rngs_as_a_plain_run(tmp_path: Path, plain: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", "0")
    _, _, recorder, after = _fit(tmp_path, ours=True)
    assert recorder.states == plain[0].states and after == plain[1]


@pytest.mark.slow  # ~2 s: two fits
def test_two_fits_in_one_process_each_draw_as_a_plain_run(tmp_path: Path, plain: Any) -> None:
    for run in range(2):
        _, _, recorder, after = _fit(tmp_path / str(run), ours=True)
        assert recorder.states == plain[0].states and after == plain[1], run


# -------- the probe step's switch


@pytest.mark.parametrize("value", ["2", "", "maybe", "of"])
def test_a_probe_step_switch_it_does_not_know_is_refused_before_anything_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    """Was: any value but 0/false/off/no (an empty one, "2", a typo of "off") ran the probe step without a word."""
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", value)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"LIGHTNING_HBM_PROBE_STEP={value!r} is not one of 1, true, on, yes .* 0, false, off, no"):
        _fit(tmp_path, ours=True, model=model)
    assert applied_transforms(model) == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize(("value", "runs"), [("yes", True), ("ON", True), (" 0 ", False)])
def test_the_probe_step_switch_reads_yes_and_no(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: Any, value: str, runs: bool) -> None:
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", value)
    with caplog.at_level(logging.INFO):
        trainer, *_ = _fit(tmp_path, ours=True, steps=1)
    assert trainer.global_step == 1
    assert ("once before changing the model" in caplog.text) == runs, caplog.text


# -------- a checkpoint saved with the embeddings wide, resumed with explicit settings


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("wide")
    pl.seed_everything(0, verbose=False)
    trainer, *_ = _fit(root, ours=True, steps=1, model=Net(embed=True),
                       plugins=[QuantizedPrecision("nf4", dtype="float32", quantize_embeddings=False)])  # fmt: skip
    trainer.save_checkpoint(root / "wide.ckpt")
    return root / "wide.ckpt"


@pytest.mark.parametrize("setting", [True, "int8"])
def test_wide_embeddings_resumed_with_an_explicit_quantized_table_are_refused_before_anything_changes(
    tmp_path: Path, wide: Path, setting: Any
) -> None:
    pl.seed_everything(0, verbose=False)
    model = Net(embed=True)  # the base the checkpoint was trained on
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"(?s)other lightning_hbm settings.*quantize_embeddings: checkpoint False \(not recorded: "
                       rf"the embeddings kept wide\), this run {setting!r}"):
        _fit(tmp_path, ours=True, steps=2, model=model, ckpt=wide,
             plugins=[QuantizedPrecision("nf4", dtype="float32", quantize_embeddings=setting)])  # fmt: skip
    assert applied_transforms(model) == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_wide_embeddings_resumed_with_quantize_embeddings_false_go_on_without_a_warning(tmp_path: Path, wide: Path) -> None:
    pl.seed_everything(0, verbose=False)
    model = Net(embed=True)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*embeddings.*")
        trainer, model, *_ = _fit(tmp_path, ours=True, steps=2, model=model, ckpt=wide,
                                  plugins=[QuantizedPrecision("nf4", dtype="float32", quantize_embeddings=False)])  # fmt: skip
    assert trainer.global_step == 2 and type(model.emb) is nn.Embedding


# -------- an export from a callback while training runs


class ExportAt(pl.Callback):
    """Saves the adapter and merges the model after batch ``at``, as a user's "export every N steps" callback."""

    def __init__(self, folder: Path, at: int = 0) -> None:
        self.folder, self.at = folder, at
        self.exported: dict[str, torch.Tensor] = {}
        self.merged: dict[str, torch.Tensor] = {}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.at:
            self.exported = {k: v.clone() for k, v in LoRA.adapter_state_dict(pl_module).items()}
            LoRA.save_adapter(pl_module, self.folder)
            self.merged = LoRA.merge(pl_module, dtype="float32")


@pytest.mark.slow  # ~2 s: two fits
def test_an_export_from_a_callback_mid_training_changes_nothing_of_the_run(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    _, straight, recorder, after = _fit(tmp_path / "straight", ours=True, steps=3)
    export = ExportAt(tmp_path / "adapter")
    _, exported, again, again_after = _fit(tmp_path / "exported", ours=True, steps=3, extra=(export,))
    assert again.losses == recorder.losses and again.states == recorder.states and again_after == after
    assert exported.training and all(p.requires_grad == ("lora_" in n) for n, p in exported.named_parameters())
    ours, theirs = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(exported)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    saved = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert len(saved) == len(export.exported) and sorted(v.sum().item() for v in saved.values()) == sorted(
        v.sum().item() for v in export.exported.values()
    )  # the step-1 adapters, under peft's names
    assert set(export.merged) == {"body.0.weight", "body.0.bias", "body.2.weight", "body.2.bias"}


# -------- a plain Trainer after a lightning_hbm fit


def _process_state() -> dict[str, Any]:
    names = ("", "lightning", "lightning.pytorch", "lightning.pytorch.utilities.rank_zero", "torch", "torch.utils._pytree",
             "bitsandbytes", "peft", "torchao", "transformers")  # fmt: skip
    return {
        "filters": list(warnings.filters), "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(), "matmul": torch.get_float32_matmul_precision(),
        "threads": torch.get_num_threads(), "anomaly": torch.is_anomaly_enabled(), "disable": logging.root.manager.disable,
        "loggers": {n: (logging.getLogger(n).level, list(logging.getLogger(n).handlers), list(logging.getLogger(n).filters),
                        logging.getLogger(n).propagate, logging.getLogger(n).disabled) for n in names},
        "callbacks": [type(c).__name__ for c in pl.Trainer(accelerator="cpu", logger=False).callbacks],
    }  # fmt: skip


@pytest.mark.slow  # ~2 s: three fits
def test_a_plain_trainer_after_a_lightning_hbm_fit_behaves_as_without_us(tmp_path: Path, caplog: Any) -> None:
    _, _, first, first_after = _fit(tmp_path / "before", ours=False)
    state = _process_state()
    _fit(tmp_path / "ours", ours=True, extra=(ModelCheckpoint(dirpath=tmp_path / "ckpt"),), enable_checkpointing=True)
    assert _process_state() == state
    caplog.clear()
    with caplog.at_level(logging.INFO):
        _, _, second, second_after = _fit(tmp_path / "after", ours=False)
    assert second.states == first.states and second.losses == first.losses and second_after == first_after
    assert "lightning_hbm" not in caplog.text


class CtrlCInTheProbe(Net):
    """A Ctrl-C while lightning_hbm changes the model: its training_step is interrupted the first time it runs."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        raise KeyboardInterrupt


@pytest.mark.slow  # ~2 s: three fits
@pytest.mark.parametrize("failure", ["late-transform", "ctrl-c-in-the-probe-step"])
def test_a_failed_lightning_hbm_fit_leaves_a_plain_trainer_as_without_us(tmp_path: Path, plain: Any, failure: str) -> None:
    state = _process_state()
    if failure == "late-transform":
        with pytest.raises(RuntimeError, match="boom"):
            _fit(tmp_path / "ours", ours=True, extra=(Boom(),))
    else:
        with pytest.raises(SystemExit):  # Lightning 2.6 ends the process after a Ctrl-C's graceful shutdown
            _fit(tmp_path / "ours", ours=True, model=CtrlCInTheProbe())
    assert _process_state() == state
    _, _, recorder, after = _fit(tmp_path / "after", ours=False)
    assert recorder.states == plain[0].states and recorder.losses == plain[0].losses and after == plain[1]
