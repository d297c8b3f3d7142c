"""transformers' Mimi (a neural audio codec) under bf16-true + LoRA stopped at its first step (issue 53, session 33).

Each codebook of Mimi's residual vector quantizer caches its table in a plain attribute on first use (``embed``, a
property: ``self._embed = self.embed_sum / self.cluster_usage...``). The probe step (the user's step run once before
the model is changed, :mod:`lightning_hbm.surgery.probe_step`) ran it on the model as built, in float32, and left the
cache behind: the cast to bf16 (Lightning's ``bf16-true``) does not reach a plain attribute, so the codebook's output
stayed float32 and the first adapted convolution after it stopped the fit ("expected scalar type Float but found
BFloat16"); in the planner, each of the 6 ``bf16-true + lora`` candidates failed the same way ("Input type (float)
and bias type (c10::BFloat16) should be the same"). Plain Lightning ``bf16-true`` with no lightning_hbm trains: the
cache is first filled after the cast. Now the probe's real runs put back every tensor attribute the step set, as its
fake runs did for fake ones (``readers._real_values``), and so does its run on the planner's fake copy.

The codebooks are filled as a trained codec's are (random centroids, not the zeros of a fresh one, which make every
code decode to zero and leave the decoder's adapters without gradient).
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins import HalfPrecision
from torch import nn

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.layers import readers
from tests import test_model_families_s29 as s29
from tests.test_model_families_s29 import Family

transformers = pytest.importorskip("transformers")

FIELDS = dict(hidden_size=32, num_filters=8, upsampling_ratios=[2, 2], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=8, intermediate_size=64, codebook_size=32, codebook_dim=16, vector_quantization_hidden_dimension=16,
              num_quantizers=2, upsample_groups=32, sliding_window=16, max_position_embeddings=64, sampling_rate=64)  # fmt: skip


def mimi() -> nn.Module:
    model = transformers.MimiModel(transformers.MimiConfig(**FIELDS))
    with torch.no_grad():  # a trained codec's codebooks: distinct centroids
        for name, buffer in model.named_buffers():
            if name.endswith("codebook.embed_sum"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(3)))
    return model


def audio(seed: int) -> torch.Tensor:
    return torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(seed))


def reconstruction(model: nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(input_values=batch).audio_values.float(), batch.float())


RECIPES = {
    "bf16_true_lora": lambda: (HalfPrecision("bf16-true"), [LoRA(r=8, alpha=16)]),  # failed at the first step
    # trained, but its resume was not bit-exact: the quantization's probe forwards (as built, float32) filled the cache
    "default": lambda: (QuantizedPrecision("nf4-dq"), [LoRA(r=8, alpha=16), ActivationCheckpointing()]),
}


@pytest.fixture
def family(monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest) -> None:
    monkeypatch.setitem(s29.FAMILIES, "mimi", Family(mimi, reconstruction, audio, falls=False))
    monkeypatch.setattr(s29, "recipe", lambda name: RECIPES[request.param]())


@pytest.mark.filterwarnings("ignore::UserWarning")  # the encoder's adapters never reach the loss (argmin), said by name
@pytest.mark.parametrize("family", list(RECIPES), indirect=True)
def test_mimi_trains_and_resumes_with_lora(tmp_path: Any, family: None) -> None:
    straight, recorder, _ = s29.fit("mimi", tmp_path / "straight")
    losses = recorder.losses
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    # the encoder is cut from the loss by the codebooks' argmin; the decoder and the quantizer's output trains
    decoder = {n for n in recorder.adapters if ".decoder." in n or "output_proj" in n}
    assert decoder and decoder <= recorder.trained, sorted(decoder - recorder.trained)
    resumed, again, _ = s29.fit("mimi", tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert again.losses == losses[2:]
    want, got = recorder.after_epoch[1], LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


class _Cache(nn.Module):
    """A module that caches a tensor in a plain attribute on its first forward, and needs a value (no fake run)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.table = nn.Buffer(torch.ones(4))
        self._cached: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._cached is None:
            self._cached = self.table * 2
        if float(x.sum()) > -1e9:  # a value read: the fake attempt fails, the probe runs on a real sample
            x = x * self._cached
        return self.proj(x)


def test_the_probe_leaves_no_tensor_cached_by_the_step() -> None:
    """Was: ``_cached`` a float32 tensor after the probe's real run (the model "as it was" but for that)."""
    model = _Cache()
    seen = readers.observe(model, torch.ones(2, 4), {"proj": model.proj}, "forward")
    assert seen is not None and seen.ran.endswith("on one real sample"), seen
    assert model._cached is None


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_mimi_plans_bf16_true_with_lora_as_measured_without_module_hooks() -> None:
    """Was: "Input type (float) and bias type (c10::BFloat16) should be the same" (the codebook's cache, fp32).

    The plan (976,398 B, session 33) against torch's MemTracker without its module hooks (``module_hooks=False``: with
    them it reads 1,519,574 B, the encoder's graph kept alive by the hooks, ``test_model_families_s33_mimi_plan.py``):
    976,398 B, the plan to the byte (2-core CPU dev machine, session 34, Dec 6 2026)."""
    from lightning_hbm.planner import Candidate
    from lightning_hbm.planner.api import predict
    from lightning_hbm.planner.reference import memtracker_peak

    class Task(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = mimi()

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return reconstruction(self.model, batch)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

    candidate = Candidate("bf16-true", lora_r=8)
    predicted = predict(Task, audio(1), candidate, extrapolate=False).peak
    measured = memtracker_peak(Task, audio(1), candidate, module_hooks=False)
    print(f"mimi bf16-true + lora: predicted {predicted:,} B, MemTracker without module hooks {measured:,} B")
    assert predicted == pytest.approx(measured, rel=0.03)
    assert abs(predicted - measured) <= 8  # equal to the byte (Dec 6 2026)
