"""The checkpoint format of lightning_hbm/resume/: atomic saves, what the checksums cover, clear load errors.

Each test is a fault (a kill, a full disk, a flipped bit, a hostile file) that an outside tester found; each
asserts that the previous checkpoint survives or that the error names the problem before anything loads.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import struct
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_hbm import LoRA, QuantizedPrecision, resume
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import NanoGPT
from lightning_hbm.resume import CheckedCheckpointIO

TINY_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)  # as tests/conftest.py's gpt_factory
F32 = dict(dtype="float32")
ROOT = Path(__file__).resolve().parents[2]


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


def test_a_planted_symlink_at_a_partial_name_is_never_written_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 55: in a folder others can write to, a symlink planted at the (then predictable) partial name made the
    save overwrite its target, and ``last.ckpt`` became that symlink."""
    from lightning_hbm.resume import io as checkpoint_io

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    monkeypatch.setattr(checkpoint_io.secrets, "token_hex", lambda n: "0" * (2 * n))  # the first name is known...
    planted = tmp_path / f".last.ckpt.{checkpoint_io._host()}~{os.getpid()}~00000000.lightning_hbm-partial"
    planted.symlink_to(victim)  # ...and planted
    tokens = iter(["00000000", "11111111"])
    monkeypatch.setattr(checkpoint_io.secrets, "token_hex", lambda n: next(tokens))
    CheckedCheckpointIO().save_checkpoint(_checkpoint(1000), tmp_path / "last.ckpt")
    assert victim.read_text() == "precious"
    last = tmp_path / "last.ckpt"
    assert last.is_file() and not last.is_symlink()
    torch.testing.assert_close(torch.load(last, weights_only=True)["state_dict"]["w"], torch.ones(250))
    assert planted.is_symlink()  # not a save of ours: left as it was


def test_another_hosts_partial_is_never_deleted_and_ours_is(tmp_path: Path) -> None:
    """Issue 55: two hosts sharing a checkpoint folder (NFS): host B deleted host A's save in progress as "a killed
    save of ours" because A's pid is not alive on B."""
    from lightning_hbm.resume import io as checkpoint_io

    dead = 2**22 + 12345  # above any pid_max default: no such process here
    theirs = tmp_path / f".last.ckpt.otherhost~{dead}~abcdabcd.lightning_hbm-partial"
    ours = tmp_path / f".last.ckpt.{checkpoint_io._host()}~{dead}~abcdabcd.lightning_hbm-partial"
    older = tmp_path / f".last.ckpt.{dead}.lightning_hbm-partial"  # the older form: no host, so not known as ours
    for partial in (theirs, ours, older):
        partial.write_bytes(b"in progress")
    CheckedCheckpointIO().save_checkpoint(_checkpoint(1000), tmp_path / "epoch=0-step=1.ckpt")
    assert theirs.exists() and older.exists() and not ours.exists()


def test_every_lightning_hbm_run_saves_atomically(
    gpt_factory: Callable, trainer_factory: Callable, datamodule_factory: Callable, small_disk: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    """QuantizedPrecision alone and LoRA with Lightning's own precision: the checkpoints land via os.replace."""
    volume = small_disk(32 << 20)
    replaced: list[str] = []
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (replaced.append(Path(b).name), real_replace(a, b)))
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


# ------------------------------------------------------------------ shared: one saved adapter run


