"""Side by side: the Hugging Face QLoRA recipe vs the same model as a plain LightningModule with lightning_hbm.

One process, one random-weight Llama saved once to a temporary directory, then three stacks built from it:

* ``hf``: the standard recipe: ``from_pretrained(quantization_config=BitsAndBytesConfig(nf4, double quant))``,
  ``prepare_model_for_kbit_training(use_gradient_checkpointing=True)``, ``get_peft_model(all-linear)``
  (transformers keeps the output head unquantized; its loss upcasts the full logits to fp32).
* ``lhbm``: ``from_pretrained`` without quantization inside a plain LightningModule whose ``training_step`` is
  ``self.model(input_ids=x, labels=x).loss``, trained by a Lightning Trainer with
  ``QuantizedPrecision("nf4-dq")`` + ``LoRA(all-linear)`` + ``ActivationCheckpointing()`` (the output head is
  kept in full precision, as transformers does: ``quantize_head=False``).
* ``lhbm+fused``: the same plus ``FusedLoss()``.

Each stack runs the same step (forward with ``labels=``, backward, AdamW over the adapters, zero_grad) by hand
after Lightning has applied the surgery (one ``fit`` step), so the loop is identical. Per stack: the step's
peak memory, by torch's ``MemTracker`` on CPU (private API; modules, optimizer and everything the step
allocates) or ``torch.cuda.max_memory_allocated`` minus what was allocated before the stack was built on CUDA,
and the median step time over interleaved rounds, reported as a ratio to the Hugging Face recipe (absolute
times on a shared machine mean little).

    python benchmarks/peer_qlora.py --preset tiny            # CPU: 2 layers, width 64, 32k vocab, batch 2 x 512
    python benchmarks/peer_qlora.py --preset 100m --rounds 2 # CPU: hidden 768, 12 layers, 4 KV heads, 32k vocab
    python benchmarks/peer_qlora.py --preset 8b --device cuda  # GPU presets: 1b, 3b, 8b (not yet run on GPU)

CPU runs compute in float32 by default (bf16 matmuls are several times slower than fp32 on CPUs without
AVX512-BF16); CUDA runs in bfloat16. ``--dtype`` overrides.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from typing import Any, Callable

import lightning.pytorch as pl
import torch

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.models import llama_config

PRESETS: dict[str, dict[str, Any]] = {
    # config fields of lightning_hbm.models.llama_config, plus batch and sequence length
    "tiny": dict(vocab_size=32000, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, batch=2, seq=512),
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, batch=2, seq=512),
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4, batch=2, seq=2048),
    "3b": dict(vocab_size=128256, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, batch=2, seq=2048),
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, batch=2, seq=2048),
}
LORA_R, LORA_ALPHA = 8, 16


class PeerLM(pl.LightningModule):
    """What a user writes around a transformers causal LM: nothing about memory."""

    def __init__(self, path: str, dtype: torch.dtype) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(path, dtype=dtype)
        self.model.config.use_cache = False

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-4)


def hf_recipe(path: str, dtype: torch.dtype, device: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import BitsAndBytesConfig, LlamaForCausalLM

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
    model = LlamaForCausalLM.from_pretrained(path, quantization_config=quant, dtype=dtype, device_map=device)
    model.config.use_cache = False
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    model = get_peft_model(model, LoraConfig(r=LORA_R, lora_alpha=LORA_ALPHA, target_modules="all-linear", task_type="CAUSAL_LM"))
    model.train()
    return model, torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)


def lightning_hbm_stack(path: str, dtype: torch.dtype, device: str, fused: bool, batch: torch.Tensor) -> tuple[Any, Any]:
    """Surgery applied by a real Trainer (one fit step), then the module and its optimizer."""
    module = PeerLM(path, dtype)
    callbacks = [LoRA(r=LORA_R, alpha=LORA_ALPHA), ActivationCheckpointing()] + ([FusedLoss()] if fused else [])
    trainer = pl.Trainer(accelerator=device, devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         plugins=[QuantizedPrecision("nf4-dq", dtype=str(dtype).removeprefix("torch."))], callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader([batch[0]] * batch.shape[0], batch_size=batch.shape[0]))
    return module, trainer.optimizers[0]


def make_step(model: Any, optimizer: torch.optim.Optimizer, batch: torch.Tensor, hf: bool) -> Callable[[], float]:
    def step() -> float:
        loss = model(input_ids=batch, labels=batch).loss if hf else model.training_step(batch, 0)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def peak_bytes(step: Callable[[], float], model: Any, optimizer: Any, device: str, base: int) -> int:
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return torch_peak_bytes(step, model, optimizer)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=list(PRESETS), default="tiny")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (median)")
    args = parser.parse_args()
    preset = dict(PRESETS[args.preset])
    b, s = preset.pop("batch"), preset.pop("seq")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device == "cuda" else "float32"))
    torch.manual_seed(0)
    batch = torch.randint(0, preset["vocab_size"], (b, s), device=args.device)
    from transformers import LlamaForCausalLM

    with tempfile.TemporaryDirectory() as path:
        LlamaForCausalLM(llama_config(max_position_embeddings=max(512, s), **preset)).to(dtype).save_pretrained(path)
        gc.collect()
        stacks: dict[str, dict[str, Any]] = {}
        for name in ("hf", "lhbm", "lhbm+fused"):
            base = torch.cuda.memory_allocated() if args.device == "cuda" else 0
            if name == "hf":
                model, optimizer = hf_recipe(path, dtype, args.device)
            else:
                model, optimizer = lightning_hbm_stack(path, dtype, args.device, name.endswith("fused"), batch)
            step = make_step(model, optimizer, batch, hf=name == "hf")
            loss = step()  # warm-up: optimizer states exist from here on
            stacks[name] = dict(step=step, loss=loss, peak=peak_bytes(step, model, optimizer, args.device, base), times=[])
    for _ in range(args.rounds):
        for stack in stacks.values():
            if args.device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            stack["step"]()
            if args.device == "cuda":
                torch.cuda.synchronize()
            stack["times"].append(time.perf_counter() - start)
    tokens, vocab = b * s, preset["vocab_size"]
    ref = statistics.median(stacks["hf"]["times"])
    print(f"\npreset {args.preset} ({args.device}, {str(dtype).removeprefix('torch.')}): batch {b} x {s}, vocab {vocab}, "
          f"LoRA r={LORA_R} all-linear; one fp32 logits copy = {tokens * vocab * 4 / 2**20:.1f} MiB")
    print("| stack | step peak (MiB) | vs HF | step time vs HF | first loss |")
    print("|---|---:|---:|---:|---:|")
    for name, stack in stacks.items():
        print(f"| {name} | {stack['peak'] / 2**20:.1f} | {stack['peak'] / stacks['hf']['peak']:.3f}x | "
              f"{statistics.median(stack['times']) / ref:.2f}x | {stack['loss']:.4f} |")


if __name__ == "__main__":
    main()
