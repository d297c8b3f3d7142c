"""``total_peak_only`` (session 42): MemTracker keeps its total peak and skips the per-module bookkeeping.

torch 2.13's ``MemTracker._update_peak_stats`` walks every module the tracker has seen at every operator; on a deep
model that bookkeeping was most of a measured step (a 30-layer tiny Llama under nf4-dq + LoRA + checkpointing: 43.3 s
of CPU with it, 3.3 s without, the same total; the real SmolLM2's fixture in tests/planner/test_pretrained_plan.py).
The planner's reference (``memtracker_peak``, ``StepPeak``) and ``torch_peak_bytes`` read the total only.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm._compat import torch as compat


def _stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(32, 32), nn.GELU()) for _ in range(6)), nn.Linear(32, 1)), torch.randn(8, 32)


def _tracked_step(total_only: bool) -> tuple[Any, nn.Module]:
    """The tracker of an Adam step, and the model (its per-module stats are weakly keyed by the modules)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    model, x = _stack()
    optimizer = torch.optim.Adam(model.parameters())
    model(x).sum().backward()
    optimizer.step()  # gradients and Adam states exist before the measured step, as in memtracker_peak
    tracker = MemTracker()
    if total_only:
        compat.total_peak_only(tracker)
    tracker.track_external(model, optimizer)
    with tracker:
        optimizer.zero_grad(set_to_none=True)
        model(x).sum().backward()
        optimizer.step()
    return tracker, model


def test_the_total_peak_is_torchs_own_and_the_modules_peaks_are_not_walked_at_each_operator() -> None:
    (stock, _model), (ours, _same) = _tracked_step(total_only=False), _tracked_step(total_only=True)
    assert ours.get_tracker_snapshot("peak") == stock.get_tracker_snapshot("peak")  # every kind, every device
    assert stock.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] > 6 * 32 * 32 * 4 * 3  # weights, grads, Adam's two
    # what is skipped: the per-operator walk that raises each running module's own peak (the root's: its forward's top)
    root = {name: next(s for s in tracker.memory_tracking.values() if s.mod_fqn == "Sequential").local_peak[torch.device("cpu")]
            for name, tracker in (("stock", stock), ("ours", ours))}  # fmt: skip
    assert root["ours"] < root["stock"], root  # the same step: the root sees its activations grow only in the walk


def test_the_names_total_peak_only_reads_are_torchs() -> None:
    """Fails when torch renames what ``_update_total_peak`` reads or writes, or the snapshot's total key."""
    from torch.distributed._tools import mem_tracker

    assert mem_tracker._TOTAL_KEY == compat.MEMTRACKER_TOTAL
    tracker = mem_tracker.MemTracker()
    assert callable(tracker._update_peak_stats)
    for name in ("_curr_mem_snap", "_peak_mem", "_peak_mem_snap"):
        assert isinstance(getattr(tracker, name), dict), name


def test_memtracker_peak_reads_the_same_bytes_as_with_torchs_bookkeeping(monkeypatch: pytest.MonkeyPatch) -> None:
    """The planner's reference, module hooks on (its default), on a LoRA-adapted nf4 Llama: the same figure with and
    without the per-module peaks."""
    pytest.importorskip("transformers")
    from lightning_hbm.data import synthetic_batch
    from lightning_hbm.models import LlamaLM
    from lightning_hbm.planner import Candidate
    from lightning_hbm.planner.reference import memtracker_peak

    def factory() -> LlamaLM:
        return LlamaLM(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=2)  # fmt: skip

    batch, candidate = synthetic_batch(2, 16, vocab_size=256), Candidate("nf4-dq", dtype="float32", lora_r=4)
    ours = memtracker_peak(factory, batch, candidate)
    monkeypatch.setattr(compat, "total_peak_only", lambda tracker: None)  # torch's MemTracker as it is
    assert ours == memtracker_peak(factory, batch, candidate)
