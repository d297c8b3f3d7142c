"""Distributed runs on two CPU processes (gloo): DDP's behaviour for models built without a seed, refusals otherwise.

* a model built without a seed trains, as under plain DDP (issue #33): rank 0's model as built is sent to every
  rank before quantizing, so the ranks train the same base (equal quantized weights, constants and losses), with
  and without ``QuantizedPrecision``;
* ranks that built another architecture are refused before the first change (nothing can be sent);
* a resume with other LoRA settings, or onto another base (issue #27 item 2): under FSDP Lightning restores after
  the strategy's setup, so these checks ran nowhere before.

The 2-rank runs happen in a subprocess that runs this file as a script (Lightning's launcher re-runs the same command
for rank 1); each rank fits the cases in turn and writes what each raised, or what it trained.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")
STEPS = 2  # of the cases that train: the second loss comes from weights DDP/FSDP updated on both ranks
CASES = {
    # case: (seed of the model on rank r (None: no seed), its n_layer on rank r, quantized, LoRA alpha, resume)
    "unseeded": (lambda rank: None, lambda rank: 2, True, 8.0, False),
    "unseeded-unquantized": (lambda rank: None, lambda rank: 2, False, 8.0, False),
    "other-architecture": (lambda rank: 0, lambda rank: 2 + rank, True, 8.0, False),
    "other-alpha": (lambda rank: 0, lambda rank: 2, True, 32.0, True),
    "other-base": (lambda rank: 1, lambda rank: 2, True, 8.0, True),
}
TRAINS = ("unseeded", "unseeded-unquantized")


def _trainer(devices: int, strategy: str, root: str, alpha: float, quantized: bool = True, callbacks: Any = ()) -> Any:
    import lightning.pytorch as pl

    from lightning_hbm import LoRA, QuantizedPrecision

    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=STEPS if devices > 1 else 1, logger=False,
        # the default int8 tables on both sides: FSDP shards them since session 31, so the one-process run that saves
        # and the FSDP run that resumes share the setting (before, FSDP kept them wide: a settings difference)
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")] if quantized else None,
        callbacks=[LoRA(r=2, alpha=alpha), *callbacks],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False, default_root_dir=root,
    )  # fmt: skip


def _model(seed: Any, n_layer: int = 2) -> Any:
    from lightning_hbm.models import NanoGPT

    if seed is None:
        torch.seed()  # no seed: each process draws its own (torch's default seed is random per process)
    else:
        torch.manual_seed(seed)
    return NanoGPT(**{**TINY, "n_layer": n_layer})


def _data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hbm.data import synthetic_batch

    # the same batches on both ranks (no distributed sampler): equal models give equal losses
    return DataLoader(TensorDataset(*synthetic_batch(2 * STEPS, 16)), batch_size=2)


def _prints(model: Any) -> dict[str, Any]:
    """Fingerprint of every tensor of the state dict (quantized weights and constants included), gathered if sharded."""
    from torch.distributed.tensor import DTensor

    from lightning_hbm.resume import fingerprint

    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    return {k: fingerprint(v.detach()) for k, v in full.items() if isinstance(v, torch.Tensor)}


class _Losses:
    """A Lightning callback (built lazily: Lightning is imported in the ranks) keeping each step's loss."""

    @staticmethod
    def make() -> Any:
        import lightning.pytorch as pl

        class Losses(pl.Callback):
            def __init__(self) -> None:
                self.losses: list[float] = []

            def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
                self.losses.append(float(outputs["loss"].detach()))

        return Losses()


