"""Small mends of a code review of the activation checkpointing (session 29): each test failed on the code before."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from lightning_hbm import ActivationCheckpointing


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
