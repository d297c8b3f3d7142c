"""The callbacks' former module paths (``lightning_hbm/callbacks/__init__.py``) still import, as the same modules: a
config.yaml that LightningCLI saved before the move (``class_path: lightning_hbm.callbacks.lora.LoRA``) keeps loading."""

from __future__ import annotations

import importlib

import pytest

import lightning_hbm

FORMER = {
    "lightning_hbm.callbacks.activation_checkpointing": ("ActivationCheckpointing", "lightning_hbm.activations.checkpointing"),
    "lightning_hbm.callbacks.attention_kernel": ("AttentionKernel", "lightning_hbm.activations.attention.kernel"),
    "lightning_hbm.callbacks.fused_loss": ("FusedLoss", "lightning_hbm.activations.loss"),
    "lightning_hbm.callbacks.lora": ("LoRA", "lightning_hbm.adapters.lora"),
    "lightning_hbm.callbacks.optimizer": ("MemoryEfficientOptimizer", "lightning_hbm.optim.optimizer"),
    "lightning_hbm.callbacks.profiler": ("HBMProfiler", "lightning_hbm.profiling.profiler"),
    "lightning_hbm.callbacks.quality": ("QuantizationQuality", "lightning_hbm.quality"),
}


@pytest.mark.parametrize("former", sorted(FORMER))
def test_former_path_is_the_new_module(former: str) -> None:
    name, module = FORMER[former]
    # what jsonargparse does with a class_path: import the module, read the class
    assert importlib.import_module(former) is importlib.import_module(module)
    assert getattr(importlib.import_module(former), name) is getattr(lightning_hbm, name)


def test_former_names_of_helpers_still_import() -> None:
    from lightning_hbm.callbacks.activation_checkpointing import find_blocks
    from lightning_hbm.callbacks.fused_loss import chunk_tokens, softmax_rows
    from lightning_hbm.callbacks.quality import compare_outputs, probe_output
    from lightning_hbm.layers.blocks import find_blocks as moved

    assert find_blocks is moved and callable(chunk_tokens) and callable(softmax_rows)
    assert callable(compare_outputs) and callable(probe_output)
