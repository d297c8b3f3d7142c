"""The planner on twenty decoder families its tests never built (session 38, issue 51): plan vs torch's MemTracker.

For each family (a transformers causal LM from a tiny config: hidden 64, 2 layers, vocabulary 512), under the library's
default recipe (``QuantizedPrecision("nf4-dq", dtype="float32")``, ``LoRA(r=8)``, ``ActivationCheckpointing()``,
``FusedLoss()``), batch ``synthetic_batch(2, 32)``:

* ``default``: the plan's peak against MemTracker's peak of one steady-state step;
* ``corr8``: the same with ``correction_rank=8`` (issue 52; the probe batch is the step's);
* ``maxctx``: ``max_context(device="cpu", multiple_of=16)`` for a byte budget (the plan's total at 1,024 tokens with
  full checkpointing), then MemTracker at the answer, at the next length up (16 tokens more: the answer is the longest
  that fits only if that one is over) and at 25 % longer, under max_context's choices.

``--no-module-hooks``: MemTracker without its module hooks (``memtracker_peak(..., module_hooks=False)``; a Trainer
installs none). With them, Mamba2 and Zamba2 measure one more gradient than the step holds: the hook on the gated
RMSNorm's two inputs buffers the first one's until the second's arrives (512 B per token here; session 40,
tests/planner/test_max_context_ssm_s40.py).

    OMP_NUM_THREADS=1 python benchmarks/planner_families_s38.py qwen3 gemma3 ...   # names below; none: all
    OMP_NUM_THREADS=1 python benchmarks/planner_families_s38.py --steps pc qwen3   # p default, c corr8, m maxctx
    OMP_NUM_THREADS=1 python benchmarks/planner_families_s38.py --steps m --budget-tokens 256 jamba  # a shorter answer
    OMP_NUM_THREADS=1 python benchmarks/planner_families_s38.py --steps p --no-module-hooks mamba2  # without ModTracker

One process per family is the way to run them all (a family that fails does not stop the others).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
import warnings
from functools import partial
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "planner")]  # this checkout's lightning_hbm, the test families
from planner_families import HFCausalLM  # noqa: E402

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision  # noqa: E402
from lightning_hbm.data import synthetic_batch  # noqa: E402
from lightning_hbm.planner import max_context, plan  # noqa: E402
from lightning_hbm.planner.reference import memtracker_peak  # noqa: E402

V = 512
T = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=V)
LM = dict(T, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192)
MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3": ("Qwen3Config", dict(LM, intermediate_size=128, head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(LM, **MOE, intermediate_size=64, moe_intermediate_size=32, head_dim=16)),
    "gemma3": ("Gemma3TextConfig", dict(LM, intermediate_size=128, head_dim=16, sliding_window=8)),
    "cohere": ("CohereConfig", dict(LM, intermediate_size=128)),
    "cohere2": ("Cohere2Config", dict(LM, intermediate_size=128, sliding_window=8)),
    "stablelm": ("StableLmConfig", dict(LM, intermediate_size=128)),
    "gpt_bigcode": ("GPTBigCodeConfig", dict(T, n_embd=64, n_layer=2, n_head=4, n_positions=8192)),
    "mamba2": ("Mamba2Config", dict(T, hidden_size=64, num_hidden_layers=2, state_size=8, num_heads=8, head_dim=16, n_groups=1, expand=2)),
    "jamba": ("JambaConfig", dict(LM, intermediate_size=64, num_experts=4, num_experts_per_tok=2, attn_layer_period=2,
                                  attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8, mamba_expand=2)),
    "zamba2": ("Zamba2Config", dict(LM, intermediate_size=128, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8,
                                    layers_block_type=["mamba", "hybrid"], num_mem_blocks=1, use_mem_rope=False)),
    "falcon_h1": ("FalconH1Config", dict(LM, intermediate_size=128, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16,
                                         mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16)),
    "falcon_mamba": ("FalconMambaConfig", dict(T, hidden_size=64, num_hidden_layers=2, state_size=8)),
    "granitemoe": ("GraniteMoeConfig", dict(LM, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2)),
    "glm": ("GlmConfig", dict(LM, intermediate_size=128, head_dim=16)),
    "olmo2": ("Olmo2Config", dict(LM, intermediate_size=128)),
    "lfm2": ("Lfm2Config", dict(LM, intermediate_size=128, layer_types=["conv", "full_attention"])),
    "smollm3": ("SmolLM3Config", dict(LM, intermediate_size=128)),
    "exaone4": ("Exaone4Config", dict(LM, intermediate_size=128, sliding_window=8)),
    "ernie4_5": ("Ernie4_5Config", dict(LM, intermediate_size=128, head_dim=16)),
    "olmo": ("OlmoConfig", dict(LM, intermediate_size=128)),
}  # fmt: skip


def _recipe(**fields: Any) -> tuple[QuantizedPrecision, list[Any]]:
    return QuantizedPrecision("nf4-dq", dtype="float32", **fields), [LoRA(r=8), ActivationCheckpointing(), FusedLoss()]


def _against_memtracker(name: str, factory: Any, label: str, plugin: Any, callbacks: list[Any], batch: Any, hooks: bool = True) -> None:
    start = time.time()
    planned = plan(factory, batch, plugin=plugin, callbacks=callbacks)
    if planned.failures or not planned.predictions:
        print(f"RESULT {name} {label}: plan failed {planned.failures}")
        return
    predicted = planned.chosen
    measured = memtracker_peak(factory, batch, predicted.candidate, module_hooks=hooks)
    print(f"RESULT {name} {label}{'' if hooks else ' (no module hooks)'}: plan {predicted.peak:,} measured {measured:,} {(predicted.peak - measured) / measured * 100:+.2f}% "
          f"fallbacks={predicted.fallbacks} ({time.time() - start:.0f} s)")  # fmt: skip


def _max_context(name: str, factory: Any, tokens: int = 1024, hooks: bool = True) -> None:
    start = time.time()
    plugin = QuantizedPrecision("nf4-dq", dtype="float32")
    full = [LoRA(r=8), ActivationCheckpointing("full"), FusedLoss()]
    budget = plan(factory, synthetic_batch(1, tokens, vocab_size=V), plugin=plugin, callbacks=full).chosen.total
    result = max_context(factory, budget, plugin=plugin, callbacks=[LoRA(r=8)], device="cpu", multiple_of=16)
    assert not isinstance(result, list)
    candidate = result.prediction.candidate

    def measured(tokens: int) -> int:
        batch = tuple(t.contiguous() for t in synthetic_batch(1, tokens, vocab_size=V))
        return memtracker_peak(factory, batch, candidate, module_hooks=hooks)

    at, up, longer = measured(result.tokens), measured(result.tokens + 16), measured(result.tokens * 5 // 4 // 16 * 16)
    print(f"RESULT {name} maxctx: budget {budget:,} -> {result.tokens} tokens (mlp_chunks {result.choices['mlp_chunks']}), "
          f"predicted {result.prediction.peak:,} measured {at:,} ({(result.prediction.peak - at) / at * 100:+.2f}%) fits={at <= budget}, "
          f"next up ({result.tokens + 16}) {up:,} over={up > budget}, +25% {longer:,} over={longer > budget} ({time.time() - start:.0f} s)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("names", nargs="*", default=list(FAMILIES))
    parser.add_argument("--steps", default="pcm")
    parser.add_argument("--budget-tokens", type=int, default=1024, help="max_context's budget: the plan's total at this length")
    parser.add_argument("--no-module-hooks", action="store_true", help="MemTracker without its module hooks")
    args = parser.parse_args()
    hooks = not args.no_module_hooks
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    batch = synthetic_batch(2, 32, vocab_size=V)
    for name in args.names:
        config, fields = FAMILIES[name]
        factory = partial(HFCausalLM, config, **fields)
        steps = {"p": partial(_against_memtracker, name, factory, "default", *_recipe(), batch, hooks),
                 "c": partial(_against_memtracker, name, factory, "corr8", *_recipe(correction_rank=8, probe_batch=batch), batch, hooks),
                 "m": partial(_max_context, name, factory, args.budget_tokens, hooks)}  # fmt: skip
        for step in args.steps:
            try:
                steps[step]()
            except Exception as err:  # one family's failure is a result too
                traceback.print_exc()
                print(f"RESULT {name} {step}: {type(err).__name__}: {str(err)[:300]}")


if __name__ == "__main__":
    main()
