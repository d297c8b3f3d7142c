"""The bitsandbytes CPU fast path must never starve an adapter of gradient (issue #37).

On an AVX512-BF16 CPU a no-grad eval forward of a ``Linear4bit`` repacks its weight for a kernel that bypasses
autograd: every adapter upstream of that layer then trains on no gradient, silently. Lightning's sanity check is
exactly such a forward. This runs the real path (a Trainer with the sanity check, the plugin's own 4-bit layers and
bitsandbytes' flag forced on as it is on such CPUs) and asserts that every LoRA adapter moved.
"""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import pytest
import torch

from lightning_hbm import LoRA, QuantizedPrecision


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq"])
def test_every_adapter_trains_after_a_sanity_check(gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any,
                                                   monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # what bitsandbytes sets on AVX512-BF16 CPUs, forced on every CPU so the test means the same everywhere
    # (Linear4bit.__init__ reads it from this name in its own module)
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)
    model = gpt_factory(bias=False)
    lora = LoRA(r=4)  # every Linear: the first block's adapters sit upstream of every 4-bit layer
    trainer = trainer_factory(max_steps=1, limit_val_batches=1, num_sanity_val_steps=1, callbacks=[lora],
                              plugins=[QuantizedPrecision(mode, dtype="float32")])
    trainer.fit(model, datamodule_factory())
    lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    assert lora_b
    # lora_B starts at zero: it is non-zero after one step only if its gradient reached it
    still_zero = sorted(n for n, p in lora_b.items() if not torch.any(p != 0))
    assert not still_zero, f"adapters that got no gradient: {still_zero}"
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and all(layer.support_avx512bf16_for_cpu is False for layer in layers)
