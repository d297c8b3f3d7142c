"""Small mends of a code review of the activation checkpointing (session 29): each test failed on the code before."""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing
from lightning_hbm.activations.regenerate import _RECORD


class _KeywordBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, hidden_states: Tensor) -> Tensor:
        return hidden_states + torch.tanh(self.linear(hidden_states))


class _KeywordStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_KeywordBlock() for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(hidden_states=x)
        return x


def _checkpointed(model: nn.Module) -> ActivationCheckpointing:
    callback = ActivationCheckpointing("full", offload=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        callback.check_model(model)
        callback.transform_model(model)
    return callback


def test_an_offloaded_blocks_keyword_tensors_are_looked_at_on_its_first_training_forward_only() -> None:
    # every training forward of every offloaded block measured its keyword tensors again, for a warning given once
    torch.manual_seed(0)
    model = _KeywordStack()
    callback = _checkpointed(model)
    assert callback.offload is not None
    model(torch.randn(4, 16)).sum().backward()
    assert list(callback.offload.keywords_kept) == ["blocks.0", "blocks.1", "blocks.2"]
    callback.offload.keywords_kept.clear()
    model(torch.randn(4, 16)).sum().backward()  # the second step: not looked at again
    assert callback.offload.keywords_kept == {}
    callback = _checkpointed(model)  # a new callback wraps the blocks again: looked at again, once
    assert callback.offload is not None
    with torch.no_grad():
        model(torch.randn(4, 16))  # an evaluation forward before the first training one does not count
    model(torch.randn(4, 16)).sum().backward()
    assert list(callback.offload.keywords_kept) == ["blocks.0", "blocks.1", "blocks.2"]


class _DropBlock(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.linear, self.drop = nn.Linear(16, 16), nn.Dropout(p)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


class _DropStack(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_DropBlock(p) for _ in range(6))

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("regenerate", [2, 3])
def test_only_the_forwards_a_remake_may_run_again_keep_their_rng_states(p: float, regenerate: int) -> None:
    # every block's record took a snapshot of the global RNG states (Python's and NumPy's most of its ~100 us), also
    # the records before a block that keeps its input (the chain's every n-th), which no remake ever runs again
    def grads(n: int) -> tuple[dict[str, Tensor], list[Optional[dict[str, Any]]]]:
        torch.manual_seed(0)
        model = _DropStack(p)
        ActivationCheckpointing("full", regenerate=n).transform_model(model)
        snapshots: list[Optional[dict[str, Any]]] = []

        def note(_block: nn.Module, _args: Any, out: Tensor) -> None:
            snapshots.append(out.grad_fn.metadata[_RECORD].rng if n > 1 else None)

        for block in model.blocks:
            block.register_forward_hook(note)
        torch.manual_seed(1)  # dropout: the same draws in every run
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(2))).square().sum().backward()
        return {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}, snapshots

    expected, _ = grads(1)
    got, snapshots = grads(regenerate)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in expected)  # bit for bit, with dropout and without
    # blocks 0..5 in one chain: the block after position k remakes its input unless k + 1 is a multiple of n
    assert [s is not None for s in snapshots] == [(k + 1) % regenerate != 0 for k in range(6)]


@pytest.mark.parametrize("regenerate", [1, 3])
def test_the_counts_of_remade_inputs_know_the_callbacks_n_before_the_model_is_changed(regenerate: int) -> None:
    # the callback's counts were made with n = 2 whatever it was given, until transform_model made them again
    assert ActivationCheckpointing(regenerate=regenerate).remade.regenerate == regenerate
