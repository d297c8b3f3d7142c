"""QuantizedFSDPStrategy on two CPU processes (gloo): nf4 + LoRA, sharded bytes, checkpoints, errors.

The 2-rank runs happen in a subprocess that runs this very file as a script (``python
test_fsdp_qlora.py fsdp OUT``): Lightning's launcher starts rank 1 by re-running the same command, and
the pytest process itself never forks into a process group. One 2-rank run serves the 2-rank tests
(loss, bytes, planner, checkpoint, and a block list held directly by the LightningModule, fitted second in
the same process group): it costs ~15 s of the 90 s budget.

Tolerance: fp32 compute, so the only difference between 1 and 2 ranks is the order of the gradient
sum (reduce-scatter of two half-batch means vs one full-batch mean): losses agree to 1e-5 absolute.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

STEPS_PER_EPOCH = 2
GLOBAL_BATCH = 8
DATA = dict(seq_len=32, train_samples=STEPS_PER_EPOCH * GLOBAL_BATCH, val_samples=8, max_bytes=200_000)
TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=64)
# set by a launcher in this process would make the 2-rank subprocess join another group
DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK", "LOCAL_WORLD_SIZE")


def _callbacks() -> list[Any]:
    from lightning_hbm.adapters.lora import LoRA

    return [LoRA(r=4, alpha=8, dropout=0.0)]


def _trainer(devices: int, strategy: Any, root: str, max_epochs: int, callbacks: list[Any], **plugin: Any) -> Any:
    import lightning.pytorch as pl

    from lightning_hbm import QuantizedPrecision

    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        # both sides take the default: the input embeddings in int8, sharded under FSDP as the 4-bit weights are
        # (row scales whole on every rank), so the 2-rank run trains the model the single process trains
        plugins=[QuantizedPrecision("nf4", dtype="float32", **plugin)],
        callbacks=callbacks,
        max_epochs=max_epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,  # see _datamodule
        default_root_dir=root,
    )


def _datamodule(ranks: int) -> Any:
    """The same global batch on 1 and 2 ranks: rank r reads samples r, r+2, ... in order.

    Lightning's automatic DistributedSampler shuffles every training set, so the test brings its
    own unshuffled one (``use_distributed_sampler=False``).
    """
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler

    from lightning_hbm.data import ByteTextDataModule

    class Ordered(ByteTextDataModule):
        def train_dataloader(self) -> DataLoader:
            loader = super().train_dataloader()
            if not dist.is_initialized():
                return loader
            sampler = DistributedSampler(loader.dataset, shuffle=False)
            return DataLoader(loader.dataset, batch_size=self.batch_size, sampler=sampler)

    return Ordered(batch_size=GLOBAL_BATCH // ranks, **DATA)


def _model() -> Any:
    """The same base on every rank; the RNG that initializes the LoRA adapters differs per rank
    (``LOCAL_RANK``), so the 2-rank run only matches if the strategy syncs them from rank 0."""
    from lightning_hbm.models import NanoGPT

    torch.manual_seed(0)
    model = NanoGPT(**TINY)
    torch.manual_seed(int(os.environ.get("LOCAL_RANK", 0)))
    return model


def _global_losses() -> Any:
    """A callback recording the loss averaged over ranks (the 1-rank loss of the same global batch)."""
    import lightning.pytorch as pl

    class GlobalLoss(pl.Callback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
            self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

    return GlobalLoss()


def _blocks_on_module() -> Any:
    """A LightningModule holding its block list directly (``self.blocks = nn.ModuleList(...)``), same on every rank."""
    import lightning.pytorch as pl
    from torch import nn

    class BlocksOnModule(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(256, 32)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)) for _ in range(2))
            self.head = nn.Linear(32, 256)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x = self.embed(batch[0])
            for block in self.blocks:
                x = x + block(x)
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), batch[1].flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return BlocksOnModule()


def _fit_blocks_on_module(out: Path) -> dict[str, Any]:
    """2 steps of fsdp_qlora + nf4 + LoRA on :func:`_blocks_on_module` (same process group as the main run)."""
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_hbm.data import synthetic_batch

    recorder = _global_losses()
    trainer = _trainer(2, "fsdp_qlora", str(out / "blocks"), 1, _callbacks() + [recorder])
    model = _blocks_on_module()
    trainer.fit(model, train_dataloaders=DataLoader(TensorDataset(*synthetic_batch(4, 16)), batch_size=2))
    weight = model.blocks[0][0].base_layer.weight  # the packed 4-bit weight under the LoRA wrapper
    return {
        "losses": recorder.losses,
        "blocks_are_units": all(isinstance(block, FSDPModule) for block in model.blocks),
        "list_is_unit": isinstance(model.blocks, FSDPModule),
        "embed_head_are_units": isinstance(model.embed, FSDPModule) and isinstance(model.head, FSDPModule),
        "weight_local_numel": weight.to_local().numel(),
        "weight_numel": weight.numel(),
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
    }


def worker(out: Path) -> None:
    """Rank body of the 2-process run: train one epoch with FSDP2 + nf4 + LoRA, save a checkpoint."""
    import torch.distributed as dist

    from lightning_hbm import HBMProfiler, QuantizedFSDPStrategy
    from lightning_hbm.memory import parameter_bytes

    torch.set_num_threads(1)
    recorder = _global_losses()
    profiler = HBMProfiler(every_n_steps=1, dirpath=str(out / "profile"), summary=False)
    trainer = _trainer(2, "fsdp_qlora", str(out), 1, _callbacks() + [recorder, profiler])
    model = _model()
    trainer.fit(model, datamodule=_datamodule(2))
    assert isinstance(trainer.strategy, QuantizedFSDPStrategy)
    trainer.save_checkpoint(out / "fsdp.ckpt")
    # optimizer states this rank holds (sharded like their parameters)
    optimizer_bytes = sum(
        t.to_local().untyped_storage().nbytes() if hasattr(t, "to_local") else t.untyped_storage().nbytes()
        for s in trainer.optimizers[0].state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    record = {
        "losses": recorder.losses,
        "param_bytes": parameter_bytes(model),
        "optimizer_bytes": optimizer_bytes,
        "trainable": sorted(n for n, p in model.named_parameters() if p.requires_grad),
        "dtensor_params": sum(type(p).__name__ == "DTensor" for p in model.parameters()),
        "blocks_on_module": _fit_blocks_on_module(out),
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))


def run_script_on_two_ranks(script: str, out: Path, timeout: int = 240) -> Path:
    """Run ``script``'s ``fsdp`` worker on 2 gloo ranks (Lightning's launcher) writing into ``out``; assert it ended well."""
    import lightning_hbm

    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # The ranks import the lightning_hbm this process tests (a script's sys.path starts at its own folder,
    # so they would otherwise import whatever copy is installed in the environment).
    package_root = str(Path(lightning_hbm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    proc = subprocess.run([sys.executable, str(Path(script).resolve()), "fsdp", str(out)], env=env,
                          capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return out


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return run_script_on_two_ranks(__file__, tmp_path_factory.mktemp("fsdp_qlora"))


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One process, no FSDP, same global batch, two epochs (epoch 1 is what the 2-rank run trained)."""
    from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes

    losses, trainer, model = _single_process(tmp_path_factory.mktemp("reference"), epochs=2)
    import bitsandbytes as bnb

    # the 4-bit Linears' constants and the int8 embedding tables' row scales (Linear8bitLt storage)
    constants = [t for m in model.modules() if isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)) for t in quantization_tensors(m)]
    assert any(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules())  # the int8 tables are there
    return {
        "losses": losses,
        "model": model,
        "param_bytes": parameter_bytes(model),
        "constant_bytes": unique_bytes(constants),
        "optimizer_bytes": unique_bytes(
            t for s in trainer.optimizers[0].state.values() for t in s.values() if t.dim() > 0
        ),
    }


