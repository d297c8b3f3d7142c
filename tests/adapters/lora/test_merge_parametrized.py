"""Layers whose weight a torch parametrization other than weight_norm computes (issue 53 item 3, session 24):
``spectral_norm`` (GAN discriminators), ``orthogonal``, and a user's own ``register_parametrization``. They are kept
in the compute dtype (the coverage table says why) and LoRA adapts them; these tests hold what happens next.

Was: ``LoRA.merge`` wrote one ``<layer>.weight`` key that the model as built does not have (its state is
``parametrizations.weight.original`` and the parametrizations' own tensors): a strict load failed, a non-strict one
silently kept the old weight (outputs 0.16-0.28 away from the trained model's). And a spectral_norm model did not
resume as the run it continued: the surgery's reads of ``layer.weight`` advanced its power iteration some sixty steps
(again after a resume had restored it), and a trainable-only checkpoint dropped its ``u``, ``v`` (renamed under peft's
``base_layer``).
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn.utils import parametrizations, parametrize
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.layers import stored_in
from lightning_hbm.precision import quantize_model


class Symmetric(nn.Module):
    """torch's own tutorial parametrization; no right_inverse."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.triu() + x.triu(1).transpose(-1, -2)


class Scale(nn.Module):
    """A fixed scaling with its right_inverse: the merged weight can be written as its input."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("s", torch.tensor(0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.s

    def right_inverse(self, w: torch.Tensor) -> torch.Tensor:
        return w / self.s


def _symmetric(layer: nn.Module) -> nn.Module:
    return parametrize.register_parametrization(layer, "weight", Symmetric())


def _scaled(layer: nn.Module) -> nn.Module:
    return parametrize.register_parametrization(layer, "weight", Scale())


PARAMETRIZED: dict[str, Callable[[nn.Module], nn.Module]] = {
    "spectral_norm": parametrizations.spectral_norm,
    "orthogonal": parametrizations.orthogonal,
    "symmetric": _symmetric,
    "scale": _scaled,
}


class Net(nn.Module):
    def __init__(self, parametrized: Callable[[nn.Module], nn.Module], conv: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = conv
        self.p = parametrized(nn.Conv2d(8, 8, 3, padding=1) if conv else nn.Linear(32, 32))
        self.lin = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.p(x.reshape(-1, 8, 2, 2)).reshape(-1, 32) if self.conv else self.p(x)
        return x + self.lin(torch.tanh(y))


def _adapted(parametrized: Callable[[nn.Module], nn.Module], conv: bool = False) -> nn.Module:
    model = Net(parametrized, conv)
    quantize_model(model, "nf4-dq", dtype="float32")
    assert stored_in(model.lin) is not None or type(model.lin).__name__ == "Linear4bit"
    assert parametrize.is_parametrized(model.p)  # kept in the compute dtype: not folded
    LoRA(r=4, target_modules=["p", "lin"], modules_to_save=[]).transform_model(model)
    with torch.no_grad():
        model.p.lora_B["default"].weight.normal_(std=0.1, generator=torch.Generator().manual_seed(3))
    return model.eval()


X = torch.randn(4, 32, generator=torch.Generator().manual_seed(5))


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_a_merge_a_parametrization_computes_back_loads_into_the_model_as_built_with_the_adapted_outputs(conv: bool) -> None:
    model = _adapted(_scaled, conv)
    with torch.no_grad():
        want = model(X)
    with pytest.warns(UserWarning, match="DEQUANTIZED"):  # lin is quantized
        merged = LoRA.merge(model, dtype="float32")
    assert "p.weight" not in merged and {"p.parametrizations.weight.original", "p.parametrizations.weight.0.s"} <= set(merged)
    plain = Net(_scaled, conv).eval()
    plain.load_state_dict(merged)  # strict
    with torch.no_grad():
        torch.testing.assert_close(plain(X), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
@pytest.mark.parametrize("kind", ["spectral_norm", "orthogonal", "symmetric"])
def test_a_merge_a_parametrization_cannot_compute_is_refused_naming_the_layer_and_the_fixes(kind: str, conv: bool) -> None:
    if kind in ("orthogonal", "symmetric") and conv:
        pytest.skip("orthogonal and symmetric parametrizations take square matrices, a convolution's weight is 4-D")
    model = _adapted(PARAMETRIZED[kind], conv)
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    with pytest.raises(ValueError, match=r"the weight of p is computed by the parametrization.*Nothing was merged.*save_adapter.*exclude_modules=\['p'\].*remove_parametrizations"):
        LoRA.merge(model, dtype="float32")
    for name, buffer in model.named_buffers():  # the model is left as it was (spectral_norm's u, v included)
        assert torch.equal(buffer, buffers[name]), name


def test_an_unadapted_parametrized_layer_merges_as_its_own_state() -> None:
    model = Net(parametrizations.spectral_norm)
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4, target_modules=["lin"], modules_to_save=[]).transform_model(model)
    model.eval()
    with torch.no_grad():
        want = model(X)
    with pytest.warns(UserWarning, match="DEQUANTIZED"):
        merged = LoRA.merge(model, dtype="float32")
    plain = Net(parametrizations.spectral_norm).eval()
    plain.load_state_dict(merged)
    with torch.no_grad():
        torch.testing.assert_close(plain(X), want, rtol=1e-5, atol=1e-5)


class Discriminator(pl.LightningModule):
    """Spectral-norm blocks (SNGAN / BigGAN discriminators), checkpointed."""

    def __init__(self, conv: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Net(parametrizations.spectral_norm, conv), Net(parametrizations.spectral_norm, conv)])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        for block in self.blocks:
            batch = block(batch)
        return batch.pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _fit(tmp_path: Any, epochs: int, ckpt_path: Any = None, save: bool = False, checkpointing: bool = True, conv: bool = False, policy: str = "full") -> Discriminator:
    module = Discriminator(conv)
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4, target_modules=["p", "lin"], modules_to_save=[]), *([ActivationCheckpointing(policy=policy)] if checkpointing else [])],
    )  # fmt: skip
    generator = torch.Generator().manual_seed(1)
    trainer.fit(module, DataLoader([torch.randn(4, 32, generator=generator) for _ in range(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return module


@pytest.mark.slow
@pytest.mark.parametrize("conv", [False, True], ids=["linear", "conv"])
def test_a_spectral_norm_model_resumes_bit_exact_with_its_power_iteration(tmp_path: Any, conv: bool) -> None:
    """conv: was also moved at fit start by the layer-kind check of the weight's dtype (``floating_weight``)."""
    straight = _fit(tmp_path, 2, conv=conv)
    _fit(tmp_path, 1, save=True, conv=conv)
    resumed = _fit(tmp_path, 2, ckpt_path=tmp_path / "half.ckpt", conv=conv)
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    buffers = dict(resumed.named_buffers())
    assert any(name.endswith("._u") for name in buffers)
    for name, buffer in straight.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_a_spectral_norm_model_trains_the_same_with_activation_checkpointing(tmp_path: Any, policy: str) -> None:
    """The recompute runs from the power iteration's state the forward started from (``activations.replay``; under
    the selective policy its copies are made outside the policy's dispatch mode)."""
    plain, checkpointed = _fit(tmp_path, 2, checkpointing=False), _fit(tmp_path, 2, policy=policy)
    want, got = LoRA.adapter_state_dict(plain), LoRA.adapter_state_dict(checkpointed)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    buffers = dict(checkpointed.named_buffers())
    for name, buffer in plain.named_buffers():
        torch.testing.assert_close(buffers[name], buffer, rtol=0, atol=0, msg=name)
