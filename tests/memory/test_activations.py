"""saved_activation_bytes and the live-storage tracker behind it."""

from __future__ import annotations

import gc
import weakref
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from lightning_hbm.data import synthetic_batch
from lightning_hbm.memory import LiveStorageTracker, owned_storages, saved_activation_bytes
from lightning_hbm.models import NanoGPT


def _gpt_loss(model: NanoGPT, batch_size: int, use_checkpoint: bool = False) -> Callable[[], torch.Tensor]:
    idx, targets = synthetic_batch(batch_size, 32)
    gpt = model.model

    def forward() -> torch.Tensor:
        x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
        for block in gpt.h:
            x = checkpoint(block, x, use_reentrant=False) if use_checkpoint else block(x)
        logits = gpt.lm_head(gpt.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    return forward


def test_hand_computed_linear_relu() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
    x = torch.randn(8, 16)  # the input exists before the forward: not counted
    # Linear saves its input and weight (not new); ReLU saves its fp32 output (8x32); the loss is 4 bytes.
    # The Linear's output is freed once ReLU has consumed it.
    assert saved_activation_bytes(lambda: model(x).sum(), model) == 8 * 32 * 4 + 4


def test_scales_with_batch(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    small = saved_activation_bytes(_gpt_loss(model, 4), model)
    large = saved_activation_bytes(_gpt_loss(model, 8), model)
    assert small > 0
    assert large / small == pytest.approx(2.0, rel=0.05)


def test_checkpointing_reports_less(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    plain = saved_activation_bytes(_gpt_loss(model, 4), model)
    recomputed = saved_activation_bytes(_gpt_loss(model, 4, use_checkpoint=True), model)
    assert recomputed < plain / 2


def test_grads_of_the_module_are_not_activations() -> None:
    model = nn.Linear(16, 32)
    x = torch.randn(8, 16)
    model(x).sum().backward()  # .grad now exists
    assert saved_activation_bytes(lambda: model(x).relu().sum(), model) == 8 * 32 * 4 + 4


def test_graph_is_freed_afterwards() -> None:
    model = nn.Linear(16, 32)
    kept: list[weakref.ref] = []

    def forward() -> torch.Tensor:
        hidden = model(torch.randn(8, 16)).relu()
        kept.append(weakref.ref(hidden.untyped_storage()))
        return hidden.sum()

    assert saved_activation_bytes(forward, model) > 0
    gc.collect()
    assert kept[0]() is None


def test_bad_input_errors() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="needs the torch.nn.Module that runs the forward, got str"):
        saved_activation_bytes(lambda: model(torch.ones(1, 2)).sum(), "model")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="needs a callable that runs the forward"):
        saved_activation_bytes(model(torch.ones(1, 2)).sum(), model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must return the loss tensor .* got float"):
        saved_activation_bytes(lambda: 1.0, model)  # type: ignore[arg-type, return-value]


def test_tracker_peak_and_release() -> None:
    tracker = LiveStorageTracker(track_peak=True)
    with tracker:
        a = torch.ones(1000)  # 4000 B
        b = a * 2  # 4000 B: peak 8000
        del a
        c = torch.ones(10)
        tracker.finish_peak()
    assert tracker.peak_bytes == 8000
    assert tracker.live_bytes == 4000 + 40
    assert sorted(r.nbytes for r in tracker.peak_records.values()) == [4000, 4000]
    assert set(tracker.live_storages().values()) == {4000, 40}
    del b, c


def test_tracker_module_attribution() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    tracker = LiveStorageTracker()
    x = torch.randn(2, 4)
    tracker.attach_modules(model)
    with tracker:
        out = model(x)
    tracker.detach_modules()
    owned = owned_storages(model)  # the Linear's weight.t() view makes the weight storage "seen" too
    modules = {r.module for key, r in tracker.live_records().items() if key not in owned}
    assert modules == {"1"}  # only ReLU's output is still alive (saved for backward)
    assert not model._forward_hooks and not model._forward_pre_hooks
    del out


def test_selective_checkpointing_sits_between(gpt_factory: Callable[..., NanoGPT]) -> None:
    from functools import partial

    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    def keep_matmuls(ctx: object, op: object, *args: object, **kwargs: object) -> CheckpointPolicy:
        saved = op in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
        return CheckpointPolicy.MUST_SAVE if saved else CheckpointPolicy.PREFER_RECOMPUTE

    model = gpt_factory()
    idx, targets = synthetic_batch(4, 32)
    gpt = model.model

    def forward(context_fn: Callable | None) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            x = gpt.wte(idx) + gpt.wpe(torch.arange(idx.shape[1]))
            for block in gpt.h:
                if context_fn is None:
                    x = block(x)
                else:
                    x = checkpoint(block, x, use_reentrant=False, context_fn=context_fn)
            logits = gpt.lm_head(gpt.ln_f(x))
            return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

        return run

    plain = saved_activation_bytes(forward(None), model)
    selective = saved_activation_bytes(forward(partial(create_selective_checkpoint_contexts, keep_matmuls)), model)
    full = saved_activation_bytes(_gpt_loss(model, 4, use_checkpoint=True), model)
    assert full < selective < plain
