"""The families of coverage round five (session 40, issue 53): the six vision-language models session 39 did not reach
(Mllama, Aria, LLaVA-NeXT, Janus, Emu3, Chameleon), tiny transformers configs with the batch and the loss each trains on.
Shared by ``tests/test_coverage_models_s40.py`` and ``benchmarks/coverage_s40.py``; the harness is session 39's
(``tests/families_s39.py``, ``benchmarks/coverage_s38.py``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tests import families_s39 as s39
from tests.families_s38 import IMAGE_TOKEN, TEXT, VISION, Family, _g, family

VOCAB, SEQ, BATCH, WIDTH = s39.VOCAB, s39.SEQ, s39.BATCH, s39.WIDTH
LLAMA = dict(TEXT, model_type="llama", num_key_value_heads=2)


def with_image(count: int, size: int = 16, seq: int = SEQ) -> Any:
    """Token ids opening with ``count`` image tokens then text (``seq`` in all), and one image per sample."""

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(3, VOCAB - 40, (BATCH, seq), generator=_g(seed))
        ids[:, :count] = IMAGE_TOKEN
        return ids, torch.randn(BATCH, 3, size, size, generator=_g(seed))

    return batch


def labels(ids: torch.Tensor) -> torch.Tensor:
    return ids.masked_fill(ids == IMAGE_TOKEN, -100)


def vlm(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    return model(input_ids=ids, pixel_values=pixels, labels=labels(ids)).loss


def sized(model: nn.Module, batch: Any) -> torch.Tensor:
    """Emu3: the image's size beside its pixels."""
    ids, pixels = batch
    sizes = torch.tensor([list(pixels.shape[-2:])] * pixels.shape[0])
    return model(input_ids=ids, pixel_values=pixels, image_sizes=sizes, labels=labels(ids)).loss


# LLaVA-NeXT ("anyres"): one 16 px grid point, so each image is the base view and one tile (pixel_values [B, 2, 3, 16, 16]);
# 16 base features + 4 rows of 4 tile features each closed by the newline token: 36 image tokens.
NEXT_TOKENS = 36


def llava_next_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pixels = with_image(NEXT_TOKENS, seq=NEXT_TOKENS + SEQ)(seed)
    return ids, torch.stack([pixels, pixels.flip(-1)], dim=1)


