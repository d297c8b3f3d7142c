"""The models the layer-kind tests share, built from their libraries' own classes and a tiny config (no download).

transformers GPT-2 (Conv1D), T5 (``_keep_in_fp32_modules``, decoder cache), Mixtral (3-D experts), BERT with a
classifier head, OLMoE, Qwen2-MoE, DeepSeek-V3, Mamba; ``nn.TransformerEncoder`` (``nn.MultiheadAttention``);
blocks in an ``nn.Sequential``; a torchvision-Swin-like attention reading its ``qkv`` weight; a ResNet-like CNN
with BatchNorm and a ViT-like classifier. The ``Wrapped`` LightningModule and the short ``fit`` helpers train them.
"""

from __future__ import annotations

from typing import Any, Callable

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.layers import base_layer, find_layers
from lightning_hbm.memory import quantization_tensors, unique_bytes

VOCAB, SEQ, BATCH = 128, 16, 4
# width 128: every quantized layer holds >= 16k weights, so bitsandbytes' per-layer constants (a 1 KiB
# nested code book with nf4-dq) stay under 0.1 B/param, as they do (far below) at real model sizes
WIDTH = 128


class EncoderLM(nn.Module):
    """A small language model on torch's own nn.TransformerEncoder (nn.MultiheadAttention inside)."""

    def __init__(self, width: int = WIDTH, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask))



class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))



class SequentialLM(nn.Module):
    """Blocks in an nn.Sequential, as timm / torchvision encoders keep them."""

    def __init__(self, width: int = WIDTH, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))



def gpt2() -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0))



def t5() -> nn.Module:
    config = T5Config(d_model=WIDTH, d_ff=2 * WIDTH, num_layers=2, num_heads=2, d_kv=WIDTH // 2, vocab_size=VOCAB, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)



def mixtral() -> nn.Module:
    config = MixtralConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return MixtralForCausalLM(config)



def bert() -> nn.Module:
    config = BertConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * WIDTH, vocab_size=VOCAB,
        max_position_embeddings=SEQ, num_labels=3,
    )
    return BertForSequenceClassification(config)



class Wrapped(pl.LightningModule):
    """The user's LightningModule around one of the models above."""

    def __init__(self, model: nn.Module, task: str) -> None:
        super().__init__()
        self.model, self.task = model, task

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.task == "causal":
            return self.model(input_ids=tokens, labels=tokens).loss
        if self.task == "seq2seq":
            return self.model(input_ids=tokens, labels=tokens.flip(1)).loss
        if self.task == "classify":
            return self.model(input_ids=tokens, labels=tokens[:, 0] % 3).loss
        logits = self.model(tokens)  # plain torch LM: next-token prediction
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.task in ("causal", "classify"):
            return self.model(input_ids=tokens).logits
        if self.task == "seq2seq":
            return self.model(input_ids=tokens, decoder_input_ids=tokens).logits
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)



MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "causal"),
    "t5": (t5, "seq2seq"),
    "mixtral": (mixtral, "causal"),
    "bert": (bert, "classify"),
    "transformer_encoder": (EncoderLM, "plain"),
    "sequential": (SequentialLM, "plain"),
}



def build(name: str, seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    factory, task = MODELS[name]
    return Wrapped(factory(), task)



def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))



