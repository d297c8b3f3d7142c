"""Outside-style attack on session 26's activation code (session 27): ``ActivationCheckpointing(regenerate=n)`` and
the token chunks' projections fed by a chunked norm, on the cases a user's run brings (mixed precision, ...)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm.activations.checkpointing import OffloadSavedTensors
from lightning_hbm.data import synthetic_batch
from tests.activations.test_regenerate import _assert_equal, _grads, _llama, _stack


@pytest.mark.slow  # 2 s: two LoRA Llamas
def test_a_remade_input_is_made_under_the_forwards_autocast() -> None:
    # bf16-mixed (torch.autocast around the forward): the backward, where an input is remade, runs outside autocast;
    # the remade input came out of an fp32 forward, not the bf16 one the block had (LoRA B gradients 2e-6 off on
    # Llama, 2e-4 on GPT-NeoX, silently)
    x, y = synthetic_batch(1, 16, vocab_size=512)

    def loss(model: nn.Module) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    expected = _grads(_llama(False, 1)[0], loss)
    model, callback = _llama(False, 2)
    _assert_equal(_grads(model, loss), expected)
    assert callback.remade.inputs == 2


def test_a_block_output_changed_in_place_is_not_remade() -> None:
    # a forward hook (or the model's code) scaling a block's output in place before the next block takes it: the
    # remade input (the block's forward again, without the hook) was the unscaled one, gradients 5x off silently
    x = torch.randn(8, 16)

    def scaled(regenerate: int) -> tuple[nn.Module, Any]:
        model, callback = _stack(regenerate)
        for block in model.blocks[::2]:
            block.register_forward_hook(lambda _module, _args, out: out.mul_(0.5))
        return model, callback

    reference, _ = scaled(1)
    torch.manual_seed(1)
    expected = _grads(reference, lambda m: m(x).square().sum())
    model, callback = scaled(2)
    torch.manual_seed(1)
    _assert_equal(_grads(model, lambda m: m(x).square().sum()), expected)
    assert callback.remade.inputs == 0 and list(callback.remade.unmatched) == ["blocks.1", "blocks.3"]  # kept, named


def test_an_offloaded_tensor_comes_back_with_its_strides_on_the_cpu_path() -> None:
    # The CUDA path (pinned pieces) restored a channels-last input with its strides; the copy to another device of
    # the same kind (the CPU path, and what the CPU tests check) made it contiguous: a conv's backward then ran in
    # another memory format, and a diffusers UNet2DModel's conv_in gradient came out 1e-8 off with offload=True
    # (with or without regenerate; equal once the strides are kept)
    offload = OffloadSavedTensors("cpu")
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    back = offload.unpack_hook(offload.pack_hook(x))
    assert back.stride() == x.stride() and torch.equal(back, x)
