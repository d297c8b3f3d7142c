"""Fit-start refusals on two CPU processes (gloo): every rank refuses, together, before anything changes (issue 55).

* A mid-epoch checkpoint saved by one process, resumed by two: the ``ResumableDataLoader`` state records the
  processes that shared the epoch (``DistributedSampler``); a resume on another number of processes would put other
  samples at each batch position, so it is refused, on every rank, with the same message.
* A checkpoint folder one rank cannot write to (a read-only mount that only that rank sees, its own mount
  namespace: a node whose scratch is read-only): the fit-start check used to raise on that rank alone while the
  others went on into the next collective and waited until the timeout. Now the ranks share their results and
  every rank raises the same ``PermissionError``, naming the rank(s) and the folder, before the model is changed.

The ranks are started here (``LOCAL_RANK`` etc. in their environment: Lightning then starts no process itself), each
one this file run as a script; rank 1 of the folder case runs under ``unshare -m`` with a read-only tmpfs over the
folder. Each rank writes what it raised and whether its model stayed as built.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK")
BATCHES = 8  # of the epoch on one process: 16 samples, batch_size 2


def _module() -> Any:
    import lightning.pytorch as pl
    from torch import nn

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 16))

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.body(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    return Tiny()


def _loader(batch_size: int = 2, samples: int = 2 * BATCHES, shuffle: bool = True) -> Any:
    from lightning_hbm.data import ResumableDataLoader

    data = [torch.randn(16, generator=torch.Generator().manual_seed(i)) for i in range(samples)]
    return ResumableDataLoader(data, batch_size=batch_size, shuffle=shuffle, seed=0)


#: session 32: a 2-process checkpoint resumed on 2 processes with another loader (each, one fit attempt on the 2 ranks)
#: (the seed: the DistributedSampler's, from seed_everything; the loader's own shuffle is not one: Lightning's training
#: DistributedSampler shuffles whatever the loader's shuffle, so a resume with shuffle=False trains the same samples)
LOADER_CHANGES = {"batch_size": {"batch_size": 4}, "samples": {"samples": 2 * BATCHES + 4}, "seed": {}}


def _trainer(devices: int, folder: Path, max_steps: int, every: int = 0, extra: Any = ()) -> Any:
    from datetime import timedelta

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_hbm import LoRA

    checkpoint = ModelCheckpoint(dirpath=folder, every_n_train_steps=every or None, save_top_k=-1, filename="{step}")
    return pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=folder,
        # a rank left waiting gives up after 40 s (gloo's default is 30 min): the old behaviour fails, not hangs
        strategy=DDPStrategy(timeout=timedelta(seconds=40)) if devices > 1 else "auto",
        callbacks=[LoRA(r=2), checkpoint, *extra],
    )  # fmt: skip


def worker(out: Path, ckpt: str, folder: str) -> None:
    """Rank body: fit each case, write what it raised, whether the model stayed as built and what was written."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    results = {
        "resume": _case(out / "resumed", ckpt),
        "folder": _case(Path(folder), None),
        "report": _case(out / f"report-run{rank}", None, report=Path(folder) / "report"),
    }
    _trainer(2, out / "saved2", max_steps=3, every=2).fit(_module(), _loader())  # step=2.ckpt: mid-epoch, 2 processes
    for change, settings in LOADER_CHANGES.items():
        if change == "seed":
            os.environ["PL_GLOBAL_SEED"] = "1"  # what seed_everything(1) sets, read by Lightning's DistributedSampler
        results[change] = _case(out / f"resumed-{change}", str(out / "saved2" / "step=2.ckpt"), loader=_loader(**settings))
        os.environ.pop("PL_GLOBAL_SEED", None)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    if dist.is_initialized():
        dist.destroy_process_group()


def _case(folder: Path, ckpt: Any, report: Optional[Path] = None, loader: Any = None) -> dict[str, Any]:
    from lightning_hbm import HBMProfiler, applied_transforms

    model = _module()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = _trainer(2, folder, max_steps=BATCHES, extra=[HBMProfiler(dirpath=str(report))] if report else [])
    try:
        trainer.fit(model, loader if loader is not None else _loader(), ckpt_path=ckpt)
        error = None
    except Exception as err:  # noqa: BLE001 - the test reads the message
        error = f"{type(err).__name__}: {err}"
    after = model.state_dict()
    return {
        "error": error,
        "untouched": applied_transforms(model) == [] and list(after) == list(before)
        and all(torch.equal(after[k], before[k]) for k in before),
        "steps": trainer.global_step,
        "written": sorted(p.name for p in folder.iterdir()) if folder.is_dir() else [],
    }  # fmt: skip