def llava_next(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    sizes = torch.tensor([[16, 16]] * ids.shape[0])
    return model(input_ids=ids, pixel_values=pixels, image_sizes=sizes, labels=labels(ids)).loss


# Mllama: one tile of 16 px per image (aspect ratio 1 x 1), a cross-attention layer after the first self-attention one.
def mllama_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pixels = with_image(1)(seed)
    return ids, pixels[:, None, None]  # [B, images, tiles, 3, H, W]


def mllama(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    ones = torch.ones(ids.shape[0], 1, dtype=torch.long)
    mask = torch.ones(ids.shape[0], ids.shape[1], 1, 1, dtype=torch.long)
    return model(input_ids=ids, pixel_values=pixels, aspect_ratio_ids=ones, aspect_ratio_mask=ones[..., None], cross_attention_mask=mask,
                 labels=labels(ids)).loss  # fmt: skip


def aria(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    mask = torch.ones(pixels.shape[0], *pixels.shape[-2:], dtype=torch.bool)
    return model(input_ids=ids, pixel_values=pixels, pixel_mask=mask, labels=labels(ids)).loss


def _vq_vocabulary(start: int, count: int, pattern: str) -> dict[str, int]:
    """Chameleon's and Emu3's map from token names to ids: the image token and ``count`` visual tokens from ``start``."""
    names = {i: f"t{i}" for i in range(VOCAB)}
    for i in range(start, start + count):
        names[i] = pattern.format(i=i, infix="".join(chr(ord("A") + int(c)) for c in str(i)))
    names[IMAGE_TOKEN] = "<image>"
    names[IMAGE_TOKEN - 1] = "<|extra_200|>"
    return {v: k for k, v in names.items()}


VQ = dict(base_channels=32, channel_multiplier=[1, 2])


def trained_gates(family: Family) -> Family:
    """Mllama with its tanh gates open, as a trained checkpoint has them: built, each gate is 0 (the cross-attention
    layers' ``cross_attn_attn_gate``/``cross_attn_mlp_gate``, the vision tower's tile and position gates), so nothing
    reaches the cross-attention or the vision tower, and LoRA (the gates frozen) would never open them."""

    def build() -> nn.Module:
        model = family.build()
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.rpartition(".")[2] in ("gate", "cross_attn_attn_gate", "cross_attn_mlp_gate"):
                    parameter.fill_(0.5)
        return model

    return Family(build, family.loss, family.batch, family.model, family.causal)

FAMILIES: dict[str, Family] = {
    "llava_next": family("LlavaNextForConditionalGeneration", "LlavaNextConfig",
                         dict(vision_config=dict(VISION, model_type="clip_vision_model", projection_dim=32), text_config=LLAMA,
                              image_token_index=IMAGE_TOKEN, image_grid_pinpoints=[[16, 16]], vision_feature_layer=-1),
                         llava_next, llava_next_batch, causal=True),
    "mllama": trained_gates(family("MllamaForConditionalGeneration", "MllamaConfig",
                     dict(vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                                             image_size=16, patch_size=4, max_num_tiles=1, supported_aspect_ratios=[[1, 1]],
                                             intermediate_layers_indices=[0], vision_output_dim=64),
                          text_config=dict(s39.DEC, vocab_size=VOCAB, cross_attention_layers=[1]), image_token_index=IMAGE_TOKEN),
                     mllama, mllama_batch, causal=True)),
    "aria": family("AriaForConditionalGeneration", "AriaConfig",
                   dict(vision_config=dict(VISION, model_type="idefics3_vision"), image_token_index=IMAGE_TOKEN,
                        text_config=dict(s39.DEC, vocab_size=VOCAB, moe_num_experts=4, moe_topk=2, moe_num_shared_experts=1),
                        projector_patch_to_query_dict={16: 4}),
                   aria, with_image(4), causal=True),
    "janus": family("JanusForConditionalGeneration", "JanusConfig",
                    dict(vision_config=dict(VISION, projection_dim=WIDTH, depth=2), text_config=LLAMA, image_token_id=IMAGE_TOKEN,
                         vq_config=dict(embed_dim=8, num_embeddings=16, base_channels=32, channel_multiplier=[1, 2], projection_dim=WIDTH,
                                        image_token_embed_dim=WIDTH, num_patches=4)),
                    vlm, with_image(16, seq=16 + SEQ), causal=True),
    "emu3": family("Emu3ForConditionalGeneration", "Emu3Config",
                   dict(text_config=dict(s39.DEC, vocab_size=VOCAB), vocabulary_map=_vq_vocabulary(3, 20, "<|visual token{i:06d}|>"),
                        vq_config=dict(codebook_size=20, temporal_downsample_factor=1, base_channels=32, channel_multiplier=[1, 2, 1],
                                       hidden_size=32, attn_resolutions=[])),
                   sized, with_image(12, size=15, seq=12 + SEQ), causal=True),
    "chameleon": family("ChameleonForConditionalGeneration", "ChameleonConfig",
                        dict(s39.DEC, vocab_size=VOCAB, vocabulary_map=_vq_vocabulary(10, 5, "IMGIMG{infix}Z"),
                             vq_config=dict(embed_dim=5, num_embeddings=5, latent_channels=5, in_channels=3, **VQ)),
                        vlm, with_image(25, size=10, seq=25 + SEQ), causal=True),
}  # fmt: skip


class Task(s39.Task):
    """The user's LightningModule, on this round's families."""

    def __init__(self, name: str) -> None:
        s39.s29.pl.LightningModule.__init__(self)
        self.model, self.loss = FAMILIES[name].build(), FAMILIES[name].loss