def _trainer(**kwargs: Any) -> pl.Trainer:
    defaults: dict[str, Any] = dict(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def _gpt(seed: int = 0) -> NanoGPT:
    torch.manual_seed(seed)
    return NanoGPT(**TINY_GPT)


def _data() -> ByteTextDataModule:
    return ByteTextDataModule(seq_len=32, batch_size=4, train_samples=256, val_samples=8, max_bytes=300_000)


def _lora_trainer(**kwargs: Any) -> pl.Trainer:
    return _trainer(plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2)], **kwargs)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step QLoRA run (AdamW) saved by the Trainer: the file every corruption test starts from."""
    path = tmp_path_factory.mktemp("saved") / "adapter.ckpt"
    trainer = _lora_trainer(default_root_dir=path.parent)
    trainer.fit(_gpt(), _data())
    trainer.save_checkpoint(path)
    return path


def _load(path: Path) -> dict[str, Any]:
    return torch.load(path, weights_only=True)


def _flip_one_bit(tensor: torch.Tensor) -> None:
    tensor.reshape(-1)[:1].view(torch.uint8)[0] ^= 0x40  # one bit of the first element's first byte


# -------------------------------------------------- 3. every tensor and the lightning_hbm part covered


def _optimizer_state(checkpoint: dict[str, Any], key: str) -> torch.Tensor:
    return next(iter(checkpoint["optimizer_states"][0]["state"].values()))[key]


KINDS = {
    "adapter A": lambda c: c["lightning_hbm"]["state_dict"]["model.h.1.attn.c_attn.lora_A.default.weight"],
    "adapter B": lambda c: c["lightning_hbm"]["state_dict"]["model.h.0.mlp.c_fc.lora_B.default.weight"],
    "Adam exp_avg": lambda c: _optimizer_state(c, "exp_avg"),
    "Adam exp_avg_sq": lambda c: _optimizer_state(c, "exp_avg_sq"),
    "Adam step": lambda c: _optimizer_state(c, "step"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_flipped_bit_in_any_tensor_is_found(saved: Path, kind: str) -> None:
    checkpoint = _load(saved)
    tensor = KINDS[kind](checkpoint)
    _flip_one_bit(tensor)
    with pytest.raises(ValueError, match=r"adapter.ckpt is damaged: tensor '.*' does not match the checksum"):
        resume.verify(checkpoint, saved)


def test_a_flipped_optimizer_state_stops_the_resume_before_training(saved: Path, tmp_path: Path) -> None:
    checkpoint = _load(saved)
    _flip_one_bit(_optimizer_state(checkpoint, "exp_avg_sq"))
    path = tmp_path / "bad.ckpt"
    torch.save(checkpoint, path)
    trainer = _lora_trainer(max_steps=4)
    with pytest.raises(ValueError, match=r"bad.ckpt is damaged: tensor '@optimizer_states/0/state/\d+/exp_avg_sq'"):
        trainer.fit(_gpt(), _data(), ckpt_path=path)
    assert trainer.global_step == 0


def test_smoothing_shifts_and_every_other_tensor_of_the_lightning_hbm_part_are_covered() -> None:
    checkpoint = {
        "state_dict": {"w": torch.ones(3)},
        "lightning_hbm": {
            "version": 2, "state_dict": {}, "placeholders": [], "omitted": [], "fingerprints": {}, "configs": {},
            "input_shifts": {"h.0.fc": torch.linspace(0.5, 2.0, 16)},
        },
        "lr_schedulers": [{"base_lrs": [0.1], "_last_lr": [torch.tensor(0.1)]}],
    }
    resume.seal(checkpoint)
    assert {"@lightning_hbm/input_shifts/h.0.fc", "@lr_schedulers/0/_last_lr/0", "w"} <= set(checkpoint["lightning_hbm"]["checksums"])
    resume.verify(checkpoint, "x.ckpt")
    for tensor in (checkpoint["lightning_hbm"]["input_shifts"]["h.0.fc"], checkpoint["lr_schedulers"][0]["_last_lr"][0]):
        copy = {**checkpoint, "lightning_hbm": {k: v for k, v in checkpoint["lightning_hbm"].items() if k != "verified"}}
        _flip_one_bit(tensor)
        with pytest.raises(ValueError, match=r"x.ckpt is damaged: tensor '@.*' does not match"):
            resume.verify(copy, "x.ckpt")
        _flip_one_bit(tensor)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda m: m["checksums"].update({k: v ^ 1 for k, v in list(m["checksums"].items())[:1]}), r"does not match its digest"),
        (lambda m: m["checksums"].clear(), r"does not match its digest"),
        (lambda m: m["configs"]["LoRA"].update(alpha=32.0), r"does not match its digest"),
        (lambda m: m["checksums"].pop(next(iter(m["state_dict"]))) and m.update(digest=resume.meta_digest(m)), r"has no checksum"),
        (lambda m: m.pop("digest"), r"\['digest'\] is missing, expected a str"),
        (lambda m: m.update(version=99), r"format version 99; this lightning_hbm reads versions 1 to 3.*upgrade"),
        (lambda m: m.update(version="2"), r"format version '2'"),
        (lambda m: m.update(checksums="abc"), r"\['checksums'\] is str, expected a dict"),
        (lambda m: m.update(omitted=[1, 2]), r"entries of the wrong type"),
    ],
    ids=["checksum-bit", "checksums-gone", "setting", "entry-gone", "digest-gone", "version-99", "version-str", "checksums-str", "omitted-ints"],
)
def test_the_lightning_hbm_part_itself_is_checked(saved: Path, edit: Callable, match: str) -> None:
    checkpoint = _load(saved)
    edit(checkpoint["lightning_hbm"])
    with pytest.raises(ValueError, match=rf"Checkpoint .*adapter.ckpt.*{match}"):
        resume.verify(checkpoint, saved)


@pytest.mark.parametrize("meta", [[1, 2], "lightning_hbm", 3], ids=["list", "str", "int"])
def test_a_lightning_hbm_part_of_another_type_is_a_clear_error_through_the_trainer(saved: Path, tmp_path: Path, meta: Any) -> None:
    checkpoint = _load(saved)
    checkpoint["lightning_hbm"] = meta
    path = tmp_path / "hostile.ckpt"
    torch.save(checkpoint, path)
    model = _gpt()
    trainer = _lora_trainer(max_steps=4)
    with pytest.raises(ValueError, match=r"hostile.ckpt: checkpoint\['lightning_hbm'\] is a \w+, not the dict"):
        trainer.fit(model, _data(), ckpt_path=path)
    assert trainer.global_step == 0 and not any("lora" in n for n, _ in model.named_parameters())


def test_a_version_1_checkpoint_still_resumes_with_a_warning(saved: Path, tmp_path: Path) -> None:
    checkpoint = _load(saved)
    meta = checkpoint["lightning_hbm"]
    # what version 1 wrote: CRCs of the weights only, 64-sample fingerprints, no digest
    weights = {**{k: v for k, v in checkpoint["state_dict"].items() if not resume.is_placeholder(v)}, **meta["state_dict"]}
    meta.update(version=1, checksums={k: resume.checksum(v) for k, v in weights.items()})
    built = _gpt().state_dict()
    meta["fingerprints"] = {k: resume.fingerprint_v1(built[k]) for k in meta["omitted"]}
    del meta["digest"]
    path = tmp_path / "v1.ckpt"
    torch.save(checkpoint, path)
    trainer = _lora_trainer(max_steps=3)
    with pytest.warns(UserWarning, match=r"format version 1: its weights are checked, but its optimizer states"):
        trainer.fit(_gpt(), _data(), ckpt_path=path)
    assert trainer.global_step == 3
    _flip_one_bit(meta["state_dict"]["model.h.0.mlp.c_fc.lora_B.default.weight"])  # its weights stay checked
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"damaged: tensor 'model.h.0.mlp.c_fc.lora_B"):
        resume.verify(checkpoint, path)


def test_the_fingerprint_sees_a_base_that_agrees_only_at_the_old_samples() -> None:
    torch.manual_seed(0)
    a = torch.randn(141_056)
    b = torch.randn(141_056)
    kept = resume.spread_indices(a.numel(), 64)
    b[kept] = a[kept]
    assert (a != b).sum() > 138_000
    assert resume.fingerprint_v1(a) == resume.fingerprint_v1(b)  # what version 1 accepted
    assert resume.fingerprint(a) != resume.fingerprint(b)


def test_the_fingerprint_of_a_large_tensor_sees_one_changed_element() -> None:
    big = torch.randn(5_000_000)  # 20 MB: above the exact-hash budget, sampled + whole-tensor sums
    other = big.clone()
    other[1_234_567] += 1e-3  # not a sampled index
    assert 1_234_567 not in set(resume.spread_indices(big.numel(), resume._SAMPLES).tolist())
    assert resume.fingerprint(big) == resume.fingerprint(big.clone())
    assert resume.fingerprint(big) != resume.fingerprint(other)
    swapped = big.clone()
    swapped[[10, 11]] = big[[11, 10]]  # same sum: the position-weighted sum sees it
    assert resume.fingerprint(big) != resume.fingerprint(swapped)


# ---------------------------------------------------------------------- 6. weights-only checkpoints


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


@pytest.mark.parametrize("callbacks", [[LoRA(r=2)], []], ids=["lora", "quantized-alone"])
def test_a_weights_only_checkpoint_loads_into_a_fresh_model(tmp_path: Path, callbacks: list) -> None:
    save = ModelCheckpoint(dirpath=tmp_path, filename="w", save_weights_only=True, save_top_k=1, every_n_train_steps=2)
    plugin = lambda: [QuantizedPrecision("nf4-dq", **F32)]  # noqa: E731
    model = _gpt()
    trainer = _trainer(plugins=plugin(), callbacks=[*callbacks, save], enable_checkpointing=True, default_root_dir=tmp_path)
    trainer.fit(model, _data())
    checkpoint = _load(tmp_path / "w.ckpt")
    assert "optimizer_states" not in checkpoint and "lightning_hbm" in checkpoint  # packed although no hook ran
    fresh = _gpt(seed=0 if callbacks else 5)  # adapter-only: the frozen base is rebuilt from the same seed
    fresh_callbacks = [LoRA(r=2)] if callbacks else []
    _trainer(plugins=plugin(), callbacks=fresh_callbacks, limit_val_batches=1).validate(fresh, _data(), ckpt_path=tmp_path / "w.ckpt")
    trained = {**_adapters(model), "model.h.0.attn.c_attn.weight": model.model.h[0].attn.c_attn.weight.detach()}
    loaded = {**_adapters(fresh), "model.h.0.attn.c_attn.weight": fresh.model.h[0].attn.c_attn.weight.detach()}
    assert trained.keys() == loaded.keys()
    for key in trained:
        torch.testing.assert_close(loaded[key], trained[key], rtol=0, atol=0)


# ------------------------------------------------------------------------- 7. clear, early errors


def test_a_directory_is_named_a_directory(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    model = _gpt()
    with pytest.raises(ValueError, match=r"run is a directory, not a checkpoint file.*distributed \(sharded\) checkpoint"):
        _lora_trainer().fit(model, _data(), ckpt_path=tmp_path / "run")
    assert not any("lora" in n for n, _ in model.named_parameters())


def test_a_legacy_format_file_resumes(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "legacy.ckpt"
    torch.save(_load(saved), path, _use_new_zipfile_serialization=False)
    trainer = _lora_trainer(max_steps=3)
    trainer.fit(_gpt(), _data(), ckpt_path=path)
    assert trainer.global_step == 3
    cut = tmp_path / "cut.ckpt"
    cut.write_bytes(path.read_bytes()[:10])  # not even torch's legacy header: still "cut short"
    with pytest.raises(ValueError, match=r"cut.ckpt is not a complete torch checkpoint"):
        _lora_trainer().fit(_gpt(), _data(), ckpt_path=cut)


def test_an_older_layout_is_a_clear_error_before_anything_loads(saved: Path, tmp_path: Path) -> None:
    checkpoint = _load(saved)
    meta = checkpoint.pop("lightning_hbm")
    checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k not in meta["placeholders"]}
    checkpoint["state_dict"].update(meta["state_dict"])  # the changed tensors in state_dict itself
    path = tmp_path / "old.ckpt"
    torch.save(checkpoint, path)
    model = _gpt()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"old.ckpt holds tensors of an already changed model.*older lightning_hbm layout"):
        _lora_trainer().fit(model, _data(), ckpt_path=path)
    for key, value in model.state_dict().items():  # nothing partly loaded
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


@pytest.mark.parametrize(
    "key", ["h.0.attn.c_attn.weight.absmax", "h.0.attn.c_attn.weight.nested_absmax", "h.0.mlp.c_fc.SCB",
            "h.0.mlp.c_fc.weight.quantized_scalers", "h.0.mlp.c_fc.lora_A.default.weight"],
)
def test_the_formats_name_the_keys_of_an_older_layout(key: str) -> None:
    # each quantized format registers the keys of its constants (QuantFormat.state_marks); LoRA's are resume's own
    checkpoint = {"state_dict": {"h.0.ln.weight": torch.ones(2), key: torch.ones(2)}}
    with pytest.raises(ValueError, match=rf"old.ckpt holds tensors of an already changed model in its state_dict \(\['{key}'\]\)"):
        resume.check_layout(checkpoint, "old.ckpt")
    resume.check_layout(checkpoint, "old.ckpt", model_keys=[key])  # a model built with such layers loads them
    resume.check_layout({"state_dict": {"h.0.ln.weight": torch.ones(2)}}, "plain.ckpt")


class _Diverge(pl.Callback):
    """Makes one adapter NaN after the first step (what a diverged loss leaves behind)."""

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step == 2:
            with torch.no_grad():
                pl_module.model.h[1].mlp.c_fc.lora_B.default.weight.fill_(float("nan"))


def test_a_diverged_run_cannot_replace_the_good_checkpoint(tmp_path: Path) -> None:
    save = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True, every_n_train_steps=1)
    plugins = [QuantizedPrecision("nf4-dq", **F32)]
    trainer = _trainer(max_steps=3, plugins=plugins, callbacks=[LoRA(r=2), _Diverge(), save], enable_checkpointing=True)
    with pytest.raises(ValueError, match=r"Refusing to save checkpoint .*last.ckpt: 1 trained tensor\(s\) hold NaN or inf "
                       r"\(\['model.h.1.mlp.c_fc.lora_B.default.weight'\]\); the previous checkpoint there is kept.*refuse_non_finite=False"):
        trainer.fit(_gpt(), _data())
    good = _load(tmp_path / "last.ckpt")
    assert good["global_step"] == 1
    assert all(torch.isfinite(v).all() for v in good["lightning_hbm"]["state_dict"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


def test_the_non_finite_guard_can_be_turned_off(tmp_path: Path) -> None:
    save = ModelCheckpoint(dirpath=tmp_path, save_top_k=0, save_last=True, every_n_train_steps=1)
    io = CheckedCheckpointIO(refuse_non_finite=False)
    trainer = _trainer(max_steps=3, plugins=[QuantizedPrecision("nf4-dq", **F32), io], callbacks=[LoRA(r=2), _Diverge(), save],
                       enable_checkpointing=True)
    trainer.fit(_gpt(), _data())
    assert trainer.strategy.checkpoint_io is io
    assert _load(tmp_path / "last.ckpt")["lightning_hbm"]["state_dict"]["model.h.1.mlp.c_fc.lora_B.default.weight"].isnan().all()


class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("callbacks", [[LoRA(r=2)], []], ids=["lora", "quantized-alone"])
def test_a_malicious_pickle_does_not_run_through_any_load_path(saved: Path, tmp_path: Path, callbacks: list) -> None:
    marker = tmp_path / "pwned"
    checkpoint = _load(saved)
    checkpoint["lightning_hbm"]["configs"]["evil"] = _Evil(marker)
    path = tmp_path / "evil.ckpt"
    torch.save(checkpoint, path)
    trainer = _trainer(plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=callbacks)
    with pytest.raises(Exception, match=r"Weights only load failed"):
        trainer.fit(_gpt(), _data(), ckpt_path=path)
    with pytest.raises(Exception, match=r"Weights only load failed"):
        CheckedCheckpointIO().load_checkpoint(path)
    assert not marker.exists()


# ------------------------------------------------------ 8. every value covered, every damaged file one clear error


def _reseal(checkpoint: dict[str, Any], path: Path) -> Path:
    """What an editor that knows the format does: change the file, then write fresh checksums and digests."""
    resume.seal(checkpoint)
    torch.save(checkpoint, path)
    return path


def _first_int(value: Any, where: str = "") -> tuple[str, Any, Any]:
    """``(path, container, key)`` of the first int (not a bool) in a nested dict/list."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if type(item) is int:
            return f"{where}/{key}", value, key
        if isinstance(item, (dict, list)):
            found = _first_int(item, f"{where}/{key}")
            if found[1] is not None:
                return found
    return where, None, None


