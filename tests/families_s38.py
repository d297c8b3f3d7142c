"""The families of coverage round three (session 38, issue 53): tiny transformers configs no earlier test built, with
the batch and the loss each trains on. Shared by ``tests/test_coverage_s38.py`` and ``benchmarks/coverage_s38.py``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from tests import test_model_families_s29 as s29

VOCAB, SEQ, BATCH, WIDTH = s29.VOCAB, s29.SEQ, s29.BATCH, s29.WIDTH
IDS = s29.IDS
ENC = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, max_position_embeddings=64)
SEQ2SEQ = dict(IDS, d_model=WIDTH, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=128, decoder_ffn_dim=128, max_position_embeddings=64, decoder_start_token_id=2)  # fmt: skip
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2),
             conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, vocab_size=32, pad_token_id=0,
             mask_time_prob=0.0, ctc_loss_reduction="mean", layerdrop=0.0)  # fmt: skip
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=16, patch_size=4)
TEXT = dict(IDS, hidden_size=WIDTH, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64)
IMAGE_TOKEN = VOCAB - 1


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(3, VOCAB - 1, (BATCH, SEQ), generator=_g(seed))


def lm(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch).loss


def audio(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One 0.1 s clip at 16 kHz per sample, and 4 CTC labels."""
    return torch.randn(BATCH, 1600, generator=_g(seed)), torch.randint(3, 32, (BATCH, 4), generator=_g(seed))


