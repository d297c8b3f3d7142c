"""FusedLoss on transformers Gemma-2 (final-logit soft-capping on): torch MemTracker step peak, fused vs unfused.

python benchmarks/fused_loss_softcap.py  (CPU, ~1 min; see benchmarks/README.md)
"""
import logging

import torch

logging.basicConfig(level=logging.INFO)  # shows FusedLoss's soft-capping line
from torch import nn
from transformers import Gemma2Config, Gemma2ForCausalLM

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, quantize_model
from lightning_hbm.memory.torch_tracker import torch_peak_bytes


class W(nn.Module):
    def __init__(s, m): super().__init__(); s.model = m
V=16000
def make(fused):
    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    m = W(Gemma2ForCausalLM(cfg))
    quantize_model(m, "nf4-dq", "float32"); LoRA(r=8).transform_model(m); ActivationCheckpointing().transform_model(m)
    if fused: FusedLoss(chunk_size=256).transform_model(m)
    return m
g = torch.Generator().manual_seed(0)
x = torch.randint(0, V, (2, 256), generator=g)
models = {f: make(f) for f in (False, True)}
print(models[True].model.config.final_logit_softcapping)
opt = {f: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad]) for f, m in models.items()}
def step(f):
    loss = models[f].model(input_ids=x, labels=x, use_cache=False).loss
    loss.backward(); opt[f].step(); opt[f].zero_grad(set_to_none=True); return loss.detach()
print(step(True), step(False))
peaks = {f: torch_peak_bytes(lambda f=f: step(f), models[f], opt[f]) for f in (False, True)}
print(peaks, peaks[True]/peaks[False])