def _set_loop_progress(c: dict[str, Any]) -> None:
    progress = c["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]
    progress["completed"] += 2  # 2 steps done -> 4: a resume would train 2 steps fewer, without a word


EDITS = {
    "loop progress": (_set_loop_progress, "loops"),
    "first int of the loops": (lambda c: (lambda _, d, k: d.__setitem__(k, d[k] ^ 1))(*_first_int(c["loops"])), "loops"),
    "epoch": (lambda c: c.update(epoch=c["epoch"] + 1), "epoch"),
    "global step": (lambda c: c.update(global_step=c["global_step"] ^ 4), "global_step"),
    "learning rate": (lambda c: c["optimizer_states"][0]["param_groups"][0].update(lr=0.5), "optimizer_states"),
    "scheduler state": (lambda c: c["lr_schedulers"].append({"last_epoch": 3}), "lr_schedulers"),
    "a string": (lambda c: c.update({"pytorch-lightning_version": "9.9.9"}), "pytorch-lightning_version"),
    "a state_dict key": (lambda c: c["state_dict"].update(junk=torch.zeros(1)), "state_dict"),
}


@pytest.mark.parametrize("edit", list(EDITS))
def test_every_value_is_covered_not_only_tensors(saved: Path, edit: str) -> None:
    checkpoint = _load(saved)
    change, entry = EDITS[edit]
    change(checkpoint)
    with pytest.raises(ValueError, match=rf"adapter.ckpt is damaged: the values of its entry '{entry}'.*do not match"):
        resume.verify(checkpoint, saved)


def test_an_entry_added_or_removed_is_found(saved: Path) -> None:
    checkpoint = _load(saved)
    checkpoint["extra"] = 1
    with pytest.raises(ValueError, match=r"adapter.ckpt is damaged: it holds an entry 'extra' that was not written"):
        resume.verify(checkpoint, saved)
    checkpoint = _load(saved)
    del checkpoint["loops"]
    with pytest.raises(ValueError, match=r"adapter.ckpt is damaged: its entry 'loops' is missing"):
        resume.verify(checkpoint, saved)


def test_a_flipped_loop_counter_stops_the_resume_before_any_change(saved: Path, tmp_path: Path, snapshot: Callable) -> None:
    checkpoint = _load(saved)
    _set_loop_progress(checkpoint)
    path = tmp_path / "loops.ckpt"
    torch.save(checkpoint, path)
    model = _gpt()
    before = snapshot(model)
    trainer = _lora_trainer(max_steps=4)
    with pytest.raises(ValueError, match=r"loops.ckpt is damaged: the values of its entry 'loops'"):
        trainer.fit(model, _data(), ckpt_path=path)
    assert snapshot(model) == before and trainer.global_step == 0


def test_a_version_2_checkpoint_still_resumes_with_a_warning(saved: Path, tmp_path: Path) -> None:
    checkpoint = _load(saved)
    meta = checkpoint["lightning_hbm"]
    del meta["values"]
    meta.update(version=2)
    meta["digest"] = resume.meta_digest(meta)
    path = tmp_path / "v2.ckpt"
    torch.save(checkpoint, path)
    trainer = _lora_trainer(max_steps=3)
    with pytest.warns(UserWarning, match=r"format version 2: its tensors and settings are checked, but its loop progress"):
        trainer.fit(_gpt(), _data(), ckpt_path=path)
    assert trainer.global_step == 3


def _pickle_span(path: Path) -> tuple[int, int]:
    """Offset and size of the bytes of ``data.pkl`` inside the zip file ``path``."""
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
    with open(path, "rb") as file:
        file.seek(info.header_offset)
        header = file.read(30)
    name, extra = struct.unpack("<HH", header[26:30])
    return info.header_offset + 30 + name + extra, info.file_size


def _rezip(path: Path, edit: Callable[[bytes], bytes], target: Path) -> Path:
    """``path`` written again with ``edit(data.pkl)`` and correct zip CRCs (an editor, or a copy tool that re-zips)."""
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_STORED) as out:
        for info in source.infolist():
            data = source.read(info)
            out.writestr(info.filename, edit(data) if info.filename.endswith("/data.pkl") else data)
    return target


