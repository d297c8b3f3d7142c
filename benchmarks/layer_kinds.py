"""Bytes per parameter of every layer kind after quantization, and the output error, on real library classes.

Models are built from their libraries' own classes and small configs (hidden 256, random weights, no
download): transformers GPT-2 (Conv1D), T5, Mixtral (3-D experts), BERT; ``nn.TransformerEncoder``
(nn.MultiheadAttention). For each mode, per layer kind: parameters, storage bytes of the kind's layers
(quantization constants included, exact on CPU) per parameter, and what was left alone; then the
relative error of the logits against the unquantized model (float32 compute).

    python benchmarks/layer_kinds.py [--modes nf4-dq int8-dynamic] [--width 256]
    python benchmarks/layer_kinds.py --checkpointing   # saved activations with / without ActivationCheckpointing
"""

from __future__ import annotations

import argparse
import copy

import torch
from torch import nn

from lightning_hbm import ActivationCheckpointing, quantize_model
from lightning_hbm.layers import base_layer, coverage, find_layers
from lightning_hbm.memory import quantization_tensors, saved_activation_bytes, unique_bytes

VOCAB, SEQ = 1024, 32


def models(width: int) -> dict[str, tuple[nn.Module, str]]:
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

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=4 * width, dropout=0.0, batch_first=True)
    return {
        "GPT-2": (GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=width, n_head=4, vocab_size=VOCAB, n_positions=SEQ)), "causal"),
        "T5": (T5ForConditionalGeneration(T5Config(d_model=width, d_ff=4 * width, num_layers=4, num_heads=4, d_kv=width // 4,
                                                   vocab_size=VOCAB, decoder_start_token_id=0)), "seq2seq"),
        "Mixtral": (MixtralForCausalLM(MixtralConfig(hidden_size=width, intermediate_size=2 * width, num_hidden_layers=4,
                                                     num_attention_heads=4, num_key_value_heads=4, num_local_experts=8,
                                                     vocab_size=VOCAB, max_position_embeddings=SEQ)), "causal"),
        "BERT": (BertForSequenceClassification(BertConfig(hidden_size=width, num_hidden_layers=4, num_attention_heads=4,
                                                          intermediate_size=4 * width, vocab_size=VOCAB,
                                                          max_position_embeddings=SEQ, num_labels=3)), "classify"),
        "nn.TransformerEncoder": (nn.TransformerEncoder(layer, 4, enable_nested_tensor=False), "encoder"),
    }


def quantized_weight_bytes(model: nn.Module) -> dict[str, float]:
    """Per kind: bytes of the quantized weights (constants included) per weight element."""
    tensors: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for _, layer, kind in find_layers(model):
        layer = base_layer(layer)
        if isinstance(layer, nn.Linear) and not layer.weight.is_floating_point():
            tensors.setdefault(kind.name, []).extend([layer.weight, *quantization_tensors(layer)])
            counts[kind.name] = counts.get(kind.name, 0) + layer.in_features * layer.out_features
    return {k: unique_bytes(tensors[k]) / counts[k] for k in counts}


def logits(model: nn.Module, task: str, tokens: torch.Tensor, width: int) -> torch.Tensor:
    if task == "seq2seq":
        return model(input_ids=tokens, decoder_input_ids=tokens).logits
    if task == "encoder":
        torch.manual_seed(1)
        return model(torch.randn(tokens.shape[0], tokens.shape[1], width))
    return model(input_ids=tokens).logits


def checkpointing(width: int, tokens: torch.Tensor) -> None:
    """Bytes one training forward keeps for backward (nf4-dq base, fp32 compute), without and with full checkpointing."""
    print(f"{'model':<22}{'saved B (no AC)':>16}{'saved B (AC)':>14}{'ratio':>8}")
    for name, (model, task) in models(width).items():
        quantize_model(model, "nf4-dq", dtype="float32")
        model.train()

        def loss(model: nn.Module = model, task: str = task) -> torch.Tensor:  # this iteration's model, bound now (B023)
            if task == "classify":
                return model(input_ids=tokens, labels=tokens[:, 0] % 3).loss
            return logits(model, task, tokens, width).float().pow(2).mean()

        before = saved_activation_bytes(loss, model)
        ActivationCheckpointing().transform_model(model)
        after = saved_activation_bytes(loss, model)
        print(f"{name:<22}{before:>16,}{after:>14,}{after / before:>8.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--modes", nargs="*", default=["nf4-dq", "int8-dynamic"])
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--checkpointing", action="store_true")
    args = parser.parse_args()
    tokens = torch.randint(1, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    if args.checkpointing:
        checkpointing(args.width, tokens)
        return
    print(f"{'model':<22}{'mode':<14}{'layer kind':<26}{'params':>10}{'share':>7}{'quantized':>11}{'B/param q.':>11}{'B/param all':>12}  left alone")
    for name, (model, task) in models(args.width).items():
        model.eval()
        with torch.no_grad():
            reference = logits(model, task, tokens, args.width)
        for mode in args.modes:
            quantized = copy.deepcopy(model)
            quantize_model(quantized, mode, dtype="float32")
            rows = coverage(quantized, quantizing=True, adapting=False)
            total = sum(r.params for r in rows)
            per_param = quantized_weight_bytes(quantized)
            for row in rows[:-1]:
                why = "; ".join(f"{r} ({n:,})" for r, n in row.reasons.items())
                q = f"{per_param[row.kind]:.3f}" if row.kind in per_param else "-"
                print(
                    f"{name:<22}{mode:<14}{row.kind:<26}{row.params:>10,}{100 * row.params / total:>6.1f}%{row.quantized:>11,}"
                    f"{q:>11}{row.bytes / row.params:>12.3f}  {why}"
                )
            with torch.no_grad():
                out = logits(quantized, task, tokens, args.width)
            error = ((out - reference).norm() / reference.norm()).item()
            print(f"{name:<22}{mode:<14}{'(logits rel. error)':<26}{error:>10.4f}")


if __name__ == "__main__":
    main()
