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
    assert roomy.tokens == 128 and "the model's longest sequence (128 positions in its position table model.wpe)" in roomy.limit
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


# -------- cases that held on the code of session 29, kept as guards (each well under a second)


@pytest.mark.parametrize(("budget", "match"), [
    ("0", r"must be positive, got '0'"),
    ("-1GiB", r"Cannot read the memory size '-1GiB'.*e.g. '24GiB'"),
    ("1e30", r"larger than any machine"),
    ("abc", r"Cannot read the memory size 'abc'"),
    ("24 G", r"ambiguous"),
    ([], r"give at least one size"),
    (["1GiB", None], r"got NoneType"),
])  # fmt: skip
def test_max_context_refuses_a_bad_budget_before_building_anything(budget: object, match: str) -> None:
    from lightning_hbm.planner import max_context

    def factory() -> object:
        raise AssertionError("built before the budget was checked")

    with pytest.raises((ValueError, TypeError), match=match):
        max_context(factory, budget, device="cpu")  # type: ignore[arg-type]


def test_max_context_of_a_model_with_no_token_input_asks_for_a_batch_fn() -> None:
    import lightning.pytorch as pl

    from lightning_hbm.planner import max_context

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(8, 1)

    with pytest.raises(ValueError, match=r"Regressor has no token vocabulary.*Pass batch_fn=lambda length"):
        max_context(Regressor, "1GiB", device="cpu")


def _report(folder: Path) -> Path:
    from lightning_hbm.memory.report import CATEGORIES, MemoryReport

    rows = [{"step": s, "mode": "light", **{c: 1000 for c in CATEGORIES}, "total": 1000 * len(CATEGORIES)} for s in (1, 2)]
    MemoryReport(rows).write(folder, "hbm_profile")
    return folder / "hbm_profile.json"


