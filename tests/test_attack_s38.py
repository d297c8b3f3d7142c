"""Session 38, h4: session 37's loader hand-over and probe step attacked by running (issue 55 "nothing lost").

Several train loaders trained together (``fit(model, {"a": ..., "b": ...})``, ``CombinedLoader(...)``, as
Lightning documents them): an explicit ``CombinedLoader`` was taken for a one-pass iterator (``iter`` gives itself)
and replaced by one whose batches were the ``(batch, batch_idx, dataloader_idx)`` triples: the fit stopped at its first
batch; a dict of loaders ran the probe step on the first loader's batch alone (``batch["b"]`` of a tensor), said as a
step that could not run, the source left to decide."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers.read_weight import ReadableLinear
from tests.surgery.test_unrun_step_reads_s37 import _BfloatOnly
from tests.surgery.test_unrun_step_reads_s37 import _fit as _fit_bfloat
from tests.test_nothing_lost_s37 import _image, _OnePass, _Restartable, _Stateful


class _Pair(pl.LightningModule):
    """A small net trained on a dict batch of two loaders, recording the first pixel of each batch it trains."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(192, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
        self.seen: list[dict[str, list[int]]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def on_train_batch_start(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.seen.append({key: value[:, 0, 0, 0].long().tolist() for key, value in batch.items()})

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["a"]).square().mean() + self(batch["b"]).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _fit(loaders: Any, ours: bool, tmp_path: Any, *, max_steps: int = -1, callbacks: Any = (), ckpt: Any = None) -> tuple[_Pair, list[str]]:
    torch.manual_seed(0)
    model = _Pair()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, max_steps=max_steps, logger=False, enable_checkpointing=bool(callbacks),
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4")] if ours else None, callbacks=[*([LoRA(r=4)] if ours else []), *callbacks],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loaders, ckpt_path=ckpt)
    return model, [str(w.message) for w in caught if "lightning_hbm" in str(w.message)]


def _numbered(start: int, stop: int) -> list[torch.Tensor]:
    return [_image(i) for i in range(start, stop)]


@pytest.mark.parametrize("stream", [False, True], ids=["map-style", "stream"])
def test_a_combined_loader_passed_to_fit_trains_as_without_us(stream: bool, tmp_path: Any) -> None:
    """``fit(model, CombinedLoader({...}, "max_size_cycle"))``: was stopped at its first batch (``'tuple' object has
    no attribute 'items'``: the loop got ``(batch, batch_idx, dataloader_idx)``); now the same batches as plain
    Lightning, nothing said."""

    def make() -> CombinedLoader:
        first = _Stateful(_OnePass(), batch_size=4) if stream else DataLoader(_numbered(0, 16), batch_size=4)
        return CombinedLoader({"a": first, "b": DataLoader(_numbered(100, 108), batch_size=4)}, "max_size_cycle")

    plain, _ = _fit(make(), False, tmp_path)
    ours, said = _fit(make(), True, tmp_path)
    assert ours.seen == plain.seen and len(plain.seen) == (10 if stream else 4) and not said


@pytest.mark.parametrize("kind", ["dict", "CombinedLoader"])
def test_the_probe_step_of_several_loaders_gets_the_batch_training_step_gets(kind: str, tmp_path: Any) -> None:
    """A dict of two loaders: the probe step ran ``training_step`` on the first loader's batch alone (a tensor:
    ``batch["b"]`` failed, the step said as one that could not run); now on ``{"a": ..., "b": ...}``, observed."""
    loaders = {"a": DataLoader(_numbered(0, 16), batch_size=4), "b": DataLoader(_numbered(100, 108), batch_size=4)}
    ours, said = _fit(loaders if kind == "dict" else CombinedLoader(loaders, "max_size_cycle"), True, tmp_path, max_steps=2)
    assert not [message for message in said if "could not run one step" in message]
    assert ours.seen == [{"a": [0, 1, 2, 3], "b": [100, 101, 102, 103]}, {"a": [4, 5, 6, 7], "b": [104, 105, 106, 107]}]


class _Offset(_Restartable):
    """A restartable stream numbered from ``offset``."""

    def __init__(self, offset: int) -> None:
        super().__init__()
        self.offset = offset

    def __iter__(self) -> Any:
        for image in super().__iter__():
            image[0, 0, 0] += self.offset
            yield image


def _saved_and_resumed(ours: bool, tmp_path: Any) -> tuple[Any, list[dict[str, list[int]]]]:
    def make() -> dict[str, Any]:  # two stateful streams whose states differ (batches of 4 and of 2)
        return {"a": _Stateful(_Offset(100), batch_size=4), "b": _Stateful(_Offset(200), batch_size=2)}

    _fit(make(), ours, tmp_path, max_steps=5, callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)])
    path = tmp_path / "ckpt" / "epoch=0-step=5.ckpt"
    state = torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    resumed, _ = _fit(make(), ours, tmp_path, callbacks=[ModelCheckpoint(dirpath=tmp_path / "more")], ckpt=path)
    return state, resumed.seen


def test_two_stateful_streams_resumed_each_start_where_their_own_state_says(tmp_path: Any) -> None:
    """Each stream's first batch drawn at fit start is drawn after its own restore (the checkpoint's state of that
    loader, not the first loader's): the resumed run trains what plain Lightning's does."""
    plain: Optional[Any] = _saved_and_resumed(False, tmp_path / "plain")
    assert plain[0] == [{"position": 24}, {"position": 12}] and plain[1][0] == {"a": [124, 125, 126, 127], "b": [212, 213]}
    assert _saved_and_resumed(True, tmp_path / "ours") == plain


class _IndexedRead(_BfloatOnly):
    """The transformers Llama of session 37's test; ``training_step`` reads a decoder layer's projection by its index
    (``self.model.model.layers[0].mlp.gate_proj.weight``) only under bfloat16: a path the probe step does not take."""

    def __init__(self) -> None:
        super().__init__()
        self.as_built = self.model.model.layers[0].mlp.gate_proj.weight.detach().clone()[:64]

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        out = self.model(input_ids=ids, labels=ids, output_hidden_states=True)
        hidden, loss = out.hidden_states[-1], out.loss
        if hidden.dtype == torch.bfloat16:
            weight = self.model.model.layers[0].mlp.gate_proj.weight[:64]
            self.read.append(float(torch.nn.functional.cosine_similarity(weight.float().reshape(-1), self.as_built.reshape(-1), dim=0)))
            loss = loss + (hidden @ weight.t()).float().square().mean() * 1e-3
        return loss


def test_a_layer_read_by_its_index_only_under_bfloat16_serves_the_read(tmp_path: Any) -> None:
    """Was: the source scan stopped at ``layers[0]``, the layer stored as nf4 unserved, and the fit stopped at its first
    step ("The size of tensor a (64) must match the size of tensor b (4096)"), naming neither the layer nor a fix. Now
    seen in the source (``layers.0``): stored quantized, the read gets the weight as built to nf4's error."""
    module = _IndexedRead()
    _fit_bfloat(module, tmp_path)
    assert len(module.read) == 2 and min(module.read) > 0.99
    assert isinstance(module.model.model.layers[0].mlp.gate_proj, ReadableLinear)
