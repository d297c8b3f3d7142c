"""Coverage round three (issue 53, session 38): vision, detection and diffusion classes nobody here tried, under the
library's default (``QuantizedPrecision()``, ``LoRA()``, ``ActivationCheckpointing()``); the figures of all of them are
``benchmarks/coverage_vision_s38.py``'s (benchmarks/README.md, "Coverage round three"). Each test here failed on main
before its fix."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision


class _Block(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.fc, self.norm = nn.Linear(cin, cout), nn.LayerNorm(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(F.gelu(self.fc(x)))
        return x + y if x.shape == y.shape else y


class _Stages(pl.LightningModule):
    """Two stages of repeated blocks, as timm's RepVGG, RegNet or a ResNet-50 build them: 5 blocks of width 32, then
    10 of width 64 (the first projecting), each stage an ``nn.Sequential`` of one class."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(16, 32)
        self.stage1 = nn.Sequential(*(_Block(32, 32) for _ in range(5)))
        self.stage2 = nn.Sequential(_Block(32, 64), *(_Block(64, 64) for _ in range(9)))
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.stage2(self.stage1(self.stem(x))))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self(batch[0]).float(), batch[1])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def test_each_cut_trace_cuts_the_same_list_only() -> None:
    """The traces the line is drawn through (stage2 cut to 3 and to 4 blocks) differ by one stage-2 block: the
    trainable parameters grow by the same amount per block from the cut to 3 to the whole model. Before, stage1 was
    cut too in the trace of 3 (5 > 3 blocks) and not in that of 4, so the line grew by a stage-1 block as well; here
    the traces' peaks told and the planner traced the whole model; timm RepVGG-A0's did not: +14.8 % over MemTracker
    (``benchmarks/coverage_vision_s38.py``), -0.002 % now."""
    from lightning_hbm.planner import Candidate
    from lightning_hbm.planner.building import build_template
    from lightning_hbm.planner.tracing import trace

    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g))
    candidate = Candidate.from_trainer(QuantizedPrecision(), [LoRA(), ActivationCheckpointing()], None)
    template = build_template(_Stages)
    trainable = {keep: trace(template, batch, candidate, "cpu", keep).trainable for keep in (3, 4, None)}
    assert trainable[None] - trainable[3] == 7 * (trainable[4] - trainable[3]), trainable
