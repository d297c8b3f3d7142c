"""Issue 55, round four ("Nothing lost"): cases written as an outside reviewer would, before the next battery.

Each test names what it found on the code of session 28 ("Was: ..."); the ones that held are kept as guards.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision, quiet
from lightning_hbm.layers import readers

# -------- a plain Trainer in a process where lightning_hbm worked: the same warnings filters


def test_filters_the_libraries_add_at_their_import_inside_our_work_are_removed_after_it() -> None:
    """Was: a fit with lightning_hbm imported accelerate (through peft) and torchao, which add process-wide filters
    at their import ("ignore every UserWarning of torch.optim.lr_scheduler", torchao's NumPy one): a plain Trainer
    run after it in the same process no longer showed torch's "lr_scheduler.step() before optimizer.step()"."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="the user's own, set before")
        before = list(warnings.filters)
        with quiet.quieted():
            warnings.filterwarnings("ignore", category=UserWarning, module="torch.optim.lr_scheduler")  # as accelerate's import does
            warnings.filterwarnings("ignore", message="the user's own, set before")  # added again: moved to the front
            with quiet.quieted():  # nested: the outer block decides
                pass
            assert any(f[3] is not None and f[3].pattern == "torch.optim.lr_scheduler" for f in warnings.filters)
        assert warnings.filters == before


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.body(batch).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(tmp_path: Path, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = dict(max_steps=1, enable_checkpointing=False)
    return pl.Trainer(
        accelerator="cpu", logger=False, enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
        **{**settings, **kwargs},
    )  # fmt: skip


@pytest.mark.slow  # ~2 s alone: the first fit of the process imports peft, accelerate and torchao
def test_a_lightning_hbm_fit_leaves_the_process_warnings_filters_as_they_were(tmp_path: Path) -> None:
    """The same through a fit (alone in a process it imports accelerate and torchao for the first time)."""
    before = list(warnings.filters)
    trainer = _trainer(tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4)])
    trainer.fit(_Tiny(), DataLoader([torch.randn(2, 64)], batch_size=None))
    assert [f for f in warnings.filters if f not in before] == []


# -------- the fit-start probe step: runs where the user's step runs, changes nothing


class _Normed(pl.LightningModule):
    """A BatchNorm net whose step logs ``loss.item()``: fake tensors cannot run it, one sample cannot either."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 16), nn.Linear(16, 1))
        self.items: list[float] = []

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.body(batch).pow(2).mean()
        self.items.append(loss.item())
        return loss


def test_a_step_that_needs_more_than_one_sample_is_probed_on_the_batch_and_its_statistics_stay() -> None:
    """Was: the probe cut the batch to one sample ("Expected more than 1 value per channel when training"), fell back
    to the source scan and told the user to "make training_step run on the first training batch", which it does."""
    torch.manual_seed(0)
    module = _Normed()
    norm = module.body[1]
    stats = [b.clone() for b in norm.buffers()]
    batch = torch.randn(8, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "could not run one step" warning
        seen = readers.observe(module, batch, {"body.0": module.body[0], "body.2": module.body[2]})
    assert seen is not None and seen.ran.endswith("on the real batch")
    assert all(torch.equal(a, b) for a, b in zip(stats, norm.buffers()))  # running statistics and count as they were
    assert module.training


def test_the_probe_on_fake_tensors_leaves_batchnorms_count_of_batches() -> None:
    """Was: the fake-tensor probe step reached the real ``num_batches_tracked`` (``add_(1)``): every lightning_hbm run
    counted one batch more than it trained (the count saved in its checkpoints differed from the same run without
    lightning_hbm)."""
    torch.manual_seed(0)
    module = _Normed()
    module.training_step = lambda batch, batch_idx: module.body(batch).pow(2).mean()  # type: ignore[method-assign]
    seen = readers.observe(module, torch.randn(8, 16), {"body.0": module.body[0], "body.2": module.body[2]})
    assert seen is not None and seen.ran.endswith("on fake tensors")
    assert int(module.body[1].num_batches_tracked) == 0


# -------- `lightning-hbm report` replaces nothing that is not the report's own


def _report_rows(step: int) -> list[dict[str, Any]]:
    from lightning_hbm.memory.report import CATEGORIES

    return [{"step": step, "mode": "light", **{c: 1000 for c in CATEGORIES}, "total": 1000 * len(CATEGORIES)}]


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_re_rendering_a_copy_of_a_report_never_replaces_the_live_one(tmp_path: Path) -> None:
    """Was: ``lightning-hbm report hbm_profile.orig`` (a copy the user kept) wrote its stem's ``hbm_profile.json``,
    ``.csv`` and ``.png``: the live run's report, beside it, was replaced by the copy's."""
    from lightning_hbm.memory.report import MemoryReport, render_report

    MemoryReport(_report_rows(7)).write(tmp_path, "hbm_profile")
    (tmp_path / "hbm_profile.orig").write_text(json.dumps({"rows": _report_rows(1)}))
    before = _files(tmp_path)
    with pytest.raises(ValueError, match=r"would replace .*hbm_profile.json', which holds another report.*nothing was written"):
        render_report(tmp_path / "hbm_profile.orig")
    assert _files(tmp_path) == before


def test_re_rendering_an_input_of_another_name_keeps_the_users_files_beside_it(tmp_path: Path) -> None:
    """Was: re-rendering ``results.json`` replaced the user's own ``results.csv`` beside it."""
    from lightning_hbm.memory.report import MemoryReport, render_report

    MemoryReport(_report_rows(3)).write(tmp_path / "run", "results")
    source = tmp_path / "results.json"
    source.write_bytes((tmp_path / "run" / "results.json").read_bytes())
    (tmp_path / "results.csv").write_text("mine\n")
    before = _files(tmp_path / "run") | {"input": source.read_bytes()}
    with pytest.raises(ValueError, match=r"would replace .*results.csv', a file that is not the profiler's.*nothing was written"):
        render_report(source)
    assert (tmp_path / "results.csv").read_text() == "mine\n" and source.read_bytes() == before["input"]
    render_report(tmp_path / "run" / "results.json")  # its own CSV (an earlier render's): re-rendered as before
    for _ in range(2):  # into another folder, twice: the same report, replaced
        render_report(tmp_path / "run" / "results.json", tmp_path / "copies")


