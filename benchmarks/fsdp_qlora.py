"""Per-rank memory of QLoRA (nf4-dq + LoRA) with and without FSDP2 sharding (QuantizedFSDPStrategy).

One configuration per run (Lightning re-runs this script for the other ranks):

    # GPU, FSDP with world size 1 (a few minutes on one GPU): ~1.1B-parameter Llama, bf16 compute
    python benchmarks/fsdp_qlora.py --strategy fsdp_qlora --devices 1 --size 1b
    python benchmarks/fsdp_qlora.py --strategy auto --devices 1 --size 1b        # same, unsharded
    # CPU dev machine, 2 processes (gloo), tiny model: bytes per rank are exact storage counts
    python benchmarks/fsdp_qlora.py --strategy fsdp_qlora --devices 2 --size tiny
    python benchmarks/fsdp_qlora.py --strategy auto --devices 1 --size tiny
    # the int8 embedding tables sharded (session 31): a vocabulary-dominated Llama (vocabulary 32000, hidden 256,
    # 2 layers), the default int8 tables against tables kept wide, untied and tied
    python benchmarks/fsdp_qlora.py --strategy fsdp_qlora --devices 2 --size small --vocab 32000 [--wide-embeddings] [--tie]

Prints, per rank: parameter bytes this rank holds (local shards + quantization constants),
optimizer-state bytes, trainable parameters; on CUDA also the peak allocated memory and tokens/s
(after warm-up steps). With world size 1 FSDP shards nothing: the GPU run shows its overhead (the
all-gathered unit buffers) against the plain run. Savings per rank need >= 2 GPUs: multi-GPU
figures need a multi-GPU machine (same command with ``--devices N``).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import lightning.pytorch as pl
import torch
from typing_extensions import override

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.models import LlamaLM

SIZES: dict[str, dict[str, int]] = {
    # hidden, intermediate, layers, heads, kv heads
    "tiny": dict(
        hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "small": dict(  # the issue-51 vocabulary-dominated shape (with --vocab 32000)
        hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "1b": dict(  # TinyLlama-1.1B's shape
        hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32, num_key_value_heads=4
    ),
}


class StepTimer(pl.Callback):
    """Wall time of the training steps after ``warmup`` (CUDA synchronized)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.start = 0.0
        self.timed_steps = 0
        self.seconds = 0.0

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.warmup and torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.start = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        if batch_idx >= self.warmup:
            self.seconds += time.perf_counter() - self.start
            self.timed_steps += 1


def optimizer_bytes(trainer: pl.Trainer) -> int:
    total = 0
    for state in trainer.optimizers[0].state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.untyped_storage().nbytes()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", choices=["fsdp_qlora", "auto", "ddp"], default="fsdp_qlora")
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch size")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's)")
    parser.add_argument("--tie", action="store_true", help="head tied to the token embedding")
    parser.add_argument("--wide-embeddings", action="store_true", help="quantize_embeddings=False (default: int8)")
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    if not cuda and args.size not in ("tiny", "small"):
        parser.error("without CUDA use --size tiny or small (the CPU path counts bytes; it does not time)")
    seq = args.seq if cuda else 32

    from lightning_hbm.data import synthetic_batch

    idx, targets = synthetic_batch(args.batch * args.steps, seq, seed=0)
    data = torch.utils.data.DataLoader(list(zip(idx, targets)), batch_size=args.batch)
    timer = StepTimer(args.warmup)
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu",
        devices=args.devices,
        strategy=args.strategy,
        plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16" if cuda else "float32",
                                    **({"quantize_embeddings": False} if args.wide_embeddings else {}))],
        callbacks=[LoRA(r=16, alpha=32), timer],
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with trainer.init_module(empty_init=False):
        shape: dict[str, Any] = dict(SIZES[args.size], tie_word_embeddings=args.tie)
        if args.vocab is not None:
            shape["vocab_size"] = args.vocab
        model = LlamaLM(**shape, max_position_embeddings=max(seq, 512))
    trainer.fit(model, train_dataloaders=data)

    figures = {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "strategy": args.strategy,
        "embeddings": "wide" if args.wide_embeddings else "int8 (default)",
        "tied": args.tie,
        "param_bytes_this_rank": parameter_bytes(model),
        "optimizer_bytes_this_rank": optimizer_bytes(trainer),
        "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    if args.strategy != "fsdp_qlora":
        figures["param_bytes_this_rank"] = parameter_bytes(model)
    if cuda:
        tokens = timer.timed_steps * args.batch * seq * trainer.world_size
        figures["cuda_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        figures["tokens_per_s_all_ranks"] = round(tokens / max(timer.seconds, 1e-9))
        figures["device"] = torch.cuda.get_device_name()
    print("FIGURES", figures, flush=True)


if __name__ == "__main__":
    main()