@pytest.mark.parametrize("cut", [0, 1, 200])
def test_a_truncated_report_is_one_clear_error_and_stays_as_it_was(tmp_path: Path, cut: int) -> None:
    from lightning_hbm.memory.report import render_report

    source = _report(tmp_path)
    source.write_bytes(source.read_bytes()[:cut])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(ValueError, match=r"is not an HBMProfiler report \(not JSON"):
        render_report(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_report_out_path_that_is_a_file_is_refused_and_the_report_stays(tmp_path: Path) -> None:
    from lightning_hbm.memory.report import render_report

    source = _report(tmp_path / "run")
    (tmp_path / "out").write_text("mine")
    with pytest.raises(ValueError, match=r"could not write the report under .*out.*hbm_profile.json' is unchanged"):
        render_report(source, tmp_path / "out")
    assert (tmp_path / "out").read_text() == "mine"


def test_a_report_under_a_unicode_path_with_spaces_renders(tmp_path: Path) -> None:
    from lightning_hbm.memory.report import render_report

    source = _report(tmp_path / "run ü 日本")
    paths = render_report(source, tmp_path / "out é")
    assert Path(paths["csv"]).parent == tmp_path / "out é" and Path(paths["csv"]).read_text().startswith("step")


def test_a_report_read_while_it_is_rewritten_is_always_whole(tmp_path: Path) -> None:
    """A reader (``lightning-hbm report`` during a run) never sees a half-written file: each write is a rename."""
    import json
    import threading

    from lightning_hbm.memory.report import atomic_write

    path = tmp_path / "hbm_profile.json"
    atomic_write(path, lambda f: json.dump({"rows": []}, f))
    done = threading.Event()

    def writer() -> None:
        for i in range(40):
            atomic_write(path, lambda f, i=i: json.dump({"rows": list(range(i * 50))}, f))
        done.set()

    thread = threading.Thread(target=writer)
    thread.start()
    reads = 0
    while not done.is_set() or reads == 0:
        json.loads(path.read_text())  # never a JSONDecodeError
        reads += 1
    thread.join()
    assert [p.name for p in tmp_path.iterdir()] == ["hbm_profile.json"]  # no partial file left


def _global_state() -> dict[str, object]:
    import logging
    import random
    import warnings

    import numpy as np

    names = ("", "lightning", "lightning.pytorch", "torch", "bitsandbytes", "peft", "torchao", "transformers")
    return {
        "filters": list(warnings.filters), "dtype": torch.get_default_dtype(), "grad": torch.is_grad_enabled(),
        "deterministic": torch.are_deterministic_algorithms_enabled(), "cudnn": torch.backends.cudnn.deterministic,
        "matmul": torch.get_float32_matmul_precision(), "python_rng": random.getstate(),
        "numpy_rng": np.random.get_state()[1].tolist(), "disable": logging.root.manager.disable,
        "levels": {n: (logging.getLogger(n).level, len(logging.getLogger(n).handlers)) for n in names},
    }  # fmt: skip


class _Counted(nn.Module):
    """The user's own hooks and attributes, to see that they are left as they were."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))


@pytest.mark.slow  # ~3 s: three fits and a validate
def test_fit_validate_fit_on_one_module_leaves_the_process_and_the_users_hooks_as_they_were(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = _Counted()
            self.seen: list[int] = []
            self.net.register_forward_hook(lambda *_: self.seen.append(1))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.net.body(batch).pow(2).mean()

        def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
            self.net.body(batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    module = Module()
    hooks = dict(module.net._forward_hooks)
    before = _global_state()
    data = DataLoader([torch.randn(2, 16)] * 4, batch_size=None)
    first = _fit(tmp_path, module, 2)
    first.validate(module, data, verbose=False)  # type: ignore[attr-defined]
    # the first fit adds what LoRA's adapters are (peft's peft_config, is_loaded_in_4bit: read by save_adapter)
    names, attributes = sorted(n for n, _ in module.named_parameters()), set(vars(module))
    _fit(tmp_path, module, 2)  # a second fit of the same, already changed module: changed once, not twice
    _fit(tmp_path, module, 0)  # max_steps=0
    assert sorted(n for n, _ in module.named_parameters()) == names
    assert dict(module.net._forward_hooks) == hooks and set(vars(module)) == attributes
    assert _global_state() == before


@pytest.mark.slow  # ~3 s: two fits
def test_a_keyboard_interrupt_at_step_2_saves_nothing_half_way_and_resumes(tmp_path: Path) -> None:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader

    from lightning_hbm import LoRA, QuantizedPrecision

    class Interrupted(pl.LightningModule):
        def __init__(self, stop: bool) -> None:
            super().__init__()
            self.net = _Counted()
            self.stop = stop

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            if self.stop and self.global_step == 2:
                raise KeyboardInterrupt
            return self.net.body(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    def trainer(callbacks: list) -> pl.Trainer:
        return pl.Trainer(
            accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, max_steps=4,
            default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
            callbacks=[LoRA(r=2), *callbacks],
        )  # fmt: skip

    before = _global_state()
    data = DataLoader([torch.randn(2, 16)] * 4, batch_size=None)
    torch.manual_seed(0)
    stopped = trainer([ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_last=True)])
    with pytest.raises(SystemExit):  # Lightning's graceful shutdown of a KeyboardInterrupt (exit status 1)
        stopped.fit(Interrupted(stop=True), data)
    assert stopped.interrupted and sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]
    torch.manual_seed(0)
    resumed = trainer([])
    resumed.fit(Interrupted(stop=False), data, ckpt_path=tmp_path / "ck" / "last.ckpt")
    assert resumed.global_step == 4
    assert _global_state() == before


_RECIPE = """\
trainer:
  precision: nf4-dq
  callbacks:
    - class_path: LoRA
      init_args: {r: 4}
model:
  class_path: lightning_hbm.models.NanoGPT
  init_args: {n_layer: 1, n_head: 2, n_embd: 32, block_size: 64}
"""


@pytest.mark.parametrize(("edit", "match"), [
    (("precision: nf4-dq", "precision: nf4-dq\n  bogus_key: 3"), r"unknown option 'bogus_key'"),
    (("r: 4", "r: four"), r"recipe.yaml:5: trainer.callbacks: LoRA init_args.r: Expected an int. Got value: four"),
    (("trainer:", "trainer: [1, 2\n"), r"recipe.yaml:.*Fix the YAML syntax there"),
])  # fmt: skip
def test_a_broken_recipe_is_one_line_naming_the_field_before_anything_is_planned(
    tmp_path: Path, capsys: pytest.CaptureFixture, edit: tuple[str, str], match: str
) -> None:
    import re

    from lightning_hbm.cli import main

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(_RECIPE.replace(*edit, 1))
    assert main(["plan", "-c", str(recipe), "--max-context", "--budget", "1GiB", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1 and "Traceback" not in err


def test_an_adapter_file_name_taken_by_a_folder_is_refused_before_any_file_is_replaced(tmp_path: Path) -> None:
    """Was: the manifest removed and adapter_config.json replaced, then ``IsADirectoryError`` at the weights with
    "some files were replaced: save again", which failed the same way: a half-written adapter folder."""
    from lightning_hbm import LoRA

    module = _adapted()
    folder = LoRA.save_adapter(module, tmp_path / "adapter")
    (folder / "adapter_model.safetensors").unlink()
    (folder / "adapter_model.safetensors").mkdir()
    (folder / "adapter_model.safetensors" / "notes.txt").write_text("mine")
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    with pytest.raises(ValueError, match=r"adapter_model.safetensors is a folder, where the adapter's file of that name "
                                         r"goes.*nothing was written"):
        LoRA.save_adapter(module, folder)
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


# -------- HBMProfiler's report: refused at fit start where it cannot go, never the end of a trained run


def _profiled_fit(tmp_path: Path, dirpath: Path) -> tuple[object, list[int]]:
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader

    from lightning_hbm import HBMProfiler

    steps: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, *args: object) -> None:
            steps.append(1)

    module = _stack_module(2)
    trainer = pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
        default_root_dir=tmp_path, max_steps=2, callbacks=[HBMProfiler(every_n_steps=1, dirpath=str(dirpath)), Count()],
    )  # fmt: skip
    trainer.fit(module, DataLoader([torch.randn(2, 16)] * 4, batch_size=None))  # type: ignore[arg-type]
    return module, steps


def test_a_report_name_taken_by_a_folder_is_refused_before_the_first_step(tmp_path: Path) -> None:
    """Was: the run trained, then ``IsADirectoryError`` from the report's rename ended ``fit()``."""
    (tmp_path / "report" / "hbm_profile.json").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"hbm_profile.json' is a folder, where the report's file of that name goes"):
        _profiled_fit(tmp_path, tmp_path / "report")


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on a 16 KiB tmpfs: room for the run's CSV, not for its JSON or picture (skip where nothing mounts)."""
    import subprocess

    mount = tmp_path / "full"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16k", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a filesystem here (not root, or no CAP_SYS_ADMIN)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