# -------- resume: a loader state saved by another number of processes


def _distributed_loader(processes: int, rank: int = 0, seed: int = 0) -> Any:
    from torch.utils.data import DistributedSampler

    from lightning_hbm.data import ResumableDataLoader

    data = [torch.full((4,), float(i)) for i in range(16)]
    return ResumableDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=processes, rank=rank, seed=seed))


@pytest.mark.parametrize(("processes", "seed"), [(4, 0), (2, 5)], ids=["more-processes", "sampler-seed"])
def test_a_loader_state_of_another_distributed_share_is_refused_before_anything_changes(processes: int, seed: int) -> None:
    """Was: a mid-epoch checkpoint of a 2-process run resumed on 4 processes (or with the DistributedSampler's seed
    changed) was accepted: batch size, dataset length, sampler class and the loader's shuffle were the same, but each
    batch position held other samples, so the resumed epoch skipped some and trained others twice."""
    first = _distributed_loader(2)
    it = iter(first)
    next(it)
    state = first.state_dict()
    other = _distributed_loader(processes, seed=seed)
    before = other.state_dict()
    with pytest.raises(ValueError, match=r"another training dataloader \(distributed .*as many processes, devices x num_nodes"):
        other.load_state_dict(state)
    assert other.state_dict() == before and other._resume is None
    same = _distributed_loader(2, rank=1)  # every rank loads the state rank 0 saved
    same.load_state_dict(state)
    assert len(list(same)) == len(same) - 1
    older = {**state, "loader": {k: v for k, v in state["loader"].items() if k != "distributed"}}  # saved before it was recorded
    _distributed_loader(4).load_state_dict(older)


# -------- LoRA.save_adapter: a path that cannot be a folder


@pytest.mark.parametrize("kind", ["file-parent", "broken-link"])
def test_an_adapter_path_through_a_file_or_a_broken_link_is_a_clear_error_and_nothing_is_written(tmp_path: Path, kind: str) -> None:
    """Was: a raw ``NotADirectoryError`` / ``FileExistsError`` from ``mkdir`` (a path under a file, a link to a folder
    that is gone). Now a ValueError naming the part and the fix; nothing is created."""
    from lightning_hbm.adapters.lora.export import write_folder

    (tmp_path / "notes").write_text("mine")
    path = tmp_path / "notes" / "adapter"
    if kind == "broken-link":
        path = tmp_path / "latest"
        path.symlink_to(tmp_path / "run-gone")
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"cannot be a folder .*a part of the path is a file or a broken link.*nothing was written"):
        write_folder(path, lambda folder: (folder / "adapter_config.json").write_text("{}"))
    assert sorted(p.name for p in tmp_path.iterdir()) == before and (tmp_path / "notes").read_text() == "mine"


# -------- checkpoints into a read-only folder: said at fit start, before the model changes


@pytest.fixture
def read_only_folder(read_only_mount: Path) -> Path:
    """A folder holding the user's ``notes.txt`` on a real read-only filesystem (tests/conftest.py)."""
    return read_only_mount / "folder"


