"""The smallest reproduction found of the planner's heap corruption on transformers' Mimi (issue 53, session 33; fixed).

``python benchmarks/mimi_plan_crash.py [repeats]`` predicts the plain fp32 candidate (``32-true``: no quantization, no
LoRA, no checkpointing) of a LightningModule holding transformers' ``MimiEncoderModel`` (SEANet convolutions, the
encoder transformer, the strided downsample) followed by ``MimiSplitResidualVectorQuantizer`` (the codebooks),
``repeats`` times (default 6) in one process, each a fresh ``lightning_hbm.planner.api.predict``; "no crash" and exit
status 0 when it holds. Before the fix each prediction returned a peak, then the process died: "Segmentation fault"
(at the 1st-4th prediction, or at interpreter exit), with ``LD_PRELOAD=libc_malloc_debug.so MALLOC_CHECK_=3`` glibc's
"corrupted double-linked list" (every run of 6 by the 4th prediction, session 33, 2-core CPU dev machine).

The cause: each ``MimiConv1d`` holds ``padding_left``/``padding_right`` as plain tensor attributes (neither parameters
nor buffers). The template's copy for each trace (``planner/building.py`` ``_fake_copy``) made fresh fakes of
parameters and buffers only; ``copy.deepcopy`` made each of those attributes a FakeTensor of a copy of the template's
fake mode (the mode object itself deep-copied; which freed object then corrupts the heap was not pinned down). Every tensor attribute is now made a
fresh fake of the copy's mode, as parameters and buffers are (``tests/test_model_families_s33.py``).

Ruled out on the way: ``build_template`` alone (8 builds, no trace); the fake-tensor dispatch cache
(``torch._dynamo.config.fake_tensor_cache_enabled = False``); the twins' size (``RealValues`` at most 1, 64 or 1,024
elements); the tracker's weak-reference callbacks on storages; the same model under ``FakeTensorMode`` + ``RealValues``
without the planner's copy (8 forwards and backwards). Only ``MimiEncoderModel`` followed by the quantizer crashed of
the parts tried; each part alone did not (its attributes were not read after the copy).
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
