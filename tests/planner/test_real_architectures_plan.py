"""``plan()`` on transformers Qwen2-MoE, Mamba and GPT-OSS configured as a user runs them, against torch's MemTracker.

The configuration is the Trainer's own (``plan(plugin=, callbacks=)``): QLoRA (nf4-dq, fp32 compute on this CPU),
LoRA r=8, full checkpointing, FusedLoss. Qwen2-MoE: ``shared_expert_gate`` (width 1) is narrower than r, so LoRA
excludes it (the router is no Linear; the experts' 3-D weights become per-expert Linears, quantized and adapted).
Mamba: on the path that trains (no CUDA kernels) ``MambaMixer.forward`` reads ``dt_proj.weight`` directly (a matmul),
so it is stored quantized as a ``ReadableLinear`` whose weight computes from the storage (session 22; narrower than r:
no adapter); ``x_proj``, read only by the kernel branch, is quantized. Both heads are fused. Tiny configs (random weights), batch 2 x 64.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import pytest
from planner_families import HFCausalLM

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.data import synthetic_batch
from lightning_hbm.planner import plan
from lightning_hbm.planner.reference import memtracker_peak

VOCAB = 512
BATCH = synthetic_batch(2, 64, vocab_size=VOCAB)

QWEN2_MOE = partial(
    HFCausalLM, "Qwen2MoeConfig", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
    shared_expert_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    num_experts=4, num_experts_per_tok=2, max_position_embeddings=128, eos_token_id=0, pad_token_id=0, bos_token_id=0,
)  # fmt: skip
# experts in 3-D Parameters run through aten._grouped_mm (biased: not converted to Linears, named by the coverage
# table); its meta kernel refuses float32 in torch 2.13, which the planner works around (_compat.torch.FakeGroupedMM)
GPT_OSS = partial(
    HFCausalLM, "GptOssConfig", vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
    sliding_window=8, max_position_embeddings=128, eos_token_id=0, pad_token_id=0, bos_token_id=0,
)  # fmt: skip
MAMBA = partial(
    HFCausalLM, "MambaConfig", vocab_size=VOCAB, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2,
    conv_kernel=4, eos_token_id=0, pad_token_id=0,
)  # fmt: skip


def qwen2_moe_setup() -> tuple[Any, list[Any]]:
    lora = LoRA(r=8, exclude_modules=["shared_expert_gate"])  # width 1: narrower than r
    return QuantizedPrecision("nf4-dq", dtype="float32"), [lora, ActivationCheckpointing(), FusedLoss()]


def mamba_setup() -> tuple[Any, list[Any]]:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")
    return plugin, [LoRA(r=8), ActivationCheckpointing(), FusedLoss()]


CASES: dict[str, tuple[Callable[[], Any], Callable[[], tuple[Any, list[Any]]]]] = {
    "qwen2_moe": (QWEN2_MOE, qwen2_moe_setup),
    "mamba": (MAMBA, mamba_setup),
    "gpt_oss": (GPT_OSS, mamba_setup),  # the same plain configuration
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_plan_as_configured_within_3_percent_of_memtracker(name: str) -> None:
    factory, setup = CASES[name]
    plugin, callbacks = setup()
    planned = plan(factory, BATCH, plugin=plugin, callbacks=callbacks)
    assert len(planned.predictions) == 1 and not planned.failures
    predicted = planned.chosen
    assert predicted.candidate.configured is not None  # the Trainer's own plugin and callbacks, traced as given
    measured = memtracker_peak(factory, BATCH, predicted.candidate)
    print(f"{name}: predicted {predicted.peak:,} B, MemTracker {measured:,} B ({100 * (predicted.peak / measured - 1):+.2f} %)")
    assert predicted.peak == pytest.approx(measured, rel=0.03)
