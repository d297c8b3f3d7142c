"""Any model (issue 24, round two): transformers families through nf4-dq + LoRA + ActivationCheckpointing.

Every family is built from its library's config with no download (2 layers, width 64, vocabulary 128) and
trained by a real Trainer on CPU, with FusedLoss on the causal LMs. For each: the loss falls, every adapter
gets a nonzero gradient, the default (adapter-only) checkpoint saved after the first epoch resumes
bit-exact (the restored adapters equal the saved ones, the resumed epoch's losses and final adapters equal
the uninterrupted run's), and the coverage table is right (experts only where the model has experts, no
kind outside the registry, the 5 % warning for exactly the kinds expected).

The families named by issue 24 run by default; the others ("tried from outside") are marked slow.
Results: benchmarks/README.md (any model).
"""

from __future__ import annotations

import math
import re
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision, coverage_of
from lightning_hbm.layers import OUTSIDE_ROWS, RAW_WEIGHTS, layer_kinds

VOCAB, SEQ, BATCH, WIDTH = 128, 16, 4, 64
IMAGE, CLASSES = 32, 5
OTHER, ADAPTERS, EXPERTS = "other (embeddings, norms, ...)", "LoRA adapters (trained)", "Experts (3-D parameters)"
# ids every config needs spelled out: the defaults point past a 128-token vocabulary
IDS = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
LM = dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@dataclass(frozen=True)
class Family:
    """A transformers model class and the tiny config it is built from."""

    model: str  # transformers class name
    config: str  # its config class name
    fields: dict[str, Any]
    task: str = "causal"  # "causal" (+ FusedLoss), "seq2seq", "image", "pooled" (image, the user's classifier), "audio"
    named: bool = False  # named by issue 24: runs by default
    experts: str = ""  # "converted": 3-D experts made Linears, quantized, adapted; "named": a layout left alone, warned
    warns: tuple[str, ...] = ()  # kinds whose "left alone" warning is true for this family
    lora: Optional[dict[str, Any]] = None  # LoRA arguments beyond r and alpha

    def build(self) -> nn.Module:
        return getattr(transformers, self.model)(getattr(transformers, self.config)(**self.fields))


