"""Outside-style attack on session 26's activation code (session 27): ``ActivationCheckpointing(regenerate=n)`` and
the token chunks' projections fed by a chunked norm, on the cases a user's run brings (mixed precision, ...)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm.data import synthetic_batch
from tests.activations.test_regenerate import _assert_equal, _grads, _llama


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
