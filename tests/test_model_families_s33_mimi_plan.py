"""transformers' ``MimiModel`` (encode, quantize, decode) planned under the default recipe (issue 53, session 33).

nf4-dq with fp32 compute, LoRA r=8, full checkpointing: the plan was 773,254 B against torch's MemTracker 1,036,302 B
(0.746). The gap was all activations (the parameters, gradients, optimizer states and the rest agree to the byte),
and it is MemTracker's own: its module hooks (``ModTracker``'s multi-grad hooks on each module's inputs and outputs)
keep the graph of a module whose output never reaches the loss alive through the backward and the optimizer step.
Mimi's encoder is one: its latents become integer codes (``argmin``), no gradient flows back, and a training step
frees its output and every tensor its graph saved at the end of the forward (263,048 B here). Measured without the
hooks (``memtracker_peak(module_hooks=False)``, the same storages counted) the step peaks at the plan's figure.
"""

from __future__ import annotations

import weakref
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.planner import plan
from lightning_hbm.planner.reference import _step, memtracker_peak
from lightning_hbm.planner.tracing import apply_candidate

transformers = pytest.importorskip("transformers")

FIELDS = dict(hidden_size=32, num_filters=8, upsampling_ratios=[2, 2], num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
              head_dim=8, intermediate_size=64, codebook_size=32, codebook_dim=16, vector_quantization_hidden_dimension=16,
              num_quantizers=2, upsample_groups=32, sliding_window=16, max_position_embeddings=64, sampling_rate=64)  # fmt: skip
AUDIO = torch.randn(2, 1, 256, generator=torch.Generator().manual_seed(1))


class MimiTask(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers.models.mimi import modeling_mimi as mimi

        torch.manual_seed(0)
        self.mimi = mimi.MimiModel(mimi.MimiConfig(**FIELDS))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.mimi(input_values=batch).audio_values.square().mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters())


def _planned() -> Any:
    planned = plan(MimiTask, AUDIO, plugin=QuantizedPrecision("nf4-dq", dtype="float32"),
                   callbacks=[LoRA(r=8), ActivationCheckpointing()])  # fmt: skip
    assert len(planned.predictions) == 1 and not planned.failures
    return planned.chosen


def test_mimi_plan_within_3_percent_of_the_step_measured_without_module_hooks() -> None:
    predicted = _planned()
    measured = memtracker_peak(MimiTask, AUDIO, predicted.candidate, module_hooks=False)
    print(f"mimi: predicted {predicted.peak:,} B, MemTracker without module hooks {measured:,} B")
    assert predicted.peak == pytest.approx(measured, rel=0.03)


def test_mimi_encoder_output_dies_with_the_forward_and_lives_under_memtracker_hooks() -> None:
    """What the plan assumes, seen on the real step: no gradient reaches the encoder, its output is freed at once;
    MemTracker's module hooks keep it (and its graph) alive to the end of the step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    candidate = _planned().candidate
    plugin = candidate.precision_plugin("cpu")
    module = MimiTask()
    with plugin.tensor_init_context():
        module.configure_model()
    optimizers = apply_candidate(module, candidate, plugin, device="cpu", batch=AUDIO)
    outputs: list[weakref.ref] = []
    seanet: nn.Module = module.mimi.encoder.encoder_seanet
    seanet.register_forward_hook(lambda _m, _i, out: outputs.append(weakref.ref(out)))
    _step(module, AUDIO, plugin, optimizers)
    assert outputs[-1]() is None
    tracker = MemTracker()
    # frozen bases: no gradient hooks on parameters (as reference._FrozenSafeMemTracker)
    tracker._track_module_params_and_buffers = lambda m, install_grad_hooks=True: (  # type: ignore[method-assign]
        MemTracker._track_module_params_and_buffers(tracker, m, install_grad_hooks=False))
    tracker.track_external(module, *optimizers)
    with tracker:
        _step(module, AUDIO, plugin, optimizers)
    assert outputs[-1]() is not None
