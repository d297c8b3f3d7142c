"""The fit-start check of the checkpoint folders (``resume.check_checkpoint_dirs``, session 29) refuses only a run
that would save: ``fast_dev_run`` saves no checkpoint (Lightning's ModelCheckpoint skips it), so a smoke test from a
read-only folder runs (session 30 review: it was stopped with "Cannot save checkpoints into ...")."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import HBMProfiler, LoRA


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.body(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(folder: Path, *callbacks: pl.Callback, **kwargs: object) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[LoRA(r=2), ModelCheckpoint(dirpath=folder), *callbacks], **kwargs)  # type: ignore[arg-type]  # fmt: skip
    trainer.fit(_Tiny(), DataLoader([torch.randn(2, 16)] * 2, batch_size=None))
    return trainer


@pytest.mark.parametrize("profiled", [False, True])
def test_a_smoke_test_that_saves_nothing_runs_from_a_read_only_folder(read_only_mount: Path, tmp_path: Path, profiled: bool) -> None:
    # HBMProfiler checks the checkpoint folders too (its own check, older): the same rule
    folder = read_only_mount / "folder"
    trainer = _fit(folder, *([HBMProfiler(dirpath=str(tmp_path / "report"))] if profiled else []), fast_dev_run=True)
    assert trainer.global_step == 1 and [p.name for p in folder.iterdir()] == ["notes.txt"]


def test_a_run_that_saves_into_a_read_only_folder_is_still_refused(read_only_mount: Path) -> None:
    with pytest.raises(PermissionError, match=r"Cannot save checkpoints into .*\(Read-only file system\)"):
        _fit(read_only_mount / "folder", max_steps=1)
