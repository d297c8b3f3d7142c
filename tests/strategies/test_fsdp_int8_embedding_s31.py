"""int8 embedding tables under ``QuantizedFSDPStrategy`` on two CPU processes (gloo), session 31 (issue 51).

``QuantizedPrecision``'s default stores the input embeddings in int8 (a head tied to one computes with the same
copy). Under FSDP they were kept wide (warned: bitsandbytes' row scales were lost on the gathered table, an
``AttributeError`` in the lookup), so an FSDP run trained another model than one process. Now the table's int8 rows
are sharded as the 4-bit weights are, its row scales kept whole on every rank, and the tied head multiplies with the
table its unit gathered. One 2-rank run of a tied nanoGPT (this file run as a script, as in test_fsdp_qlora.py):
epoch 1, a checkpoint, then epoch 2 resumed from it on the same 2 ranks. fp32 compute: the losses agree with one
process to 1e-5 (only the order of the gradient sum differs).

Session 32: the same worker then fits ``QuantizedPrecision("int8")`` (every Linear a bitsandbytes ``Linear8bitLt``, the
rows sharded, the row scales whole on each rank), an epoch, a checkpoint and the resumed epoch, and the planner's
``Prediction.per_rank`` is checked against both runs' per-rank parameter bytes.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fsdp_qlora import GLOBAL_BATCH, STEPS_PER_EPOCH, TINY, _callbacks, _datamodule, _global_losses, run_script_on_two_ranks  # noqa: E402


def _model() -> Any:
    """The tiny nanoGPT with its head tied to the token embedding (SmolLM2's, GPT-2's layout)."""
    from lightning_hbm.models import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(**TINY, tie_weights=True)
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", 0)))  # adapters differ per rank unless synced from rank 0
    return model


def _fit(devices: int, root: Path, epochs: int, ckpt: Any = None, mode: str = "nf4") -> tuple[list[float], Any, Any]:
    import lightning.pytorch as pl

    from lightning_hbm import QuantizedPrecision

    recorder = _global_losses()
    trainer = pl.Trainer(
        accelerator="cpu", devices=devices, strategy="fsdp_qlora" if devices > 1 else "auto", max_epochs=epochs,
        plugins=[QuantizedPrecision(mode, dtype="float32")], callbacks=_callbacks() + [recorder], logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(root),
    )  # fmt: skip
    model = _model()
    trainer.fit(model, datamodule=_datamodule(devices), ckpt_path=ckpt)
    return recorder.losses, trainer, model


def worker(out: Path) -> None:
    """Rank body: epoch 1 of fsdp_qlora + nf4 + LoRA with the default int8 tables, a checkpoint, epoch 2 resumed."""
    import torch.distributed as dist

    from lightning_hbm.layers.embedding import QuantizedEmbedding, TiedHead
    from lightning_hbm.memory import parameter_bytes

    torch.set_num_threads(1)
    losses, trainer, model = _fit(2, out / "first", 1)
    trainer.save_checkpoint(out / "fsdp.ckpt")
    table = model.model.wte.storage().weight
    record = {
        "losses": losses,
        "param_bytes": parameter_bytes(model),
        "embeddings": sorted(n for n, m in model.named_modules() if isinstance(m, QuantizedEmbedding)),
        "tied_head": isinstance(model.model.lm_head, TiedHead),
        "table": [type(table).__name__, str(table.dtype), table.to_local().numel(), table.numel()],
        "resumed": _fit(2, out / "resumed", 2, out / "fsdp.ckpt")[0],
        "int8": _int8_linears(out),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


def _int8_linears(out: Path) -> dict[str, Any]:
    """The same run in ``QuantizedPrecision("int8")``: every Linear a bitsandbytes ``Linear8bitLt`` (LoRA on them),
    session 32. bitsandbytes' forward read ``weight.CB``, which FSDP2's gathered weight lacks (``AttributeError`` at
    the first step); its rows are now sharded, the row scales whole on the layer."""
    from lightning_hbm.memory import parameter_bytes

    losses, trainer, model = _fit(2, out / "int8", 1, mode="int8")
    trainer.save_checkpoint(out / "int8.ckpt")
    weight = model.model.h[0].attn.c_attn.base_layer.weight
    return {
        "losses": losses,
        "param_bytes": parameter_bytes(model),
        "weight": [type(weight).__name__, str(weight.dtype), weight.to_local().numel(), weight.numel()],
        "resumed": _fit(2, out / "int8-resumed", 2, out / "int8.ckpt", mode="int8")[0],
    }


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script_on_two_ranks(__file__, tmp_path_factory.mktemp("fsdp_int8_embedding"), timeout=300)


@pytest.mark.slow
def test_two_rank_int8_tables_train_resume_and_count_as_one_process(two_rank_run: Path, tmp_path: Path) -> None:
    import bitsandbytes as bnb

    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.planner import Candidate, predict, quantization_constant_bytes, shard_categories

    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text()) for r in (0, 1)]
    reference, _, model = _fit(1, tmp_path, 2)  # one process, the same global batches, two epochs
    # the same model on both sides: wte in int8, the head computing with its one copy (wpe, 64 x 64 = 4,096 values, stays
    # wide under "auto": too small to gain)
    assert ranks[0]["embeddings"] == ["model.wte"] and ranks[0]["tied_head"]
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules()) == 1  # wte only
    kind, dtype, local, total = ranks[0]["table"]
    assert (kind, dtype) == ("DTensor", "torch.int8") and local * 2 == total == 256 * TINY["n_embd"]  # rows sharded
    for rank in ranks:
        assert len(rank["losses"]) == STEPS_PER_EPOCH
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference[:STEPS_PER_EPOCH]), atol=1e-5, rtol=0)
        # epoch 2 resumed on 2 ranks from the sealed checkpoint: as the uninterrupted single process
        torch.testing.assert_close(torch.tensor(rank["resumed"]), torch.tensor(reference[STEPS_PER_EPOCH:]), atol=1e-5, rtol=0)
    # the checkpoint says the tables were int8 (a resume with them wide is refused as another setting)
    saved = torch.load(two_rank_run / "fsdp.ckpt", map_location="cpu", weights_only=False)["lightning_hbm"]
    assert saved["configs"]["QuantizedPrecision"]["quantize_embeddings"] == "int8"
    # the planner's per-rank parameters: the int8 tables sharded, their row scales whole on each rank, exact
    prediction = predict(_model, synthetic_batch(GLOBAL_BATCH // 2, 32), Candidate("nf4", "float32", lora_r=4))
    constants = quantization_constant_bytes(_model, "nf4", "float32")
    assert constants - quantization_constant_bytes(_model, "nf4", "float32", quantize_embeddings=False) == 4 * 256  # wte's row scales
    per_rank = shard_categories(prediction.categories, world_size=2, replicated_parameter_bytes=constants)
    assert [rank["param_bytes"] for rank in ranks] == [per_rank["parameters"]] * 2
    # Prediction.per_rank knows the constants itself (before session 32 it split them too: half of them under the measured)
    assert prediction.per_rank(2)["parameters"] == per_rank["parameters"]
    assert prediction.replicated_bytes == constants


@pytest.mark.slow
def test_two_rank_int8_linears_train_resume_and_count_as_one_process(two_rank_run: Path, tmp_path: Path) -> None:
    """``QuantizedPrecision("int8")`` under ``fsdp_qlora`` (issue 51): losses and the resumed epoch as one process to
    1e-5, the int8 rows sharded, and each rank's parameter bytes the planner's (rows split, row scales whole)."""
    import bitsandbytes as bnb

    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.planner import Candidate, predict, quantization_constant_bytes

    ranks = [json.loads((two_rank_run / f"rank{r}.json").read_text())["int8"] for r in (0, 1)]
    reference, _, model = _fit(1, tmp_path, 2, mode="int8")
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules()) == 9  # 8 block Linears + wte (the head stays wide)
    kind, dtype, local, total = ranks[0]["weight"]
    assert (kind, dtype) == ("DTensor", "torch.int8") and local * 2 == total == 3 * TINY["n_embd"] ** 2  # rows sharded
    for rank in ranks:
        torch.testing.assert_close(torch.tensor(rank["losses"]), torch.tensor(reference[:STEPS_PER_EPOCH]), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(rank["resumed"]), torch.tensor(reference[STEPS_PER_EPOCH:]), atol=1e-5, rtol=0)
    # the planner's per-rank parameters, exact: the int8 rows split over the ranks, their fp32 row scales whole on each
    prediction = predict(_model, synthetic_batch(GLOBAL_BATCH // 2, 32), Candidate("int8", "float32", lora_r=4))
    assert [rank["param_bytes"] for rank in ranks] == [prediction.per_rank(2)["parameters"]] * 2
    assert prediction.replicated_bytes == quantization_constant_bytes(_model, "int8", "float32") > 0


@pytest.mark.slow  # ~1-2 s: bitsandbytes and the strategy's imports
def test_a_tied_head_outside_its_embeddings_unit_is_refused_before_sharding() -> None:
    """The strategy's own check (the plugin refuses or keeps wide the usual case earlier): a :class:`TiedHead` whose
    embedding lies in another FSDP unit would multiply with a shard of the table; refused, naming the head."""
    from torch import nn

    from lightning_hbm.layers.embedding import TiedHead
    from lightning_hbm.precision import quantize_model
    from lightning_hbm.strategies.fsdp_qlora import _check_tied_heads

    def tied() -> nn.Module:
        model = nn.Module()
        model.emb, model.head = nn.Embedding(128, 64), nn.Linear(64, 128, bias=False)
        model.head.weight = model.emb.weight
        quantize_model(model, "nf4", "float32", quantize_embeddings="int8")
        assert isinstance(model.head, TiedHead)
        return model

    with pytest.raises(ValueError, match=r"head is tied to a quantized input embedding, but QuantizedFSDPStrategy puts "
                       r"them in different FSDP units.*quantize_embeddings=False"):
        _check_tied_heads(tied(), [])  # emb and head: two top-level children, two units
    _check_tied_heads(nn.Sequential(tied()), [])  # one submodule holds both: one unit, the table gathered for both


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
