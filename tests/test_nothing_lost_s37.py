"""Session 37, h4: nothing lost to the fit-start draws (issue 55, item 3: "take the first batch once and train on that
same batch"). A stateful loader over a stream read once trained 8 of its 10 batches: the probe step and the
quantization's fit-start measures each drew a batch in a pass of their own."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset, IterableDataset

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ResumableDataLoader


def _image(i: int) -> torch.Tensor:
    image = torch.rand(3, 8, 8, generator=torch.Generator().manual_seed(i))
    image[0, 0, 0] = i  # numbered by its first pixel
    return image


class _OnePass(IterableDataset):
    """A stream read once (a queue, a socket): a second ``iter`` goes on where the first stopped."""

    def __init__(self) -> None:
        self.items = iter(range(40))

    def __iter__(self) -> Any:
        for i in self.items:
            yield _image(i)


class _Restartable(IterableDataset):
    """A stream with a position of its own, saved and restored (a sharded reader's offset)."""

    def __init__(self) -> None:
        self.position = 0

    def __iter__(self) -> Any:
        while self.position < 40:
            self.position += 1
            yield _image(self.position - 1)


class _Stateful(DataLoader):
    """A loader Lightning saves and restores: its dataset's position."""

    def state_dict(self) -> dict[str, Any]:
        return {"position": getattr(self.dataset, "position", 0)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if hasattr(self.dataset, "position"):
            self.dataset.position = state["position"]


class _OwnIter(_Stateful):
    """torchdata's ``StatefulDataLoader``'s layout: an ``__iter__`` of its own that keeps the pass it takes from
    ``_get_iterator`` and whose ``state_dict`` asks that pass (its batches yielded)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.own_pass: Optional[Any] = None
        self.next_state: Optional[dict[str, Any]] = None

    def __iter__(self) -> Any:
        self.own_pass = self._get_iterator()
        if self.next_state is not None:
            self.dataset.position, self.next_state = self.next_state["yielded"] * 4, None
        return self.own_pass

    def state_dict(self) -> dict[str, Any]:
        return {"yielded": self.own_pass._num_yielded if self.own_pass is not None else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.own_pass, self.next_state = None, state


class _FastForward(_OwnIter):
    """torchdata's restore of a stream without a state of its own: the restored pass skips the batches yielded, read
    from the stream as it is (a batch drawn from it before the restore moved it one batch on)."""

    def __iter__(self) -> Any:
        self.own_pass = self._get_iterator()
        if self.next_state is not None:
            for _ in range(self.next_state["yielded"]):
                next(self.own_pass)
            self.next_state = None
        return self.own_pass


class _Wrapping(_Stateful):
    """An ``__iter__`` of its own around its parent's (``super().__iter__()``): DataLoader's pass, handed over."""

    def __iter__(self) -> Any:
        yield from super().__iter__()


class _Unkept(_Stateful):
    """An ``__iter__`` of its own whose passes do not come from ``_get_iterator``: a drawn batch cannot be handed back."""

    def __iter__(self) -> Any:
        return iter(DataLoader(self.dataset, batch_size=self.batch_size))  # a loader of its own per pass


class _Seen(pl.LightningModule):
    """A small net recording the first pixel of each batch it trains (``on_train_batch_start``)."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        if conv:
            self.net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3))
        else:
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.seen: list[list[int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.seen.append(batch[:, 0, 0, 0].long().tolist())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


#: the fit-start draws: the int8 conv check (its joined batches) and the probe step; nf4 with LoRA: the probe step
_SETUPS = {
    "int8-conv": (True, lambda: {"plugins": [QuantizedPrecision("int8")]}),
    "nf4-lora": (False, lambda: {"plugins": [QuantizedPrecision("nf4")], "callbacks": [LoRA(r=4)]}),
}
_ALL = [list(range(k, k + 4)) for k in range(0, 40, 4)]


def _fit(loader: Any, setup: Optional[str], tmp_path: Any, *, max_steps: int = -1, callbacks: Any = (), ckpt: Any = None) -> tuple[_Seen, list[Any]]:
    conv, extra = _SETUPS[setup or "int8-conv"]
    kwargs = extra() if setup else {}
    torch.manual_seed(0)
    model = _Seen(conv)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, max_steps=max_steps, logger=False, enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        plugins=kwargs.get("plugins"), callbacks=[*kwargs.get("callbacks", []), *callbacks],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, ckpt_path=ckpt)
    return model, [w for w in caught if "lightning_hbm drew" in str(w.message)]


@pytest.mark.parametrize("setup", list(_SETUPS))
@pytest.mark.parametrize("kind", [_Stateful, _OwnIter, _Wrapping])
def test_a_stateful_loader_over_a_stream_read_once_trains_every_batch(kind: type, setup: str, tmp_path: Any) -> None:
    """Was 8 of 10 (the probe step's batch and the measures' each drawn in a new pass); now the pass the first batch
    was drawn from is handed to the loop, as for a plain DataLoader over a stream: 10 of 10, in order, nothing said."""
    assert _fit(kind(_OnePass(), batch_size=4), None, tmp_path)[0].seen == _ALL
    model, said = _fit(kind(_OnePass(), batch_size=4), setup, tmp_path)
    assert model.seen == _ALL and not said


@pytest.mark.parametrize("loader", ["dataloader", "generator", "resumable"])
def test_the_other_loaders_train_every_batch(loader: str, tmp_path: Any) -> None:
    """A plain DataLoader over a stream, a one-pass iterator, the library's own ResumableDataLoader: 10 of 10 (they
    did on main too; kept so)."""

    class _Numbered(Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            return _image(i)

    def make() -> Any:
        if loader == "dataloader":
            return DataLoader(_OnePass(), batch_size=4)
        if loader == "generator":
            return (torch.stack([_image(i) for i in range(k, k + 4)]) for k in range(0, 40, 4))
        return ResumableDataLoader(_Numbered(), batch_size=4)

    for setup in _SETUPS:
        assert _fit(make(), setup, tmp_path)[0].seen == _ALL


def _saved_and_resumed(kind: type, setup: Optional[str], tmp_path: Any) -> tuple[Any, list[list[int]]]:
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    first, _ = _fit(kind(_Restartable(), batch_size=4), setup, tmp_path, max_steps=5, callbacks=[saving])
    assert first.seen == _ALL[:5]
    path = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    state = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    resumed, _ = _fit(kind(_Restartable(), batch_size=4), setup, tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "more")], ckpt=path)
    return state, resumed.seen


