"""Session 29 outside-style attack on the checkpoint's replay and ``regenerate=n`` (issue 53: never stop a healthy
model, nothing silent): gradients compared with the plain model's on what users' models do."""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the running norm of test_attack_s28
from test_attack_s28 import _RunningNorm  # noqa: E402


class _LazyNorm(nn.Module):
    """A user's norm that creates its running mean on its first training batch (``register_buffer(name, None)``, then
    assigned; or ``hasattr`` and ``register_buffer``), and updates it in place after."""

    def __init__(self, slot: bool) -> None:
        super().__init__()
        self.slot = slot
        if slot:
            self.register_buffer("mean", None)

    def forward(self, x: Tensor) -> Tensor:
        if self.training:
            with torch.no_grad():
                if getattr(self, "mean", None) is None:
                    self.register_buffer("mean", 0.5 * x.mean(0))
                else:
                    self.mean.mul_(0.5).add_(0.5 * x.mean(0))
        return x - self.mean


def _WarmNorm(width: int) -> nn.Module:
    """A user's norm whose running mean is first written after a warm-up step (its counter is written from the first)."""
    return _RunningNorm(width, momentum=0.5, warmup=1)


class _Block(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module]) -> None:
        super().__init__()
        self.lin, self.norm = nn.Linear(8, 8), norm()

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.norm(self.lin(x)))


class _Net(nn.Module):
    def __init__(self, norm: Callable[[], nn.Module], blocks: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(norm) for _ in range(blocks))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def _same_steps(reference: nn.Module, model: nn.Module, steps: int, batch: Callable[[int], Any], loss: Callable[[Any], Tensor]) -> None:
    """``steps`` training steps of both (gradients set to None before each), gradients and buffers equal after each."""
    for step in range(steps):
        grads = []
        for net in (reference, model):
            net.train()
            net.zero_grad(set_to_none=True)
            loss(net(batch(step))).backward()
            grads.append([p.grad for p in net.parameters()])
        for (name, _), ours, theirs in zip(model.named_parameters(), grads[1], grads[0]):
            assert ours is not None and theirs is not None and torch.allclose(ours, theirs, rtol=0, atol=1e-6), (step, name)
        for (name, ours), theirs in zip(model.named_buffers(), reference.buffers()):
            assert torch.equal(ours, theirs), (step, name)


def _batch(step: int) -> Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(step))


@pytest.mark.parametrize("regenerate", [1, 2])
@pytest.mark.parametrize("slot", [True, False])
def test_a_buffer_a_block_creates_on_its_first_batch_is_replayed_exactly(slot: bool, regenerate: int) -> None:
    # the buffers a block writes were learnt on its first training forward, from those it had before it: one it
    # creates there (None or absent before) was never learnt, so the recompute found it created and updated it a
    # second time, every step, and read the updated mean: gradients 0.03-0.2 off, silently
    torch.manual_seed(0)
    reference = _Net(lambda: _LazyNorm(slot))
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    _same_steps(reference, model, 4, _batch, lambda out: out.square().sum())


@pytest.mark.parametrize("regenerate", [1, 2])
def test_a_buffer_first_written_after_a_warm_up_step_is_said_and_replayed_from_then_on(regenerate: int) -> None:
    # learnt on the first step as written by nothing: from the second step on it was updated twice per step and the
    # recompute read the updated mean (gradients 0.01 off every step), silently. Now: the step that first writes it
    # is said (its recompute reads the updated value, its statistics are not updated twice), every later one exact
    torch.manual_seed(0)
    reference = _Net(lambda: _WarmNorm(8))
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", regenerate=regenerate).transform_model(model)
    _same_steps(reference, model, 1, _batch, lambda out: out.square().sum())
    with pytest.warns(UserWarning, match=r"_Block's training forward wrote its buffer\(s\) norm.mean for the first time"):
        for net in (reference, model):
            net(_batch(1)).square().sum().backward()
    _same_steps(reference, model, 3, lambda step: _batch(step + 2), lambda out: out.square().sum())


class _Residual(nn.Module):
    def __init__(self, tuple_out: bool = False) -> None:
        super().__init__()
        self.a, self.b, self.tuple_out = nn.Linear(16, 16), nn.Linear(16, 16), tuple_out

    def forward(self, x: Tensor, extra: Any = None, *, gate: Any = None) -> Any:
        h = x + self.b(torch.tanh(self.a(x)))
        h = h if extra is None else h + 0.5 * extra
        h = h if gate is None else h * torch.sigmoid(gate)
        return (h, h.sum(-1)) if self.tuple_out else h


