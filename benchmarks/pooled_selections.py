"""The fit-start accuracy check on a SegNet-style net: max pooling's indices followed (session 29).

A SegNet keeps the position of each maximum when it pools (``return_indices=True``) and its decoder puts the values
back there (``max_unpool2d``). Quantized convolutions move near-ties in a few pooling windows: the value lands on
another pixel and the output, compared pixel by pixel, read that as the quantization's loss. The same net with
upsampling instead of unpooling (``--interp``: no selection) is the control. Model: ``tests/precision/
test_quant_attack_s29.py``'s ``SegNet`` (4 conv-BN-ReLU, 2 pools; BatchNorm calibrated on 4 batches), probe 4 x 3 x 32 x 32.
Per arm (``int8`` in bf16 and fp32, ``nf4-dq`` in fp32 with the conv plan): the figure, the selections followed
(differed / recorded), whether it warned.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/pooled_selections.py
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import QuantizedPrecision


class SegNet(nn.Module):
    def __init__(self, unpool: bool) -> None:
        super().__init__()

        def conv(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())

        self.unpool = unpool
        self.e1, self.e2, self.d2, self.d1, self.out = conv(3, 16), conv(16, 32), conv(32, 16), conv(16, 16), nn.Conv2d(16, 5, 1)

    def up(self, x: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
        return F.max_unpool2d(x, where, 2) if self.unpool else F.interpolate(x, scale_factor=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, first = F.max_pool2d(self.e1(x), 2, return_indices=True)
        x, second = F.max_pool2d(self.e2(x), 2, return_indices=True)
        return self.out(self.d1(self.up(self.d2(self.up(x, second)), first)))


def calibrated(unpool: bool) -> SegNet:
    torch.manual_seed(0)
    model = SegNet(unpool)
    for norm in model.modules():
        if isinstance(norm, nn.BatchNorm2d):
            norm.momentum = None
    model.train()
    with torch.no_grad():
        for i in range(4):
            model(torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(100 + i)))
    return model.eval()


def main() -> None:
    batch = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    print("| net | mode | dtype | figure | followed / selections | warned |\n|---|---|---|---:|---:|---|")
    for unpool in (True, False):
        for mode, dtype in (("int8", "bfloat16"), ("int8", "float32"), ("nf4-dq", "float32")):
            plugin = QuantizedPrecision(mode, dtype=dtype, probe_batch=batch)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                plugin.convert_module(copy.deepcopy(calibrated(unpool)))
            m = plugin.quantization.conv_accuracy
            assert m is not None
            net = "unpool" if unpool else "upsample"
            print(f"| {net} | {mode} | {dtype} | {m.cosine:.4f} | {m.followed} / {m.selections} | {'yes' if m.warned else 'no'} |")


if __name__ == "__main__":
    main()
