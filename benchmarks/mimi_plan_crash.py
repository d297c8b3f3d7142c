"""The smallest reproduction found of the planner's heap corruption on transformers' Mimi (issue 53, session 33; not fixed).

``python benchmarks/mimi_plan_crash.py [repeats]`` predicts the plain fp32 candidate (``32-true``: no quantization, no
LoRA, no checkpointing) of a LightningModule holding transformers' ``MimiEncoderModel`` (SEANet convolutions, the
encoder transformer, the strided downsample) followed by ``MimiSplitResidualVectorQuantizer`` (the codebooks),
``repeats`` times (default 6) in one process, each a fresh ``lightning_hbm.planner.api.predict``. Each prediction
returns a peak, then the process dies: "Fatal Python error: Segmentation fault" (at the 2nd-3rd prediction, or at
interpreter exit), with ``LD_PRELOAD=libc_malloc_debug.so MALLOC_CHECK_=3`` glibc's "corrupted double-linked list".
Exit status 0 means it no longer crashes.

What session 33 (h4) established on the 2-core CPU dev machine (torch 2.13.0+cpu, transformers 5.25.0):
- the whole ``MimiModel`` (the families tests' wrapper, loss on ``audio_values``) crashes the same way: ``plan()``'s
  default grid at its 13th candidate, ``bf16-true`` predicted 3 times, and a candidate that fails inside the trace
  (``bf16-true`` + LoRA 16: "Input type (float) and bias type (c10::BFloat16) should be the same", a second finding)
  predicted 3 times; one plan of the library's default recipe (nf4-dq, LoRA, checkpointing) returned and exited
  cleanly twice (one prediction is often not enough to show it);
- none of these crashes in 4-6 predictions: ``MimiEncoder`` (convolutions only), ``MimiTransformerModel``,
  ``MimiDecoder``, ``MimiEncoderModel``, ``MimiDecoderModel``, the quantizer alone (with and without random
  codebooks, at the same frame count), ``MimiEncoder`` + quantizer, transformer + quantizer, the strided downsample
  conv + quantizer. Only the encoder model (SEANet + transformer + downsample) followed by the quantizer does;
- ``build_template`` alone (the model built on fake tensors, no trace) 8 times does not crash: the trace does;
- not the fake-tensor dispatch cache (``torch._dynamo.config.fake_tensor_cache_enabled = False``: still crashes);
- not the twins' size (``RealValues`` with at most 1, 64 or 1,024 elements per twin: still crashes, flaky);
- ``PYTHONMALLOC=debug`` hides it (3 predictions, no crash, nothing reported); valgrind memcheck over one
  prediction ran past 25 min without reporting an invalid write before it was stopped.
"""

from __future__ import annotations

import gc
import sys

import lightning.pytorch as pl
import torch
from torch import nn

FIELDS = dict(hidden_size=32, num_filters=8, upsampling_ratios=[2, 2], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=8, intermediate_size=64, codebook_size=32, codebook_dim=16, vector_quantization_hidden_dimension=16,
              num_quantizers=2, upsample_groups=32, sliding_window=16, max_position_embeddings=64, sampling_rate=64)  # fmt: skip


class EncodeAndQuantize(nn.Module):
    """What ``MimiModel.encode`` then ``quantizer.decode`` run, without the decoder."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.mimi import modeling_mimi as mimi

        config = mimi.MimiConfig(**FIELDS)
        self.encoder = mimi.MimiEncoderModel(config)
        self.quantizer = mimi.MimiSplitResidualVectorQuantizer(config)

    def forward(self, audio: torch.Tensor) -> torch.Tensor:
        codes = self.quantizer.encode(self.encoder(input_values=audio).latents)
        return self.quantizer.decode(codes.transpose(0, 1))


class Task(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = EncodeAndQuantize()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.model(batch).square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def main(repeats: int) -> None:
    from lightning_hbm.planner import Candidate
    from lightning_hbm.planner.api import predict

    audio = torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(1))
    for i in range(repeats):
        peak = predict(Task, audio, Candidate("32-true"), extrapolate=False).peak
        print(f"prediction {i + 1}: peak {peak:,} B", flush=True)
        gc.collect()
    print("no crash", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 6)
