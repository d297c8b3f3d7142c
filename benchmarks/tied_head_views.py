"""A tied int8 head's vocabulary slices read as views (session 35, ``QuantFormat.gather_range``) against gathered by
index (before): CPU seconds of the head's forward and forward+backward on SmolLM2-135M's shape (transformers' Llama from
its config: vocabulary 49,152 x hidden 576, tied embedding stored int8 by ``QuantizedPrecision("nf4-dq")``, bf16
compute, 1 x 128 tokens), the two arms interleaved in one process, 3 runs of 10 calls each; outputs compared.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/tied_head_views.py
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any

import lightning.pytorch as pl
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers.embedding import TiedHead
from lightning_hbm.precision.bnb import Bnb8bitFormat
from lightning_hbm.surgery import run_surgery

CONFIG = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=64, num_hidden_layers=1, num_attention_heads=9,
                     num_key_value_heads=3, tie_word_embeddings=True)


class CausalLM(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = LlamaForCausalLM(CONFIG)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(input_ids=batch, labels=batch).loss


def _indexed(self: Any, module: Any, start: int, stop: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return self.gather_rows(module, torch.arange(start, stop, device=device), dtype)


def main() -> None:
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    torch.manual_seed(0)
    module = CausalLM()
    run_surgery(module, QuantizedPrecision("nf4-dq", dtype="bfloat16"), [], batch=torch.randint(0, 49152, (1, 128)))
    head = next(m for m in module.modules() if isinstance(m, TiedHead))
    x = torch.randn(1, 128, 576, dtype=torch.bfloat16, requires_grad=True)
    views = Bnb8bitFormat.gather_range
    times: dict[str, dict[str, list[float]]] = {arm: {"forward": [], "forward+backward": []} for arm in ("before", "after")}
    outputs = {}
    for run in range(3):
        for arm in ("before", "after") if run % 2 == 0 else ("after", "before"):
            Bnb8bitFormat.gather_range = _indexed if arm == "before" else views  # type: ignore[method-assign]
            start = time.process_time()
            with torch.no_grad():
                for _ in range(10):
                    head(x)
            times[arm]["forward"].append((time.process_time() - start) / 10)
            start = time.process_time()
            for _ in range(10):
                out = head(x)
                (grad,) = torch.autograd.grad(out.float().square().sum(), x)
            times[arm]["forward+backward"].append((time.process_time() - start) / 10)
            outputs[arm] = (out.detach(), grad)
    Bnb8bitFormat.gather_range = views  # type: ignore[method-assign]
    same = all(torch.equal(a, b) for a, b in zip(outputs["before"], outputs["after"]))
    for what in ("forward", "forward+backward"):
        before, after = times["before"][what], times["after"][what]
        print(f"{what}: before {' / '.join(f'{t:.3f}' for t in before)} s, after {' / '.join(f'{t:.3f}' for t in after)} s, "
              f"ratio {sum(after) / sum(before):.2f}")
    print(f"same logits and input gradient: {same}")


if __name__ == "__main__":
    main()
