"""The hooks an input embedding carries into its int8 table stay the user's to remove (session 31).

Was (session 30): :meth:`QuantizedEmbedding.from_quantized` copied the embedding's forward hooks into dicts of its
own, so the handle the user (or transformers' ``disable_input_require_grads()``) held pointed at the replaced module:
``handle.remove()`` removed nothing, the hook ran on. Its backward hooks were dropped without a word.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_hbm.layers.embedding import QuantizedEmbedding
from tests.precision.test_embedding_default_s30 import Tied, _converted


def test_a_hook_handle_taken_before_the_surgery_removes_the_hook_after() -> None:
    model, ids = Tied(), torch.randint(0, 128, (2, 9))
    handle = model.emb.register_forward_hook(lambda module, args, output: output.requires_grad_())  # enable_input_require_grads()
    _converted(model)
    assert isinstance(model.emb, QuantizedEmbedding) and model.emb(ids).requires_grad  # goes on with the table
    handle.remove()  # disable_input_require_grads()
    assert not model.emb(ids).requires_grad  # was: still True, the hook left on the int8 table


def test_a_backward_hook_goes_on_with_the_table() -> None:
    model, ids = Tied(), torch.randint(0, 128, (2, 9))
    seen: list[Any] = []
    model.emb.register_forward_hook(lambda module, args, output: output.requires_grad_())
    model.emb.register_full_backward_hook(lambda module, grad_in, grad_out: seen.append(grad_out[0].shape))
    _converted(model)
    model.emb(ids).sum().backward()
    assert seen == [torch.Size([2, 9, 64])]  # was: [] (dropped)
