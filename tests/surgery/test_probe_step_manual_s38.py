"""Session 38, h2 (issue 55, item 3): a manual-optimization step with several optimizers (a GAN: ``opt_g, opt_d =
self.optimizers()``, Lightning's documented pattern). The probe step's stand-in gave one optimizer: "cannot unpack
non-iterable _NoStep object" at each of its three attempts (the user's step run three times), said as "could not run one
step", the layers it reads left to its source. Now it gets as many stand-ins as it unpacks (a loop: as many as
``configure_optimizers`` returns, read from its source, never called), the probe step runs once, and the fit trains as
without lightning_hbm."""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers


class _GAN(pl.LightningModule):
    """A GAN as Lightning's manual-optimization docs write it: two optimizers, each stepped once a batch."""

    def __init__(self, loop: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.generator = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
        self.discriminator = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
        self.automatic_optimization = False
        self.loop, self.calls, self.configured = loop, 0, 0

    def _loss(self, real: torch.Tensor, which: int) -> torch.Tensor:
        """The generator's loss (``which`` 0) or the discriminator's (1), on a fresh fake batch."""
        fake = self.generator(torch.randn(real.shape[0], 8, device=real.device))
        ones, zeros = torch.ones(real.shape[0], 1, device=real.device), torch.zeros(real.shape[0], 1, device=real.device)
        bce = torch.nn.functional.binary_cross_entropy_with_logits
        if which == 0:
            return bce(self.discriminator(fake), ones)
        return bce(self.discriminator(real), ones) + bce(self.discriminator(fake.detach()), zeros)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.calls += 1
        if self.loop:  # every optimizer in turn, as many as configure_optimizers returns
            for i, opt in enumerate(self.optimizers()):  # type: ignore[arg-type]
                loss = self._loss(batch, i)
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
            return
        opt_g, opt_d = self.optimizers()  # type: ignore[misc]
        for which, opt in ((1, opt_d), (0, opt_g)):
            loss = self._loss(batch, which)
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        sched_g, sched_d = self.lr_schedulers()  # type: ignore[misc]
        sched_g.step()
        sched_d.step()

    def configure_optimizers(self) -> Any:
        self.configured += 1  # the user's code: run once, by Lightning, never by the probe step
        opt_g = torch.optim.Adam([p for p in self.generator.parameters() if p.requires_grad], lr=1e-3)
        opt_d = torch.optim.Adam([p for p in self.discriminator.parameters() if p.requires_grad], lr=1e-3)
        return [opt_g, opt_d], [torch.optim.lr_scheduler.StepLR(opt_g, 1), torch.optim.lr_scheduler.StepLR(opt_d, 1)]


def _fit(module: _GAN, tmp_path: Any, hbm: bool) -> list[str]:
    extra: dict[str, Any] = {"plugins": [QuantizedPrecision("nf4")], "callbacks": [LoRA(r=4)]} if hbm else {}
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, **extra,
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader(torch.randn(12, 16), batch_size=4))
    assert trainer.global_step == 6  # two optimizer steps a batch, three batches
    return [str(w.message) for w in caught if "could not run one step" in str(w.message)]


@pytest.mark.parametrize("loop", [False, True], ids=["unpacked", "loop"])
def test_a_gan_with_two_optimizers_is_probed_once_and_trains(loop: bool, tmp_path: Any) -> None:
    plain = _GAN(loop)
    assert not _fit(plain, tmp_path, hbm=False)
    module = _GAN(loop)
    failed = _fit(module, tmp_path, hbm=True)
    assert not failed, failed
    assert module.calls == plain.calls + 1  # the three steps, and the probe step once (said at fit start)
    assert module.configured == plain.configured == 1
    seen = readers.observation(module)
    assert seen is not None and seen.ran.startswith("_GAN.training_step")
    assert any("lora_" in name for name, _ in module.generator.named_parameters())
    assert any("lora_" in name for name, _ in module.discriminator.named_parameters())