def _single_process(root: Path, epochs: int, ckpt: Any = None) -> tuple[list[float], Any, Any]:
    recorder = _global_losses()
    trainer = _trainer(1, "auto", str(root), epochs, _callbacks() + [recorder])
    model = _model()
    trainer.fit(model, datamodule=_datamodule(1), ckpt_path=ckpt)
    return recorder.losses, trainer, model


def _ranks(out: Path) -> list[dict[str, Any]]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.slow
def test_two_rank_qlora_loss_equals_single_process(two_rank_run: Path, reference: dict[str, Any]) -> None:
    ranks = _ranks(two_rank_run)
    assert ranks[0]["losses"] == ranks[1]["losses"]  # reduced over ranks
    expected = reference["losses"][:STEPS_PER_EPOCH]
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(expected), atol=1e-5, rtol=0)
    # only LoRA adapters were trained, on both sides, and every parameter really was sharded
    model = reference["model"]
    trainable = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    assert ranks[0]["trainable"] == trainable
    assert trainable and all(".lora_" in n for n in trainable)
    assert ranks[0]["dtensor_params"] == len(list(model.parameters()))


@pytest.mark.slow
def test_each_rank_holds_half_the_parameter_and_optimizer_bytes(two_rank_run: Path, reference: dict[str, Any]) -> None:
    """Per rank: half of every parameter (4-bit base and adapters) and of the Adam states.

    The quantization constants (absmax, code book) live on the bitsandbytes module, not in the
    sharded parameter: every rank keeps a full copy of them.
    """
    ranks = _ranks(two_rank_run)
    total, constants = reference["param_bytes"], reference["constant_bytes"]
    assert constants > 0
    sharded = total - constants
    for rank in ranks:
        assert rank["param_bytes"] == sharded // 2 + constants
        assert rank["optimizer_bytes"] * 2 == reference["optimizer_bytes"]