class _Flows(nn.Module):
    """Five blocks wired as users wire them: ``kind`` picks the data flow between them."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(_Residual(tuple_out=kind == "tuple") for _ in range(5))

    def forward(self, x: Tensor) -> Tensor:
        b, h = self.blocks, x * 1.0
        if self.kind == "used_twice":  # blocks.0's output feeds blocks.1 and blocks.2
            h0 = b[0](h)
            return b[4](b[3](b[1](h0), b[2](h0)))
        if self.kind == "shared":  # two blocks called three times each, in turn (weight sharing)
            for _ in range(3):
                h = b[1](b[0](h))
            return h
        if self.kind == "order":  # called in another order than registered
            for i in (3, 1, 4, 0, 2):
                h = b[i](h)
            return h
        if self.kind == "tuple":
            for block in b:
                h = block(h)[0]
            return h
        if self.kind == "no_grad":  # a block run without gradients in between
            h = b[1](b[0](h))
            with torch.no_grad():
                side = b[2](h)
            return b[4](b[3](h, side))
        if self.kind == "user_checkpoint":  # torch.utils.checkpoint of the user's own around two blocks
            h = torch.utils.checkpoint.checkpoint(lambda t: b[2](b[1](t)), b[0](h), use_reentrant=False)
            return b[4](b[3](h))
        if self.kind == "keywords":
            h = b[1](x=b[0](h))
            return b[4](b[3](x=b[2](h, gate=h), extra=h))
        h = b[1](b[0](h))  # "in_place": scaled in place between two blocks, then on
        h.mul_(0.5)
        return b[4](b[3](b[2](h)))


@pytest.mark.parametrize("kind", ["used_twice", "shared", "order", "tuple", "no_grad", "user_checkpoint", "keywords", "in_place"])
@pytest.mark.parametrize("regenerate", [2, 3])
def test_regenerate_on_users_data_flows_gives_the_plain_gradients_with_accumulation(kind: str, regenerate: int) -> None:
    # held (session 29): each data flow, two backwards accumulated without zeroing, gradients within 1e-6 of the
    # model without checkpointing, and at least one input remade
    torch.manual_seed(0)
    reference = _Flows(kind)
    model = copy.deepcopy(reference)
    callback = ActivationCheckpointing("full", blocks=[f"blocks.{i}" for i in range(5)], regenerate=regenerate)
    callback.transform_model(model)
    for step in range(2):
        callback.remade.reset()
        for net in (reference, model):
            net(_batch(step).repeat(1, 2)).square().sum().backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert (ours.grad is None) == (theirs.grad is None), name
        assert ours.grad is None or torch.allclose(ours.grad, theirs.grad, rtol=0, atol=1e-6), name
    assert callback.remade.inputs > 0


@pytest.mark.parametrize("mode", ["retain_twice", "partial_then_full", "gradient_penalty"])
def test_regenerate_under_two_backwards_of_one_graph_gives_the_plain_gradients(mode: str) -> None:
    # held (session 29): the record holds a kept input weakly; a graph retained for a second backward, a partial
    # torch.autograd.grad before the full backward, and a double backward still find it
    torch.manual_seed(0)
    reference = _Flows("order")
    model = copy.deepcopy(reference)
    ActivationCheckpointing("full", blocks=[f"blocks.{i}" for i in range(5)], regenerate=2).transform_model(model)
    for net in (reference, model):
        x = _batch(0).repeat(1, 2).requires_grad_()
        loss = net(x).square().sum()
        if mode == "retain_twice":
            loss.backward(retain_graph=True)
            loss.backward()
        elif mode == "partial_then_full":
            torch.autograd.grad(loss, list(net.blocks[2].parameters()), retain_graph=True)
            loss.backward()
        else:
            (grad,) = torch.autograd.grad(loss, x, create_graph=True)
            (loss + grad.square().sum()).backward()
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert ours.grad is not None and theirs.grad is not None and torch.allclose(ours.grad, theirs.grad, rtol=0, atol=1e-6), name


def test_regenerate_on_albert_whose_one_layer_is_called_six_times_is_bit_exact_with_dropout() -> None:
    # held (session 29): transformers' ALBERT shares one layer across its depth: each call remakes its input from the
    # call before (3 of 6 with regenerate=2), dropout's draws replayed; the gradients are the plain model's, bit for bit
    transformers = pytest.importorskip("transformers")
    config = transformers.AlbertConfig(vocab_size=128, embedding_size=32, hidden_size=64, num_hidden_layers=6, num_attention_heads=4, intermediate_size=128)
    torch.manual_seed(0)
    reference = transformers.AlbertModel(config).train()
    model = copy.deepcopy(reference)
    callback = ActivationCheckpointing("full", blocks=["encoder.albert_layer_groups.0.albert_layers.0"], regenerate=2)
    callback.transform_model(model)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    for net in (reference, model):
        torch.manual_seed(7)
        net(input_ids=ids).last_hidden_state.square().sum().backward()
    assert callback.remade.inputs == 3
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters()):
        assert (ours.grad is None) == (theirs.grad is None) and (ours.grad is None or torch.equal(ours.grad, theirs.grad)), name


class _SharedAfterSkip(nn.Module):
    """``blocks.1``'s weights shared by two calls: first fed something else than ``blocks.0``'s output (its input kept,
    unmatched), then its own output (remade)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Residual() for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        h = self.blocks[0](x)
        side = self.blocks[1](h * 2.0)  # not blocks.0's output (computed from it): kept, named
        return h + self.blocks[1](side)  # its own call before's output: remade


def test_a_shared_block_that_keeps_its_input_on_one_call_is_named_in_the_warning() -> None:
    # the notes were by block name: the second call (remade) took away the first call's note (kept, unmatched) and
    # the warning naming it was never said
    torch.manual_seed(0)
    model = _SharedAfterSkip()
    callback = ActivationCheckpointing("full", blocks=["blocks.0", "blocks.1"], regenerate=2)
    callback.transform_model(model)
    callback.remade.reset()
    model(_batch(0).repeat(1, 2)).sum().backward()
    assert callback.remade.unmatched == {"blocks.1": (256, "blocks.0")} and list(callback.remade.made) == ["blocks.1 (call 2)"]
    with pytest.warns(UserWarning, match=r"could not remake the input of 1 block\(s\).*blocks\.1 \(256 B, the block called before it: blocks\.0\).*Remade: 1 block\(s\).*blocks\.1 \(call 2\)"):
        callback.warn_unremade()