MOE = dict(num_experts=4, num_experts_per_tok=2)
FAMILIES: dict[str, Family] = {
    # ------------------------------------------------------------------ named by issue 24
    "mamba": Family("MambaForCausalLM", "MambaConfig", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, state_size=8), named=True),
    "qwen2_moe": Family("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(LM, **MOE, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64), named=True, experts="converted"),
    "qwen3_moe": Family("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(LM, **MOE, intermediate_size=64, moe_intermediate_size=32, head_dim=16), named=True, experts="converted"),
    "olmoe": Family("OlmoeForCausalLM", "OlmoeConfig", dict(LM, **MOE, intermediate_size=64), named=True, experts="converted"),
    "gemma2": Family("Gemma2ForCausalLM", "Gemma2Config", dict(LM, intermediate_size=128, head_dim=16, final_logit_softcapping=30.0, attn_logit_softcapping=50.0, sliding_window=8), named=True),
    "deepseek_v3": Family("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        LM, intermediate_size=64, moe_intermediate_size=32, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
        first_k_dense_replace=1, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
    ), named=True, experts="converted"),
    "mixtral": Family("MixtralForCausalLM", "MixtralConfig", dict(LM, intermediate_size=128, num_local_experts=4, num_experts_per_tok=2), named=True, experts="converted"),
    # the vision tower with its attention-pooling head (nn.MultiheadAttention, a 3-D probe), classified from the pooled output
    "siglip": Family("SiglipVisionModel", "SiglipVisionConfig", dict(
        hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE, patch_size=8,
    ), task="pooled", named=True),
    # ------------------------------------------------------------------ not named: tried from outside
    "phi3": Family("Phi3ForCausalLM", "Phi3Config", dict(LM, intermediate_size=128)),
    "gpt_neox": Family("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)),
    "falcon": Family("FalconForCausalLM", "FalconConfig", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4)),
    "granite": Family("GraniteForCausalLM", "GraniteConfig", dict(LM, intermediate_size=128)),
    "granitemoe": Family("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(LM, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2), experts="converted"),
    "jamba": Family("JambaForCausalLM", "JambaConfig", dict(
        LM, intermediate_size=64, num_experts=4, num_experts_per_tok=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=1, mamba_d_state=8, mamba_expand=2,
    ), experts="converted"),
    "bamba": Family("BambaForCausalLM", "BambaConfig", dict(
        LM, intermediate_size=128, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1, mamba_expand=2,
    )),  # out_proj: read directly only by the fused CUDA scan, which does not run here: quantized (issue 33)
    "zamba2": Family("Zamba2ForCausalLM", "Zamba2Config", dict(
        LM, intermediate_size=128, mamba_d_state=8, mamba_headdim=16, n_mamba_heads=8, layers_block_type=["mamba", "hybrid"],
        num_mem_blocks=1, use_mem_rope=False,
    )),  # out_proj: read directly only by the fused CUDA scan, which does not run here: quantized (issue 33)
    "gemma3": Family("Gemma3ForCausalLM", "Gemma3TextConfig", dict(LM, intermediate_size=128, head_dim=16, sliding_window=8)),
    "starcoder2": Family("Starcoder2ForCausalLM", "Starcoder2Config", dict(LM, intermediate_size=128)),
    "cohere": Family("CohereForCausalLM", "CohereConfig", dict(LM, intermediate_size=128)),
    "stablelm": Family("StableLmForCausalLM", "StableLmConfig", dict(LM, intermediate_size=128)),
    "mamba2": Family("Mamba2ForCausalLM", "Mamba2Config", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, state_size=8, num_heads=8, head_dim=16, n_groups=1, expand=2)),
    "rwkv": Family("RwkvForCausalLM", "RwkvConfig", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, attention_hidden_size=WIDTH, intermediate_size=128, context_length=64)),
    "olmo2": Family("Olmo2ForCausalLM", "Olmo2Config", dict(LM, intermediate_size=128)),
    "phi": Family("PhiForCausalLM", "PhiConfig", dict(LM, intermediate_size=128)),
    "qwen3": Family("Qwen3ForCausalLM", "Qwen3Config", dict(LM, intermediate_size=128, head_dim=16)),
    "glm4": Family("Glm4ForCausalLM", "Glm4Config", dict(LM, intermediate_size=128, head_dim=16)),
    "lfm2": Family("Lfm2ForCausalLM", "Lfm2Config", dict(LM, intermediate_size=128, layer_types=["conv", "full_attention"])),
    "falcon_mamba": Family("FalconMambaForCausalLM", "FalconMambaConfig", dict(IDS, hidden_size=WIDTH, num_hidden_layers=2, state_size=8)),
    "gpt_oss": Family("GptOssForCausalLM", "GptOssConfig", dict(LM, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8), experts="named", warns=(EXPERTS,)),  # biased, interleaved gate/up
    # experts as 2-D w1/v1/w2 Parameters of one module: no layer kind, named as weights outside any layer (was: silent)
    "dbrx": Family("DbrxForCausalLM", "DbrxConfig", dict(
        IDS, d_model=WIDTH, n_layers=2, n_heads=4, max_seq_len=64, attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
        ffn_config=dict(ffn_hidden_size=64, moe_num_experts=4, moe_top_k=2),
    ), warns=(RAW_WEIGHTS,)),
    "ernie4_5_moe": Family("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", dict(
        LM, intermediate_size=64, moe_intermediate_size=32, moe_num_experts=4, moe_k=2, moe_layer_start_index=1, head_dim=16,
    ), experts="converted"),
    "llama4": Family("Llama4ForCausalLM", "Llama4TextConfig", dict(
        LM, intermediate_size=64, intermediate_size_mlp=128, num_local_experts=4, num_experts_per_tok=1, head_dim=16, interleave_moe_layer_step=2,
    ), experts="named", warns=(EXPERTS,)),  # experts [E, in, out] (transposed); the router: a Linear with its own forward
    "qwen2_vl": Family("Qwen2VLForConditionalGeneration", "Qwen2VLConfig", dict(
        IDS, text_config=dict(LM, intermediate_size=128, rope_scaling=dict(type="mrope", mrope_section=[2, 3, 3])),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=WIDTH, num_heads=4, patch_size=4, spatial_merge_size=2),
    ), lora=dict(exclude_modules=r"model\.model\.visual\..*")),  # the text part: text-only batches never run the vision tower
    "t5": Family("T5ForConditionalGeneration", "T5Config", dict(IDS, d_model=WIDTH, d_ff=128, num_layers=2, num_heads=4, d_kv=16, decoder_start_token_id=0), task="seq2seq"),
    "bart": Family("BartForConditionalGeneration", "BartConfig", dict(
        IDS, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=2,
    ), task="seq2seq"),
    "whisper": Family("WhisperForAudioClassification", "WhisperConfig", dict(
        IDS, d_model=WIDTH, encoder_layers=2, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, num_mel_bins=16, max_source_positions=16, num_labels=CLASSES, decoder_start_token_id=0,
    ), task="audio"),
    "vit": Family("ViTForImageClassification", "ViTConfig", dict(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=IMAGE, patch_size=8, num_labels=CLASSES,
    ), task="image"),
    "dinov2": Family("Dinov2ForImageClassification", "Dinov2Config", dict(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, mlp_ratio=2, image_size=IMAGE, patch_size=8, num_labels=CLASSES,
    ), task="image"),
    "convnext": Family("ConvNextForImageClassification", "ConvNextConfig", dict(
        hidden_sizes=[16, 32], depths=[1, 1], num_stages=2, image_size=IMAGE, num_labels=CLASSES,
    ), task="image"),
}