def worker(strategy: str, out: Path, ckpt: str) -> None:
    """Rank body: fit each case, record the error it raised (and whether the model stayed as built), or its results."""
    import torch.distributed as dist

    from lightning_hbm import applied_transforms

    torch.set_num_threads(1)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    results = {}
    for case, (seed, n_layer, quantized, alpha, resume) in CASES.items():
        model = _model(seed(rank), n_layer(rank))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        built = _prints(model)
        losses = _Losses.make()
        trainer = _trainer(2, strategy, str(out / case), alpha, quantized, [losses])
        try:
            trainer.fit(model, train_dataloaders=_data(), ckpt_path=ckpt if resume else None)
            error = None
        except Exception as err:  # noqa: BLE001 - the test reads the message
            error = f"{type(err).__name__}: {err}"
        after = model.state_dict()
        trained = error is None
        results[case] = {
            "error": error,
            "untouched": applied_transforms(model) == [] and list(after) == list(before)
            and all(torch.equal(after[k], before[k]) for k in before),
            "steps": trainer.global_step,
            "built": built,
            "losses": losses.losses,
            "trained": _prints(model) if trained else {},
            "packed": trained and any(t.dtype == torch.uint8 for t in after.values()),  # 4-bit weights are uint8
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


@pytest.fixture(scope="module", params=["ddp", "fsdp_qlora"])
def two_ranks(request: pytest.FixtureRequest, checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Every case on 2 gloo ranks, once per strategy: (strategy, [rank 0's results, rank 1's])."""
    return request.param, _two_ranks(request.param, tmp_path_factory.mktemp(request.param), checkpoint)


@pytest.mark.slow
@pytest.mark.parametrize("case", TRAINS)
def test_a_model_built_without_a_seed_trains_the_same_on_every_rank(two_ranks: Any, case: str) -> None:
    strategy, (rank0, rank1) = two_ranks
    zero, one = rank0[case], rank1[case]
    assert zero["error"] is None and one["error"] is None, (strategy, case, zero["error"], one["error"])
    assert zero["steps"] == one["steps"] == STEPS
    # not vacuous: the ranks built different models
    assert zero["built"] != one["built"], "both ranks built the same model: the broadcast was not exercised"
    # rank 0's model was sent before quantizing: the same quantized weights, constants and adapters after training
    assert zero["trained"] and zero["trained"] == one["trained"], sorted(
        k for k in zero["trained"] if zero["trained"][k] != one["trained"].get(k)
    )[:5]
    assert zero["packed"] == one["packed"] == (case == "unseeded")  # quantized only with QuantizedPrecision
    assert len(zero["losses"]) == STEPS and zero["losses"] == one["losses"], (zero["losses"], one["losses"])


@pytest.mark.slow
def test_two_ranks_refuse_a_wrong_state_before_the_first_change(two_ranks: Any) -> None:
    strategy, ranks = two_ranks
    expected = {
        "other-architecture": r"Rank 1 built another model than rank 0: tensor 'model\.\S+' is float32 of shape "
        r"\[\d+(, \d+)*\] there, absent on rank 0.*same architecture",
        "other-alpha": r"other lightning_hbm settings.*LoRA\.alpha: checkpoint 8\.0, this run 32\.0",
        "other-base": r"adapters trained on another frozen base.*allow_base_change=True",
    }
    for rank in ranks:
        for case, pattern in expected.items():
            result = rank[case]
            assert result["error"] is not None, f"{strategy} {case}: trained without a word"
            assert result["error"].startswith("ValueError"), result["error"]
            assert re.search(pattern, result["error"], re.S), result["error"]
            assert result["steps"] == 0, (case, result["steps"])
            # Under FSDP Lightning restores after the strategy's setup and gives no checkpoint path before: a resume is
            # refused after the surgery (quantized, sharded), still before any tensor is loaded or any step runs
            if strategy == "ddp" or case == "other-architecture":
                assert result["untouched"], case


def tensor_worker(rank: int, port: str, out: Path) -> None:
    """Rank body without Lightning: odd tensors (bf16, bool, non-contiguous, non-persistent, quantized as built)."""
    import bitsandbytes as bnb
    import torch.distributed as dist
    from torch import nn

    from lightning_hbm import resume
    from lightning_hbm.record import as_built, set_as_built
    from lightning_hbm.surgery.ranks import _tensors, check_ranks

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(rank)
    module = nn.Module()
    module.low = nn.Parameter(torch.randn(4, 3, dtype=torch.bfloat16))
    module.strided = nn.Parameter(torch.randn(3, 5).t())  # not contiguous
    module.register_buffer("mask", torch.rand(64) > 0.5)
    module.register_buffer("scratch", torch.randn(2), persistent=False)  # DDP sends these too
    module.q = bnb.nn.Linear4bit(64, 64, quant_type="nf4", compress_statistics=True).to("cpu")  # constants exist
    module.q.support_avx512bf16_for_cpu = False
    set_as_built(module, resume.as_built_record(module))
    prints = lambda: {n: resume.fingerprint(t.detach()) for n, t in _tensors(module)}  # noqa: E731
    before = prints()
    check_ranks(module)
    with torch.no_grad():
        output = module.q(torch.ones(1, 64) * module.mask.float())
    result = {
        "before": before, "after": prints(), "output": resume.fingerprint(output), "names": sorted(before),
        "record": as_built(module)["fingerprints"], "contiguous": module.strided.is_contiguous(),
    }  # fmt: skip
    (out / f"tensors{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_kind_of_tensor_is_sent(tmp_path: Path) -> None:
    """Without Lightning, 2 gloo ranks: every dtype and layout arrives byte for byte, constants of a 4-bit layer too."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    script = str(Path(__file__).resolve())
    procs = [
        subprocess.Popen(
            [sys.executable, script, "tensors", str(r), port, str(tmp_path)], env=env, stderr=subprocess.PIPE, text=True
        )
        for r in (0, 1)
    ]  # fmt: skip
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert all(proc.returncode == 0 for proc in procs), errors[0][-3000:] + errors[1][-3000:]
    zero, one = (json.loads((tmp_path / f"tensors{r}.json").read_text()) for r in (0, 1))
    names = zero["names"]
    assert {"low", "strided", "mask", "scratch", "q.weight", "q.weight.quant_state.absmax"} <= set(names), names
    assert "q.weight.quant_state.state2.absmax" in names  # the nested (double-quant) constants
    assert zero["before"]["low"] != one["before"]["low"] and zero["before"]["q.weight"] != one["before"]["q.weight"]
    assert zero["after"] == one["after"] == zero["before"]  # rank 0 unchanged, rank 1 holds rank 0's bytes
    assert zero["output"] == one["output"] and zero["record"] == one["record"]
    assert not one["contiguous"]  # copied into the tensor, its layout kept


if __name__ == "__main__":
    if sys.argv[1] == "tensors":
        tensor_worker(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]))
    else:
        worker(sys.argv[1], Path(sys.argv[2]), sys.argv[3])
