"""The checkpoint format of lightning_hbm/resume.py: atomic saves, what the checksums cover, clear load errors.

Each test is a fault (a kill, a full disk, a flipped bit, a hostile file) that an outside tester found; each
asserts that the previous checkpoint survives or that the error names the problem before anything loads.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hbm import LoRA, QuantizedPrecision, resume
from lightning_hbm.resume import CheckedCheckpointIO

F32 = dict(dtype="float32")
ROOT = Path(__file__).resolve().parents[1]


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """``small_disk(bytes)``: a fresh tmpfs of that size, i.e. another filesystem than the temp folder (skip if no mount)."""
    mounts: list[Path] = []

    def make(size: int) -> Path:
        folder = tmp_path / f"volume{len(mounts)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {done.stderr.decode().strip()}")
        mounts.append(folder)
        return folder

    yield make
    for folder in mounts:
        subprocess.run(["umount", str(folder)], check=False)


def _checkpoint(nbytes: int, value: float = 1.0) -> dict[str, Any]:
    return {"state_dict": {"w": torch.full((nbytes // 4,), value)}, "epoch": 1}


# ------------------------------------------------------------------------- 1. atomic saves


def test_a_full_disk_keeps_the_previous_checkpoint_and_leaves_no_partial_file(small_disk: Callable) -> None:
    volume = small_disk(1 << 20)
    io = CheckedCheckpointIO()
    last = volume / "last.ckpt"
    io.save_checkpoint(_checkpoint(300_000), last)
    digest = _digest(last)
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(_checkpoint(900_000, 2.0), last)  # old + new do not fit together
    with pytest.raises(OSError, match="No space left"):
        io.save_checkpoint(_checkpoint(900_000), volume / "epoch=1-step=4.ckpt")
    assert _digest(last) == digest
    torch.testing.assert_close(torch.load(last, weights_only=True)["state_dict"]["w"], torch.ones(75_000))
    assert sorted(p.name for p in volume.iterdir()) == ["last.ckpt"]  # no partial file, under any name


_KILLED_SAVE = """
import os, sys, time, torch
from lightning_hbm.resume import CheckedCheckpointIO

path, ready = sys.argv[1], sys.argv[2]
real_fsync = os.fsync
def fsync_then_hang(fd):  # every byte written, not yet renamed: the worst moment for a kill
    real_fsync(fd)
    open(ready, "w").close()
    time.sleep(120)
os.fsync = fsync_then_hang
CheckedCheckpointIO().save_checkpoint({"state_dict": {"w": torch.full((250_000,), 2.0)}}, path)
"""


def test_a_kill_during_a_save_onto_another_filesystem_keeps_the_previous_checkpoint(small_disk: Callable, tmp_path: Path) -> None:
    volume = small_disk(8 << 20)
    last = volume / "last.ckpt"
    CheckedCheckpointIO().save_checkpoint(_checkpoint(1_000_000), last)
    digest = _digest(last)
    ready = tmp_path / "ready"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    child = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, str(last), str(ready)], env=env)
    try:
        deadline = time.time() + 90
        while not ready.exists() and child.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        assert ready.exists(), "the save never reached its write"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert _digest(last) == digest  # the previous checkpoint, whole
    torch.testing.assert_close(torch.load(last, weights_only=True)["state_dict"]["w"], torch.ones(250_000))
    partials = [p for p in volume.iterdir() if p.name != "last.ckpt"]
    assert len(partials) == 1 and partials[0].name.startswith(".last.ckpt.")  # hidden, never under a final name
    CheckedCheckpointIO().save_checkpoint(_checkpoint(1000, 3.0), volume / "epoch=0-step=1.ckpt")
    assert sorted(p.name for p in volume.iterdir()) == ["epoch=0-step=1.ckpt", "last.ckpt"]  # the next save cleans it


def test_any_error_during_a_save_removes_the_partial_file(tmp_path: Path) -> None:
    class Unpicklable:
        def __reduce__(self) -> Any:
            raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        CheckedCheckpointIO().save_checkpoint({"a": torch.ones(10), "b": Unpicklable()}, tmp_path / "x.ckpt")
    assert list(tmp_path.iterdir()) == []


def test_every_lightning_hbm_run_saves_atomically(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, small_disk: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QuantizedPrecision alone and LoRA with Lightning's own precision: the checkpoints land via os.replace."""
    volume = small_disk(32 << 20)
    replaced: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(resume.os, "replace", lambda a, b: (replaced.append(Path(b).name), real_replace(a, b)))
    for name, plugins, callbacks in [("q", [QuantizedPrecision("nf4", **F32)], []), ("lora", [], [LoRA(r=2)])]:
        folder = volume / name
        save = ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True)
        trainer = trainer_factory(max_steps=2, enable_checkpointing=True, plugins=plugins, callbacks=[*callbacks, save])
        trainer.fit(gpt_factory(), datamodule_factory())
        assert isinstance(trainer.strategy.checkpoint_io, CheckedCheckpointIO)
        assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt"]
        assert "lightning_hbm" in torch.load(folder / "last.ckpt", weights_only=True)
    assert replaced == ["last.ckpt", "last.ckpt"]


def test_lightning_hbm_strategies_save_atomically() -> None:
    from lightning_hbm.strategies import CPUOffloadStrategy, QuantizedFSDPStrategy

    assert isinstance(CPUOffloadStrategy().checkpoint_io, CheckedCheckpointIO)
    assert isinstance(QuantizedFSDPStrategy().checkpoint_io, CheckedCheckpointIO)