class Task(pl.LightningModule):
    """The user's LightningModule: the model's own loss from its own inputs, AdamW over self.parameters()."""

    def __init__(self, family: Family) -> None:
        super().__init__()
        self.model, self.task = family.build(), family.task
        if self.task == "pooled":  # the user's classifier on the model's pooled output
            self.classifier = nn.Linear(WIDTH, CLASSES)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        if self.task == "causal":
            return self.model(input_ids=batch, labels=batch).loss
        if self.task == "seq2seq":
            return self.model(input_ids=batch, labels=batch.flip(1)).loss
        inputs, labels = batch
        if self.task == "pooled":
            return F.cross_entropy(self.classifier(self.model(pixel_values=inputs).pooler_output), labels)
        key = "pixel_values" if self.task == "image" else "input_features"
        return self.model(**{key: inputs}, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def batch(task: str, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    if task in ("causal", "seq2seq"):
        return torch.randint(3, VOCAB, (BATCH, SEQ), generator=generator)
    shape = (BATCH, 3, IMAGE, IMAGE) if task in ("image", "pooled") else (BATCH, 16, 32)  # audio: 16 mel bins x 2 * 16 frames
    return torch.randn(*shape, generator=generator), torch.randint(0, CLASSES, (BATCH,), generator=generator)


class Recorder(pl.Callback):
    """Losses; adapters whose gradient was never nonzero; adapters at train start and after each epoch.

    Seeds every step from its index, so dropout draws the same masks in a resumed run as in the uninterrupted one.
    """

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.trained: set[str] = set()
        self.adapters: list[str] = []
        self.at_start: dict[str, torch.Tensor] = {}
        self.after_epoch: list[dict[str, torch.Tensor]] = []

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.at_start = LoRA.adapter_state_dict(pl_module)
        self.adapters = [n for n, _ in pl_module.named_parameters() if ".lora_" in n]

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        torch.manual_seed(trainer.global_step)

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.trained |= {n for n, p in pl_module.named_parameters() if ".lora_" in n and p.grad is not None and p.grad.any()}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.after_epoch.append(LoRA.adapter_state_dict(pl_module))


def fit(name: str, epochs: int, tmp_path: Any, ckpt_path: Any = None) -> tuple[Task, Recorder, list[warnings.WarningMessage]]:
    """Whole epochs of 2 different batches; a checkpoint after each epoch (``tmp_path/epoch=N.ckpt``)."""
    family = FAMILIES[name]
    torch.manual_seed(0)
    module, recorder = Task(family), Recorder()
    callbacks = [LoRA(r=8, alpha=16, **(family.lora or {})), ActivationCheckpointing(), recorder]
    callbacks += [FusedLoss(chunk_size=24)] if family.task == "causal" else []  # 24: several chunks, a ragged last one
    callbacks += [ModelCheckpoint(dirpath=tmp_path, filename="{epoch}", save_top_k=-1, every_n_epochs=1, enable_version_counter=False)]
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=callbacks,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([batch(family.task, 1), batch(family.task, 2)], batch_size=None), ckpt_path=ckpt_path)
    return module, recorder, caught


def check_coverage(family: Family, module: Task, caught: list[warnings.WarningMessage]) -> None:
    rows = {r.kind: r for r in coverage_of(module)}
    assert set(rows) <= {k.name for k in layer_kinds()} | {OTHER, ADAPTERS, RAW_WEIGHTS, *OUTSIDE_ROWS}, set(rows)  # no unnamed kind
    experts = rows.get(EXPERTS)
    if family.experts == "converted":  # every expert converted, quantized and adapted
        assert experts is not None and experts.quantized == experts.adapted == experts.params > 0, experts
    elif family.experts == "named":  # a layout LinearExperts does not reproduce: left alone, and the warning says so
        assert experts is not None and experts.quantized == experts.adapted == 0 and EXPERTS in family.warns, experts
    else:  # was: position tables, pooling probes, SSM parameters called "experts"
        assert experts is None, experts
    messages = [str(w.message) for w in caught]
    warned = {r.kind for r in rows.values() for m in messages if f"% of the parameters are {r.kind} layers" in m or f"are {r.kind}, left" in m}
    assert warned == set(family.warns), [str(w.message) for w in caught if "of the parameters are" in str(w.message)]
    linear = rows["Linear"]
    assert linear.quantized > 0.5 * linear.params and linear.adapted > 0.5 * linear.params, linear
    blocks = sum(r.checkpointed for r in rows.values())
    assert blocks > 0.5 * sum(r.params for k, r in rows.items() if k not in (OTHER, ADAPTERS)), rows


def check_trains_and_resumes(name: str, tmp_path: Any) -> None:
    family = FAMILIES[name]
    straight, recorder, caught = fit(name, 2, tmp_path / "straight")
    losses = recorder.losses
    # the second epoch's loss (same 2 batches) below the first's
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses) and sum(losses[2:]) < sum(losses[:2]), losses
    assert recorder.adapters and set(recorder.adapters) == recorder.trained, sorted(set(recorder.adapters) - recorder.trained)[:6]
    check_coverage(family, straight, caught)

    saved = torch.load(tmp_path / "straight" / "epoch=0.ckpt", weights_only=False)
    assert all(".lora_" in k for k in saved["lightning_hbm"]["state_dict"])  # adapter-only: no frozen base saved
    resumed, again, _ = fit(name, 2, tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert again.losses == losses[2:]  # bit-exact: the resumed epoch is the uninterrupted run's second epoch
    for want, got in ((recorder.after_epoch[0], again.at_start), (recorder.after_epoch[1], LoRA.adapter_state_dict(resumed))):
        assert set(got) == set(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


NAMED = [n for n, f in FAMILIES.items() if f.named]
OUTSIDE = [n for n, f in FAMILIES.items() if not f.named]


@pytest.mark.parametrize("name", NAMED)
def test_named_family_trains_resumes_and_reports(name: str, tmp_path: Any) -> None:
    check_trains_and_resumes(name, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("name", OUTSIDE)
def test_other_family_trains_resumes_and_reports(name: str, tmp_path: Any) -> None:
    check_trains_and_resumes(name, tmp_path)


def _fit_chunked(name: str, chunks: int) -> tuple[dict[str, torch.Tensor], list[str], list[str]]:
    family = FAMILIES[name]
    torch.manual_seed(0)
    module, checkpointing = Task(family), ActivationCheckpointing(mlp_chunks=chunks)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0, limit_val_batches=0,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=8, alpha=16), checkpointing],
    )  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([batch(family.task, 1), batch(family.task, 2)], batch_size=None))
    trained = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    return trained, checkpointing.chunked, [str(w.message) for w in caught if "mlp_chunks=" in str(w.message)]


