"""A model of 4-7 repeated blocks is traced once (issue 53, session 29: planner speed).

``extrapolate="auto"`` extends traces cut to 3 and 4 blocks only past 7 blocks; below, the planner traced the model cut to
3 blocks, found it deeper, and traced it whole again: the first trace was thrown away (a tiny transformers MobileViT,
4 transformer layers in its largest list: 12.3 -> 7.9 s CPU of 2 traces). The block count is known before tracing, so
the whole model is traced at once: the same plan, one trace.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

import lightning_hbm.planner.api as api
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import NanoGPT
from lightning_hbm.planner import Candidate, predict


@pytest.mark.slow
def test_a_model_the_cut_traces_would_not_extend_is_traced_once_with_the_same_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    # (8 blocks and more: cut to 3 and 4 and extended, as before: test_api.py::test_extrapolated_depth_equals_full_trace)
    kept: list[Any] = []
    traced = api._trace

    def counted(*args: Any, **kwargs: Any) -> Any:
        kept.append(args[4])  # keep_blocks
        return traced(*args, **kwargs)

    monkeypatch.setattr(api, "_trace", counted)
    factory = partial(NanoGPT, n_layer=5, n_head=2, n_embd=32, block_size=128)
    batch = synthetic_batch(2, 16)
    candidate = Candidate("bf16-true", checkpointing="full")
    auto = predict(factory, batch, candidate)
    assert kept == [None], kept  # was [3, None]: cut to 3, then whole
    whole = predict(factory, batch, candidate, extrapolate=False)
    assert auto.categories == whole.categories and auto.peak == whole.peak
    assert (auto.trainable_params, auto.total_params) == (whole.trainable_params, whole.total_params)