def _port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])


def _two_ranks(out: Path, ckpt: Path, folder: Path, wrap_rank1: Any = None) -> list[dict[str, Any]]:
    """Start ranks 0 and 1 (rank 1's command through ``wrap_rank1``); their results."""
    import lightning_hbm

    port = _port()
    base = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    package_root = str(Path(lightning_hbm.__file__).resolve().parents[1])  # the ranks import the package under test
    base.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                WORLD_SIZE="2", NODE_RANK="0", PYTHONPATH=os.pathsep.join(p for p in (package_root, base.get("PYTHONPATH")) if p))  # fmt: skip
    command = [sys.executable, str(Path(__file__).resolve()), str(out), str(ckpt), str(folder)]
    procs = []
    for rank in (0, 1):
        env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
        cmd = wrap_rank1(command) if rank == 1 and wrap_rank1 else command
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    try:
        logs = [proc.communicate(timeout=200)[0] for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    assert all(proc.returncode == 0 for proc in procs), logs[0][-3000:] + "\n----\n" + logs[1][-3000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def _can_mount_in_a_namespace(path: Path) -> bool:
    command = ["unshare", "-m", "--propagation", "private", "mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(path)]
    return shutil.which("unshare") is not None and subprocess.run(command, capture_output=True).returncode == 0


@pytest.mark.slow  # ~1 s of fits (and the first imports)
def test_a_checkpoint_of_two_processes_resumed_on_one_is_refused_before_anything_changes(tmp_path: Path) -> None:
    """The other way, in one process (rank 0's share of a 2-process epoch, its DistributedSampler given by hand):
    was refused by the loader's own check in Lightning's fit loop, with LoRA already in the model."""
    from torch.utils.data import DistributedSampler

    from lightning_hbm import applied_transforms
    from lightning_hbm.data import ResumableDataLoader

    data = _loader().dataset
    share = ResumableDataLoader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=2, rank=0, seed=0))
    _trainer(1, tmp_path / "saved", max_steps=3, every=2).fit(_module(), share)  # step=2.ckpt: 2 of its 4 batches
    model = _module()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"was saved by 2 process\(es\) sharing each epoch, this run has 1 \(devices x "
                       r"num_nodes\): at the saved batch position \(epoch 0, batch 2\).*Nothing was changed"):  # fmt: skip
        _trainer(1, tmp_path / "resumed", max_steps=4).fit(model, _loader(), ckpt_path=tmp_path / "saved" / "step=2.ckpt")
    assert applied_transforms(model) == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


@pytest.mark.slow  # ~1 s of fits
@pytest.mark.parametrize("change", ["batch_size", "seed"])
def test_a_one_process_resume_with_another_loader_is_refused_before_anything_changes(tmp_path: Path, change: str) -> None:
    """Was: refused by the loader's own check in Lightning's fit loop, after the strategy's setup: LoRA in the model."""
    from lightning_hbm import applied_transforms
    from lightning_hbm.data import ResumableDataLoader

    _trainer(1, tmp_path / "saved", max_steps=3, every=2).fit(_module(), _loader())  # step=2.ckpt: mid-epoch 0
    data = _loader().dataset
    other = ResumableDataLoader(data, batch_size=4 if change == "batch_size" else 2, shuffle=True, seed=1 if change == "seed" else 0)
    model = _module()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"another training dataloader \({change} .*skip or repeat samples"):
        _trainer(1, tmp_path / "resumed", max_steps=4).fit(model, other, ckpt_path=tmp_path / "saved" / "step=2.ckpt")
    assert applied_transforms(model) == [] and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def _read_only_for_rank1(folder: Path) -> Any:
    def wrap(command: list[str]) -> list[str]:
        mount = f"mount -t tmpfs -o ro,size=1m tmpfs {folder}"
        return ["unshare", "-m", "--propagation", "private", "sh", "-c", f'{mount} && exec "$@"', "sh", *command]

    return wrap


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, bool, list[dict[str, Any]]]:
    """One launch of 2 ranks for both cases (each rank imports the libraries once): the checkpoint, the folder,
    whether rank 1 saw the folder read-only, the ranks' results."""
    out = tmp_path_factory.mktemp("ranks")
    saved, folder = out / "saved", out / "checkpoints"
    _trainer(1, saved, max_steps=3, every=2).fit(_module(), _loader())  # step=2.ckpt: 2 of 8 batches of epoch 0
    folder.mkdir()
    isolated = _can_mount_in_a_namespace(folder)
    return saved / "step=2.ckpt", folder, isolated, _two_ranks(out, saved / "step=2.ckpt", folder, _read_only_for_rank1(folder) if isolated else None)


