"""A block whose forward changes a list or dict it is given is not checkpointed, said by name (session 32).

Was: diffusers' ``AutoencoderKLWan`` passes ``feat_cache`` (a list of cached frames) and ``feat_idx`` (a one-item
counter) to every ``WanResidualBlock`` / ``WanUpBlock``; each forward replaces cache items and moves the counter on, so
checkpoint's recompute in backward indexed past the cache: ``IndexError: list index out of range`` at the first step.
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm import ActivationCheckpointing

diffusers = pytest.importorskip("diffusers")


def _wan() -> nn.Module:
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2], num_res_blocks=1, temperal_downsample=[True],
                                      latents_mean=[0.0] * 4, latents_std=[1.0] * 4)  # fmt: skip


def _gradients(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    model.train()
    F.mse_loss(model(x).sample, x).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpointed(model: nn.Module) -> ActivationCheckpointing:
    callback = ActivationCheckpointing()
    callback.check_model(model)
    callback.transform_model(model)
    return callback


def test_wan_vae_blocks_that_change_their_cache_are_left_unchecked_by_name_and_train_as_without() -> None:
    x = torch.randn(1, 3, 5, 8, 8, generator=torch.Generator().manual_seed(1))
    want = _gradients(_wan(), x)
    model = _wan()
    assert "decoder.up_blocks.0" in _checkpointed(model).checkpointed
    with pytest.warns(UserWarning, match=r"leaves 'decoder.up_blocks.0' \(WanUpBlock\) without checkpoint: its forward changes the list given as 'feat_cache' \(\d+ of \d+ items.*'feat_idx'.*Fix: ActivationCheckpointing\(blocks="):
        got = _gradients(model, x)  # was: IndexError in the recompute
    assert set(got) == set(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], msg=name)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per block: the second step is quiet
        _gradients(model, x)


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.forwards = 0

    def forward(self, x: torch.Tensor, options: Optional[dict[str, Any]] = None) -> torch.Tensor:
        self.forwards += 1
        return torch.tanh(self.linear(x)) * (options or {}).get("scale", 1.0)


def test_a_block_given_a_dict_it_leaves_alone_is_checkpointed_from_its_second_call() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block())
    _checkpointed(model)
    x = torch.randn(4, 8, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            y = x
            for block in model:
                y = block(y, options={"scale": 2.0})
            y.sum().backward()
    assert [block.forwards for block in model] == [3, 3]  # the first step plain, the second forward and its recompute
