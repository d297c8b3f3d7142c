"""Resume from a mid-epoch checkpoint (``every_n_train_steps``, the ``last.ckpt`` of a Ctrl-C): the project's data
continues at the next batch in the same order, so N steps straight equal N/2 steps + checkpoint + the rest, bit for
bit; a plain ``DataLoader``, which Lightning restarts at batch 0, gets a warning naming the fix.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule, ByteWindows, EpochSampler, ResumableDataLoader
from lightning_hbm.models import NanoGPT

TINY_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)  # as tests/resume/test_resume.py
BATCHES = 8  # per epoch: train_samples=32, batch_size=4


class _Losses(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def _data(**kwargs: Any) -> ByteTextDataModule:
    return ByteTextDataModule(seq_len=32, batch_size=4, train_samples=4 * BATCHES, val_samples=8, max_bytes=300_000, **kwargs)


def _fit(root: Path, data: pl.LightningDataModule, max_steps: int, ckpt_path: Any = None, every: int = 0) -> tuple[Any, _Losses]:
    torch.manual_seed(0)
    model, losses = NanoGPT(**TINY_GPT), _Losses()
    callbacks: list[Any] = [LoRA(r=2), losses]
    if every:
        callbacks.append(ModelCheckpoint(dirpath=root, every_n_train_steps=every, save_top_k=-1, filename="{step}"))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=bool(every),
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=callbacks, default_root_dir=root,
    )
    trainer.fit(model, data, ckpt_path=ckpt_path)
    return model, losses


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_mid_epoch_resume_equals_the_straight_run_bit_for_bit(tmp_path: Path, shuffle: bool) -> None:
    steps = BATCHES + 4  # epoch 0 whole, 4 batches of epoch 1
    straight, run = _fit(tmp_path / "straight", _data(shuffle=shuffle), steps, every=2)
    assert len(run.losses) == steps
    want = LoRA.adapter_state_dict(straight)
    # mid-epoch 0 (N/2 steps), the end of epoch 0 (its last batch), mid-epoch 1 (another order when shuffled)
    for step in (steps // 2, BATCHES, BATCHES + 2):
        ckpt = tmp_path / "straight" / f"step={step}.ckpt"
        states = torch.load(ckpt, weights_only=True)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
        assert [_position(state) for state in states] == [
            {"version": 2, "epoch": (step - 1) // BATCHES, "batches": (step - 1) % BATCHES + 1}
        ]
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*(not resumable|has no state_dict).*")
            resumed, again = _fit(tmp_path / f"resumed{step}", _data(shuffle=shuffle), steps, ckpt_path=ckpt)
        assert again.losses == run.losses[step:], step  # every step's loss, bit for bit
        got = LoRA.adapter_state_dict(resumed)
        assert set(got) == set(want) and want
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_the_same_resume_from_a_plain_dataloader_repeats_batches_and_warns(tmp_path: Path) -> None:
    class Plain(ByteTextDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(super().train_dataloader().dataset, batch_size=self.batch_size)

    steps = BATCHES - 2
    _, run = _fit(tmp_path / "straight", _plain(Plain), steps, every=3)
    ckpt = tmp_path / "straight" / "step=3.ckpt"
    with pytest.warns(UserWarning, match=r"Resuming 3 batches into epoch 0 \(3 of 8\) .*DataLoader.*restarts it at batch 0.*"
                      r"ResumableDataLoader, or torchdata's StatefulDataLoader.*checkpoints saved at epoch ends"):
        _, again = _fit(tmp_path / "resumed", _plain(Plain), steps, ckpt_path=ckpt)
    assert again.losses != run.losses[3:]  # what the warning is about: batches 0.. again, another run


def _plain(cls: type) -> ByteTextDataModule:
    return cls(seq_len=32, batch_size=4, train_samples=4 * BATCHES, val_samples=8, max_bytes=300_000)


def test_no_warning_at_an_epoch_end_resume_with_a_plain_dataloader(tmp_path: Path) -> None:
    class Plain(ByteTextDataModule):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(super().train_dataloader().dataset, batch_size=self.batch_size)

    _fit(tmp_path / "straight", _plain(Plain), BATCHES + 2, every=BATCHES)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has no state_dict.*")
        _fit(tmp_path / "resumed", _plain(Plain), BATCHES + 2, ckpt_path=tmp_path / "straight" / f"step={BATCHES}.ckpt")


# ------------------------------------------------------------------ the loader alone


def _windows(n: int = 10) -> ByteWindows:
    return ByteWindows(torch.arange(200, dtype=torch.uint8), seq_len=4, num_samples=n, seed=0)


def _position(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k != "loader"}


def _firsts(batches: Any) -> list[list[int]]:
    return [x[:, 0].tolist() for x, _ in batches]


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_skips_by_indices_to_the_saved_batch_and_only_in_the_saved_epoch(workers: int) -> None:
    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(_windows(), batch_size=2, shuffle=True, seed=3, num_workers=workers)

    first = loader()
    first.sampler.set_epoch(1)
    whole = _firsts(first)
    it = iter(first)
    seen = _firsts([next(it), next(it)])
    state = first.state_dict()
    assert _position(state) == {"version": 2, "epoch": 1, "batches": 2} and seen == whole[:2]

    again = loader()
    again.load_state_dict(state)
    assert _firsts(again) == whole[2:]  # the rest of epoch 1, same order
    assert _position(again.state_dict()) == {"version": 2, "epoch": 1, "batches": 5}  # absolute position, skipped ones included
    later = loader()
    later.load_state_dict(state)
    later.sampler.set_epoch(2)  # the checkpoint ended epoch 1: epoch 2 starts at batch 0
    epoch2 = _firsts(later)
    assert len(epoch2) == 5 and epoch2 != whole


def test_epoch_sampler_orders_depend_on_seed_and_epoch_alone() -> None:
    a, b = EpochSampler(50, seed=1), EpochSampler(50, seed=1)
    torch.manual_seed(0)
    order = list(a)
    torch.manual_seed(123)  # the global RNG plays no part
    assert list(b) == order and sorted(order) == list(range(50)) and order != list(range(50))
    b.set_epoch(1)
    assert list(b) != order
    with pytest.raises(ValueError, match="num_samples must be an int >= 1, got 0"):
        EpochSampler(0)


def test_a_skipped_batch_is_never_loaded() -> None:
    loaded: list[int] = []

    class Counting(ByteWindows):
        def __getitem__(self, index: int) -> Any:
            loaded.append(index)
            return super().__getitem__(index)

    dl = ResumableDataLoader(Counting(torch.arange(200, dtype=torch.uint8), 4, 10, 0), batch_size=2)
    dl.load_state_dict({"version": 1, "epoch": 0, "batches": 3})
    assert len(list(dl)) == 2 and loaded == [6, 7, 8, 9]


def test_the_loader_refuses_what_it_cannot_resume() -> None:
    dl = ResumableDataLoader(_windows(), batch_size=2)
    with pytest.raises(ValueError, match="another dataloader's state"):
        dl.load_state_dict({"_snapshot": {}})  # torchdata's format
    with pytest.raises(ValueError, match="batches=6 do not fit this loader of 5 batches"):
        dl.load_state_dict({"version": 1, "epoch": 0, "batches": 6})
    with pytest.raises(TypeError, match="IterableDataset"):
        ResumableDataLoader(torch.utils.data.IterableDataset())
    with pytest.raises(ValueError, match="sampler or shuffle, not both"):
        ResumableDataLoader(_windows(), shuffle=True, sampler=range(10))


def test_a_sampler_without_set_epoch_is_said() -> None:
    dl = ResumableDataLoader(_windows(), batch_size=2, sampler=list(range(10)))
    with pytest.warns(UserWarning, match="has no set_epoch/epoch, so the 2 restored batches are skipped"):
        dl.load_state_dict({"version": 1, "epoch": None, "batches": 2})
    assert len(list(dl)) == 3


def test_a_distributed_sampler_resumes_in_its_epoch() -> None:
    def loader() -> ResumableDataLoader:
        return ResumableDataLoader(_windows(12), batch_size=2, sampler=DistributedSampler(_windows(12), num_replicas=2, rank=1))

    first = loader()
    first.sampler.set_epoch(4)
    whole, it = _firsts(first), iter(first)
    next(it)
    again = loader()
    again.load_state_dict(first.state_dict())
    assert first.state_dict()["epoch"] == 4 and _firsts(again) == whole[1:]


@pytest.mark.parametrize(
    ("changed", "message"),
    [
        (dict(batch_size=4), r"batch_size 2 -> 4"),
        (dict(seed=4), r"seed 3 -> 4"),
        (dict(samples=16), r"samples 10 -> 16"),
        (dict(shuffle=False), r"shuffle True -> False"),
    ],
    ids=["batch-size", "seed", "dataset-length", "no-shuffle"],
)
def test_a_resume_with_another_loader_is_refused_before_anything_changes(changed: dict[str, Any], message: str) -> None:
    """Issue 55: a resume after the loader changed trained the wrong samples silently (batch size 8 instead of 4: 24
    samples of the epoch never trained; another seed, more samples or shuffle=False: samples trained twice)."""
    settings = dict(batch_size=2, seed=3, samples=10, shuffle=True)
    first = ResumableDataLoader(_windows(settings["samples"]), batch_size=2, shuffle=True, seed=3)
    first.sampler.set_epoch(1)
    it = iter(first)
    next(it)
    state = first.state_dict()
    now = {**settings, **changed}
    other = ResumableDataLoader(_windows(now["samples"]), batch_size=now["batch_size"], shuffle=now["shuffle"], seed=now["seed"])
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"saved with another training dataloader \(.*" + message + r".*skip or repeat samples"):
        other.load_state_dict(state)
    assert other.state_dict() == before and other._resume is None  # nothing changed
    same = ResumableDataLoader(_windows(10), batch_size=2, shuffle=True, seed=3)
    same.load_state_dict(state)  # the same settings: resumes
    assert len(list(same)) == 4


def test_an_older_loader_state_is_resumed_with_a_warning() -> None:
    dl = ResumableDataLoader(_windows(), batch_size=2)
    with pytest.warns(UserWarning, match=r"version 1, which does not record the loader's settings"):
        dl.load_state_dict({"version": 1, "epoch": 0, "batches": 3})
    assert len(list(dl)) == 2


@pytest.mark.parametrize(("changed", "message"), [(dict(batch_size=8), r"batch_size 4 -> 8"), (dict(shuffle=False), r"shuffle True -> False")],
                         ids=["batch-size", "no-shuffle"])  # fmt: skip
def test_a_trainer_resumed_with_another_loader_stops_before_training(tmp_path: Path, changed: dict[str, Any], message: str) -> None:
    """Issue 55 item 2 through the Trainer: ``fit(ckpt_path=...)`` of a mid-epoch checkpoint with the loader changed
    (batch size 8 instead of 4: 24 samples of the epoch never trained; shuffle off: samples trained twice) is refused
    before any step, naming the setting."""
    _fit(tmp_path / "first", _data(shuffle=True), 2, every=2)
    settings = dict(seq_len=32, batch_size=4, train_samples=4 * BATCHES, val_samples=8, max_bytes=300_000, shuffle=True)
    other = ByteTextDataModule(**{**settings, **changed})
    seen = _Losses()
    with pytest.raises(ValueError, match=r"saved with another training dataloader \(.*" + message):
        trainer = pl.Trainer(
            accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0, default_root_dir=tmp_path / "resumed",
            plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=2), seen],
        )  # fmt: skip
        torch.manual_seed(0)  # the base the checkpoint was trained on (as _fit)
        trainer.fit(NanoGPT(**TINY_GPT), other, ckpt_path=tmp_path / "first" / "step=2.ckpt")
    assert seen.losses == []  # not one step on the wrong samples