# ActivationCheckpointing(mlp_chunks=2): which layers are recomputed in token chunks is decided by running them
CHUNKED = {
    "mixtral": ("model.model.layers.0.mlp", ""),  # a sparse MoE that views its input: chunks are made contiguous
    "gemma2": ("model.model.layers.0.mlp", ""),
    "falcon": ("model.transformer.h.0.mlp", ""),  # adds the attention output to the MLP's in place
    "convnext": ("", r"stages\.0 \(layers\.0: mixes tokens"),  # a 7x7 convolution behind a 1e-6 layer scale
    "t5": ("", r"block\.0 \(layer\.0: not called with one tensor of tokens; layer\.1: draws random numbers"),
}


@pytest.mark.parametrize("name", list(CHUNKED))
def test_mlp_chunks_are_decided_by_running_the_layers(name: str) -> None:
    first, warned = CHUNKED[name]
    expected, _, _ = _fit_chunked(name, 1)
    got, chunked, warnings_ = _fit_chunked(name, 2)
    assert (chunked[0] if chunked else "") == first
    if warned:
        assert len(warnings_) == 1 and re.search(warned, warnings_[0]), warnings_
    else:
        assert not warnings_
    for key in expected:  # chunked or not, the same training (float rounding only)
        torch.testing.assert_close(got[key], expected[key], rtol=1e-3, atol=2e-4, msg=key)
