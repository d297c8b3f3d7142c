"""Model families that stopped under the library's default compute dtype (issue 53 "any model", session 32).

Session 31's family runs with ``QuantizedPrecision("nf4-dq")``'s default dtype, bfloat16 (the s29/s31 family tests run
in float32), left five models stopping at their first step, each fine in plain bf16 (``model.to(torch.bfloat16)``):

* NLLB-MoE, Kosmos-2 (sinusoidal position tables), Swin2SR (``relative_coords_table``, the input ``mean``) and diffusers
  ``ConsistencyDecoderVAE`` (the latent ``means``/``stds``): a float32 buffer, which the cast to the compute dtype left
  as built, turned the activations float32 at its first use: "mixed dtype (CPU): expect parameter to have scalar type
  of Float" (a LayerNorm), "expected m1 and m2 to have the same dtype" (an attention matmul), "Input type (float) and
  bias type (c10::BFloat16) should be the same" (a convolution), "value cannot be converted to type c10::BFloat16
  without overflow" (Kosmos-2's causal mask, built from ``torch.finfo(float32).min``). One cause: float32 buffers now
  take the compute dtype (``lightning_hbm.precision.quantize.cast_the_rest``), as ``model.to(dtype)`` casts them;
* Switch Transformers: ``UnobservedRead`` on ``wo.weight.dtype`` in an expert the probe sample did not route to. A
  metadata read is no value read: the guard answers it as the layer computes (``readers.see_as``).

Each: the default recipe (nf4-dq in bf16, LoRA, checkpointing), 2 epochs of 2 batches, finite losses, every adapter
trained, and the checkpoint after the first epoch resumes bit-exact. Tiny configs: a few seconds each.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.layers import base_layer, readers, stored_in
from tests import test_model_families_s29 as s29
from tests.test_model_families_s29 import IDS, SEQ, VOCAB, WIDTH, Family, diffusers_model, images, tokens, transformers_model

BATCH = s29.BATCH


def seq2seq_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def kosmos2_batch(seed: int) -> tuple[torch.Tensor, ...]:  # tokens, an image, where its 4 latent queries go in the text
    where = torch.cat([torch.zeros(BATCH, 1), torch.ones(BATCH, 4), torch.zeros(BATCH, SEQ - 5)], 1).long()
    return tokens(seed), images(seed), where


def kosmos2_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], pixel_values=batch[1], image_embeds_position_mask=batch[2], labels=batch[0]).loss


def super_resolution(seed: int) -> tuple[torch.Tensor, torch.Tensor]:  # a 16 px image, its 32 px target
    return images(seed, 16), images(seed + 10, 32)


def swin2sr_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.l1_loss(model(pixel_values=batch[0]).reconstruction, batch[1])


def vae_loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    return F.mse_loss(model(batch).sample, batch)


FAMILIES: dict[str, Family] = {
    # a top-2 router computing in fp32 (router_dtype), experts dropping tokens past their capacity, sinusoidal positions
    "nllb_moe": Family(transformers_model("NllbMoeForConditionalGeneration", "NllbMoeConfig", **IDS, d_model=WIDTH, encoder_layers=2,
                                          decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                                          decoder_ffn_dim=64, num_experts=4, expert_capacity=8, encoder_sparse_step=2, decoder_sparse_step=2,
                                          max_position_embeddings=64, decoder_start_token_id=2), seq2seq_loss, tokens, falls=False),
    # top-1 routing over 16 experts: the probe's one sample reaches only some of them, whose DenseActDense reads
    # wo.weight.dtype to cast its input
    "switch": Family(transformers_model("SwitchTransformersForConditionalGeneration", "SwitchTransformersConfig", vocab_size=VOCAB,
                                        pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, d_model=WIDTH, d_kv=16, d_ff=64, num_layers=2,
                                        num_decoder_layers=2, num_heads=4, num_experts=16, expert_capacity=8, encoder_sparse_step=2,
                                        decoder_sparse_step=2), seq2seq_loss, tokens, falls=False),
    # Swin-V2 attention (a continuous position-bias MLP over a coordinates buffer), pixel-shuffle upsampling
    "swin2sr": Family(transformers_model("Swin2SRForImageSuperResolution", "Swin2SRConfig", image_size=16, patch_size=1, embed_dim=16,
                                         depths=[2], num_heads=[2], window_size=4, upscale=2, upsampler="pixelshuffle"),
                      swin2sr_loss, super_resolution, falls=False),
    # a CLIP-like vision tower, latent queries resampled into a causal LM's input
    "kosmos2": Family(transformers_model("Kosmos2ForConditionalGeneration", "Kosmos2Config", latent_query_num=4,
                                         text_config=dict(vocab_size=VOCAB, embed_dim=WIDTH, layers=2, attention_heads=4, ffn_dim=128,
                                                          max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2),
                                         vision_config=dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                                                            image_size=32, patch_size=8)), kosmos2_loss, kosmos2_batch, falls=False),
    # a KL encoder and a UNet decoder run as a consistency model: noise drawn in the forward, latents scaled by buffers
    "consistency_vae": Family(diffusers_model("ConsistencyDecoderVAE", encoder_block_out_channels=(8,), encoder_down_block_types=("DownEncoderBlock2D",),
                                              encoder_layers_per_block=1, encoder_norm_num_groups=2, latent_channels=4, decoder_block_out_channels=(8, 16),
                                              decoder_down_block_types=("ResnetDownsampleBlock2D",) * 2, decoder_up_block_types=("ResnetUpsampleBlock2D",) * 2,
                                              decoder_layers_per_block=1, decoder_norm_num_groups=2, decoder_in_channels=7, decoder_out_channels=6,
                                              decoder_add_attention=False, decoder_time_embedding_type="learned",
                                              decoder_resnet_time_scale_shift="scale_shift"),
                              vae_loss, lambda seed: images(seed, 8), falls=False),
}  # fmt: skip


ROUTED = {"nllb_moe", "switch"}


def recipe(name: str) -> tuple[QuantizedPrecision, list[pl.Callback]]:
    """The library's default recipe, fresh instances: nf4-dq in the default compute dtype (bf16)."""
    callbacks: list[pl.Callback] = [LoRA(r=8, alpha=16), ActivationCheckpointing()]
    if FAMILIES[name].causal:
        callbacks.append(FusedLoss(chunk_size=24))
    return QuantizedPrecision("nf4-dq"), callbacks