def ctc(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(input_values=batch[0], labels=batch[1]).loss


def speech_to_text(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 1600, generator=_g(seed)), tokens(seed)


def image_and_text(tokens_per_image: int, size: int = 16) -> Callable[[int], tuple[torch.Tensor, torch.Tensor]]:
    """Token ids opening with the image's tokens, then text; pixel values."""

    def batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = tokens(seed)
        ids[:, :tokens_per_image] = IMAGE_TOKEN
        return ids, torch.randn(BATCH, 3, size, size, generator=_g(seed))

    return batch


def vlm(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    return model(input_ids=ids, pixel_values=pixels, labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


def paligemma(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    types = (ids != IMAGE_TOKEN).long()  # the prefix (image) 0, the suffix (text) 1: the loss on the suffix
    return model(input_ids=ids, pixel_values=pixels, token_type_ids=types, labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


def idefics(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    return model(input_ids=ids, pixel_values=pixels[:, None], labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


def instructblip(model: nn.Module, batch: Any) -> torch.Tensor:
    ids, pixels = batch
    return model(input_ids=ids, pixel_values=pixels, qformer_input_ids=ids[:, -6:], labels=ids.masked_fill(ids == IMAGE_TOKEN, -100)).loss


def florence_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, pixels = image_and_text(5)(seed)  # 4 patches of 16 px and the pooled one
    return ids, pixels, tokens(seed + 100)[:, :8].contiguous()


def florence(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(input_ids=batch[0], pixel_values=batch[1], labels=batch[2]).loss


def captioning(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(BATCH, 3, 16, 16, generator=_g(seed)), tokens(seed)[:, :8].contiguous()


def caption(model: nn.Module, batch: Any) -> torch.Tensor:
    return model(pixel_values=batch[0], labels=batch[1]).loss


def musicgen_tokens(seed: int) -> torch.Tensor:  # [batch x codebooks, time]
    return torch.randint(0, 64, (BATCH * 2, SEQ), generator=_g(seed))


def musicgen(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    return model(input_ids=batch, labels=batch.reshape(BATCH, 2, SEQ).transpose(1, 2)).loss


def build(model: str, config: str, **fields: Any) -> Callable[[], nn.Module]:
    return s29.transformers_model(model, config, **fields)


def encoder_decoder() -> nn.Module:
    import pytest

    transformers = pytest.importorskip("transformers")
    encoder = transformers.ViTConfig(**VISION)
    decoder = transformers.BertConfig(**dict(TEXT, num_attention_heads=4, is_decoder=True, add_cross_attention=True))
    config = transformers.VisionEncoderDecoderConfig(encoder=encoder.to_dict(), decoder=decoder.to_dict(), decoder_start_token_id=2, pad_token_id=0)
    return transformers.VisionEncoderDecoderModel(config)


@dataclass(frozen=True)
class Family:
    build: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    batch: Callable[[int], Any]
    model: str
    causal: bool = False  # + FusedLoss
    input_grads: bool = False


def family(model: str, config: str, fields: dict[str, Any], loss: Callable[..., torch.Tensor], batch: Callable[[int], Any],
           causal: bool = False) -> Family:  # fmt: skip
    return Family(build(model, config, **fields), loss, batch, model, causal)


FAMILIES: dict[str, Family] = {
    # encoders
    "modernbert": family("ModernBertForMaskedLM", "ModernBertConfig", dict(IDS, **ENC, cls_token_id=1, sep_token_id=2, local_attention=8, global_attn_every_n_layers=2),
                         lm, tokens),
    "electra": family("ElectraForMaskedLM", "ElectraConfig", dict(IDS, **ENC, embedding_size=32), lm, tokens),
    "xlm_roberta": family("XLMRobertaForMaskedLM", "XLMRobertaConfig", dict(IDS, **ENC), lm, tokens),
    # seq2seq
    "led": family("LEDForConditionalGeneration", "LEDConfig", dict({k: v for k, v in SEQ2SEQ.items() if k != "max_position_embeddings"},
                  max_encoder_position_embeddings=64, max_decoder_position_embeddings=64, attention_window=8), lm, tokens),
    "pegasus_x": family("PegasusXForConditionalGeneration", "PegasusXConfig", dict(SEQ2SEQ, block_size=8, num_global_tokens=4), lm, tokens),
    "prophetnet": family("ProphetNetForConditionalGeneration", "ProphetNetConfig",
                         dict(IDS, hidden_size=WIDTH, encoder_ffn_dim=128, num_encoder_layers=2, num_encoder_attention_heads=4,
                              decoder_ffn_dim=128, num_decoder_layers=2, num_decoder_attention_heads=4, max_position_embeddings=64,
                              ngram=2, num_buckets=8, relative_max_distance=16, decoder_start_token_id=2), lm, tokens),
    "fsmt": family("FSMTForConditionalGeneration", "FSMTConfig",
                   dict({k: v for k, v in SEQ2SEQ.items() if k != "vocab_size"}, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB), lm, tokens),
    # audio
    "speecht5_asr": family("SpeechT5ForSpeechToText", "SpeechT5Config",
                           dict(IDS, hidden_size=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                                encoder_ffn_dim=64, decoder_ffn_dim=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2, mask_time_prob=0.0, encoder_layerdrop=0.0,
                                decoder_layerdrop=0.0, max_speech_positions=400, max_text_positions=64, decoder_start_token_id=2),
                           lambda m, b: m(input_values=b[0], labels=b[1]).loss, speech_to_text),
    "wav2vec2_conformer": family("Wav2Vec2ConformerForCTC", "Wav2Vec2ConformerConfig", dict(AUDIO, conv_depthwise_kernel_size=7), ctc, audio),
    "wavlm": family("WavLMForCTC", "WavLMConfig", dict(AUDIO, num_buckets=32, max_bucket_distance=80), ctc, audio),
    "sew": family("SEWForCTC", "SEWConfig", dict(AUDIO, squeeze_factor=2), ctc, audio),
    "sew_d": family("SEWDForCTC", "SEWDConfig", dict(AUDIO, squeeze_factor=2, position_buckets=16, max_relative_positions=32), ctc, audio),
    "data2vec_audio": family("Data2VecAudioForCTC", "Data2VecAudioConfig", dict(AUDIO, num_conv_pos_embeddings=5, conv_pos_kernel_size=5), ctc,
                             audio),
    "musicgen": family("MusicgenForCausalLM", "MusicgenDecoderConfig", dict(vocab_size=64, hidden_size=WIDTH, num_hidden_layers=2, ffn_dim=128,
                       num_attention_heads=4, num_codebooks=2, max_position_embeddings=64, pad_token_id=64, bos_token_id=64), musicgen,
                       musicgen_tokens),  # one head per codebook: FusedLoss refuses it, with the fix (leave it out)
    # vision-language
    "paligemma": family("PaliGemmaForConditionalGeneration", "PaliGemmaConfig",
                        dict(vision_config=dict(VISION, image_size=8, model_type="siglip_vision_model"), projection_dim=WIDTH, hidden_size=WIDTH,
                             text_config=dict(TEXT, model_type="gemma", num_key_value_heads=1, head_dim=16), image_token_index=IMAGE_TOKEN,
                             vocab_size=VOCAB), paligemma, image_and_text(4, size=8), causal=True),
    "blip2": family("Blip2ForConditionalGeneration", "Blip2Config",
                    dict(vision_config=VISION, qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, encoder_hidden_size=32, vocab_size=VOCAB),
                         text_config=dict(TEXT, model_type="opt", ffn_dim=128, word_embed_proj_dim=WIDTH), num_query_tokens=4,
                         image_token_index=IMAGE_TOKEN), vlm, image_and_text(4), causal=True),
    "instructblip": family("InstructBlipForConditionalGeneration", "InstructBlipConfig",
                           dict(vision_config=VISION, qformer_config=dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                                intermediate_size=64, encoder_hidden_size=32, vocab_size=VOCAB),
                                text_config=dict(TEXT, model_type="opt", ffn_dim=128, word_embed_proj_dim=WIDTH), num_query_tokens=4,
                                image_token_index=IMAGE_TOKEN), instructblip, image_and_text(4), causal=True),
    "idefics3": family("Idefics3ForConditionalGeneration", "Idefics3Config",
                       dict(vision_config=VISION, text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE_TOKEN, scale_factor=2),
                       idefics, image_and_text(4), causal=True),
    "smolvlm": family("SmolVLMForConditionalGeneration", "SmolVLMConfig",
                      dict(vision_config=VISION, text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE_TOKEN, scale_factor=2),
                      idefics, image_and_text(4), causal=True),
    "florence2": family("Florence2ForConditionalGeneration", "Florence2Config",
                        dict(vision_config=dict(depths=(1, 1), patch_size=(7, 3), patch_stride=(4, 2), patch_padding=(3, 1), patch_prenorm=(False, True),
                                                embed_dim=(32, 64), num_heads=(2, 4), num_groups=(2, 4), window_size=2, drop_path_rate=0.0,
                                                projection_dim=WIDTH, max_position_embeddings=16, max_temporal_embeddings=4),
                             text_config=dict(SEQ2SEQ, model_type="bart"), image_token_id=IMAGE_TOKEN), florence, florence_batch),
    "vision_encoder_decoder": Family(encoder_decoder, caption, captioning, "VisionEncoderDecoderModel (ViT + BERT)"),
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
