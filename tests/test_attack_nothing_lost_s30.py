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


@pytest.mark.parametrize("path", ["", "  ", None])
def test_an_adapter_path_that_names_no_folder_is_refused_and_nothing_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, path: object
) -> None:
    """Was: ``save_adapter(model, "")`` (an unset variable) wrote the adapter into the working directory, ``None`` a
    ``TypeError`` from pathlib."""
    from lightning_hbm import LoRA

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"save_adapter\(path=.*give the folder to write the adapter into.*Nothing was written"):
        LoRA.save_adapter(_adapted(), path)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# -------- lightning-hbm plan --max-context: the recipe's batch is the batch planned, or a clear error


_RECIPE_MODEL = {"class_path": "lightning_hbm.models.NanoGPT", "init_args": {"n_layer": 1, "n_head": 2, "n_embd": 32}}


@pytest.mark.parametrize("batch_size", [0, -2, 2.5, True, "4"])
def test_a_recipes_batch_size_that_is_not_a_count_is_refused_before_planning(batch_size: object) -> None:
    """Was: ``int(batch_size or 1)``: a recipe's ``batch_size: 0`` was planned as batch 1 (and 2.5 as 2), and the
    answer printed with no word about it."""
    from lightning_hbm.planner.config import max_context_from_config

    config = {"model": _RECIPE_MODEL, "data": {"class_path": "x", "init_args": {"batch_size": batch_size}}}
    with pytest.raises(ValueError, match=rf"data.init_args.batch_size is {batch_size!r}.*an int >= 1 .*Fix the data section"):
        max_context_from_config(config, ["1GiB"], "cpu")


def _short_gpt() -> "object":
    from lightning_hbm.models import NanoGPT

    torch.manual_seed(0)
    return NanoGPT(n_layer=1, n_head=2, n_embd=32, block_size=128)


@pytest.mark.slow  # ~4 s: four plans (the first imports the planner's libraries)
def test_max_context_of_a_model_with_a_position_table_stops_at_its_last_row() -> None:
    """Was: ``ValueError: Sequence length 256 exceeds block_size 128`` (the model's own error) for every budget, on
    the package's own NanoGPT (its default block_size 256 too) and any GPT-2/BERT-style model: max_context planned
    2,048 tokens first whatever the model."""
    from lightning_hbm.planner import max_context

    roomy, tight = max_context(_short_gpt, ["1GiB", "600KiB"], device="cpu")  # type: ignore[arg-type]
    assert roomy.tokens == 128 and "the model's longest sequence (128 rows in its position table model.wpe)" in roomy.limit
    assert 0 < tight.tokens < 128 and tight.prediction.total <= tight.budget


def test_max_context_refuses_a_multiple_longer_than_the_position_table() -> None:
    from lightning_hbm.planner import max_context

    with pytest.raises(ValueError, match=r"multiple_of=256\): NanoGPT runs at most 128 tokens .*Fix: multiple_of <= 128"):
        max_context(_short_gpt, "1GiB", device="cpu", multiple_of=256)  # type: ignore[arg-type]


# -------- resume into a model with more layers than the one that saved it


class _Stack(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.body = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])


def _stack_module(layers: int) -> "object":
    import lightning.pytorch as pl

    class Stack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Stack(layers)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net.body(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    return Stack()


def _fit(tmp_path: Path, module: "object", steps: int, ckpt_path: "Path | None" = None) -> "object":
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hbm import LoRA, QuantizedPrecision

    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, max_steps=steps, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=2)],
    )  # fmt: skip
    trainer.fit(module, DataLoader([torch.randn(2, 16)] * 4, batch_size=None), ckpt_path=ckpt_path)  # type: ignore[arg-type]
    return trainer


@pytest.mark.slow  # ~2 s: two fits
def test_resuming_into_a_model_with_more_layers_is_a_clear_error_before_anything_loads(tmp_path: Path) -> None:
    """Was Lightning's strict error from torch, ``RuntimeError: Error(s) in loading state_dict ... Missing key(s) in
    state_dict: "net.body.2.weight", ...`` (raised after the tensors the checkpoint holds were copied in), with no
    word of what to do. A model with fewer layers already had a clear error (its adapters fit no layer)."""
    trainer = _fit(tmp_path, _stack_module(2), 1)
    trainer.save_checkpoint(tmp_path / "two.ckpt")  # type: ignore[attr-defined]
    wider = _stack_module(3)
    before = {k: v.clone() for k, v in wider.state_dict().items()}  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"holds nothing for 2 tensor\(s\) of this model \(first: \['net.body.2.weight', "
                                         r"'net.body.2.bias'\]\).*Build the model of the run that saved it.*nothing was loaded"):
        _fit(tmp_path, wider, 2, ckpt_path=tmp_path / "two.ckpt")
    after = wider.state_dict()  # type: ignore[attr-defined]
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)  # as built