RAW = (UnicodeDecodeError, TypeError, IndexError, KeyError, AttributeError, EOFError, RuntimeError)


def _flip(data: bytes, rng: random.Random) -> bytes:
    damaged = bytearray(data)
    damaged[rng.randrange(len(damaged))] ^= rng.randrange(1, 256)
    return bytes(damaged)


def _outcome(path: Path, original: dict[str, Any]) -> str:
    """What loading ``path`` through lightning_hbm's IO does: one clear error, or the original checkpoint exactly."""
    try:
        loaded = CheckedCheckpointIO().load_checkpoint(path)
    except ValueError as err:
        assert not isinstance(err, RAW) and f"Checkpoint {path} is damaged" in str(err), err
        return str(err).split(" is damaged", 1)[1][:60]
    # a flip the unpickler never reads back (e.g. the number a memo slot is stored under): the very same contents
    assert resume.value_digests(loaded) == resume.value_digests(original)
    assert loaded["lightning_hbm"]["checksums"] == original["lightning_hbm"]["checksums"]
    return "same contents"


def test_24_random_byte_flips_inside_the_pickle_are_each_one_clear_error(saved: Path, tmp_path: Path) -> None:
    rng = random.Random(34)
    start, size = _pickle_span(saved)
    original, checkpoint = saved.read_bytes(), _load(saved)
    in_place, rezipped = [], []
    for i in range(24):
        flipped = _flip(original[start : start + size], rng)
        path = tmp_path / f"in-place-{i}.ckpt"
        path.write_bytes(original[:start] + flipped + original[start + size :])
        in_place.append(_outcome(path, checkpoint))
        # the same flip under a correct zip CRC: the unpickler, the digests and the CRCs must catch it
        rezipped.append(_outcome(_rezip(saved, lambda _: flipped, tmp_path / f"rezipped-{i}.ckpt"), checkpoint))  # noqa: B023 - called at once
    assert all("zip archive does not read back (Bad CRC-32" in o for o in in_place), in_place
    assert sum(o != "same contents" for o in rezipped) >= 20, rezipped


