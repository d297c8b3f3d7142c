"""Issue 55 and the house rule on bad input, attacked from outside (session 30): each case as a user who wants to break
the library would try it. A case that failed on the code of session 29 says what it did ("Was: ..."); the ones that
held are kept as guards (each well under a second).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_hbm.memory.report import atomic_write
from lightning_hbm.resume.io import atomic_save


@pytest.fixture
def umask_027() -> Iterator[int]:
    """A team's umask (group may read, others nothing): what a plain ``open(path, "w")`` gives is 0640."""
    old = os.umask(0o027)
    try:
        yield 0o640
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# -------- files we write get the mode a plain save gives (the umask's; a replaced file keeps its own)


def test_a_checkpoint_gets_the_mode_of_a_plain_lightning_save(tmp_path: Path, umask_027: int) -> None:
    """Was: every checkpoint of a lightning_hbm run was 0600 (its partial file is created 0600 and renamed into place)
    where plain Lightning's is 0644 under the usual umask: in a team folder nobody else could resume or read it."""
    atomic_save({"x": torch.zeros(2)}, tmp_path / "new.ckpt")
    assert _mode(tmp_path / "new.ckpt") == umask_027
    kept = tmp_path / "kept.ckpt"
    kept.write_bytes(b"old")
    kept.chmod(0o664)  # a replaced checkpoint keeps the mode its owner gave it, as open(path, "wb") does
    atomic_save({"x": torch.zeros(2)}, kept)
    assert _mode(kept) == 0o664


def test_the_profilers_files_get_the_mode_of_a_plain_write(tmp_path: Path, umask_027: int) -> None:
    """Was: hbm_profile.csv/json/png and hbm_figure.json were 0600 (``mkstemp``), and re-rendering a report turned
    an existing 0644 one into 0600."""
    atomic_write(tmp_path / "hbm_profile.json", lambda f: f.write("{}"))
    assert _mode(tmp_path / "hbm_profile.json") == umask_027
    (tmp_path / "hbm_profile.csv").write_text("old")
    (tmp_path / "hbm_profile.csv").chmod(0o644)
    atomic_write(tmp_path / "hbm_profile.csv", lambda f: f.write("new"))
    assert _mode(tmp_path / "hbm_profile.csv") == 0o644


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _adapted() -> nn.Module:
    from lightning_hbm import LoRA

    torch.manual_seed(0)
    module = _Two()
    LoRA(r=2).transform_model(module)
    return module


def test_the_adapter_weights_get_the_mode_of_the_config_beside_them(tmp_path: Path, umask_027: int) -> None:
    """Was: ``adapter_model.safetensors`` was 0600 (safetensors writes it so) while ``adapter_config.json`` beside it
    was 0644: a colleague loading the adapter got the config and a PermissionError on the weights."""
    from lightning_hbm import LoRA

    folder = LoRA.save_adapter(_adapted(), tmp_path / "adapter")
    assert {f.name: _mode(f) for f in folder.iterdir()} == {f.name: umask_027 for f in folder.iterdir()}
