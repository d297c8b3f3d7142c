"""bitsandbytes Linears taking every input an ``nn.Linear`` takes (``_compat/bitsandbytes.py`` ``_flatten_input`` /
``_shape_output``), attacked from outside (session 25): 1-D inputs, empty batches, strided and channels-last inputs,
eval and training, gradients, hooks of others, copies of hooked layers.

Was: a 1-D input (a head applied to one pooled vector) stopped a healthy model under every quantized mode (4-bit:
"MatMul4BitBackward returned an invalid gradient" in backward; int8 eval: "Dimension out of range"); a pre-hook
registered after ours that hands the forward another tensor (as the accuracy check's device hooks do for layers
quantized on a GPU) left an int8 layer's 4-D output flattened to 2-D; a deep copy of a hooked int8 layer was hooked
twice by the next fit.
"""

from __future__ import annotations

import copy
import warnings

import bitsandbytes as bnb
import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import QuantizedPrecision
from lightning_hbm._compat import bitsandbytes as compat
from lightning_hbm.precision import quantize_model


def _quantized(mode: str) -> tuple[nn.Module, nn.Module]:
    """A plain Linear and its copy quantized by lightning_hbm in ``mode``."""
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(16, 24))
    model = copy.deepcopy(plain)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quantize_model(model, mode, dtype="float32")
    return plain, model


def test_bitsandbytes_own_layers_fail_on_a_1d_input() -> None:
    """When this fails, bitsandbytes takes 1-D inputs and the 1-D case of ``_flatten_input`` can go."""
    layer = bnb.nn.Linear4bit(16, 24, quant_type="nf4", compute_dtype=torch.float32).to("cpu")
    layer.support_avx512bf16_for_cpu = False
    x = torch.randn(16, requires_grad=True)
    with pytest.raises(RuntimeError, match="invalid gradient"):
        layer(x).sum().backward()


@pytest.mark.parametrize("mode", ["int8", "nf4-dq", "nf4"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(
    "shape", [(16,), (0, 16), (0, 3, 5, 16), (2, 3, 5, 16), (2, 16, 5, 3), (2, 16, 4, 4)], ids=["1d", "empty", "empty-4d", "4d", "strided", "channels-last"]
)
def test_quantized_linears_take_every_input_a_linear_takes(mode: str, training: bool, shape: tuple[int, ...]) -> None:
    plain, model = _quantized(mode)
    model.train(training)
    x = torch.randn(*shape)
    if shape == (2, 16, 5, 3):
        x = x.permute(0, 2, 3, 1)  # channels last of a conv's output, not contiguous
    elif shape == (2, 16, 4, 4):
        x = x.to(memory_format=torch.channels_last).permute(0, 2, 3, 1)  # a channels-last tensor as NHWC: contiguous
    x.requires_grad_(True)
    out = model(x)
    assert out.shape == plain(x).shape
    rows = model(x.detach().reshape(-1, 16)).reshape(out.shape)  # the same rows as a 2-D input
    torch.testing.assert_close(out, rows, rtol=0, atol=0)
    if out.numel():
        want = plain(x)
        assert float((out - want).norm() / want.norm()) < 0.15  # nf4's rounding: about 0.09
        out.square().sum().backward()
        assert x.grad is not None and x.grad.shape == x.shape and bool(x.grad.isfinite().all())


def test_a_later_pre_hook_that_hands_on_another_tensor_keeps_the_output_shape() -> None:
    _, model = _quantized("int8")
    model[0].register_forward_pre_hook(lambda layer, args: (args[0].clone(), *args[1:]))  # e.g. a copy to another device
    for training in (False, True):
        assert model.train(training)(torch.randn(2, 3, 5, 16)).shape == (2, 3, 5, 24)


def test_a_copy_of_a_hooked_layer_is_hooked_once() -> None:
    _, model = _quantized("int8")
    twin = copy.deepcopy(model)  # an EMA copy, a reference model: fitted next
    assert compat.drop_kept_inputs(twin) == 1
    assert list(twin[0]._forward_pre_hooks.values()) == [compat._flatten_input]
    assert list(twin[0]._forward_hooks.values()) == [compat.drop_int8_kept_input, compat._shape_output]
    _, four = _quantized("nf4-dq")
    twin4 = copy.deepcopy(four)
    compat.disable_cpu_repacks(twin4)
    assert list(twin4[0]._forward_pre_hooks.values()).count(compat._flatten_input) == 1
    assert twin.eval()(torch.randn(2, 3, 5, 16)).shape == (2, 3, 5, 24) and twin4(torch.randn(16)).shape == (24,)


def test_a_forward_that_raised_leaves_nothing_for_the_next() -> None:
    _, model = _quantized("int8")
    model.eval()
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 3, 5, 8))  # the wrong width: raised inside the matmul, after the pre-hook
    assert model(torch.randn(30, 16)).shape == (30, 24)  # not shaped as the failed call's input


class PerSample(pl.LightningModule):
    """A head applied to one sample's vector at a time (1-D inputs); QuantizedPrecision alone trains the biases."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([self.head(torch.relu(self.body(v))) for v in x])

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


@pytest.mark.parametrize("mode", ["int8", "nf4-dq"])
def test_a_fit_with_1d_inputs_trains_and_evaluates(mode: str) -> None:
    """Was: the first step failed (bitsandbytes' bias gradient of a 1-D input), and int8's eval forward."""
    module = PerSample()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[QuantizedPrecision(mode, dtype="float32")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, DataLoader([torch.randn(3, 16) for _ in range(2)], batch_size=None))
    assert trainer.global_step == 2 and module.head.bias.grad is not None
    with torch.no_grad():
        assert module.eval()(torch.randn(3, 16)).shape == (3, 4)
