"""Distributed runs refuse a wrong state before the first change (issue #27 item 2), on two CPU processes (gloo).

* ranks that built different frozen bases (a per-rank seed): bitsandbytes' quantization constants are neither
  parameters nor buffers, so DDP's first broadcast would leave the ranks training on different bases;
* a resume with other LoRA settings, or onto another base: under FSDP Lightning restores after the strategy's setup,
  so these checks ran nowhere before.

The 2-rank runs happen in a subprocess that runs this file as a script (Lightning's launcher re-runs the same command
for rank 1); each rank fits the three cases in turn and writes what each raised.
"""

from __future__ import annotations

import json
import re
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
CASES = {
    # case: (seed of the model on rank r, LoRA alpha, resume from the 1-process checkpoint)
    "ranks-differ": (lambda rank: rank, 8.0, False),
    "other-alpha": (lambda rank: 0, 32.0, True),
    "other-base": (lambda rank: 1, 8.0, True),
}


def _trainer(devices: int, strategy: str, root: str, alpha: float) -> Any:
    import lightning.pytorch as pl

    from lightning_hbm import LoRA, QuantizedPrecision

    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=2, alpha=alpha)],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=root,
    )  # fmt: skip


def _model(seed: int) -> Any:
    from lightning_hbm.models import NanoGPT

    torch.manual_seed(seed)
    return NanoGPT(**TINY)


def _data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hbm.data import synthetic_batch

    return DataLoader(TensorDataset(*synthetic_batch(2, 16)), batch_size=2)


def worker(strategy: str, out: Path, ckpt: str) -> None:
    """Rank body: fit each case, record the error it raised and whether the model stayed as built."""
    import torch.distributed as dist

    from lightning_hbm import applied_transforms

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    for case, (seed, alpha, resume) in CASES.items():
        model = _model(seed(rank))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        trainer = _trainer(2, strategy, str(out / case), alpha)
        try:
            trainer.fit(model, train_dataloaders=_data(), ckpt_path=ckpt if resume else None)
            error = None
        except Exception as err:  # noqa: BLE001 - the test reads the message
            error = f"{type(err).__name__}: {err}"
        after = model.state_dict()
        results[case] = {
            "error": error,
            "untouched": applied_transforms(model) == [] and list(after) == list(before)
            and all(torch.equal(after[k], before[k]) for k in before),
            "steps": trainer.global_step,
        }
    (out / f"rank{dist.get_rank() if dist.is_initialized() else rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One step of nf4-dq + LoRA(alpha=8) on one process, the base seeded 0."""
    root = tmp_path_factory.mktemp("saved")
    trainer = _trainer(1, "auto", str(root), 8.0)
    trainer.fit(_model(0), train_dataloaders=_data())
    trainer.save_checkpoint(root / "adapter.ckpt")
    return root / "adapter.ckpt"


def _two_ranks(strategy: str, out: Path, ckpt: Path) -> list[dict[str, Any]]:
    import lightning_hbm

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    package_root = str(Path(lightning_hbm.__file__).resolve().parents[1])  # the ranks import the package under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve()), strategy, str(out), str(ckpt)],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp_qlora"])
def test_two_ranks_refuse_a_wrong_state_before_the_first_change(strategy: str, checkpoint: Path, tmp_path: Path) -> None:
    expected = {
        "ranks-differ": r"Rank 1 built another model than rank 0: \d+ tensor\(s\) differ, first 'model\.\S+'.*"
        r"seed before building the model on every rank",
        "other-alpha": r"other lightning_hbm settings.*LoRA\.alpha: checkpoint 8\.0, this run 32\.0",
        "other-base": r"adapters trained on another frozen base.*allow_base_change=True",
    }
    for rank in _two_ranks(strategy, tmp_path, checkpoint):
        for case, pattern in expected.items():
            result = rank[case]
            assert result["error"] is not None, f"{strategy} {case}: trained without a word"
            assert result["error"].startswith("ValueError") and re.search(pattern, result["error"], re.S), result
            assert result["steps"] == 0, (case, result)
            # Under FSDP Lightning restores after the strategy's setup and gives no checkpoint path before: a resume is
            # refused after the surgery (quantized, sharded), still before any tensor is loaded or any step runs
            if strategy == "ddp" or case == "ranks-differ":
                assert result["untouched"], (case, result)


if __name__ == "__main__":
    worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
