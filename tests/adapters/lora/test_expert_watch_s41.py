"""MoE experts whose adapters never trained in a whole fit are warned at its end, by name (issue 53).

An expert no token of the first batch reaches cannot be judged at fit start (FlexOlmo, Aria: it trains once tokens
reach it; a warning then would fire on healthy runs), so nothing was said, even when no token ever reached it. Now
``LoRA`` watches each expert of a ``LinearExperts`` over the fit and, at its end, names the experts whose adapters never
received a non-zero gradient, with the count and the fix; silent when every expert trained, including one that no
token reached in the first step. A real transformers Qwen3-MoE (4 experts, top-2) from its config, routed by its own
router, with a bias on one expert's router logit (a forward hook on ``mlp.gate``) that keeps tokens away from it.
"""

from __future__ import annotations

import re
import warnings
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_hbm import LoRA
from lightning_hbm.data import synthetic_batch

VOCAB, STEPS, AVOIDED = 128, 4, 3
FIELDS = dict(pad_token_id=0, bos_token_id=0, eos_token_id=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2,
              intermediate_size=32, moe_intermediate_size=16, max_position_embeddings=64)  # fmt: skip


class BiasedMoE(pl.LightningModule):
    """Qwen3-MoE whose routers see ``-1e4`` added to expert :data:`AVOIDED`'s logit for the first ``biased`` steps."""

    def __init__(self, biased: int) -> None:
        super().__init__()
        import transformers

        torch.manual_seed(0)
        self.model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**FIELDS))
        self.biased = biased
        for layer in self.model.model.layers:
            layer.mlp.gate.register_forward_hook(self._bias)

    def _bias(self, gate: torch.nn.Module, args: Any, output: Any) -> Any:
        if self.trainer.global_step >= self.biased:
            return output
        logits = output[0].clone()
        logits[:, AVOIDED] -= 1e4  # the router's own softmax and top-k, on biased logits
        probs = torch.softmax(logits, dtype=torch.float, dim=-1)
        top, index = torch.topk(probs, gate.top_k, dim=-1)
        return logits, (top / top.sum(dim=-1, keepdim=True)).to(logits.dtype), index

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        tokens, targets = batch
        return self.model(input_ids=tokens, labels=targets.contiguous(), use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-3)


def _fit(biased: int, tmp_path: Any) -> tuple[LoRA, list[str]]:
    data = [synthetic_batch(2, 8, vocab_size=VOCAB, seed=i) for i in range(STEPS)]
    lora = LoRA(r=4)
    trainer = pl.Trainer(accelerator="cpu", max_steps=STEPS, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path, callbacks=[lora])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(BiasedMoE(biased), DataLoader(data, batch_size=None))
    return lora, [str(w.message) for w in caught if "MoE experts" in str(w.message)]


def test_an_expert_no_token_ever_reached_is_warned_at_fit_end(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    lora, warned = _fit(STEPS, tmp_path)
    [message] = warned
    experts = [f"model.model.layers.{i}.mlp.experts expert {AVOIDED}" for i in range(2)]
    assert f"the adapters of 2 of 8 MoE experts never received a non-zero gradient in this fit's {STEPS} backward" in message
    assert all(e in message for e in experts), message
    assert "load-balancing loss" in message and "train more steps" in message and "exclude_modules" in message
    # the fix names exactly the avoided experts' adapters, as LoRA(exclude_modules=...) takes them
    named = re.search(r"exclude_modules=(\[.*\])", message)
    assert named is not None and eval(named.group(1)) == lora.untrained_experts
    assert lora.untrained_experts == sorted(f"model.model.layers.{i}.mlp.experts.{p}.{AVOIDED}"
                                            for i in range(2) for p in ("gate_up_proj", "down_proj"))  # fmt: skip


def test_silent_when_every_expert_trains_even_one_the_first_step_missed(tmp_path: Any) -> None:
    pytest.importorskip("transformers")
    for biased in (0, 1):  # every step routed by the router alone; the first step kept away from one expert
        lora, warned = _fit(biased, tmp_path)
        assert warned == [] and lora.untrained_experts == [], (biased, warned)