@pytest.mark.slow
def test_a_checkpoint_of_one_process_resumed_on_two_is_refused_on_every_rank_before_anything_changes(ranks: Any) -> None:
    """The resume's process-count check had no multi-process test (only the loader alone, num_replicas by hand)."""
    ckpt, _, _, results = ranks
    for rank, result in enumerate(r["resume"] for r in results):
        error = result["error"]
        assert error is not None, f"rank {rank} resumed a 1-process epoch on 2 processes without a word"
        assert error.startswith(f"ValueError: ResumableDataLoader: the checkpoint {ckpt} was saved by 1 process(es) "
                                "sharing each epoch, this run has 2 (devices x num_nodes"), error  # fmt: skip
        assert "(epoch 0, batch 2)" in error and "Nothing was changed. Resume on 1 process(es)" in error, error
        assert result["steps"] == 0 and result["written"] == [], result
        # Lightning restores the loader's state in its fit loop, after the strategy's setup: the loader's own check
        # refused it there with the LoRA layers already in the model (and the checkpoint's step restored)
        assert result["untouched"], f"rank {rank}: the model was changed before the refusal"
    assert results[0]["resume"]["error"] == results[1]["resume"]["error"]


@pytest.mark.slow
@pytest.mark.parametrize("change", list(LOADER_CHANGES))
def test_a_two_process_resume_with_another_loader_is_refused_on_every_rank_before_anything_changes(ranks: Any, change: str) -> None:
    """Was (session 31): on several processes only the number of processes was compared at fit start; another batch
    size, dataset length or sampler seed was refused by the loader's own check in Lightning's fit loop, with LoRA already in
    the model (the checkpoint's step restored)."""
    results = [r[change] for r in ranks[3]]
    for rank, result in enumerate(results):
        error = result["error"]
        assert error is not None, f"rank {rank} resumed with another loader without a word"
        assert error.startswith("ValueError: ResumableDataLoader.load_state_dict: the checkpoint was saved with another "
                                f"training dataloader ({'distributed' if change == 'seed' else change} "), error  # fmt: skip
        assert result["untouched"] and result["steps"] == 0 and result["written"] == [], (rank, result)
    assert results[0]["error"] == results[1]["error"]


@pytest.mark.slow
def test_a_checkpoint_folder_one_rank_cannot_write_is_refused_on_every_rank(ranks: Any) -> None:
    """Was: rank 1 raised alone ('Cannot save checkpoints into ...'), rank 0 went on into the broadcast of the model
    as built and waited there until the process group's timeout."""
    _, folder, isolated, results = ranks
    if not isolated:
        pytest.skip("cannot mount a filesystem in a new mount namespace here (not root, or no CAP_SYS_ADMIN)")
    for rank, result in enumerate(r["folder"] for r in results):
        error = result["error"]
        assert error is not None, f"rank {rank} went on"
        assert error.startswith(f"PermissionError: [Errno 30] Cannot save checkpoints into {folder} on rank 1 of 2 "
                                "(Read-only file system)"), error  # fmt: skip
        assert "ModelCheckpoint(dirpath=<a folder every rank can write to>)" in error, error
        assert result["untouched"] and result["steps"] == 0, result
    assert results[0]["folder"]["error"] == results[1]["folder"]["error"] and results[0]["folder"]["written"] == []


@pytest.mark.slow
def test_a_report_folder_one_rank_cannot_write_is_refused_on_every_rank(ranks: Any) -> None:
    """HBMProfiler's own fit-start check of its report folder: was the same (rank 1 raised alone, in the callbacks'
    setup, rank 0 went on)."""
    _, folder, isolated, results = ranks
    if not isolated:
        pytest.skip("cannot mount a filesystem in a new mount namespace here (not root, or no CAP_SYS_ADMIN)")
    for rank, result in enumerate(r["report"] for r in results):
        error = result["error"]
        assert error is not None, f"rank {rank} went on"
        assert error.startswith(f"ValueError: HBMProfiler: on rank 1 of 2: HBMProfiler(dirpath=...): the report directory "
                                f"'{folder / 'report'}' is not writable"), error  # fmt: skip
        assert result["untouched"] and result["steps"] == 0, result
    assert results[0]["report"]["error"] == results[1]["report"]["error"]


if __name__ == "__main__":
    worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3])