class GradientRecorder(pl.Callback):
    """Losses of every step; the LoRA parameters that had no gradient after some backward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.no_grad: set[str] = set()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.no_grad |= {n for n, p in pl_module.named_parameters() if ".lora_" in n and p.grad is None}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))



def fit(module: Wrapped, mode: str, steps: int = 8, lora: dict | None = None, tmp_path: Any = None, **plugin: Any) -> GradientRecorder:
    recorder = GradientRecorder()
    batch = tokens()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision(mode, dtype="float32", **plugin)],
        callbacks=[LoRA(r=8, alpha=16, **(lora or {})), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([batch] * steps, batch_size=None))
    return recorder



def quantized_bytes_per_param(module: nn.Module) -> dict[str, float]:
    """Per kind: storage bytes of the quantized weights (constants included) per logical weight element."""
    tensors: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for _, layer, kind in find_layers(module):
        layer = base_layer(layer)
        if isinstance(layer, nn.Linear) and not layer.weight.is_floating_point():
            tensors.setdefault(kind.name, []).extend([layer.weight, *quantization_tensors(layer)])
            if getattr(layer, "state", None) is not None and getattr(layer.state, "SCB", None) is not None:
                tensors[kind.name].append(layer.state.SCB)
            counts[kind.name] = counts.get(kind.name, 0) + layer.in_features * layer.out_features
    return {k: unique_bytes(tensors[k]) / counts[k] for k in counts}



def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    return ((reference - approximation).norm() / reference.norm()).item()



def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ, eos_token_id=0, pad_token_id=0,
    )
    return OlmoeForCausalLM(config)



def mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, eos_token_id=0, pad_token_id=0))



class SwinLikeAttention(nn.Module):
    """torchvision Swin's attention: its parent reads ``self.qkv.weight`` and calls a function, never ``self.qkv``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))



class SwinLikeLM(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.layers = nn.ModuleList(nn.Sequential(SwinLikeAttention(width), Block(width)) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)



def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return Qwen2MoeForCausalLM(config)



def deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        vocab_size=VOCAB, max_position_embeddings=SEQ, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return DeepseekV3ForCausalLM(config)



MODELS_24: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "olmoe": (olmoe, "causal"),
    "deepseek_v3": (deepseek_v3, "causal"),
    "qwen2_moe": (qwen2_moe, "causal"),
    "mamba": (mamba, "causal"),
    "swin_like": (SwinLikeLM, "plain"),
}



def build_any(name: str, seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    factory, task = {**MODELS, **MODELS_24}[name]
    return Wrapped(factory(), task)



def fit_epochs(name: str, epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> tuple[Wrapped, GradientRecorder]:
    """Whole epochs of 2 different batches (a resumed run replays the same batches), nf4-dq + LoRA + checkpointing."""
    module = build_any(name)
    return module, fit_epochs_module(module, epochs, tmp_path, ckpt_path, save)



def fit_epochs_module(module: Wrapped, epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> GradientRecorder:
    recorder = GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=8, alpha=16), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([tokens(1), tokens(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return recorder



class BasicBlock(nn.Module):
    """torchvision ResNet's BasicBlock: Conv2d + BatchNorm2d, twice, and the residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))



class ResNetLike(nn.Module):
    """torchvision's resnet18 layout in miniature (no torchvision here: it does not import beside torch 2.13)."""

    def __init__(self, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.layer2 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x))))).mean((2, 3)))



class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ResNetLike()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images).float(), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)



def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)



def fit_cnn(epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> tuple[Classifier, GradientRecorder]:
    torch.manual_seed(0)
    module, recorder = Classifier(), GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
        callbacks=[LoRA(r=4), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([images(1), images(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "cnn.ckpt")
    return module, recorder



class MLPBlock(nn.Sequential):
    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))



class EncoderBlock(nn.Module):
    """torchvision ViT's EncoderBlock: nn.MultiheadAttention and an MLP, pre-norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))



class ViTLike(nn.Module):
    """torchvision's vit_b_16 layout in miniature: encoder.layers is an nn.Sequential built from an OrderedDict,
    the class token and position table are 3-D Parameters [1, ., width]."""

    def __init__(self, width: int = 64, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        from collections import OrderedDict

        self.conv_proj = nn.Conv2d(3, width, 4, stride=4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.randn(1, 5, width) * 0.02)
        self.encoder.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", EncoderBlock(width)) for i in range(layers)))
        self.encoder.ln = nn.LayerNorm(width)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(width, classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.encoder.pos_embedding
        return self.heads(self.encoder.ln(self.encoder.layers(x))[:, 0])



class Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.downsample = nn.Linear(width, width)
        self.blocks = nn.Sequential(Block(width), Block(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))



class ViTClassifier(Classifier):
    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model = ViTLike()
