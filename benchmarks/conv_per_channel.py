"""Per-output-channel 4-bit scales on a MobileNet (issue 53 item 2 stretch, session 34): measured, not in the library.

bitsandbytes' nf4 scales blocks of 64 weights of the flattened weight, which span several output channels of a small
convolution (a depthwise 3x3: 7 channels a block). Here every convolution of transformers' ``MobileNetV2Model``
(``image_size=64, depth_multiplier=0.35``, BatchNorm calibrated as ``conv_mobilenet_v2.py``; seeds, probe and held-out
batches as there) is fake-quantized in float32 (quantized, dequantized back into the weight) with: nf4 in blocks of
64 (bitsandbytes' layout); nf4 with one absmax scale per output channel (fp16 scale: 0.5 B + 2 B / row); int8 with one
scale per output channel (1 B + 2 B / row; bitsandbytes' int8 is per row too). Folding BatchNorm's scale (gamma /
sqrt(var + eps), one per output channel) into the weight before quantizing changes nothing under per-output-channel
scales (absmax quantization is invariant to a row's constant factor): not a separate arm. Held-out centred cosine of
``last_hidden_state``; bytes per conv weight from the formats' sizes (fp16 scales; nf4-dq's double quantization left
out).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/conv_per_channel.py
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "layers"))
from conv_models import calibrate, images  # noqa: E402

SIZE = 64
NF4 = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                    0.7229568362236023, 1.0])  # fmt: skip


def nf4(rows: torch.Tensor) -> torch.Tensor:
    scale = rows.abs().amax(1, keepdim=True).half().float().clamp_min(1e-12)
    codes = (rows / scale).unsqueeze(-1).sub(NF4).abs().argmin(-1)
    return NF4[codes] * scale


def int8(rows: torch.Tensor) -> torch.Tensor:
    scale = (rows.abs().amax(1, keepdim=True) / 127).half().float().clamp_min(1e-12)
    return (rows / scale).round().clamp(-127, 127) * scale


def quantized(weight: torch.Tensor, arm: str) -> tuple[torch.Tensor, float]:
    """The weight fake-quantized by ``arm``, and its bytes."""
    n, out = weight.numel(), weight.shape[0]
    if arm == "nf4, blocks of 64":
        flat = F.pad(weight.flatten(), (0, -n % 64)).reshape(-1, 64)
        return nf4(flat).flatten()[:n].reshape(weight.shape), n / 2 + 2 * (-(-n // 64))
    rows = weight.reshape(out, -1)
    if arm == "nf4, per output channel":
        return nf4(rows).reshape(weight.shape), n / 2 + 2 * out
    return int8(rows).reshape(weight.shape), n + 2 * out


def main() -> None:
    import transformers

    print("| seed | arm | held-out cosine | bytes per conv weight |")
    print("|---:|---|---:|---:|")
    for seed in (0, 1):
        torch.manual_seed(seed)
        built = transformers.MobileNetV2Model(transformers.MobileNetV2Config(image_size=SIZE, depth_multiplier=0.35))
        reference = calibrate(built, images(8, seed=10 + seed, batches=4, size=SIZE))
        held = images(4, seed=1 + 10 * seed, size=SIZE)
        with torch.no_grad():
            want = reference(pixel_values=held).last_hidden_state
        mean = want.mean()
        for arm in ("nf4, blocks of 64", "nf4, per output channel", "int8, per output channel"):
            model, total, count = copy.deepcopy(reference), 0.0, 0
            with torch.no_grad():
                for layer in model.modules():
                    if isinstance(layer, nn.Conv2d):
                        layer.weight.copy_(quantized(layer.weight, arm)[0])
                        total, count = total + quantized(layer.weight, arm)[1], count + layer.weight.numel()
                got = model(pixel_values=held).last_hidden_state
            cosine = F.cosine_similarity((got - mean).flatten(), (want - mean).flatten(), dim=0).item()
            print(f"| {seed} | {arm} | {cosine:.4f} | {total / count:.3f} |", flush=True)


if __name__ == "__main__":
    main()
