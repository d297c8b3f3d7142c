"""A quantized convolution's saved activations and step time, with the dequantized weight saved for backward (before)
and dequantized again in the backward (now, ``lightning_hbm.layers.frozen_weight.FrozenWeight``).

ResNet18 (``tests/layers/conv_models.py``, torchvision's layers and sizes, random weights), nf4-dq, fp32 compute,
LoRA r=8 on its (non-grouped) convolutions, batch 8 x 3 x 64 x 64, one training step = forward, cross-entropy,
backward, SGD step. "before" runs the quantized convolutions' old forward (``F.conv2d`` on the detached dequantized
weight) in the same process; the arms alternate and each round times ``--steps`` steps.

    OMP_NUM_THREADS=1 python benchmarks/conv_saved.py [--rounds 7] [--steps 3]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "layers")]  # this checkout's lightning_hbm, then the test models
from conv_models import ResNet18  # noqa: E402

from lightning_hbm import LoRA  # noqa: E402
from lightning_hbm.layers.conv import _Quantized  # noqa: E402
from lightning_hbm.memory import saved_activation_bytes  # noqa: E402
from lightning_hbm.precision import quantize_model  # noqa: E402


def _old_forward(self: Any, x: torch.Tensor) -> torch.Tensor:
    # the forward before FrozenWeight (FrozenConvolution then): autograd saves the dequantized weight (and the input) for backward
    weight = self.dequantized(self.storage()).detach()
    return self._conv_forward(x.to(self.compute_dtype), weight, self.bias)


@contextlib.contextmanager
def arm(name: str) -> Iterator[None]:
    if name == "now":
        yield
        return
    new = _Quantized.forward
    _Quantized.forward = _old_forward  # type: ignore[method-assign]
    try:
        yield
    finally:
        _Quantized.forward = new  # type: ignore[method-assign]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = ResNet18(classes=10)
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=8, target_modules="all-linear").transform_model(model)
    model.train()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    x, y = torch.randn(8, 3, 64, 64), torch.randint(0, 10, (8,))

    def step() -> None:
        optimizer.zero_grad()
        F.cross_entropy(model(x), y).backward()
        optimizer.step()

    times: dict[str, list[float]] = {"before": [], "now": []}
    for name in times:
        with arm(name):
            saved = saved_activation_bytes(lambda: F.cross_entropy(model(x), y), model)
            print(f"{name}: saved bytes of one training forward {saved:,}")
            step()  # warm-up
    for _ in range(args.rounds):
        for name in times:
            with arm(name):
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - start) / args.steps)
    for name, values in times.items():
        print(f"{name}: step median {statistics.median(values) * 1000:.1f} ms (rounds: {', '.join(f'{v * 1000:.0f}' for v in values)})")


if __name__ == "__main__":
    main()
