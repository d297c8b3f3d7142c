"""The first step's rerun (``adapters/lora/input_grads.py``) draws as the first run did from every global RNG.

Was (session 30): only torch's CPU and CUDA generators were put back before the rerun, so a step drawing from Python's
``random`` or NumPy (a masking ratio, a crop) drew other numbers in the rerun than a model with the fix from the start,
and the fit differed from the fixed model's though the warning says "same batch, random state".
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from lightning_hbm import LoRA
from tests.adapters.test_input_grads_s30 import Model, fit, tokens


class Drawing(Model):
    """The session-30 Reformer-like model whose step scales its loss by draws from Python's and NumPy's RNGs."""

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        scale = 1.0 + random.random() + float(np.random.rand())
        return super().training_step(batch, batch_idx) * scale


@pytest.mark.slow  # two 2-step fits
def test_the_rerun_draws_the_python_and_numpy_numbers_of_the_first_run() -> None:
    random.seed(0)
    np.random.seed(0)
    mended = Drawing()
    fit(mended, [tokens(1), tokens(2)], steps=2)
    random.seed(0)
    np.random.seed(0)
    fixed = Drawing(fix=True)
    fit(fixed, [tokens(1), tokens(2)], steps=2)
    want, got = LoRA.adapter_state_dict(fixed), LoRA.adapter_state_dict(mended)
    assert set(want) == set(got) and want
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)  # was: other draws in the rerun
