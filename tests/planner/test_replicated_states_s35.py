"""Adam's 0-dim ``step`` tensors are whole on every FSDP2 rank (session 35, issue 53's last bytes).

``shard_categories`` split every optimizer state by the world size, the 0-dim ``step`` tensors too, which FSDP2 leaves
plain tensors on each rank beside the sharded DTensor states: the per-rank plans read 56-60 B under the 2-rank Llama
layouts (``tests/strategies/test_fsdp_remainder_units_s34.py``) and 32 B under the nanoGPT one, half of 4 B per
trainable parameter. The measured figures are in those tests; here the rule and the bytes it takes from the trace.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch

from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, predict, shard_categories

TINY = dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1)


def test_replicated_states_stay_whole_on_each_rank() -> None:
    categories = {"parameters": 1000, "gradients": 100, "optimizer_states": 264, "activations": 50, "other": 0}
    per_rank = shard_categories(categories, world_size=2, replicated_state_bytes=64)
    assert per_rank["optimizer_states"] == 100 + 64  # (264 - 64) / 2 sharded, 64 whole
    assert shard_categories(categories, world_size=2)["optimizer_states"] == 132  # the old rule: everything split


@pytest.mark.filterwarnings("ignore")
def test_prediction_counts_the_step_tensors_a_real_step_makes() -> None:
    from lightning_hbm.planner.reference import _step
    from lightning_hbm.planner.tracing import apply_candidate

    factory, batch, candidate = partial(LlamaLM, **TINY), synthetic_batch(2, 8, vocab_size=256), Candidate("nf4", lora_r=4)
    prediction = predict(factory, batch, candidate)
    plugin = candidate.precision_plugin("cpu")
    module = factory()
    optimizers = apply_candidate(module, candidate, plugin, device="cpu", batch=batch)
    _step(module, batch, plugin, optimizers)
    steps = [t for o in optimizers for state in o.state.values() for t in state.values()
             if isinstance(t, torch.Tensor) and t.dim() == 0]
    assert len(steps) == sum(p.requires_grad for p in module.parameters()) > 0  # one per trainable parameter
    assert prediction.replicated_state_bytes == sum(t.element_size() for t in steps)
    per_rank = prediction.per_rank(2)
    sharded = prediction.categories["optimizer_states"] - prediction.replicated_state_bytes
    assert per_rank["optimizer_states"] == -(-sharded // 2) + prediction.replicated_state_bytes