@pytest.mark.slow  # ~1 s: a fit that draws its report
def test_a_full_disk_at_the_report_warns_and_the_trained_run_ends_normally(tmp_path: Path, full_disk: Path) -> None:
    """Was: ``OSError: [Errno 28] No space left on device`` ended ``fit()`` after training: the user's next line
    (``LoRA.save_adapter(model, ...)``, saving the model) never ran."""
    with pytest.warns(UserWarning, match=r"HBMProfiler could not write its report into .*full \(No space left on device\); "
                                         r"the training is complete and not affected.*dirpath=<another folder>"):
        _, steps = _profiled_fit(tmp_path, full_disk)
    assert len(steps) == 2
    assert not [p for p in full_disk.iterdir() if "partial" in p.name]  # no temp file left on the full disk


@pytest.mark.slow  # ~2 s: two fits
def test_a_checkpoint_with_a_tensor_deleted_is_refused_before_the_model_changes(tmp_path: Path) -> None:
    """Was: only the tensors present were checked against the checksum table, so a deleted adapter tensor was found
    after the surgery ("does not hold these tensors of the model after lightning_hbm's changes"): the user's model
    was already quantized and adapted when the error came."""
    trainer = _fit(tmp_path, _stack_module(2), 1)
    trainer.save_checkpoint(tmp_path / "full.ckpt")  # type: ignore[attr-defined]
    checkpoint = torch.load(tmp_path / "full.ckpt", weights_only=False)
    del checkpoint["lightning_hbm"]["state_dict"]["net.body.0.lora_A.default.weight"]
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    module = _stack_module(2)
    kinds = [type(m) for m in module.modules()]  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"is damaged: tensor 'net.body.0.lora_A.default.weight' written with it is "
                                         r"missing.*nothing was loaded"):
        _fit(tmp_path, module, 2, ckpt_path=tmp_path / "edited.ckpt")
    assert [type(m) for m in module.modules()] == kinds  # type: ignore[attr-defined]  # as built: nothing changed
