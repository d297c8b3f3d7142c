"""What torch's MemTracker module hooks keep alive, and that the profiler's do not (issue 53, session 35).

transformers' Mamba at ``32-true`` read 41,472 B more under MemTracker with its module hooks (torch's ``ModTracker``)
than without them (planner/reference.py). Found by running the step with a live-storage tracker inside both (session
35): each ``MambaMixer.forward`` computes ``A = -torch.exp(self.A_log.float())`` and hands it to ``mamba_inner_fn``, a
kernels-hub function that runs as a module and returns None without the CUDA kernels; ``ModTracker``'s forward
pre-hook registers a multi-gradient hook on that module's inputs, whose closure holds ``A``'s autograd node and, through
it, the ``exp`` output it saved (4,096 B per mixer, 2 mixers), after the forward and the backward. The other 33,280 B
are gradients (``out_proj.weight``, 32,768 B, and one 128-float vector) the same hook buffers until the gradients of
every input have arrived, while the parameters' ``.grad`` get copies. Neither is memory of the step without MemTracker.
"""

from __future__ import annotations

import gc
import sys
import weakref
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lightning_hbm import HBMProfiler
from lightning_hbm.memory import LiveStorageTracker
from lightning_hbm.planner import Candidate, predict


class _ReturnsNothing(nn.Module):
    """Like ``mamba_inner_fn`` without its kernels: takes tensors, returns None."""

    def forward(self, x: torch.Tensor, a: torch.Tensor) -> None:
        return None


class _DeadBranch(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a_log = nn.Parameter(torch.zeros(128, 8))
        self.lin = nn.Linear(8, 8)
        self.unused = _ReturnsNothing()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.unused(x, -torch.exp(self.a_log))  # a branch that never reaches the loss
        return self.lin(x)


class _ExpOutputs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.refs: list[weakref.ref] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.exp.default:
            self.refs.append(weakref.ref(out.untyped_storage()))
        return out


def _exp_alive_after_step(watch: Any) -> bool:
    model, x = _DeadBranch(), torch.randn(4, 8, requires_grad=True)
    spy = _ExpOutputs()
    with watch(model), spy:
        model(x).sum().backward()
    gc.collect()
    (ref,) = spy.refs
    return ref() is not None


class _Attached:
    """The profiler's detailed mode: its live-storage tracker, with which module allocated each storage."""

    def __init__(self, module: nn.Module) -> None:
        self.tracker, self.module = LiveStorageTracker(track_peak=True), module

    def __enter__(self) -> None:
        self.tracker.attach_modules(self.module)
        self.tracker.__enter__()

    def __exit__(self, *exc: Any) -> None:
        self.tracker.__exit__(*exc)
        self.tracker.detach_modules()


def test_memtracker_module_hooks_keep_a_dead_branch_alive_the_profiler_does_not() -> None:
    from torch.distributed._tools.mod_tracker import ModTracker

    assert _exp_alive_after_step(lambda model: ModTracker())  # torch's hooks: the exp output outlives the step
    assert not _exp_alive_after_step(_Attached)  # ours: freed when the forward drops the branch


@pytest.mark.filterwarnings("ignore")
def test_mamba_profiler_detailed_step_peaks_at_the_plan(tmp_path: Path) -> None:
    """HBMProfiler's detailed step of transformers' Mamba in a Trainer peaks at the plan, which is the unhooked
    MemTracker figure (tests/planner/test_realvalues.py, 2 x 64 tokens): its module attribution keeps nothing alive."""
    pytest.importorskip("transformers")
    sys.path.insert(0, str(Path(__file__).parent / "planner"))
    try:
        from test_realvalues import TinyMamba
    finally:
        sys.path.pop(0)

    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    predicted = predict(TinyMamba, batch, Candidate("32-true"))
    torch.manual_seed(0)
    profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
                         callbacks=[profiler])
    trainer.fit(TinyMamba(), DataLoader(list(batch) * 2, batch_size=2))
    measured = profiler.rows[-1]["tracked_peak"]
    print(f"Mamba 2 x 16 tokens: plan {predicted.peak:,} B, HBMProfiler {measured:,} B")
    assert abs(predicted.peak - measured) <= 8, (predicted.peak, measured)
