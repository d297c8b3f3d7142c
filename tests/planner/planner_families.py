"""Tiny models of four families for the planner's accuracy checks (tests and ``benchmarks/planner.py``).

transformers Llama (``lightning_hbm.models.LlamaLM``), GPT-2 (``Conv1D`` layers), BERT (masked LM with an
attention mask), and a plain ``nn.TransformerEncoder`` LM with a causal mask; all built from configs
(random weights, nothing downloaded), all taking ``(input_ids, targets)`` byte-token batches, all
optimizing with ``AdamW(self.parameters())`` as an unchanged user module would.
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate


class HFLM(pl.LightningModule):
    """A transformers model from its config (``kind``: "gpt2" causal LM or "bert" masked LM), loss from the model."""

    def __init__(self, kind: str, **config: Any) -> None:
        super().__init__()
        import transformers

        if kind == "gpt2":
            self.model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=256, **config))
        elif kind == "bert":
            self.model = transformers.BertForMaskedLM(transformers.BertConfig(vocab_size=256, **config))
        else:
            raise ValueError(f"kind must be 'gpt2' or 'bert', got {kind!r}")
        self.kind = kind

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        mask = torch.ones_like(input_ids)  # what a tokenizer gives; transformers checks it for padding
        return self.model(input_ids=input_ids, attention_mask=mask, labels=targets.contiguous()).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class HFCausalLM(pl.LightningModule):
    """A transformers causal LM from its config class (``GPTNeoXConfig``, ``Phi3Config``, ...), loss from ``labels=``."""

    def __init__(self, config: str, **fields: Any) -> None:
        super().__init__()
        import transformers

        self.model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**fields))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        return self.model(input_ids=input_ids, labels=targets.contiguous(), use_cache=False).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class EncoderLM(pl.LightningModule):
    """Embedding, ``nn.TransformerEncoder`` (causal mask), Linear head: plain torch."""

    def __init__(self, vocab: int = 256, width: int = 64, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        layer = nn.TransformerEncoderLayer(width, heads, 4 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, vocab)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        input_ids, targets = batch
        mask = nn.Transformer.generate_square_subsequent_mask(input_ids.shape[1])
        logits = self.head(self.encoder(self.embed(input_ids), mask=mask))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


FAMILIES: dict[str, Callable[[], pl.LightningModule]] = {
    "llama": partial(
        LlamaLM, hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2
    ),
    "gpt2": partial(HFLM, "gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=128),
    "bert": partial(
        HFLM, "bert", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=128,
    ),  # fmt: skip
    "encoder": EncoderLM,
}

# Real vocabularies (32k: the loss is the largest term of the step), for FusedLoss: Llama, GPT-NeoX, Phi-3.
VOCAB_32K = 32000
FAMILIES_32K: dict[str, Callable[[], pl.LightningModule]] = {
    "llama": partial(
        LlamaLM, vocab_size=VOCAB_32K, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2,
    ),
    "neox": partial(
        HFCausalLM, "GPTNeoXConfig", vocab_size=VOCAB_32K, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=256,
    ),
    "phi3": partial(
        HFCausalLM, "Phi3Config", vocab_size=VOCAB_32K, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, pad_token_id=0,
    ),
}  # fmt: skip

# Ten configurations over the four families, every axis (precision, LoRA, checkpointing, optimizer) on each of
# the transformers families; GPT-2's Conv1D layers are quantized and adapted as Linears (lightning_hbm's layer kinds).
MEMTRACKER_CASES: list[tuple[str, Candidate]] = [
    ("llama", Candidate("32-true")),
    ("llama", Candidate("nf4-dq", lora_r=8)),
    ("llama", Candidate("bf16-true", checkpointing="full", optimizer="adamw8bit")),
    ("gpt2", Candidate("nf4-dq", lora_r=8)),
    ("gpt2", Candidate("32-true", checkpointing="full", optimizer="adamw8bit")),
    ("bert", Candidate("32-true")),
    ("bert", Candidate("int8", lora_r=8, checkpointing="selective")),
    ("encoder", Candidate("32-true")),
    ("encoder", Candidate("bf16-true", checkpointing="full")),
    ("encoder", Candidate("32-true", optimizer="adamw8bit")),
]