@pytest.mark.slow
def test_planner_per_rank_prediction_matches_two_rank_measurement(
    two_rank_run: Path, reference: dict[str, Any]
) -> None:
    """The planner's 2-rank figures (``shard_categories``) against what each rank holds.

    Checked against exact storage counts on each rank and against the HBMProfiler's report (max
    over ranks). FSDP2 shards the packed 4-bit weights but keeps the quantization constants whole
    on every rank: the planner is told so (``replicated_parameter_bytes``) and is then exact.
    """
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.memory import parameter_bytes, quantization_tensors, unique_bytes
    from lightning_hbm.planner import Candidate, predict, quantization_constant_bytes, shard_categories

    batch = synthetic_batch(GLOBAL_BATCH // 2, DATA["seq_len"])  # what one rank computes on
    prediction = predict(_model, batch, Candidate("nf4", "float32", lora_r=4))  # int8 tables, as FSDP now stores them
    assert prediction.categories["parameters"] == reference["param_bytes"]  # exact on one rank
    constants = quantization_constant_bytes(_model, "nf4", "float32")
    assert constants == reference["constant_bytes"]
    per_rank = shard_categories(prediction.categories, world_size=2, replicated_parameter_bytes=constants)
    for rank in _ranks(two_rank_run):
        assert rank["param_bytes"] == per_rank["parameters"]
        # Adam states: sharded like their parameters (the planner also counts the 0-dim step tensors)
        assert abs(rank["optimizer_bytes"] - per_rank["optimizer_states"]) <= 0.01 * per_rank["optimizer_states"]
    # the profiler's measurement (rank 0 writes the max over ranks)
    profile = json.loads((two_rank_run / "profile" / "hbm_profile.json").read_text())
    rows = profile["rows"]
    assert rows and all(row["parameters"] == per_rank["parameters"] for row in rows)
    measured_states = rows[-1]["optimizer_states"]
    assert abs(measured_states - per_rank["optimizer_states"]) <= 0.01 * per_rank["optimizer_states"]
    # Prediction.per_rank (session 32): the constants whole on each rank, and the parameters outside the blocks (wte's
    # int8 rows, wpe, ln_f, lm_head: 98,816 B) gathered by FSDP2's unit around the blocks (NanoGPT's model) while its
    # forward and its backward run. Resharded at its forward's end: nothing of it is live then (session 32 read the
    # 98,816 B in the profiler's forward-end breakdown, freed storages its tracker still counted)
    planned = prediction.per_rank(2)
    assert planned["parameters"] == per_rank["parameters"]
    assert prediction.remainder_bytes == 98_816 and "<root>" not in profile["modules"]["1"]
    # a block gathers its parameters, not its quantization constants (whole on every rank, in replicated_bytes): 44,288
    # B, the measured block all-gather; before session 33 they were counted twice (+3,328 B a block)
    block = reference["model"].model.h[0]
    block_constants = unique_bytes(t for m in block.modules() for t in quantization_tensors(m))
    assert block_constants == 3_328
    assert prediction.block_bytes == parameter_bytes(block) - block_constants == 44_288
    # The whole per-rank peak (session 33). The profiler's tracker follows FSDP2's storage resizes (resize_(0) frees a
    # unit's gathered parameters, resize_(n) allocates them again); before, the freed storages stayed counted and a
    # refill at a new address counted twice: 1,777,744, 1,826,896 and 1,831,760 B measured in three runs of this step.
    # Now the same 1,658,960 B every run, in the backward of the last block: the remainder unit and that block
    # gathered, the next block's prefetched all-gather buffer (44,288 B) alive beside them. The plan puts the rank's
    # peak in the same region and holds the same there; the step's own peak, the loss's backward, runs outside the
    # unit around the blocks, with nothing gathered.
    detailed = [row for row in rows if row["mode"] == "detailed"]
    assert detailed and all(row["tracked_peak"] == row["total"] == 1_658_960 for row in detailed)
    # the step's picture follows the resizes too: its peak is the row's (it drew 1,846,352 B before)
    figure = json.loads((two_rank_run / "profile" / "hbm_figure.json").read_text())
    assert figure["peak"]["bytes"] == 1_658_960 and figure["peak"]["phase"] == "backward"
    assert abs(sum(planned.values()) - 1_658_960) <= 0.03 * 1_658_960  # the house tolerance
    # 4 B under since session 35 (12 B over before): the plan holds the rank's batch as the DataLoader collates it
    # (2 x 1,024 B), not as synthetic_batch's views of one tensor (2 x 1,048 B), and Adam's 0-dim step tensors (16 x 4 B)
    # whole on each rank (Prediction.replicated_state_bytes; split with the states before: 32 B under)
    assert planned["optimizer_states"] == measured_states == 32_832
    assert sum(planned.values()) == 1_658_956


def _saved(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Every tensor of a lightning_hbm checkpoint: the as-built part (no placeholders) and the changed part."""
    meta = checkpoint["lightning_hbm"]
    as_built = {k: v for k, v in checkpoint["state_dict"].items() if k not in meta["placeholders"]}
    return {**as_built, **meta["state_dict"]}


@pytest.mark.slow
def test_checkpoint_from_two_ranks_resumes_on_one(
    two_rank_run: Path, reference: dict[str, Any], tmp_path: Path
) -> None:
    ckpt = two_rank_run / "fsdp.ckpt"
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=False)
    # lightning_hbm's two-part form (lightning_hbm/resume/): the adapters do not fit the model as built, so they
    # are in the second part; adapter-only: no quantized base; full (gathered, unsharded) tensors
    adapters = checkpoint["lightning_hbm"]["state_dict"]
    keys = sorted(adapters)
    assert keys == _ranks(two_rank_run)[0]["trainable"]
    assert not any(".lora_" in k or k.endswith("c_attn.weight") for k in checkpoint["state_dict"])
    model = reference["model"]
    for key in keys:
        assert type(adapters[key]) is torch.Tensor
        assert adapters[key].shape == model.get_parameter(key).shape
    assert sorted(checkpoint["optimizer_states"][0]["state"]) == list(range(len(keys)))
    # 1 process, no FSDP: epoch 2 after the 2-rank epoch 1 equals epoch 2 of the uninterrupted run
    resumed, _, _ = _single_process(tmp_path, epochs=2, ckpt=ckpt)
    expected = reference["losses"][STEPS_PER_EPOCH:]
    torch.testing.assert_close(torch.tensor(resumed), torch.tensor(expected), atol=1e-5, rtol=0)


@pytest.mark.slow
def test_modulelist_on_the_lightning_module_shards_its_blocks(two_rank_run: Path) -> None:
    """``self.blocks = nn.ModuleList(...)`` directly on the LightningModule, 2 ranks: each block is a unit, the list
    never is (``fully_shard`` refuses containers without ``forward``; before, that failed after quantization and
    LoRA had changed the model), and each rank holds half of every block's 4-bit weight."""
    runs = [rank["blocks_on_module"] for rank in _ranks(two_rank_run)]
    for run in runs:
        assert run["blocks_are_units"] and not run["list_is_unit"] and run["embed_head_are_units"]
        assert run["weight_local_numel"] * 2 == run["weight_numel"]
        assert run["trainable"] and all(".lora_" in n for n in run["trainable"])
        assert len(run["losses"]) == 2 and all(math.isfinite(loss) for loss in run["losses"])
    assert runs[0]["losses"] == runs[1]["losses"]  # reduced over ranks


@pytest.mark.slow
@pytest.mark.parametrize("chunks", [1, 2], ids=["whole", "mlp_chunks=2"])
def test_one_rank_fsdp_resumes_with_cpu_offload_and_activation_checkpointing(
    two_rank_run: Path, reference: dict[str, Any], tmp_path: Path, no_process_group: Any, chunks: int
) -> None:
    """World size 1 (the GPU benchmark's setting), in this process: the 2-rank checkpoint is loaded
    into FSDP2 shards (the strategy's own load path, optimizer states included), parameters and
    optimizer states stay on the CPU (offload policy), ActivationCheckpointing wraps the blocks
    before they are sharded, and epoch 2 still equals the uninterrupted run (recompute is exact; with
    ``mlp_chunks=2`` the MLPs' recompute runs in token chunks on the sharded, offloaded parameters).
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from lightning_hbm import ActivationCheckpointing, QuantizedFSDPStrategy, applied_transforms

    recorder = _global_losses()
    strategy = QuantizedFSDPStrategy(cpu_offload=True)
    checkpointing = ActivationCheckpointing("full", mlp_chunks=chunks)
    callbacks = _callbacks() + [checkpointing, recorder]
    trainer = _trainer(1, strategy, str(tmp_path), 2, callbacks)
    model = _model()
    trainer.fit(model, datamodule=_datamodule(1), ckpt_path=two_rank_run / "fsdp.ckpt")
    assert applied_transforms(model)[-2:] == ["LoRA", "ActivationCheckpointing"]
    blocks = list(model.model.h)
    assert all(isinstance(b, FSDPModule) for b in blocks)
    assert isinstance(blocks[0]._get_fsdp_state()._fsdp_param_group.offload_policy, CPUOffloadPolicy)
    assert len(checkpointing.chunked) == (len(blocks) if chunks > 1 else 0)
    expected = reference["losses"][STEPS_PER_EPOCH:]
    torch.testing.assert_close(torch.tensor(recorder.losses), torch.tensor(expected), atol=1e-5, rtol=0)


def test_quantized_base_without_lora_trains_norms_and_embeddings(tmp_path: Path, no_process_group: Any) -> None:
    """QuantizedPrecision alone (no adapters): the trainable set is the unquantized parameters, sharded."""
    from torch.distributed.tensor import DTensor

    losses, checkpoints, trainable = {}, {}, {}
    for strategy in ("auto", "fsdp_qlora"):
        recorder = _global_losses()
        # the embeddings kept wide (trained): the default stores them in int8, frozen
        trainer = _trainer(1, strategy, str(tmp_path / strategy), 1, [recorder], quantize_embeddings=False)
        model = _model()
        trainer.fit(model, datamodule=_datamodule(1))
        trainer.save_checkpoint(tmp_path / f"{strategy}.ckpt")
        losses[strategy] = recorder.losses
        trainable[strategy] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        checkpoints[strategy] = _saved(torch.load(tmp_path / f"{strategy}.ckpt", weights_only=False))
    torch.testing.assert_close(torch.tensor(losses["fsdp_qlora"]), torch.tensor(losses["auto"]), atol=1e-5, rtol=0)
    names = sorted(trainable["fsdp_qlora"])
    assert names == sorted(trainable["auto"])
    assert "model.wte.weight" in names and "model.ln_f.weight" in names and "model.h.0.attn.c_attn.bias" in names
    assert not any(n.endswith("c_attn.weight") for n in names)  # the quantized base is frozen
    assert all(isinstance(p, DTensor) for p in trainable["fsdp_qlora"].values())
    # the FSDP checkpoint holds exactly the trainable weights, equal to the single-device ones
    assert sorted(checkpoints["fsdp_qlora"]) == names
    for name in names:
        torch.testing.assert_close(checkpoints["fsdp_qlora"][name], checkpoints["auto"][name], atol=1e-5, rtol=0)


def test_container_class_as_shard_module_fails_before_the_model_changes(
    gpt_factory: Any, trainer_factory: Any, no_process_group: Any
) -> None:
    from lightning_hbm import QuantizedFSDPStrategy, QuantizedPrecision

    model = gpt_factory()
    trainer = trainer_factory(
        strategy=QuantizedFSDPStrategy(shard_modules=["ModuleList"]), plugins=[QuantizedPrecision("nf4", dtype="float32")]
    )
    with pytest.raises(ValueError, match=r"shard_modules=\['ModuleList'\]: ModuleList is a container without forward.*"
                       r"name the blocks it holds, e.g. \['Block'\]"):
        trainer.fit(model, train_dataloaders=[_batch()])
    assert type(model.model.h[0].attn.c_attn) is torch.nn.Linear  # nothing half-applied


# ---------------------------------------------------------------- errors (no second process)


@pytest.mark.parametrize("bad", ["Block", [""], [3]])
def test_shard_modules_must_be_a_list_of_names(bad: Any) -> None:
    from lightning_hbm import QuantizedFSDPStrategy

    with pytest.raises(TypeError, match=r"shard_modules(=.*pass a list of strs or None| must be a list of module class names)"):
        QuantizedFSDPStrategy(shard_modules=bad)


def test_registered_name_builds_the_strategy(trainer_factory: Any) -> None:
    from lightning_hbm import QuantizedFSDPStrategy

    trainer = trainer_factory(strategy="fsdp_qlora")
    assert isinstance(trainer.strategy, QuantizedFSDPStrategy)
    assert trainer.strategy.shard_modules is None and not trainer.strategy.cpu_offload


def test_unknown_shard_module_fails_before_the_model_changes(
    gpt_factory: Any, trainer_factory: Any, no_process_group: Any
) -> None:
    from lightning_hbm import QuantizedFSDPStrategy, QuantizedPrecision

    model = gpt_factory()
    trainer = trainer_factory(
        strategy=QuantizedFSDPStrategy(shard_modules=["Block", "DecoderLayer"]),
        plugins=[QuantizedPrecision("nf4", dtype="float32")],
    )
    with pytest.raises(ValueError, match=r"\['DecoderLayer'\] match no submodule class of NanoGPT.*'Block'"):
        trainer.fit(model, train_dataloaders=[_batch()])
    assert type(model.model.h[0].attn.c_attn) is torch.nn.Linear  # nothing half-applied


def test_parameters_outside_submodules_are_refused(trainer_factory: Any, no_process_group: Any) -> None:
    from lightning_hbm import QuantizedFSDPStrategy
    from lightning_hbm.models import NanoGPT

    class WithScale(NanoGPT):
        def __init__(self) -> None:
            super().__init__(**TINY)
            self.scale = torch.nn.Parameter(torch.ones(()))

    model = WithScale()
    trainer = trainer_factory(strategy=QuantizedFSDPStrategy())
    message = r"WithScale holds parameters directly \(\['scale'\]\).*move them into a submodule"
    with pytest.raises(ValueError, match=message):
        trainer.fit(model, train_dataloaders=[_batch()])


def test_full_checkpoint_request_is_refused(gpt_factory: Any, trainer_factory: Any, no_process_group: Any) -> None:
    from lightning_hbm import LoRA

    model = gpt_factory()
    trainer = trainer_factory(strategy="fsdp_qlora", callbacks=[LoRA(r=2, full_checkpoint=True)])
    with pytest.raises(ValueError, match=r"LoRA\(full_checkpoint=True\) asks for the frozen base.*full_checkpoint=False"):
        trainer.fit(model, train_dataloaders=[_batch()])
    assert not any(".lora_" in n for n, _ in model.named_parameters())  # nothing half-applied


def test_bitsandbytes_optimizer_is_refused_before_training(
    gpt_factory: Any, trainer_factory: Any, no_process_group: Any, loss_recorder: Any, snapshot: Any
) -> None:
    from lightning_hbm import MemoryEfficientOptimizer

    recorder = loss_recorder()
    model = gpt_factory()
    before = snapshot(model)
    trainer = trainer_factory(strategy="fsdp_qlora", callbacks=[MemoryEfficientOptimizer("adamw8bit"), recorder])
    with pytest.raises(ValueError, match=r"AdamW8bit \(bitsandbytes\) cannot step FSDP2-sharded.*strategy='ddp'"):
        trainer.fit(model, train_dataloaders=[_batch()])
    assert recorder.losses == []
    assert snapshot(model) == before  # refused before quantizing and sharding


def test_lightning_cli_parses_the_strategy() -> None:
    from jsonargparse import ArgumentParser

    from lightning_hbm import QuantizedFSDPStrategy

    parser = ArgumentParser()
    parser.add_class_arguments(QuantizedFSDPStrategy, "strategy")
    config = parser.parse_args(["--strategy.shard_modules=[LlamaDecoderLayer]", "--strategy.cpu_offload=true"])
    strategy = parser.instantiate(config).strategy
    assert strategy.shard_modules == ["LlamaDecoderLayer"] and strategy.cpu_offload


@pytest.mark.gpu
def test_one_gpu_fsdp_qlora_bf16_matches_single_device(tmp_path: Path, no_process_group: Any) -> None:
    """World size 1 on one GPU, bf16 compute: the sharded (1-way) run equals the plain run to bf16 noise."""
    import bitsandbytes as bnb
    import lightning.pytorch as pl

    from lightning_hbm import QuantizedPrecision

    losses = {}
    for strategy in ("auto", "fsdp_qlora"):
        recorder = _global_losses()
        trainer = pl.Trainer(
            accelerator="gpu", devices=1, strategy=strategy, max_epochs=1, logger=False,
            plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16", quantize_embeddings=False)], callbacks=_callbacks() + [recorder],
            enable_checkpointing=False, enable_progress_bar=False, default_root_dir=str(tmp_path / strategy),
        )  # fmt: skip
        model = _model()
        trainer.fit(model, datamodule=_datamodule(1))
        losses[strategy] = recorder.losses
        layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
        assert layer.weight.device.type == "cuda" and layer.weight.dtype == torch.uint8
    torch.testing.assert_close(torch.tensor(losses["fsdp_qlora"]), torch.tensor(losses["auto"]), atol=2e-2, rtol=0)


def _batch() -> Any:
    from lightning_hbm.data import synthetic_batch

    return synthetic_batch(2, 16)


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
