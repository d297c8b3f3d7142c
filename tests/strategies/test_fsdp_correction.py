"""The calibrated correction (``QuantizedPrecision(correction_rank=r)``) under ``QuantizedFSDPStrategy`` on two CPU
processes (gloo): the factors are sharded like the weight, the 2-rank loss is the 1-rank loss, and every rank fits
the factors of all ranks' probes together when each rank's datamodule gives it other batches (issue 52).

As tests/strategies/test_fsdp_qlora.py, the 2-rank run is this file run as a script in a subprocess (Lightning's
launcher starts rank 1 by re-running the command). fp32 compute: 1 and 2 ranks differ only in the order of the
gradient sum, so the losses agree to 1e-5.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fsdp_qlora import STEPS_PER_EPOCH, _datamodule, _global_losses, _model, run_script_on_two_ranks  # noqa: E402

RANK = 4  # the tiny GPT is 64 wide; its probe (the first batch of 4 x 32 tokens per rank) holds 128 rows


def _trainer(devices: int, strategy: str, root: str, probe: Any, callbacks: list[Any]) -> Any:
    import lightning.pytorch as pl

    from lightning_hbm import LoRA, QuantizedPrecision

    return pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, default_root_dir=root,
        plugins=[QuantizedPrecision("nf4", dtype="float32", correction_rank=RANK, probe_batch=probe,
                                    quantize_embeddings=False)],
        callbacks=[LoRA(r=4, alpha=8, dropout=0.0), *callbacks],
    )  # fmt: skip


def _factors(model: torch.nn.Module) -> dict[str, list[float]]:
    """Each correction factor as a full tensor (gathered from its shards under FSDP), summed to a checksum pair."""
    from lightning_hbm.layers.correction import KEY_MARK

    out = {}
    for name, tensor in model.named_parameters():
        if KEY_MARK in name:  # the same order on every rank: full_tensor() is a collective
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            out[name] = [float(full.double().sum()), float(full.double().abs().sum()), type(tensor).__name__]
    return out


def worker(out: Path) -> None:
    """Rank body: one epoch of fsdp_qlora + nf4 + correction + LoRA, twice: a probe batch given (the same on every
    rank), then the default probe (each rank's own first batches: rank r reads samples r, r+2, ...)."""
    import torch.distributed as dist

    from lightning_hbm.data import synthetic_batch

    torch.set_num_threads(1)
    record: dict[str, Any] = {}
    for arm, probe in (("given", synthetic_batch(4, 32)), ("default", None)):
        recorder = _global_losses()
        trainer = _trainer(2, "fsdp_qlora", str(out / arm), probe, [recorder])
        model = _model()
        trainer.fit(model, datamodule=_datamodule(2))
        record[arm] = {"losses": recorder.losses, "factors": _factors(model)}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script_on_two_ranks(__file__, tmp_path_factory.mktemp("fsdp_correction"), timeout=300)


def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_rank_correction_is_sharded_and_trains_as_one_rank(two_rank_run: Path, tmp_path: Path) -> None:
    from lightning_hbm.data import synthetic_batch

    ranks = _ranks(two_rank_run)
    recorder = _global_losses()
    trainer = _trainer(1, "auto", str(tmp_path), synthetic_batch(4, 32), [recorder])
    model = _model()
    trainer.fit(model, datamodule=_datamodule(1))
    expected = _factors(model)
    given = ranks[0]["given"]
    assert len(expected) == 2 * 4 * 2  # (right, left) of the 4 Linears of each of the 2 blocks; the head unquantized
    assert {kind for *_, kind in given["factors"].values()} == {"DTensor"}  # sharded like the weight
    for name, (total, size, _) in expected.items():
        assert given["factors"][name][:2] == pytest.approx([total, size], rel=1e-6, abs=1e-9), name
    assert len(given["losses"]) == STEPS_PER_EPOCH
    torch.testing.assert_close(torch.tensor(given["losses"]), torch.tensor(recorder.losses), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_each_rank_fits_the_factors_of_all_ranks_probes(two_rank_run: Path, tmp_path: Path) -> None:
    """The default probe: each rank's datamodule gives it other batches (rank r reads samples r, r+2, ...). The ranks
    pool their statistics, so the factors are those one process fits on all the samples (its loader gives them all),
    and the run trains as one process does. Without the pooling each rank kept its shard of factors fitted on its own
    half: gathered, a correction no rank fitted (the sums of the first factor here -0.238 and 10.51 against -0.0048
    and 10.60; pooled: equal to float rounding, 2e-7)."""
    ranks = _ranks(two_rank_run)
    recorder = _global_losses()
    trainer = _trainer(1, "auto", str(tmp_path), None, [recorder])
    model = _model()
    trainer.fit(model, datamodule=_datamodule(1))
    expected = _factors(model)
    assert ranks[0]["default"]["factors"] != ranks[0]["given"]["factors"]  # another probe: other factors
    for name, (total, size, _) in expected.items():
        assert ranks[0]["default"]["factors"][name][:2] == pytest.approx([total, size], rel=1e-4, abs=1e-5), name
    torch.testing.assert_close(torch.tensor(ranks[0]["default"]["losses"]), torch.tensor(recorder.losses), atol=1e-5, rtol=0)


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
