"""The families of coverage round four (session 39, issue 53): tiny transformers configs no earlier test nor benchmark
built, with the batch and the loss each trains on. Shared by ``tests/test_coverage_models_s39.py`` and
``benchmarks/coverage_s39.py``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import test_model_families_s29 as s29
from tests.families_s38 import IMAGE_TOKEN, TEXT, VISION, Family, _g, family, lm, tokens

VOCAB, SEQ, BATCH, WIDTH = s29.VOCAB, s29.SEQ, s29.BATCH, s29.WIDTH
DEC = dict(s29.LM, intermediate_size=128, num_key_value_heads=2, head_dim=16)
MOE = dict(moe_intermediate_size=32, num_experts_per_tok=2)


def images(seed: int, size: int = 16) -> torch.Tensor:
    return torch.randn(BATCH, 3, size, size, generator=_g(seed))


def classify(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return images(seed), torch.randint(0, 4, (BATCH,), generator=_g(seed))


def image_classifier(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


def series(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """32 steps of 3 channels in, 8 steps out."""
    return torch.randn(BATCH, 32, 3, generator=_g(seed)), torch.randn(BATCH, 8, 3, generator=_g(seed + 1))


def forecast(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(past_values=batch[0], future_values=batch[1]).loss


def qwen_vl_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One 8 x 8 image per sample as 4 patches of 4 px (merged 2 x 2: one image token), flattened as Qwen2-VL's
    processor does; ``image_grid_thw`` [1, 2, 2]."""
    ids = tokens(seed)
    ids[:, 1] = IMAGE_TOKEN
    return ids, torch.randn(BATCH * 4, 3 * 2 * 4 * 4, generator=_g(seed)), torch.tensor([[1, 2, 2]] * BATCH)


def qwen_vl(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels, grid = batch
    return model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


QWEN_VISION = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                   temporal_patch_size=2, in_channels=3)  # fmt: skip


def siglip2_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """16 patches of 4 x 4 px per sample (a 4 x 4 grid), flattened as Siglip2's processor does, all valid."""
    patches = torch.randn(BATCH, 16, 3 * 4 * 4, generator=_g(seed))
    return patches, torch.randint(0, 4, (BATCH,), generator=_g(seed)), torch.tensor([[4, 4]] * BATCH)


def siglip2(model: nn.Module, batch: Any) -> torch.Tensor:
    patches, labels, shapes = batch
    mask = torch.ones(patches.shape[:2], dtype=torch.long)
    return model(pixel_values=patches, pixel_attention_mask=mask, spatial_shapes=shapes, labels=labels).loss


def qwen2_audio_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """16 mel bins x 16 frames per sample (4 audio tokens after the encoder's stride and pooling), then text."""
    ids = tokens(seed)
    ids[:, 1:5] = IMAGE_TOKEN
    return ids, torch.randn(BATCH, 16, 16, generator=_g(seed))


