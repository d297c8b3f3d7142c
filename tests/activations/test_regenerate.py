"""``ActivationCheckpointing(regenerate=n)``: every n-th block keeps its input, the others remake theirs in the backward.

The gradients are plain checkpointing's, bit for bit (the remade input is the forward's: same ops, the forward's RNG
states and buffers); a block fed something else than the block before's output keeps its input and is named.
"""

from __future__ import annotations

import gc
from typing import Any, Union

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing, LoRA
from lightning_hbm.activations.regenerate import Record
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM


def _llama(offload: Union[bool, int], regenerate: int) -> tuple[nn.Module, ActivationCheckpointing]:
    torch.manual_seed(0)
    model = LlamaLM(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=5, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=512)
    LoRA(r=4).transform_model(model)
    callback = ActivationCheckpointing("full", offload=offload, mlp_chunks=4, regenerate=regenerate)
    callback.transform_model(model)
    return model, callback


def _grads(model: nn.Module, loss: Any) -> dict[str, Tensor]:
    loss(model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_equal(got: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    assert got.keys() == expected.keys() and expected
    for name in expected:
        assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize(("offload", "regenerate", "remade", "copies"), [
    (True, 2, 2, 3),  # blocks 0, 2, 4 keep (offloaded); 1 and 3 remade: one forward each
    (False, 3, 4, None),  # 0 and 3 keep (on the device); 1 remade by one forward, 2 by two, 4 by one
    (3, 2, 2, 2),  # the first 3 checkpointed blocks offload: 0 and 2 keep theirs there, 4 on the device
])  # fmt: skip
def test_remade_inputs_give_the_gradients_of_plain_checkpointing(
    offload: Union[bool, int], regenerate: int, remade: int, copies: Any
) -> None:
    x, y = synthetic_batch(2, 128, vocab_size=512)

    def loss(model: nn.Module) -> Tensor:
        return nn.functional.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())

    expected = _grads(_llama(offload, 1)[0], loss)
    model, callback = _llama(offload, regenerate)
    _assert_equal(_grads(model, loss), expected)
    assert callback.remade.inputs == remade and not callback.remade.unmatched  # block forwards run again
    assert (callback.offload.copies if callback.offload is not None else None) == copies


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear, self.norm, self.drop = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(torch.tanh(self.norm(self.linear(x))))


class _Stack(nn.Module):
    def __init__(self, between: bool = False) -> None:
        super().__init__()
        self.blocks, self.between = nn.ModuleList(_Block() for _ in range(4)), between

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x) * 1.0 if self.between else block(x)
        return x


def _stack(regenerate: int, between: bool = False) -> tuple[nn.Module, ActivationCheckpointing]:
    torch.manual_seed(0)
    model = _Stack(between)
    callback = ActivationCheckpointing("full", offload=True, regenerate=regenerate)
    callback.transform_model(model)
    return model, callback


def _seeded_grads(model: nn.Module, x: Tensor) -> list[Tensor]:
    """The gradients of ``model(x).square().sum()``, its draws from seed 1 (dropout: the same draws in both runs)."""
    torch.manual_seed(1)
    return _grads(model, lambda m: m(x).square().sum())


def test_a_remade_input_draws_as_its_forward_did_and_updates_no_statistics_twice() -> None:
    # dropout in training: the remade input needs the forward's RNG states; BatchNorm: its running statistics are
    # updated by the forward only, not again when an input is remade (nor when the block is recomputed)
    x = torch.randn(8, 16)
    reference, _ = _stack(1)
    model, callback = _stack(2)
    _assert_equal(_seeded_grads(model, x), _seeded_grads(reference, x))
    assert callback.remade.inputs == 2
    for ours, theirs in zip(model.blocks, reference.blocks):
        assert torch.equal(ours.norm.running_mean, theirs.norm.running_mean)
        assert ours.norm.num_batches_tracked == theirs.norm.num_batches_tracked == 1


def test_a_kept_input_is_freed_after_its_backward_without_the_cycle_collector() -> None:
    # a block's saved-tensor hooks are a reference cycle (they hold their own bound methods); holding the record of the
    # forward they packed, they kept its saved input (an offload handle and what it restored) alive until Python's
    # collector ran: in the planner, one block input more or less at a point set by the collector's thresholds
    model, callback = _stack(2)
    x = torch.randn(8, 16)
    gc.collect()
    gc.disable()
    try:
        model(x).sum().backward()
        alive = [o for o in gc.get_objects() if isinstance(o, Record)]
    finally:
        gc.enable()
    assert callback.remade.inputs == 2 and alive == []


def test_a_block_fed_something_else_keeps_its_input_and_is_named_in_a_warning() -> None:
    x = torch.randn(8, 16)
    reference, _ = _stack(1, between=True)
    torch.manual_seed(1)
    expected = _grads(reference, lambda m: m(x).sum())
    model, callback = _stack(2, between=True)
    torch.manual_seed(1)
    _assert_equal(_grads(model, lambda m: m(x).sum()), expected)
    # no block is fed the one before's output (each gets it times 1.0): every one starts a chain of its own
    assert callback.remade.inputs == 0 and list(callback.remade.unmatched) == ["blocks.1", "blocks.2", "blocks.3"]
    assert callback.offload is not None and callback.offload.copies == 4  # kept, as without regenerate
    with pytest.warns(UserWarning, match=r"regenerate=2\) could not remake the input of 3 block\(s\), which keep it as "
                      r"without regenerate \(1.50 KiB in all\): blocks.1 \(512 B, the block called before it: blocks.0\);"):
        callback.warn_unremade()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"regenerate": 0}, r"regenerate=0\): must be an int >= 1"),
    ({"regenerate": 2, "policy": "selective"}, r"regenerate=2, policy='selective', every=1\): remade inputs need"),
    ({"regenerate": 2, "every": 2}, r"regenerate=2, policy='full', every=2\): remade inputs need"),
])  # fmt: skip
def test_a_bad_regenerate_is_a_clear_error(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ActivationCheckpointing(**kwargs)


def test_a_bool_regenerate_is_a_type_error() -> None:
    with pytest.raises(TypeError, match=r"regenerate=True\): a bool"):
        ActivationCheckpointing(regenerate=True)
