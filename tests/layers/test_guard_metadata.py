"""A metadata read of a guarded weight (``.dtype``, ``.shape``, ``.size()``) is never refused (issue 53, session 32).

Was: ``UnobservedRead`` on ``wo.weight.dtype`` of a Switch Transformers expert the probe sample was not routed to
(``SwitchTransformersDenseActDense.forward`` casts its input to ``self.wo.weight.dtype``): the guard refused any read of
a quantized weight on a path the probe did not take, metadata included. Now the guard answers it as the layer computes:
the compute dtype and the shape it multiplies as, never the packed ``uint8`` storage (to which transformers' cast would
turn the activations). A value read there is still refused. The real class: ``tests/test_model_families_s32.py``.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import readers

VOCAB, WIDTH = 64, 64


class CastsToTheWeight(nn.Module):
    """Reads ``self.lin.weight``'s dtype and shape on a path the first batch does not take (``cast``), and its values
    on another (``exact``), as transformers' MoE experts and Bloom's ``slow_but_exact`` do."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.a, self.lin = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)
        self.cast = self.exact = False
        self.seen: list[tuple[torch.dtype, tuple[int, ...], int, bool]] = []

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.a(self.embed(tokens))
        if self.cast:
            weight = self.lin.weight
            self.seen.append((weight.dtype, tuple(weight.shape), weight.size(0), weight.is_floating_point()))
            x = x.to(self.lin.weight.dtype)
        if self.exact:
            return self.head(F.linear(x, self.lin.weight, self.lin.bias))
        return self.head(self.lin(x))


class Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = CastsToTheWeight()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.model(batch).flatten(0, 1), batch.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def _batch(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_dtype_read_on_a_path_the_probe_did_not_take_answers_the_compute_dtype(tmp_path: Any, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    task = Task()
    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype=dtype)],
                         callbacks=[LoRA(r=4, target_modules=["a", "lin"])])  # fmt: skip
    trainer.fit(task, DataLoader([_batch(1)], batch_size=None))
    model = task.model
    assert not model.lin.base_layer.weight.is_floating_point()  # stored quantized (packed), and guarded
    model.cast = True
    with torch.no_grad():
        out = model(_batch(2).to(model.embed.weight.device))  # was: UnobservedRead ... 'model.lin' directly (dtype)
    assert out.dtype == dtype
    assert model.seen == [(dtype, (WIDTH, WIDTH), WIDTH, True)]  # as the layer computes; not uint8, (2048, 1)
    model.exact = True  # a value read is still refused
    with pytest.raises(readers.UnobservedRead, match=r"CastsToTheWeight.forward read the weight of 'model.lin' directly \(linear\)"):
        model(_batch(2))
