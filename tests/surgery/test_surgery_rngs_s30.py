"""The surgery leaves the user's random draws as they were (issue 55, residue of item 3).

peft's LoRA init draws from torch's global RNG while the model is changed, which happens in the strategy's setup,
before the fit loop's first ``iter(loader)``: a shuffled DataLoader without a generator of its own draws its order
from that RNG there. So ``seed_everything(0)`` trained on other batches with ``LoRA(...)`` than without. Now every
draw the surgery makes (adapter init, the probe step, calibration) leaves Python's, NumPy's and torch's global RNGs
as they were, while the adapters stay the same for the same seed.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizationQuality, QuantizedPrecision, run_surgery
from lightning_hbm._compat import torch as torch_compat

WIDTH, ITEMS = 32, 12


class Indexed(Dataset):
    """Item ``i`` is ``(i, features)``: the loop's batches say which items they hold."""

    def __len__(self) -> int:
        return ITEMS

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor]:
        return i, torch.randn(WIDTH, generator=torch.Generator().manual_seed(i))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 2 * WIDTH), nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(x)))


class Model(pl.LightningModule):
    """Records the items each training step sees, and one draw of each global RNG there."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, 1)
        self.seen: list[list[int]] = []
        self.draws: list[tuple[float, float, float]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x) + 0 * torch.rand((), device=x.device)  # a forward that draws (noise, sampling)

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.looping = True  # the fit loop's steps, not the probe step (which never calls this hook)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        index, x = batch
        if getattr(self, "looping", False):
            self.seen.append(index.tolist())
            self.draws.append((random.random(), float(np.random.rand()), float(torch.rand(()))))
        return self(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


def _fit(tmp_path: Path, ours: bool) -> Model:
    pl.seed_everything(0, verbose=False)
    module = Model()
    extra: dict[str, Any] = (
        dict(plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[
            LoRA(r=4, alpha=8), ActivationCheckpointing(), QuantizationQuality(probe_batch=torch.randn(3, WIDTH, generator=torch.Generator()))
        ]) if ours else {}
    )  # fmt: skip
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path, **extra,
    )  # fmt: skip
    trainer.fit(module, DataLoader(Indexed(), batch_size=3, shuffle=True))
    return module


@pytest.mark.slow
def test_lora_quantization_and_checkpointing_leave_the_batch_order_and_draws_as_they_were(tmp_path: Path) -> None:
    """Was: with nf4-dq + LoRA + checkpointing, epoch 0 saw another order of the same items than the plain run
    (peft's init had drawn from torch's RNG before the loader drew its order), and other draws in training_step; and
    QuantizationQuality's measure at fit start ran a forward that draws."""
    plain = _fit(tmp_path / "plain", ours=False)
    ours = _fit(tmp_path / "ours", ours=True)
    assert sorted(i for batch in plain.seen for i in batch) == list(range(ITEMS))
    assert ours.seen == plain.seen
    assert ours.draws == plain.draws


def _adapters(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters() if "lora_" in name}


def _surgery(seed: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    module = Model()
    before = torch_compat.rng_states()
    x = torch.randn(3, WIDTH, generator=torch.Generator().manual_seed(1))
    run_surgery(module, QuantizedPrecision("nf4-dq", dtype="float32"), [LoRA(r=4, alpha=8)], batch=(torch.arange(3), x))
    return _adapters(module), before, torch_compat.rng_states()


def _same_states(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        a["python"] == b["python"]
        and all(np.array_equal(x, y) for x, y in zip(a["numpy"], b["numpy"]))
        and torch.equal(a["cpu"], b["cpu"])
    )


def test_the_same_seed_gives_bit_identical_adapters_and_leaves_the_rngs_as_they_were() -> None:
    first, before, after = _surgery(0)
    second, _, _ = _surgery(0)
    other, _, _ = _surgery(1)
    assert first and first.keys() == second.keys()
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert any(not torch.equal(first[name], other[name]) for name in first if "lora_A" in name)  # drawn from the seed
    assert _same_states(before, after)


_CUDA_DRAWS = """
import sys, torch
from lightning_hbm._compat import torch as torch_compat
torch.manual_seed(0)
if sys.argv[1] == "inside":
    with torch_compat.preserved_rngs():  # CUDA begins inside the block, with a draw there (an adapter init on the GPU)
        torch.rand(8, device="cuda")
print(torch.rand(4, device="cuda").tolist())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's generators: needs a GPU")
def test_cuda_begun_inside_the_surgery_draws_as_if_it_began_after() -> None:
    """A draw that began CUDA inside the block leaves its generators at the seed and offset a run without the block
    finds when it begins CUDA itself (fresh processes: CUDA begins once per process)."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    outputs = [
        subprocess.run([sys.executable, "-c", _CUDA_DRAWS, how], env=env, capture_output=True, text=True, check=True).stdout
        for how in ("plain", "inside")
    ]
    assert outputs[0] == outputs[1]
