"""The FSDP2 per-rank plan of transformers' ConvNext: stages that hold blocks and parameters of their own (session 35,
issue 51): a stated gap, not yet fixed.

``QuantizedFSDPStrategy`` makes units of both the stages (``encoder.stages``, a list) and the layers inside each (a
list in each stage), and of the two members of a stage's ``downsampling_layer`` (an ``nn.Sequential`` of a LayerNorm
and a Conv2d); the planner plans the stages as its blocks (depth 2) and the rest as the remainder: it does not model
the layer units inside a stage nor the stages' own parameters. Measured on 2 gloo ranks (Dec 6 2026, 2-core CPU dev
machine): 1,496,784 B per rank, planned 1,472,848 (-1.6 %). The 2-rank test is a strict xfail: it passes, and so fails,
once the plan follows these units (then drop the mark and the README's gap).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_fsdp_qlora import run_script_on_two_ranks  # noqa: E402
from test_fsdp_remainder_units_s34 import plan_matches  # noqa: E402

IMAGE, CLASSES, BATCH = 32, 10, 4


def _convnext() -> Any:
    import lightning.pytorch as pl
    from transformers import ConvNextConfig, ConvNextForImageClassification

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            config = ConvNextConfig(hidden_sizes=[32, 64], depths=[2, 2], num_stages=2, image_size=IMAGE,
                                    num_labels=CLASSES)
            self.model = ConvNextForImageClassification(config)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            pixels, labels = batch
            return self.model(pixel_values=pixels, labels=labels).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    return Task()


def _samples(n: int) -> list[tuple[torch.Tensor, int]]:
    generator = torch.Generator().manual_seed(0)
    return [(torch.randn(3, IMAGE, IMAGE, generator=generator), int(torch.randint(0, CLASSES, (1,), generator=generator)))
            for _ in range(n)]


def worker(out: Path) -> None:
    import lightning.pytorch as pl
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.data import DataLoader

    from lightning_hbm import HBMProfiler, QuantizedPrecision
    from lightning_hbm.adapters.lora import LoRA

    torch.set_num_threads(1)
    profiler = HBMProfiler(every_n_steps=1, dirpath=str(out / "convnext"), summary=False)
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="fsdp_qlora", max_steps=3, logger=False,
        plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=[LoRA(r=4, alpha=8, dropout=0.0), profiler],
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
        num_sanity_val_steps=0, use_distributed_sampler=False, default_root_dir=str(out),
    )  # fmt: skip
    model = _convnext()
    trainer.fit(model, DataLoader(_samples(4 * BATCH), batch_size=BATCH))  # the same batches on each rank
    units = sorted(n for n, m in model.named_modules() if isinstance(m, FSDPModule))
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(units))


@pytest.mark.slow
@pytest.mark.xfail(strict=True, raises=AssertionError, reason="the plan does not model ConvNext's layer units inside its stages nor the "
                   "stages' own parameters: -1.6 % per rank (benchmarks/README.md, FSDP per-rank)")
def test_per_rank_plan_of_convnext_stages(tmp_path: Path) -> None:
    from torch.utils.data import default_collate

    from lightning_hbm.planner import Candidate, predict

    out = run_script_on_two_ranks(__file__, tmp_path, timeout=300)
    units = json.loads((out / "rank0.json").read_text())
    assert "model.convnext.encoder.stages.1" in units and "model.convnext.encoder.stages.1.layers.0" in units
    rows = json.loads((out / "convnext" / "hbm_profile.json").read_text())["rows"]
    measured = max(row["tracked_peak"] for row in rows if row["mode"] == "detailed")
    prediction = predict(_convnext, default_collate(_samples(BATCH)), Candidate("nf4", "float32", lora_r=4))
    print("convnext measured", measured, "planned", sum(prediction.per_rank(2).values()))
    assert plan_matches(prediction, measured, within=8)


if __name__ == "__main__":
    if sys.argv[1] == "fsdp":
        worker(Path(sys.argv[2]))
