"""The fit-start accuracy check made cheaper without losing what it measures (issue 53 / 54, session 33).

Session 32's check cost 1.34x the time to the first step on SmolLM2-135M (``benchmarks/accuracy_check_cost.py``). Of its
~2 s on this CPU, 0.3 s was ``undo_int8_states`` reading ``.weight`` of every module before asking its type (an int8
input embedding dequantizes its whole table at each read), and the per-layer cosines (``responsible``) ran on every
model though only the warning under the threshold names them. A LightningModule without ``forward`` is measured
through the submodule the reference ran through (the reference hands it on; was: a ``forwarding`` around the check).
Real classes from tiny configs.
"""

from __future__ import annotations

import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

import lightning_hbm.precision.accuracy as accuracy
from lightning_hbm import QuantizedPrecision
from lightning_hbm._compat import bitsandbytes as bnb_compat

transformers = pytest.importorskip("transformers")


def llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                      max_position_embeddings=64)  # fmt: skip
    batch = dict(input_ids=torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1)))
    return transformers.LlamaForCausalLM(config), batch


def test_a_healthy_model_measures_no_per_layer_cosines(monkeypatch: pytest.MonkeyPatch) -> None:
    ran: list[int] = []
    real = accuracy.responsible
    monkeypatch.setattr(accuracy, "responsible", lambda *args: ran.append(1) or real(*args))
    model, batch = llama()
    plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=batch)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(model)
    assert not [str(w.message) for w in seen if "against the model as built" in str(w.message)]
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.cosine > 0.99 and not measured.warned
    assert measured.layers == [] and not ran  # was: every layer's input and output cosines, on every model


class Computed(nn.Module):
    """A layer whose ``weight`` is computed at each read (as an int8 ``QuantizedEmbedding`` dequantizes its table)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0
        self.state = object()

    @property
    def weight(self) -> torch.Tensor:
        self.reads += 1
        return torch.zeros(4, 4)


def test_undo_int8_states_reads_no_weight_of_another_layer() -> None:
    layer = Computed()
    assert bnb_compat.undo_int8_states(nn.Sequential(layer)) == 0
    assert layer.reads == 0  # was: one whole-table dequantization per such layer, 0.3 s of SmolLM2's fit start


class NoForward(pl.LightningModule):
    """A LightningModule without ``forward``: its training_step calls ``self.model``."""

    def __init__(self) -> None:
        super().__init__()
        self.model, self.batch = llama()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.model(**batch).logits.float().mean()


def test_a_module_without_forward_is_measured_through_the_submodule_the_reference_ran_through() -> None:
    module = NoForward()
    plugin = QuantizedPrecision("int8", dtype="float32", probe_batch=module.batch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plugin.convert_module(module)
    measured = plugin.quantization.conv_accuracy
    assert measured is not None and measured.cosine > 0.99
    assert "forward" not in vars(module) and plugin.quantization.measures.stepped is None