def test_a_read_only_checkpoint_folder_stops_the_fit_before_the_model_changes(tmp_path: Path, read_only_folder: Path) -> None:
    """Was: the run trained until its first save, then died on the raw ``OSError: [Errno 30] Read-only file system:
    '.../.epoch=0-step=2.ckpt.<host>~<pid>~<token>.lightning_hbm-partial'`` (a file the user never named)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    trained: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            trained.append(trainer.global_step)

    module = _Tiny()
    weights = {k: v.clone() for k, v in module.state_dict().items()}
    trainer = _trainer(
        tmp_path, max_steps=3, enable_checkpointing=True, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4), Count(), ModelCheckpoint(dirpath=read_only_folder, every_n_train_steps=2)],
    )  # fmt: skip
    with pytest.raises(PermissionError, match=rf"Cannot save checkpoints into {read_only_folder} \(Read-only file system\): pass ModelCheckpoint\(dirpath="):
        trainer.fit(module, DataLoader([torch.randn(2, 64)] * 4, batch_size=None))
    assert trained == [] and module.state_dict().keys() == weights.keys()  # not quantized, no adapters
    assert all(torch.equal(v, weights[k]) for k, v in module.state_dict().items())
    assert [p.name for p in read_only_folder.iterdir()] == ["notes.txt"]


def test_a_save_into_a_folder_that_became_read_only_names_the_folder(read_only_folder: Path) -> None:
    from lightning_hbm.resume import atomic_save

    with pytest.raises(PermissionError, match=rf"Cannot save checkpoints into {read_only_folder} \(Read-only file system\)"):
        atomic_save({"state_dict": {}}, read_only_folder / "last.ckpt")


# -------- HBMProfiler's figure data: never written through a link planted at its name


class _FigureData:
    def as_dict(self) -> dict[str, Any]:
        return {"step": 1}


def test_the_figure_data_replaces_a_link_at_its_name_and_never_writes_through_it(tmp_path: Path) -> None:
    """Was: ``hbm_figure.json`` was opened for writing in place: a symlink at that name in a shared run folder
    (``hbm_figure.json -> ~/notes.txt``) had its target truncated and overwritten by the report."""
    from lightning_hbm.profiling.figure import write_figure

    target = tmp_path / "notes.txt"
    target.write_text("mine")
    (tmp_path / "run").mkdir()
    link = tmp_path / "run" / "hbm_figure.json"
    link.symlink_to(target)
    write_figure(_FigureData(), link)  # type: ignore[arg-type]  # only as_dict() is read
    assert target.read_text() == "mine"
    assert not link.is_symlink() and json.loads(link.read_text()) == {"step": 1}
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["hbm_figure.json"]  # no temp file left


# -------- guards: what held in this round


def test_the_probe_leaves_each_modules_mode_grad_mode_and_default_dtype() -> None:
    torch.manual_seed(0)
    module = _Normed()
    module.body[1].eval()  # a frozen BatchNorm inside a model that trains
    module.training_step = lambda batch, batch_idx: module.body(batch).pow(2).mean()  # type: ignore[method-assign]
    modes = [m.training for m in module.modules()]
    batch = torch.randn(8, 16)
    state = torch.get_rng_state()
    readers.observe(module, batch, {"body.0": module.body[0], "body.2": module.body[2]})
    assert [m.training for m in module.modules()] == modes
    assert torch.is_grad_enabled() and torch.get_default_dtype() == torch.float32 and torch.equal(torch.get_rng_state(), state)
    assert all(p.grad is None for p in module.parameters())


@pytest.mark.parametrize("stop", ["error", "interrupt"])
def test_a_fit_stopped_mid_way_keeps_the_users_files_and_lets_the_model_go(tmp_path: Path, stop: str) -> None:
    """A user error or a KeyboardInterrupt (Lightning's graceful shutdown, then SystemExit) at step 2: the user's
    file in the checkpoint folder is intact, the checkpoint saved before is whole, and once the Trainer is dropped
    the model is collected (no lightning_hbm state keeps it)."""
    import gc
    import weakref

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_hbm.resume import read_file

    folder = tmp_path / "ck"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == 2:
                raise RuntimeError("user bug") if stop == "error" else KeyboardInterrupt

    def run() -> weakref.ref:
        module = _Tiny()
        trainer = _trainer(
            tmp_path, max_steps=4, enable_checkpointing=True, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
            callbacks=[LoRA(r=4), Stop(), ModelCheckpoint(dirpath=folder, every_n_train_steps=1, save_top_k=-1)],
        )  # fmt: skip
        with pytest.raises(RuntimeError if stop == "error" else SystemExit):
            trainer.fit(module, DataLoader([torch.randn(2, 64)] * 4, batch_size=None))
        assert module.body[0](torch.randn(2, 64)).isfinite().all()  # the changed model still computes
        return weakref.ref(module)

    model = run()
    gc.collect()
    assert model() is None
    assert (folder / "notes.txt").read_text() == "mine"
    saved = sorted(p.name for p in folder.iterdir() if p.suffix == ".ckpt")
    assert saved and not [p for p in folder.iterdir() if "partial" in p.name]
    assert "state_dict" in read_file(folder / saved[0])


def test_an_adapter_save_leaves_no_lock_file_in_the_users_folder(tmp_path: Path) -> None:
    """Was: every save left ``.lightning_hbm_export.lock`` in the adapter folder (uploaded with it to a hub, copied
    with it); the writers are now serialised by a lock on the folder itself."""
    from concurrent.futures import ThreadPoolExecutor

    from lightning_hbm.adapters.lora.export import MANIFEST, write_folder

    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "README.md").write_text("mine")

    def save(i: int) -> None:
        write_folder(folder, lambda tmp: (tmp / "adapter_config.json").write_text(json.dumps({"i": i})))

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(save, range(8)))
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "adapter_config.json", MANIFEST]
    assert (folder / "README.md").read_text() == "mine"
