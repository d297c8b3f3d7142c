"""``ActivationCheckpointing(regenerate=n)`` linked by data flow (session 28): a block's input is remade when it is
exactly the output of the checkpointed block called just before it, whatever the module order, and whether it is passed
positionally or as a keyword; the warning names what is kept (with bytes and the block called before it) and what is
remade. Each test failed on the code before (blocks linked in module order, keyword tensors never saved through the
hooks)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing
from tests.activations.test_regenerate import _assert_equal, _grads

diffusers = pytest.importorskip("diffusers")


def _checkpointed(model: nn.Module, regenerate: int, **kwargs: Any) -> ActivationCheckpointing:
    callback = ActivationCheckpointing("full", regenerate=regenerate, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback.check_model(model)
        callback.transform_model(model)
    return callback


def _unet(regenerate: int) -> tuple[nn.Module, ActivationCheckpointing]:
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=2,
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=4,
    )  # fmt: skip
    return model, _checkpointed(model, regenerate)


def _unet_loss(model: nn.Module) -> Tensor:
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return model(x, torch.tensor([3, 7])).sample.square().sum()


def test_a_unet_remakes_the_inputs_its_blocks_feed_each_other_in_call_order() -> None:
    # module order linked down_blocks.1.attentions.1 to attentions.0 (called resnet, attention, resnet, attention) and
    # up_blocks.0.resnets.0 to down_blocks.1.resnets.1: 1 input remade of 17, and a warning blaming "the model changes
    # the hidden states between blocks" for 5 blocks picked by module order
    expected = _grads(_unet(1)[0], _unet_loss)
    model, callback = _unet(2)
    _assert_equal(_grads(model, _unet_loss), expected)
    remade = callback.remade
    assert remade.inputs == 6 and list(remade.made) == [
        "down_blocks.0.resnets.1", "down_blocks.1.attentions.0", "down_blocks.1.attentions.1", "up_blocks.0.attentions.0",
        "up_blocks.0.attentions.1", "up_blocks.0.attentions.2"]  # fmt: skip
    # an up block's resnet is fed its input concatenated with a skip connection; the mid block's second resnet the
    # mid attention's output (not checkpointed: alone in its list)
    assert remade.unmatched["up_blocks.0.resnets.0"] == (4096, "mid_block.resnets.1")  # bytes of its input
    assert list(remade.unmatched) == [
        "down_blocks.1.resnets.0", "mid_block.resnets.1", "up_blocks.0.resnets.0", "up_blocks.0.resnets.1",
        "up_blocks.0.resnets.2", "up_blocks.1.resnets.0", "up_blocks.1.resnets.1", "up_blocks.1.resnets.2"]  # fmt: skip
    assert list(remade.kept) == ["down_blocks.0.resnets.0", "down_blocks.1.resnets.1", "mid_block.resnets.0"]
    with pytest.warns(UserWarning) as record:
        callback.warn_unremade()
    text = str(record[0].message)
    assert "could not remake the input of 8 block(s), which keep it as without regenerate (42.00 KiB in all)" in text
    assert "down_blocks.1.resnets.0 (1.00 KiB, the block called before it: down_blocks.0.resnets.1)" in text
    assert "Remade: 6 block(s), " in text and "down_blocks.1.attentions.0 (2.00 KiB)" in text
    assert "kept as one block in 2 of a chain: 3 block(s), 8.00 KiB: down_blocks.0.resnets.0 (4.00 KiB)" in text


@pytest.mark.slow  # 1 s: two conditional UNets
def test_a_conditional_unet_remakes_its_inputs_with_the_gradients_of_plain_checkpointing() -> None:
    def build(regenerate: int) -> tuple[nn.Module, ActivationCheckpointing]:
        torch.manual_seed(0)
        model = diffusers.UNet2DConditionModel(
            sample_size=8, in_channels=4, out_channels=4, block_out_channels=(8, 16), layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
            cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4,
        )  # fmt: skip
        return model, _checkpointed(model, regenerate)

    def loss(model: nn.Module) -> Tensor:
        g = torch.Generator().manual_seed(1)
        x, text = torch.randn(2, 4, 8, 8, generator=g), torch.randn(2, 5, 8, generator=g)
        return model(x, torch.tensor([3, 7]), encoder_hidden_states=text).sample.square().sum()

    expected = _grads(build(1)[0], loss)
    model, callback = build(2)
    _assert_equal(_grads(model, loss), expected)
    assert callback.remade.inputs == 6 and "down_blocks.0.attentions.0" in callback.remade.made  # old code: 1


class _KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(16, 16), nn.Dropout(0.5)

    def forward(self, hidden_states: Tensor, scale: float = 1.0) -> Tensor:
        return hidden_states + scale * self.drop(torch.tanh(self.linear(hidden_states)))


class _KeywordStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_KeywordBlock() for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(hidden_states=x, scale=0.5)
        return x


@pytest.mark.parametrize("offload", [False, True])
def test_a_block_input_passed_as_a_keyword_is_remade(offload: bool) -> None:
    # checkpoint saves only the positional inputs through the saved-tensor hooks (the keywords stay in its closure):
    # block(hidden_states=h) kept every input, and with offload=True kept them on the device
    def build(regenerate: int) -> tuple[nn.Module, ActivationCheckpointing]:
        torch.manual_seed(0)
        model = _KeywordStack()
        return model, _checkpointed(model, regenerate, offload=offload)

    def loss(model: nn.Module) -> Tensor:
        torch.manual_seed(1)  # dropout: the same draws in both runs
        return model(torch.randn(8, 16, generator=torch.Generator().manual_seed(2))).square().sum()

    expected = _grads(build(1)[0], loss)
    model, callback = build(2)
    _assert_equal(_grads(model, loss), expected)  # fp32, bit for bit
    assert callback.remade.inputs == 2 and list(callback.remade.made) == ["blocks.1", "blocks.3"]
    assert not callback.remade.unmatched
    if callback.offload is not None:  # blocks.2 keeps its (keyword) input: offloaded; blocks.0's is the model's input
        assert callback.offload.copies == 1
