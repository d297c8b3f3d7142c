"""``LoRA.save_adapter`` of a model sharded by ``QuantizedFSDPStrategy`` (FSDP2 on two CPU processes, gloo; issue 52,
"FSDP (sharded like the weight)" and "both exports").

Session 39's exports read the model's tensors as they are; under FSDP2 the adapters, the calibrated correction's factors
and the packed 4-bit weights are DTensor shards, and ``save_adapter`` raised on every rank ("Attempted to access the
data pointer on an invalid python storage"), with and without ``with_correction``: nothing written. Now every rank
gathers the same tensors in the same order and rank 0 alone writes the folder: the one a single device writes of the
same weights (same files, keys and values; the quantized-base record equal, its fingerprints taken of the whole rounded
storage, so ``check_quantized_base`` of a one-device base passes). The other ranks write nothing, and a failure on
rank 0 raises on every rank (no rank left waiting).

As tests/strategies/test_fsdp_qlora.py, the 2-rank run is this file run as a script in a subprocess. A tiny
transformers Llama, nf4 with a rank-4 correction fitted on one probe batch given to every rank, LoRA r=4, one epoch
of 2 steps, fp32 compute: 1 and 2 ranks differ only in the order of the gradient sum (values agree to 1e-5).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fsdp_qlora import _datamodule, run_script_on_two_ranks  # noqa: E402

SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64)
ARMS = {"plain": False, "corrected": True}  # the adapter for the full-precision base, and for the quantized one


def _fit(devices: int, strategy: str, root: str) -> Any:
    import lightning.pytorch as pl

    from lightning_hbm import LoRA, QuantizedPrecision
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.models import LlamaLM

    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_epochs=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
        use_distributed_sampler=False, default_root_dir=root,
        plugins=[QuantizedPrecision("nf4", dtype="float32", correction_rank=4, probe_batch=synthetic_batch(4, 32),
                                    quantize_embeddings=False)],
        callbacks=[LoRA(r=4, alpha=8, dropout=0.0)],
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaLM(**SHAPE)
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", 0)))  # other adapters per rank: rank 0's are broadcast
    trainer.fit(model, datamodule=_datamodule(devices))
    return model


def _attempt(call: Any) -> str:
    try:
        call()
        return "ok"
    except Exception:
        return traceback.format_exc(limit=-3)


def worker(out: Path) -> None:
    """Rank body: fit on 2 ranks, then, on every rank as a user's script does, both exports into one folder each, an
    export into a folder named per rank (which ranks write), the quantized-base check on the sharded model, and an
    export into a path that is a file (rank 0's failure)."""
    import torch.distributed as dist

    from lightning_hbm import LoRA

    torch.set_num_threads(1)
    model = _fit(2, "fsdp_qlora", str(out / "root"))
    rank = dist.get_rank()
    record = {arm: _attempt(lambda wc=wc, arm=arm: LoRA.save_adapter(model, out / arm, with_correction=wc))
              for arm, wc in ARMS.items()}  # fmt: skip
    record["own"] = _attempt(lambda: LoRA.save_adapter(model, out / f"own{rank}"))
    record["check"] = _attempt(lambda: LoRA.check_quantized_base(model, out / "corrected"))
    record["merge"] = _attempt(lambda: _merge_and_save(model, out / f"merged{rank}.safetensors"))
    record["sharded after"] = sorted({type(p).__name__ for p in model.parameters()})
    if rank == 0:
        (out / "blocked").write_text("a file where the folder should go")
    dist.barrier()
    record["blocked"] = _attempt(lambda: LoRA.save_adapter(model, out / "blocked"))
    (out / f"rank{rank}.json").write_text(json.dumps(record))


def _merge_and_save(model: Any, file: Path) -> None:
    from safetensors.torch import save_file

    from lightning_hbm import LoRA

    save_file(LoRA.merge(model, dtype="float32"), str(file))


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script_on_two_ranks(__file__, tmp_path_factory.mktemp("fsdp_export"), timeout=300)


def _folder(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    from safetensors.torch import load_file

    config = json.loads((path / "adapter_config.json").read_text())
    config["target_modules"] = sorted(config["target_modules"])  # peft writes its set in hash order
    record = path / "lightning_hbm_quantized_base.json"
    return load_file(str(path / "adapter_model.safetensors")), config, json.loads(record.read_text()) if record.exists() else {}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The same fit on one process: the model whose exports the 2-rank ones must equal."""
    return _fit(1, "auto", str(tmp_path_factory.mktemp("one_device")))


@pytest.mark.slow
def test_sharded_run_writes_the_one_device_export_from_rank_zero(two_rank_run: Path, one_device: Any, tmp_path: Path) -> None:
    from lightning_hbm import LoRA

    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in ranks:  # was: RuntimeError (a DTensor's data pointer) on every rank, nothing written
        assert [rank[arm] for arm in ("plain", "corrected", "own", "check")] == ["ok"] * 4, rank
    model = one_device
    for arm, with_correction in ARMS.items():
        LoRA.save_adapter(model, tmp_path / arm, with_correction=with_correction)
        want, got = _folder(tmp_path / arm), _folder(two_rank_run / arm)
        assert sorted(p.name for p in (two_rank_run / arm).iterdir()) == sorted(p.name for p in (tmp_path / arm).iterdir())
        assert sorted(got[0]) == sorted(want[0]), arm
        for key, tensor in want[0].items():
            assert got[0][key].shape == tensor.shape, key  # whole, not a shard
            torch.testing.assert_close(got[0][key], tensor, atol=1e-5, rtol=0, msg=key)
        assert got[1] == want[1], arm
        assert got[2] == want[2], arm  # the same fingerprints of the whole rounded storage (empty: no record)
    assert len(_folder(two_rank_run / "corrected")[2]["layers"]) == 14  # 7 Linears of each of the 2 blocks
    assert got[0]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"].shape == (8, 64)  # r 4 + 4
    LoRA.check_quantized_base(model, two_rank_run / "corrected")  # the one-device base fits the 2-rank export


@pytest.mark.slow
def test_sharded_run_merges_as_one_device(two_rank_run: Path, one_device: Any) -> None:
    """``LoRA.merge`` on every rank gathers the whole model meanwhile: each rank gets the one-device merge, and the
    model is sharded again after. Was: bitsandbytes' dequantize raised on the DTensor shard, on every rank."""
    from safetensors.torch import load_file

    from lightning_hbm import LoRA

    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [rank["merge"] for rank in ranks] == ["ok", "ok"], ranks
    assert [rank["sharded after"] for rank in ranks] == [["DTensor"], ["DTensor"]]
    want = LoRA.merge(one_device, dtype="float32")
    for r in (0, 1):
        got = load_file(str(two_rank_run / f"merged{r}.safetensors"))
        assert sorted(got) == sorted(want)
        for key, tensor in want.items():
            torch.testing.assert_close(got[key], tensor, atol=1e-5, rtol=0, msg=key)


@pytest.mark.slow
def test_only_rank_zero_writes_and_its_failure_raises_on_every_rank(two_rank_run: Path) -> None:
    assert (two_rank_run / "own0" / "adapter_model.safetensors").is_file()
    assert not (two_rank_run / "own1").exists()  # rank 1 wrote nothing
    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert "is a file, not a folder" in ranks[0]["blocked"], ranks[0]["blocked"]
    assert "RuntimeError: LoRA.save_adapter: rank 0 could not write the adapter" in ranks[1]["blocked"], ranks[1]["blocked"]
    assert "is a file, not a folder" in ranks[1]["blocked"]  # rank 0's reason, said on rank 1


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