def qwen2_audio(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, features = batch
    mask = torch.ones(BATCH, features.shape[-1], dtype=torch.long)
    return model(input_ids=ids, input_features=features, feature_attention_mask=mask, labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


FAMILIES: dict[str, Family] = {
    # decoders
    "gemma3n_text": family("Gemma3nForCausalLM", "Gemma3nTextConfig",
                           dict(DEC, vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8, laurel_rank=4, altup_num_inputs=2,
                                num_kv_shared_layers=0, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                                activation_sparsity_pattern=[0.0, 0.0]), lm, tokens, causal=True),
    "qwen3_next": family("Qwen3NextForCausalLM", "Qwen3NextConfig",
                         dict(DEC, **MOE, num_experts=4, shared_expert_intermediate_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                              linear_key_head_dim=16, linear_value_head_dim=16, layer_types=["linear_attention", "full_attention"]),
                         lm, tokens, causal=True),
    "glm4_moe": family("Glm4MoeForCausalLM", "Glm4MoeConfig", dict(DEC, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                       n_group=1, topk_group=1), lm, tokens, causal=True),
    "dots1": family("Dots1ForCausalLM", "Dots1Config", dict(DEC, **MOE, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1,
                    n_group=1, topk_group=1), lm, tokens, causal=True),
    "hunyuan_moe": family("HunYuanMoEV1ForCausalLM", "HunYuanMoEV1Config", dict(DEC, num_experts=4, moe_topk=2), lm, tokens, causal=True),
    "minimax": family("MiniMaxForCausalLM", "MiniMaxConfig", dict(DEC, num_local_experts=4, num_experts_per_tok=2, block_size=8,
                      layer_types=["linear_attention", "full_attention"]), lm, tokens, causal=True),
    "granitemoehybrid": family("GraniteMoeHybridForCausalLM", "GraniteMoeHybridConfig",
                               dict({k: v for k, v in DEC.items() if k != "head_dim"}, num_local_experts=4, num_experts_per_tok=2,
                                    shared_intermediate_size=64, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16,
                                    mamba_d_state=8, mamba_n_groups=1, mamba_chunk_size=16), lm, tokens, causal=True),
    "nemotron": family("NemotronForCausalLM", "NemotronConfig", dict(DEC, partial_rotary_factor=0.5), lm, tokens, causal=True),
    "seed_oss": family("SeedOssForCausalLM", "SeedOssConfig", DEC, lm, tokens, causal=True),
    "olmo3": family("Olmo3ForCausalLM", "Olmo3Config", dict(DEC, sliding_window=8), lm, tokens, causal=True),
    "flex_olmo": family("FlexOlmoForCausalLM", "FlexOlmoConfig", dict(DEC, num_experts=4, num_experts_per_tok=2), lm, tokens, causal=True),
    "lfm2_moe": family("Lfm2MoeForCausalLM", "Lfm2MoeConfig", dict(DEC, **MOE, num_experts=4, num_dense_layers=1,
                       layer_types=["conv", "full_attention"]), lm, tokens, causal=True),
    "bitnet": family("BitNetForCausalLM", "BitNetConfig", DEC, lm, tokens, causal=True),
    "apertus": family("ApertusForCausalLM", "ApertusConfig", DEC, lm, tokens, causal=True),
    "doge": family("DogeForCausalLM", "DogeConfig", dict(DEC, keep_window_size=8), lm, tokens, causal=True),
    # vision-language
    "qwen2_5_vl": family("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                         dict(IDS := s29.IDS, text_config=dict(DEC, rope_parameters=dict(rope_type="default", mrope_section=[2, 3, 3])),
                              vision_config=dict(QWEN_VISION, intermediate_size=64, out_hidden_size=WIDTH, window_size=8,
                                                 fullatt_block_indexes=[1]),
                              image_token_id=IMAGE_TOKEN, video_token_id=IMAGE_TOKEN - 1, vision_start_token_id=IMAGE_TOKEN - 2),
                         qwen_vl, qwen_vl_batch, causal=True),
    # vision
    "siglip2": family("Siglip2ForImageClassification", "Siglip2Config",
                      dict(vision_config=dict(VISION, num_patches=16), text_config=dict(TEXT, model_type="siglip2_text_model"), num_labels=4),
                      siglip2, siglip2_batch),
    "pvt_v2": family("PvtV2ForImageClassification", "PvtV2Config",
                     dict(image_size=32, depths=[1, 1, 1, 1], hidden_sizes=[16, 16, 32, 32], num_attention_heads=[1, 1, 2, 2], num_labels=4),
                     image_classifier, lambda s: (images(s, 32), torch.randint(0, 4, (BATCH,), generator=_g(s)))),
    "dinov2_registers": family("Dinov2WithRegistersForImageClassification", "Dinov2WithRegistersConfig",
                               dict(VISION, num_register_tokens=2, num_labels=4), image_classifier, classify),
    "hiera": family("HieraForImageClassification", "HieraConfig",
                    dict(embed_dim=16, image_size=[32, 32], patch_size=[3, 3], patch_stride=[2, 2], patch_padding=[1, 1], depths=[1, 1, 1, 1],
                         num_heads=[1, 1, 2, 2], query_stride=[2, 2], masked_unit_size=[8, 8], num_labels=4),
                    image_classifier, lambda s: (images(s, 32), torch.randint(0, 4, (BATCH,), generator=_g(s)))),
    # audio-language
    "qwen2_audio": family("Qwen2AudioForConditionalGeneration", "Qwen2AudioConfig",
                          dict(audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=64, d_model=32,
                                                 max_source_positions=8),
                               text_config=dict(TEXT, model_type="qwen2", num_key_value_heads=2), audio_token_index=IMAGE_TOKEN),
                          qwen2_audio, qwen2_audio_batch, causal=True),
    # time series
    "patchtst": family("PatchTSTForPrediction", "PatchTSTConfig",
                       dict(num_input_channels=3, context_length=32, prediction_length=8, patch_length=8, patch_stride=8, d_model=32,
                            num_hidden_layers=2, num_attention_heads=2, ffn_dim=64), forecast, series),
    "patchtsmixer": family("PatchTSMixerForPrediction", "PatchTSMixerConfig",
                           dict(num_input_channels=3, context_length=32, prediction_length=8, patch_length=8, patch_stride=8, d_model=32,
                                num_layers=2), forecast, series),
}  # fmt: skip


class Task(s29.pl.LightningModule):
    """The user's LightningModule: the loss from the model's own outputs, AdamW over self.parameters()."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.model, self.loss = FAMILIES[name].build(), FAMILIES[name].loss

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.loss(self.model, batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)
