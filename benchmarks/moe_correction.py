"""Held-out loss of a small trained Qwen3-MoE as each quantized base stores it, before any LoRA training (issue 52).

A transformers ``Qwen3MoeForCausalLM`` from a config (byte vocabulary, ``--hidden`` wide, 8 experts, top-2) is trained
in fp32 for ``--steps`` AdamW steps on byte text (``ByteTextDataModule``, the standard library's sources) so that its
weights carry data-like statistics, then quantized by ``QuantizedPrecision`` (the library's own surgery, no Trainer,
fp32 compute) with the probe batch = the first ``--probe`` training windows. The loss is the mean next-token loss on
``--val`` validation windows the probe never saw. Arms: ``nf4-dq`` (no correction), ``c{r} without experts`` (the
rank-r correction with the experts' factors zeroed: what the library did before session 41, whose experts got none),
``c{r}`` (every quantized layer, the experts included: the tokens routed to each expert on the probe), and the same
with GPTQ rounding. ``gap closed`` = ``(loss(nf4-dq) - loss(arm)) / (loss(nf4-dq) - loss(fp32))``.

    OMP_NUM_THREADS=2 PYTHONPATH=. python benchmarks/moe_correction.py --seeds 0 1
"""

from __future__ import annotations

import argparse
import copy
import logging
import warnings
from typing import Any, Optional

import torch
import transformers

from lightning_hbm import QuantizedPrecision
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.layers.experts import LinearExperts


class MoeLM(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


@torch.no_grad()
def held_out_loss(model: torch.nn.Module, batches: list[Any]) -> float:
    model.eval()
    losses = [torch.nn.functional.cross_entropy(model(x).float().flatten(0, 1), y.flatten()) for x, y in batches]
    return torch.stack(losses).mean().item()


def moe_model(seed: int, hidden: int, intermediate: Optional[int] = None) -> MoeLM:
    """A 2-layer Qwen3-MoE of 8 experts (2 per token), each expert ``intermediate`` wide (default ``hidden``), seeded."""
    torch.manual_seed(seed)
    config = transformers.Qwen3MoeConfig(
        vocab_size=256, pad_token_id=0, bos_token_id=0, eos_token_id=0, hidden_size=hidden, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, num_experts=8, num_experts_per_tok=2,
        intermediate_size=2 * hidden, moe_intermediate_size=intermediate or hidden, tie_word_embeddings=False,
    )  # fmt: skip
    return MoeLM(transformers.AutoModelForCausalLM.from_config(config)).train()


def trained(seed: int, hidden: int, steps: int, data: ByteTextDataModule) -> MoeLM:
    model = moe_model(seed, hidden)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = data.train_dataloader()
    step = 0
    while step < steps:
        for x, y in loader:
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % 50 == 0:
                print(f"  step {step}: training loss {loss.item():.3f}", flush=True)
            if step == steps:
                break
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--probe", type=int, default=32, help="probe windows (32 x 64 = 2048 tokens, the default probe's size)")
    parser.add_argument("--val", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="training windows per step")
    parser.add_argument("--no-gptq", action="store_true", help="leave out the GPTQ arms")
    args = parser.parse_args()
    logging.getLogger("lightning_hbm").setLevel(logging.WARNING)
    warnings.simplefilter("ignore")
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, train_samples=4096, val_samples=args.val, max_bytes=2_000_000)
    probe = torch.cat([x for x, _ in data.train_dataloader()][: max(1, args.probe // args.batch)])  # the first training windows
    val = list(data.val_dataloader())
    r = args.rank
    arms: dict[str, dict[str, Any]] = {
        "nf4-dq": {}, f"nf4-dq+c{r} without experts": dict(correction_rank=r, zero_experts=True), f"nf4-dq+c{r}": dict(correction_rank=r),
        f"nf4-dq+gptq+c{r} without experts": dict(rounding="gptq", correction_rank=r, zero_experts=True),
        f"nf4-dq+gptq+c{r}": dict(rounding="gptq", correction_rank=r),
    }  # fmt: skip
    arms = {arm: settings for arm, settings in arms.items() if not (args.no_gptq and "gptq" in arm)}
    print(f"Qwen3-MoE hidden {args.hidden}, 2 layers, 8 experts top-2, {args.steps} fp32 steps; probe {tuple(probe.shape)}, "
          f"{len(val)} val batches; rank {r}")
    for seed in args.seeds:
        model = trained(seed, args.hidden, args.steps, data)
        base = held_out_loss(model, val)
        plain = None
        print(f"seed {seed}: fp32 {base:.4f}")
        for arm, settings in arms.items():
            settings = dict(settings)
            zero = settings.pop("zero_experts", False)
            quantized = copy.deepcopy(model)
            QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, quantize_embeddings=False, **settings).convert_module(quantized)
            experts = [linear for sub in quantized.modules() if isinstance(sub, LinearExperts) for linear in [*sub.gate_up_proj, *sub.down_proj]]
            corrected = sum(correction_of(linear) is not None for linear in experts)
            if zero:
                with torch.no_grad():
                    for linear in experts:
                        correction = correction_of(linear)
                        if correction is not None:
                            correction.left.zero_()
            loss = held_out_loss(quantized, val)
            plain = loss if arm == "nf4-dq" else plain
            gap = "" if plain is None or plain == base else f"  gap closed {(plain - loss) / (plain - base):+.1%}"
            print(f"  {arm:32s} {loss:.4f} ({(loss - base) / base:+.2%} vs fp32){gap}; experts corrected {0 if zero else corrected}/{len(experts)}")


if __name__ == "__main__":
    main()