@pytest.mark.parametrize("kind", [_Stateful, _OwnIter, _FastForward])
def test_a_stateful_stream_resumed_mid_epoch_starts_where_its_state_says(kind: type, tmp_path: Any) -> None:
    """The kept pass is dropped when Lightning restores the loader's state before its loop iterates: the resumed run
    trains what plain Lightning's does (not the batch drawn at fit start, 0, in front of them), and the saved state is
    plain Lightning's (the batch the loop took from the kept pass counted)."""
    plain = _saved_and_resumed(kind, None, tmp_path / "plain")
    assert plain[1] == _ALL[6:]  # Lightning's fetcher has read one batch ahead, and these states count it: as without us
    assert _saved_and_resumed(kind, "nf4-lora", tmp_path / "ours") == plain


def test_a_stream_whose_passes_cannot_be_handed_back_is_drawn_once_and_said(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loader whose ``__iter__`` makes its passes without ``_get_iterator``: the drawn batch cannot reach the loop.
    It was drawn twice (8 of 10 trained), unsaid; now once (9 of 10) and said at fit start, naming the loader and the
    fixes; with them (the measures' batch given, the probe step off) nothing is drawn: 10 of 10."""
    model, said = _fit(_Unkept(_OnePass(), batch_size=4), "int8-conv", tmp_path)
    assert model.seen == _ALL[1:] and len(said) == 1
    message = str(said[0].message)
    assert "_Unkept" in message and "QuantizedPrecision(probe_batch=<a batch>) with LIGHTNING_HBM_PROBE_STEP=0" in message
    assert "self._get_iterator()" in message
    monkeypatch.setenv("LIGHTNING_HBM_PROBE_STEP", "0")
    _SETUPS["given"] = (True, lambda: {"plugins": [QuantizedPrecision("int8", probe_batch=torch.stack([_image(i) for i in range(40, 72)]))]})
    try:
        model, said = _fit(_Unkept(_OnePass(), batch_size=4), "given", tmp_path)
    finally:
        del _SETUPS["given"]
    assert model.seen == _ALL and not said


# ---------------------------------------------------------------- h9: AutoFit's planning batch (issue 55, item 3)


def _fit_linear(loader: Any, tmp_path: Any, callbacks: list[Any], plugins: Optional[list[Any]] = None) -> tuple[_Seen, list[Any]]:
    torch.manual_seed(0)
    model = _Seen(conv=False)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=plugins, callbacks=callbacks,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader)
    return model, [w for w in caught if "lightning_hbm drew" in str(w.message)]


def _autofit(precisions: list[str], rank: int) -> Any:
    from lightning_hbm import AutoFit

    return AutoFit(budget="1GiB", precisions=precisions, lora_ranks=[rank], checkpointing=["none"], optimizers=["user"], fused_loss=[False])


@pytest.mark.parametrize(("precisions", "rank"), [(["nf4-dq"], 4), ([], 0)], ids=["probe-step", "no-probe-step"])
def test_autofit_over_a_stream_whose_passes_cannot_be_handed_back_draws_once_and_says_it(precisions: list[str], rank: int, tmp_path: Any) -> None:
    """AutoFit drew its planning batch with ``next(iter(loader))``, a pass of its own, unsaid: with a choice that runs
    the probe step another batch was drawn (8 of 10 trained, one warning); with one that runs none, 9 of 10 and no word.
    Now the planning batch is the one the surgery's draws reuse, said once at fit start: 9 of 10, one warning."""
    model, said = _fit_linear(_Unkept(_OnePass(), batch_size=4), tmp_path, [_autofit(precisions, rank)])
    assert model.seen == _ALL[1:] and len(said) == 1 and "_Unkept" in str(said[0].message)


def test_autofit_leaves_a_shuffled_loaders_epoch_order_as_the_same_choice_by_hand(tmp_path: Any) -> None:
    """AutoFit's planning batch advanced the shuffled DataLoader's order (a pass begun with ``next(iter(loader))``):
    epoch 0 trained another order than the same choice made by hand, and than plain Lightning. Now drawn in a pass
    left as it was (``torch_compat.leading_batches``)."""

    class _Numbered(Dataset):
        def __len__(self) -> int:
            return 40

        def __getitem__(self, i: int) -> torch.Tensor:
            return _image(i)

    def shuffled() -> DataLoader:
        return DataLoader(_Numbered(), batch_size=4, shuffle=True)

    chosen, _ = _fit_linear(shuffled(), tmp_path, [_autofit(["nf4-dq"], 4)])
    by_hand, _ = _fit_linear(shuffled(), tmp_path, [LoRA(r=4)], [QuantizedPrecision("nf4-dq")])
    plain, _ = _fit_linear(shuffled(), tmp_path, [])
    assert chosen.seen == by_hand.seen == plain.seen and sorted(sum(plain.seen, [])) == list(range(40))