def test_a_flip_that_unpickles_into_another_error_is_wrapped(saved: Path, tmp_path: Path) -> None:
    # flips that break torch's unpickler itself (checked one by one above, here one of each raw type)
    path = _rezip(saved, lambda data: data[: len(data) // 2], tmp_path / "half-pickle.ckpt")
    with pytest.raises(ValueError, match=r"half-pickle.ckpt is damaged: its pickled metadata does not load \(\w+"):
        CheckedCheckpointIO().load_checkpoint(path)


def test_an_oversized_pickle_is_refused_from_the_zip_directory_without_reading_it(
    saved: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "junk.ckpt"
    path.write_bytes(saved.read_bytes())
    with zipfile.ZipFile(path) as archive:
        info = next(i for i in archive.infolist() if i.filename.endswith("/data.pkl"))
        directory = archive.start_dir
    data = bytearray(path.read_bytes())
    # the central directory entry of data.pkl says 2 GiB (what a file with 2 GiB of junk pickled in it says)
    entry = data.index(b"PK\x01\x02" + data[directory + 4 : directory + 8], directory)
    while data[entry + 46 : entry + 46 + len(info.filename)] != info.filename.encode():
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 20 : entry + 28] = struct.pack("<II", 2 << 30, 2 << 30)
    path.write_bytes(bytes(data))
    read: list[Any] = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: read.append(a) or pytest.fail("torch.load ran"))
    monkeypatch.setattr(zipfile.ZipFile, "open", lambda *a, **k: read.append(a) or pytest.fail("data.pkl was read"))
    with pytest.raises(ValueError, match=r"junk.ckpt is damaged or not a checkpoint: its pickled metadata .*data.pkl\) is 2048 MiB, above the 64 MiB"):
        CheckedCheckpointIO().load_checkpoint(path)
    assert not read


def test_the_pickle_bound_applies_through_the_trainer(saved: Path, snapshot: Callable, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(resume, "MAX_PICKLE_BYTES", 1024)
    model = _gpt()
    before = snapshot(model)
    with pytest.raises(ValueError, match=r"adapter.ckpt is damaged or not a checkpoint: .*above the 0 MiB"):
        _lora_trainer().fit(model, _data(), ckpt_path=saved)
    assert snapshot(model) == before


@pytest.mark.parametrize("part", ["state_dict", "lightning_hbm"])
def test_ten_thousand_extra_tensors_are_one_short_message_before_any_change(
    saved: Path, tmp_path: Path, snapshot: Callable, part: str
) -> None:
    checkpoint = _load(saved)
    target = checkpoint["state_dict"] if part == "state_dict" else checkpoint["lightning_hbm"]["state_dict"]
    target.update({f"junk.{i}.weight": torch.zeros(1) for i in range(10_000)})
    path = _reseal(checkpoint, tmp_path / "extra.ckpt")
    model = _gpt()
    before = snapshot(model)
    trainer = _lora_trainer(max_steps=4)
    with pytest.raises(ValueError, match=r"extra.ckpt holds 10000 tensor\(s\) that fit no layer of this model \(first: \['junk.0.weight'") as err:
        trainer.fit(model, _data(), ckpt_path=path)
    assert len(str(err.value)) < 600
    assert snapshot(model) == before and trainer.global_step == 0


def test_a_weights_only_file_given_to_fit_is_refused_before_any_change(tmp_path: Path, snapshot: Callable) -> None:
    save = ModelCheckpoint(dirpath=tmp_path, filename="w", save_weights_only=True, save_top_k=1, every_n_train_steps=2)
    _trainer(plugins=[QuantizedPrecision("nf4-dq", **F32)], callbacks=[LoRA(r=2), save], enable_checkpointing=True,
             default_root_dir=tmp_path).fit(_gpt(), _data())
    model = _gpt()
    before = snapshot(model)
    trainer = _lora_trainer(max_steps=4)
    with pytest.raises(ValueError, match=r"w.ckpt holds only weights \(no optimizer_states / lr_schedulers.*fit\(ckpt_path=...\) resumes"
                                         r".*nothing was loaded.*validate/test/predict\(model, ckpt_path=...\)"):
        trainer.fit(model, _data(), ckpt_path=tmp_path / "w.ckpt")
    assert snapshot(model) == before and trainer.global_step == 0


def test_a_file_holding_no_dict_is_named(tmp_path: Path) -> None:
    path = tmp_path / "list.ckpt"
    torch.save([1, 2], path)
    with pytest.raises(ValueError, match=r"list.ckpt is damaged: it holds a list, not the dict"):
        CheckedCheckpointIO().load_checkpoint(path)


def test_changed_tensors_of_every_kind_find_their_layer_and_junk_does_not() -> None:
    model = torch.nn.ModuleDict({
        "h": torch.nn.ModuleList([torch.nn.ModuleDict({"fc": torch.nn.Linear(4, 4), "attn": torch.nn.MultiheadAttention(4, 1)})]),
        "head": torch.nn.Sequential(torch.nn.Linear(4, 2)),  # a container trained in full (modules_to_save)
    })
    legit = [
        "h.0.fc.lora_A.default.weight", "h.0.fc.weight.absmax", "h.0.fc.base_layer.weight", "h.0.fc.weight_scale",
        "h.0.attn.q_proj.weight", "h.0.attn.out_proj.lora_B.default.weight",  # a converted MultiheadAttention
        "head.modules_to_save.default.0.weight", "head.original_module.0.bias",
    ]
    junk = ["junk.0.weight", "h.lora_A.default.weight", "extra"]
    checkpoint = {"state_dict": {"h.0.fc.weight": torch.ones(1), "h.9.fc.weight": torch.ones(1)},
                  "lightning_hbm": {"state_dict": dict.fromkeys(legit + junk)}}
    assert resume.stray_keys(checkpoint, model) == ["h.9.fc.weight", *junk]


class _Migrating(NanoGPT):
    """A model whose own hook renames an old key before Lightning's strict load (a common migration)."""

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["state_dict"].pop("old.name", None)


def test_a_model_that_migrates_keys_in_on_load_checkpoint_still_resumes(saved: Path, tmp_path: Path) -> None:
    checkpoint = _load(saved)
    checkpoint["state_dict"]["old.name"] = torch.zeros(1)
    path = _reseal(checkpoint, tmp_path / "old-names.ckpt")
    torch.manual_seed(0)
    trainer = _lora_trainer(max_steps=3)
    trainer.fit(_Migrating(**TINY_GPT), _data(), ckpt_path=path)
    assert trainer.global_step == 3


def test_saved_in_changed_form_is_the_pairwise_answer_from_sets() -> None:
    """pack() asks, per as-built key, whether a changed key is a form of it: the set index (issue 37, once per save)
    answers exactly what the pairwise loop did, converted layers, adapters under them and beside-weight constants
    included."""
    rng = random.Random(0)
    parts = ["a", "b", "weight", "bias", "base_layer", "weight_scale", "input_shift", "absmax", "q_proj", "lora_A", "0"]
    keys = resume.KeyMap()
    for trial in range(2000):
        keys.converted = {"a.q_proj.weight": "a.in_proj_weight", "b.0.weight": "b.weight"} if trial % 2 else {}
        keys.targets = set(keys.converted.values())
        changed = [".".join(rng.choice(parts) for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 8))]
        asked = [".".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) for _ in range(20)] + changed
        indexed = keys.any_form_of(changed)
        for key in [*asked, *keys.targets]:
            assert indexed(key) == any(keys.covers(k, key) for k in changed), (changed, key)
