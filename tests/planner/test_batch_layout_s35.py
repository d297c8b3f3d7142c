"""The planner's batch is laid out as the step holds it (session 35, issue 53's last bytes).

``synthetic_batch`` returns inputs and targets as views of one ``[b, t + 1]`` tensor. The planner traced fakes with
those strides: each a storage of ``b * (t + 1) - 1`` elements, and ``targets.reshape(-1)`` a copy, where the step on
the batch as Lightning moves it to the device (``Tensor.to``: its own contiguous storage) and as a DataLoader collates
it holds neither. On the FusedLoss adapted head (tests/activations/loss/test_fused_loss.py) the plan read 367,420 B
against MemTracker's 367,148 B: +272 B = 2 x 8 B of storage + the 256 B reshape copy.
"""

from __future__ import annotations

from functools import partial

import torch

from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, predict
from lightning_hbm.planner.reference import memtracker_peak

TINY = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1)


def test_a_batch_of_views_plans_as_its_moved_copy() -> None:
    factory, views = partial(LlamaLM, **TINY), synthetic_batch(2, 16, vocab_size=512)
    assert views[1].stride() == (17, 1)  # views of one tensor, not contiguous
    moved = tuple(t.to("cpu", copy=True) for t in views)  # as Tensor.to lays them out: contiguous
    assert moved[1].is_contiguous()
    of_views = predict(factory, views, Candidate("32-true"))
    of_moved = predict(factory, moved, Candidate("32-true"))
    assert of_views.categories == of_moved.categories  # was +272 B: 2 x 264 B of batch, and a 256 B reshape copy
    measured = memtracker_peak(factory, views, Candidate("32-true"))
    assert abs(of_views.peak - measured) <= 8, (of_views.peak, measured)


def test_a_dense_view_keeps_its_strides() -> None:
    """A transposed batch is dense: ``Tensor.to`` keeps its strides (and MemTracker's clone too), so does the plan,
    with the copy ``targets.reshape(-1)`` makes of it."""
    factory = partial(LlamaLM, **TINY)
    tokens = torch.randint(0, 512, (16, 2), generator=torch.Generator().manual_seed(0)).t()
    assert tokens.stride() == (1, 2) and not tokens.is_contiguous()
    batch = (tokens, tokens.clone())  # clone keeps a dense tensor's strides
    of_batch = predict(factory, batch, Candidate("32-true"))
    measured = memtracker_peak(factory, batch, Candidate("32-true"))
    assert abs(of_batch.peak - measured) <= 8, (of_batch.peak, measured)
