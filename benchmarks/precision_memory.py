"""Parameter bytes per precision mode for a ~100M-parameter Llama config (random weights, no download).

Counts tensor storage bytes (quantization constants included) after ``quantize_model``; exact on CPU.
Runs on GPU unchanged (``--device cuda``), where bitsandbytes quantizes on the device.

    python benchmarks/precision_memory.py [--device cpu|cuda] [--modes nf4 nf4-dq ...]
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_hbm import available_precisions, quantize_model
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.models import llama_config

# ~110M parameters: 12 layers, hidden 768, MLP 2048, vocabulary 16k, untied head
CONFIG = dict(
    vocab_size=16_000,
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=12,
)


def build(device: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(llama_config(**CONFIG)).to(torch.bfloat16)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modes", nargs="*", default=[m for m in available_precisions()])
    args = parser.parse_args()

    model = build(args.device)
    total = parameter_count(model)
    bf16 = parameter_bytes(model)
    print(f"Llama config {CONFIG}: {total / 1e6:.1f}M parameters, bf16 = {bf16 / 2**20:.1f} MiB")
    print(f"{'mode':<14}{'param MiB':>11}{'ratio to bf16':>15}{'B/param (all)':>15}{'quantize s':>12}")
    print(f"{'bf16':<14}{bf16 / 2**20:>11.1f}{1.0:>15.3f}{bf16 / total:>15.3f}{'-':>12}")
    for mode in args.modes:
        model = build(args.device)
        start = time.perf_counter()
        # quantize_head=True: the figures count every Linear quantized, the head included (the default
        # keeps a Hugging Face model's output head in bf16, as transformers' quantizers do)
        quantize_model(model, mode, dtype="bfloat16", quantize_head=True)
        seconds = time.perf_counter() - start
        quantized = parameter_bytes(model)
        print(f"{mode:<14}{quantized / 2**20:>11.1f}{quantized / bf16:>15.3f}{quantized / total:>15.3f}{seconds:>12.1f}")
        del model


if __name__ == "__main__":
    main()
