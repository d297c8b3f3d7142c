"""``ActivationCheckpointing(regenerate=n)`` linked by data flow (session 28): a block's input is remade when it is
exactly the output of the checkpointed block called just before it, whatever the module order, and whether it is passed
positionally or as a keyword; the warning names what is kept (with bytes and the block called before it) and what is
remade. Each test failed on the code before (blocks linked in module order, keyword tensors never saved through the
hooks)."""

from __future__ import annotations

import gc
import warnings
import weakref
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


@pytest.mark.slow  # 2 s: diffusers' first model built (its lazy imports), two UNets
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


@pytest.mark.slow  # 2 s when it runs first (diffusers' lazy imports): two conditional UNets
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


def test_an_offloaded_block_called_with_its_input_as_a_keyword_is_named_in_a_warning() -> None:
    # offload=True offloaded nothing of block(hidden_states=h) (checkpoint holds keyword tensors in its closure), and
    # said nothing. Moving every keyword tensor to the hooks was tried: it also offloads a Llama's position_ids, whose
    # pinned allocation moved the planner's longest contexts (tests/planner/test_remade_inputs.py: 6,400 -> 5,120)
    torch.manual_seed(0)
    model = _KeywordStack()
    callback = _checkpointed(model, 1, offload=True)
    model(torch.randn(8, 16)).sum().backward()
    assert callback.offload is not None and callback.offload.copies == 0  # still on the device: named below
    with pytest.warns(UserWarning, match=r"keeps on the device the keyword tensor inputs of 4 block\(s\): blocks.0: "
                      r"hidden_states \(512 B\); blocks.1: hidden_states \(512 B\);.*block\(hidden_states=h\)\)"):
        callback.warn_keywords_kept()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        callback.warn_keywords_kept()  # once per block


def test_a_llama_with_offload_is_not_warned_about_its_small_keyword_tensors() -> None:
    # transformers' decoder layers get hidden_states positionally, position_ids (and a mask) as keywords
    from tests.activations.test_regenerate import _llama

    x = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(0))
    model, callback = _llama(True, 2)
    model(x).float().square().mean().backward()
    assert callback.offload is not None and not callback.offload.keywords_kept
    assert callback.remade.inputs == 2 and list(callback.remade.made) == [
        "model.model.layers.1", "model.model.layers.3"] and not callback.remade.unmatched  # fmt: skip


def test_a_kept_input_is_freed_at_its_blocks_backward_not_at_the_end_of_the_step() -> None:
    # the record of a block's forward held what the checkpoint saved for its input (here the input itself, on the
    # device) as long as the step's graph: blocks.2's kept input outlived its backward (blocks.4's too, once every
    # block recorded its forward for data-flow linking)
    torch.manual_seed(0)
    model = nn.Sequential(*(_KeywordBlock() for _ in range(5)))
    callback = _checkpointed(model, 2, blocks=["_KeywordBlock"])
    inputs: list[Any] = []
    for block in model:
        block.register_forward_pre_hook(lambda _module, args: inputs.append(weakref.ref(args[0])))
    alive: list[list[bool]] = []
    model[0].linear.weight.register_hook(lambda grad: alive.append([ref() is not None for ref in inputs]))
    gc.disable()
    try:
        model(torch.randn(8, 16, requires_grad=True) * 1.0).sum().backward()
    finally:
        gc.enable()
    assert callback.remade.inputs == 2 and list(callback.remade.kept) == ["0", "2", "4"]
    assert len(alive) == 1 and alive[0][1:] == [False] * 4  # at blocks.0's backward: every later input freed


def test_a_remake_after_the_feeding_blocks_backward_is_a_clear_error() -> None:
    # the records hold the saved inputs weakly: a backward through the feeding block first (autograd.grad on its own
    # output) frees what the remake needs; the error says so instead of a remake from nothing
    torch.manual_seed(0)
    model = nn.Sequential(_KeywordBlock(), _KeywordBlock())
    _checkpointed(model, 2, blocks=["_KeywordBlock"])
    h = model[0](torch.randn(8, 16, requires_grad=True) * 1.0)
    out = model[1](h)
    torch.autograd.grad(h.sum(), model[0].linear.weight)
    with pytest.raises(RuntimeError, match=r"regenerate: the saved input of 0 was freed \(its backward ran\) before"):
        out.sum().backward()