@pytest.fixture
def families(monkeypatch: pytest.MonkeyPatch) -> None:
    """s29's Task, fit and Recorder, on these families and this recipe."""
    for name, family in FAMILIES.items():
        monkeypatch.setitem(s29.FAMILIES, name, family)
    monkeypatch.setattr(s29, "recipe", recipe)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_trains_and_resumes_in_bf16(name: str, tmp_path: Any, families: None) -> None:
    straight, recorder, _ = s29.fit(name, tmp_path / "straight")
    losses = recorder.losses
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    untrained = set(recorder.adapters) - recorder.trained  # an MoE's experts no token was routed to: no gradient
    assert recorder.adapters and all(name in ROUTED and ".experts." in n for n in untrained), sorted(untrained)
    resumed, again, _ = s29.fit(name, tmp_path / "resumed", ckpt_path=tmp_path / "straight" / "epoch=0.ckpt")
    assert again.losses == losses[2:]
    want, got = recorder.after_epoch[1], LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    if name == "switch":  # the experts the probe did not see are stored quantized and ran (were refused)
        seen = readers.observation(straight)
        assert seen is not None
        unseen = [
            n for n, m in straight.named_modules()
            if n.endswith(".wo") and ".experts." in n and n not in seen.reads and _quantized(m)
        ]  # fmt: skip
        assert unseen, "the probe saw every expert: this test no longer reaches the guard"


def _quantized(layer: torch.nn.Module) -> bool:
    base = base_layer(layer)
    return stored_in(base) is not None or not base.weight.is_floating_point()
