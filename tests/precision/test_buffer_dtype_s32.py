"""Float32 buffers take the compute dtype with the rest of the model (issue 53, session 32).

Was: the cast to the compute dtype reached the parameters only. A float32 buffer the model's code adds or multiplies
into its activations (a sinusoidal position table, an input mean, latent scales) turned them float32 at its first use
under bf16, and the next layer stopped: NLLB-MoE "mixed dtype (CPU): expect parameter to have scalar type of Float",
four models in all (``tests/test_model_families_s32.py``), each fine after ``model.to(torch.bfloat16)``. Kept as built:
BatchNorm's statistics, the model's ``_keep_in_fp32_modules``, float64 buffers and rotary frequencies.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision import quantize_model
from tests.test_model_families_s29 import IDS, WIDTH, tokens, transformers_model


class Buffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.norm = nn.BatchNorm1d(64)
        self.register_buffer("scale", torch.full((64,), 0.5))  # added into the activations
        self.register_buffer("exact", torch.ones(4, dtype=torch.float64))  # a deliberate float64
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.norm(x) * self.scale)


class LlamaRotaryEmbeddingLike(nn.Module):  # transformers' convention: a rotary module's class name has "Rotary"
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16), persistent=False)


def test_float32_buffers_take_the_compute_dtype_and_the_deliberate_ones_stay() -> None:
    model = nn.Sequential(Buffers(), LlamaRotaryEmbeddingLike())
    quantize_model(model, "nf4-dq", dtype="bfloat16")
    buffers = {name: b.dtype for name, b in model.named_buffers()}
    assert buffers == {
        "0.norm.running_mean": torch.float32, "0.norm.running_var": torch.float32, "0.norm.num_batches_tracked": torch.long,
        "0.scale": torch.bfloat16,  # was float32: the activations after it were float32
        "0.exact": torch.float64, "0.steps": torch.long, "1.inv_freq": torch.float32,
    }  # fmt: skip
    assert model[0](torch.randn(2, 64, dtype=torch.bfloat16)).dtype == torch.bfloat16


def test_the_quantized_layers_own_buffers_stay_as_built() -> None:
    """int8-dynamic's per-row scales are fp32 buffers of its layer: quantization constants, not the model's."""
    model = Buffers()
    quantize_model(model, "int8-dynamic", dtype="bfloat16")
    assert model.lin.weight_scale.dtype == torch.float32 and model.scale.dtype == torch.bfloat16


def test_float32_compute_leaves_every_buffer_as_built() -> None:
    model = Buffers()
    quantize_model(model, "nf4-dq", dtype="float32")
    assert model.scale.dtype == torch.float32 and model.exact.dtype == torch.float64


def test_nllb_moe_sinusoidal_positions_compute_in_bf16() -> None:
    """The real class: its position table (a float32 buffer built at init) was added to bf16 token embeddings."""
    build = transformers_model("NllbMoeForConditionalGeneration", "NllbMoeConfig", **IDS, d_model=WIDTH, encoder_layers=2, decoder_layers=2,
                               encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, num_experts=4,
                               expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2, max_position_embeddings=64,
                               decoder_start_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    model = build()
    quantize_model(model, "nf4-dq", dtype="bfloat16")
    assert model.model.encoder.embed_positions.weights.dtype == torch.bfloat16
    loss = model(input_ids=tokens(1), labels=tokens(1)).loss  # was: RuntimeError: mixed dtype (CPU) in a LayerNorm
    assert loss.dtype == torch.bfloat16 and torch.isfinite(loss)


def test_a_llama_keeps_its_rotary_frequencies() -> None:
    """transformers computes the rotary angles from ``inv_freq`` in fp32: a bf16 frequency would move the angle at
    position p by up to p * 2**-9 radians."""
    torch.manual_seed(0)
    model = transformers_model("LlamaForCausalLM", "LlamaConfig", **IDS, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=4,
                               intermediate_size=128, max_position_embeddings=64)()  # fmt: skip
    quantize_model(model, "nf4-dq", dtype="bfloat16")
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    assert model(input_ids=tokens(1)).logits.dtype == torch.bfloat16


def test_a_float32_tensor_the_model_makes_is_a_clear_error_naming_the_fix(tmp_path: Any) -> None:
    """What the cast cannot reach, a tensor the model's code makes in float32 (here a LayerNorm's input), was torch's
    bare "mixed dtype (CPU): expect parameter to have scalar type of Float" deep in the forward."""

    class MakesFloat32(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.proj, self.norm, self.head = nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 2)

        def training_step(self, batch: torch.Tensor, index: int) -> torch.Tensor:
            x = self.proj(batch) * torch.ones(32, dtype=torch.float32)  # promoted to float32
            return self.head(self.norm(x)).square().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4")])  # fmt: skip
    with pytest.raises(RuntimeError, match=r"an op of the model got a float32 tensor beside bfloat16 ones, and QuantizedPrecision computes the "
                       r"model in bfloat16 .*Pass QuantizedPrecision\(\.\.\., dtype=\"float32\"\).*model\.to\(torch\.bfloat16\).*torch said: "
                       r"mixed dtype"):  # fmt: skip
        trainer.fit(MakesFloat32(), DataLoader([torch.randn(8, 32)], batch_size=None))
    assert trainer.global_step == 0
