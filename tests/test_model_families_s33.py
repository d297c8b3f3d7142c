"""Model families nobody here wrote, session 33 (issue 53, "a plan for every model").

transformers' Mimi: the planner's trace corrupted the heap (found in session 32). Each ``MimiConv1d`` holds
``padding_left``/``padding_right`` as plain tensor attributes (neither parameters nor buffers), and each codebook
caches ``_embed`` so. The template's copy for each trace (``planner/building.py`` ``_fake_copy``) made fresh fakes of
parameters and buffers only: ``copy.deepcopy`` made each a FakeTensor of a copy of the template's fake mode (the mode object
itself deep-copied), and a few plans later the process died with a segmentation fault (glibc:
"corrupted double-linked list"). Now every tensor attribute is made a fresh fake of the copy's mode, as parameters
and buffers are. ``benchmarks/mimi_plan_crash.py`` is the smallest reproduction (run here in a subprocess, so a
regression fails this test instead of killing the suite).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import lightning.pytorch as pl
import pytest
from torch._subclasses.fake_tensor import FakeTensor

from lightning_hbm.planner.building import _build, _fake_mode, build_template
from lightning_hbm.planner.realvalues import RealValues

transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# glibc's checking allocator (glibc >= 2.34) finds the corrupted heap at once: without it 1 run in 5 of 6 predictions
# ended cleanly on the old code (session 33, 2-core dev machine); with it every run crashed by the 4th prediction
MALLOC_DEBUG = Path("/usr/lib/x86_64-linux-gnu/libc_malloc_debug.so")


class _Conv(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers.models.mimi import modeling_mimi as mimi

        config = mimi.MimiConfig(hidden_size=16, num_filters=4, codebook_dim=4, codebook_size=8)
        self.conv = mimi.MimiConv1d(config, 4, 4, 4, stride=2)
        self.codebook = mimi.MimiEuclideanCodebook(config)
        self.codebook.embed  # noqa: B018  # the cached property: a plain tensor attribute from now on


def test_a_tensor_held_as_a_plain_attribute_is_a_fresh_fake_of_each_copy() -> None:
    """Was: the copy's ``padding_left`` a FakeTensor of a deep copy of the template's fake mode."""
    template = build_template(_Conv)
    fake_mode = _fake_mode()
    copied = _build(template, fake_mode, RealValues(fake_mode))
    for tensor in (copied.conv.padding_left, copied.conv.padding_right, copied.codebook._embed):
        assert isinstance(tensor, FakeTensor) and tensor.fake_mode is fake_mode
    assert copied.conv.padding_left.shape == template.module.conv.padding_left.shape


@pytest.mark.slow
def test_mimi_encoder_and_quantizer_plan_repeatedly_without_crashing() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONFAULTHANDLER="1")
    if MALLOC_DEBUG.exists():
        env.update(LD_PRELOAD=str(MALLOC_DEBUG), MALLOC_CHECK_="3")
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "mimi_plan_crash.py"), "6"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0 and "no crash" in run.stdout, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
