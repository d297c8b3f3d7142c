"""Outside-style attack on session 26's activation code (session 27): ``ActivationCheckpointing(regenerate=n)``, the
token chunks' projections fed by a chunked norm and the offload they run with, on what a user's run brings: mixed
precision, hooks that change a block's output in place, ``autograd.grad``, channels-last inputs, pickling after a step,
and how long a step's block inputs live. Each test failed on the code before its fix."""

from __future__ import annotations

import gc
import pickle
import warnings
import weakref
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.activations.checkpointing import OffloadSavedTensors
from lightning_hbm.activations.regenerate import Record
from lightning_hbm.activations.replay import ForwardState
from lightning_hbm.data import synthetic_batch
from tests.activations.test_regenerate import _assert_equal, _grads, _llama, _seeded_grads, _Stack, _stack
from tests.activations.test_token_chunks_battery2 import WIDTH, _AttentionBlock


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
    model, callback = scaled(2)
    _assert_equal(_seeded_grads(model, x), _seeded_grads(reference, x))
    assert list(callback.remade.unmatched) == ["blocks.1", "blocks.3"]  # kept, named
    # (session 28) linked by data flow: blocks.2 is fed blocks.1's output unchanged, and remakes it
    assert callback.remade.inputs == 1 and list(callback.remade.made) == ["blocks.2"]


def test_an_offloaded_tensor_comes_back_with_its_strides_on_the_cpu_path() -> None:
    # The CUDA path (pinned pieces) restored a channels-last input with its strides; the copy to another device of
    # the same kind (the CPU path, and what the CPU tests check) made it contiguous: a conv's backward then ran in
    # another memory format, and a diffusers UNet2DModel's conv_in gradient came out 1e-8 off with offload=True
    # (with or without regenerate; equal once the strides are kept)
    offload = OffloadSavedTensors("cpu")
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    back = offload.unpack_hook(offload.pack_hook(x))
    assert back.stride() == x.stride() and torch.equal(back, x)


def _fed_model() -> nn.Module:
    """Three bf16 blocks whose q/k are fed by the chunked input norm (run whole, input remade), after a first step."""
    torch.manual_seed(0)
    model = nn.Sequential(*(_AttentionBlock() for _ in range(3))).to(torch.bfloat16)
    callback = ActivationCheckpointing(mlp_chunks=3, blocks=["_AttentionBlock"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback.check_model(model)
        callback.transform_model(model)
    model(_fed_input()).float().pow(2).sum().backward()  # the first step decides what is chunked
    assert model[1].attn.q.forward.verdict == "" and model[1].attn.q.forward.fed_only
    model.zero_grad(set_to_none=True)
    return model


def _fed_input() -> Tensor:
    return torch.randn(2, 10, WIDTH, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).requires_grad_(True)


def _close(got: Optional[Tensor], want: Tensor) -> bool:  # bf16: the input gradient summed in another order
    return got is not None and float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2


def test_autograd_grad_through_projections_fed_by_a_chunked_norm_returns_their_gradients() -> None:
    # q/k's parameter gradients were accumulated by a backward of their own, into .grad: autograd.grad(loss, params)
    # got None for them (an error without allow_unused) and found them in .grad; backward(inputs=[...]) filled the
    # .grad of parameters it leaves out
    model = _fed_model()
    x = _fed_input()
    model(x).float().pow(2).sum().backward()
    named = dict(model.named_parameters())
    want = {n: p.grad.clone() for n, p in named.items() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    got = torch.autograd.grad(model(x).float().pow(2).sum(), list(named.values()), allow_unused=True)
    assert all(p.grad is None for p in named.values())
    assert [n for n, g in zip(named, got) if not _close(g, want[n])] == []
    model(x).float().pow(2).sum().backward(inputs=[named["1.attn.q.weight"]])
    assert [n for n, p in named.items() if p.grad is not None] == ["1.attn.q.weight"]
    assert _close(named["1.attn.q.weight"].grad, want["1.attn.q.weight"])


def test_a_record_of_a_forward_on_meta_tensors_has_no_autocast_to_read() -> None:
    # (the autocast fix above first asked torch for the "meta" device's autocast: a RuntimeError)
    block = nn.Linear(4, 4)
    record = Record(block, block, (torch.empty(2, 4, device="meta"),), {}, ForwardState(block), lambda t: t)
    assert [t for t, _, _ in record.autocast] == ["cpu"]


def test_a_model_with_offloaded_inputs_pickles_after_a_step() -> None:
    # the offload hooks kept weak references to the last step's handles: torch.save(model) after training failed
    x = torch.randn(8, 16)
    model, _ = _stack(2)
    model(x).sum().backward()
    copied = pickle.loads(pickle.dumps(model))  # the same weights, BatchNorm statistics and RNG draws next
    model.zero_grad(set_to_none=True)
    copied.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    expected = _grads(model, lambda m: m(x).square().sum())
    torch.manual_seed(1)
    _assert_equal(_grads(copied, lambda m: m(x).square().sum()), expected)


def test_a_model_pickles_after_a_block_ran_on_its_own() -> None:
    # regenerate: the forward of a block that feeds the next one waits (a record) for that block's call; called on
    # its own, the record stayed on the block, and its weak reference made the model unpicklable
    model, _ = _stack(2)
    model.blocks[0](torch.randn(8, 16))
    assert pickle.loads(pickle.dumps(model)) is not model


def _plain_stack(regenerate: int) -> nn.Module:  # inputs kept on the device (no offload)
    torch.manual_seed(0)
    model = _Stack()
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    return model


def test_a_block_input_is_freed_with_its_step_not_by_the_garbage_collector() -> None:
    # regenerate's records of block inputs lived in a reference cycle (the saved-tensor hooks' own methods): the
    # block inputs of a step outlived it, on the device, until the garbage collector ran
    model = _plain_stack(2)
    inputs: list[weakref.ref[Tensor]] = []
    for block in model.blocks:
        block.register_forward_pre_hook(lambda _module, args: inputs.append(weakref.ref(args[0])))
    gc.disable()
    try:
        model(torch.randn(8, 16, requires_grad=True)).sum().backward()
        assert len(inputs) == 4 and [ref() for ref in inputs] == [None] * 4
    finally:
        gc.enable()


def test_the_input_of_a_block_called_on_its_own_is_not_kept_past_its_forward() -> None:
    # the record of a forward that feeds the next block stayed on the block until its next forward when no block took
    # it (the block called on its own; in a UNet, the next block in module order called before it), holding the input
    model = _plain_stack(2)
    gc.disable()
    try:
        h = torch.randn(8, 16, requires_grad=True) * 1.0
        ref = weakref.ref(h)
        out = model.blocks[0](h)
        del h, out
        assert ref() is None
    finally:
        gc.enable()
