"""Would a 5- or 6-bit format for the sensitive convolutions meet issue 53's goal (held-out cosine >= 0.98 at <= 0.6
bytes per conv weight on the four conv nets of ``conv_accuracy.py``)?

Session 22's lead: int8 costs 1 B a weight, a blockwise 5/6-bit format 0.66 / 0.78 B, so the plan's widened layers
would cost less. Here the convolutions' plan (:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`, the knapsack the
library runs at fit start, probe batch of 4 images) is given ``int5-b64`` / ``int6-b64`` next to ``int8``, and the
held-out cosine (centred, every output, another batch of 4) and bytes per conv weight (constants included, counted on
the stored model) are measured per model and seed (seed 0: ``conv_gptq.py``'s batches), float32 compute.

``int5-b64`` / ``int6-b64`` are registered by this script only (not library modes): symmetric integers in blocks of 64
weights along each row, one fp16 scale (absmax / (2^(b-1) - 1)) per block, stored packed as a nibble plane (two codes
a byte) and a plane of the remaining 1 or 2 bits (8 or 4 codes a byte): 0.656 / 0.781 B a weight. Written by hand
because no installed library stores them packed on CPU: torchao 0.18's ``IntxWeightOnlyConfig`` keeps one int8 per
weight (``IntxUnpackedToInt8Tensor``, 1 B: no saving over int8), bitsandbytes has only 4 and 8 bits.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_intn.py [--models ResNet18 ...] [--seeds 0 1]
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import quantize_model
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.registry import QuantFormat, register_format
from lightning_hbm.precision.sensitivity import choose_layer_modes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_accuracy import MODELS, calibrated_nets, cosine, flat  # noqa: E402

BLOCK = 64


class BlockInt(nn.Module):
    """A frozen Linear weight in symmetric ``bits``-bit integers, blocks of 64 along each row, fp16 scales, packed."""

    def __init__(self, linear: nn.Linear, bits: int) -> None:
        super().__init__()
        self.bits, self.in_features, self.out_features = bits, linear.in_features, linear.out_features
        rows = linear.weight.detach().float()
        rows = F.pad(rows, (0, -self.in_features % BLOCK))  # a short last block padded with zeros
        blocks = rows.reshape(self.out_features, -1, BLOCK)
        top = 2 ** (bits - 1) - 1
        scale = (blocks.abs().amax(-1) / top).to(torch.float16)
        step = torch.where(scale.float() > 0, scale.float(), torch.ones_like(scale.float()))
        codes = (torch.round(blocks / step[..., None]).clamp_(-top, top) + top).to(torch.uint8).flatten()
        low = codes & 15
        high, per = codes >> 4, 8 // (bits - 4)
        # the scales as int16 bits: a floating parameter would be cast to the compute dtype (fp32: twice the bytes)
        frozen = {"low": (low[0::2] << 4) | low[1::2], "scale": scale.view(torch.int16)}
        packed = torch.zeros(codes.numel() // per, dtype=torch.uint8)
        for i in range(per):
            packed |= high[i::per] << ((bits - 4) * i)
        frozen["high"] = packed
        for name, tensor in frozen.items():
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        self.bias = linear.bias

    def dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        per, width = 8 // (self.bits - 4), self.bits - 4
        low = torch.stack((self.low >> 4, self.low & 15), dim=1).flatten()
        high = torch.stack([(self.high >> (width * i)) & (2**width - 1) for i in range(per)], dim=1).flatten()
        codes = (low.float() + 16 * high.float() - (2 ** (self.bits - 1) - 1)).reshape(self.out_features, -1, BLOCK)
        return (codes * self.scale.view(torch.float16).float()[..., None]).reshape(self.out_features, -1)[:, : self.in_features].to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), self.bias)


class BlockIntFormat(QuantFormat):
    def owns(self, module: nn.Module) -> bool:
        return isinstance(module, BlockInt)

    def dequantize(self, module: nn.Module, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        return module.dequantize(dtype or torch.float32)  # type: ignore[operator]

    def weight_shape(self, module: nn.Module) -> torch.Size:
        return torch.Size((module.out_features, module.in_features))  # type: ignore[arg-type]


for _bits in (5, 6):
    register_format(BlockIntFormat(
        f"int{_bits}-b64", lambda linear, dtype, device, b=_bits: BlockInt(linear, b), (torch.float32, torch.bfloat16),
        f"symmetric int{_bits}, blocks of 64, fp16 scale (benchmark only)",
    ))  # fmt: skip


def held_out(reference: nn.Module, modes: dict[str, str], x: torch.Tensor) -> tuple[float, float]:
    """(held-out cosine, stored bytes per conv weight: the convolutions' parameters and constants over their weights)."""
    model = copy.deepcopy(reference)
    quantize_model(model, "nf4-dq", dtype="float32", layer_modes=modes)
    weights = sum(reference.get_submodule(name).weight.numel() for name in modes)
    stored = sum(parameter_bytes(model.get_submodule(name)) for name in modes)
    with torch.no_grad():
        return cosine(flat(model(x)), flat(reference(x))), stored / weights


ARMS: list[tuple[str, Any, dict[str, float]]] = [
    ("nf4-dq-b32/int8, target 0.98 (default ladder)", "auto", {"min_cosine": 0.98}),
    ("int5/int6/int8, target 0.98", ["int5-b64", "int6-b64", "int8"], {"min_cosine": 0.98}),
    ("int5/int6/int8, target 0.985", ["int5-b64", "int6-b64", "int8"], {"min_cosine": 0.985}),
    ("int5/int6/int8, budget 0.6 B", ["int5-b64", "int6-b64", "int8"], {"max_bytes_per_param": 0.6}),
    ("nf4-dq-b32/int5/int6/int8, budget 0.6 B", ["nf4-dq-b32", "int5-b64", "int6-b64", "int8"], {"max_bytes_per_param": 0.6}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    args = parser.parse_args()
    torch.set_num_threads(1)
    print("| model | seed | ladder, target | probe cosine | held-out cosine | B/conv weight | plan (s) |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, seed, reference, probe, held in calibrated_nets(args.models, args.seeds, 4):
        convs = [n for n, m in reference.named_modules() if isinstance(m, nn.Conv2d)]
        for label, ladder, target in ARMS:
            start = time.perf_counter()
            report = choose_layer_modes(reference, convs, "nf4-dq", ladder, "float32", probe, strict=False, **target)  # type: ignore[arg-type]
            seconds = time.perf_counter() - start
            h, b = held_out(reference, report.modes, held)
            print(f"| {name} | {seed} | {label} | {report.cosine:.4f} | {h:.4f} | {b:.3f} | {seconds:.1f} |", flush=True)


if __name__ == "__main__":
    main()
