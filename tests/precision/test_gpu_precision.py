"""The precision modes on CUDA (``pytest -m gpu``; skipped without a GPU). A few seconds on one GPU."""

from __future__ import annotations

from typing import Any

import bitsandbytes as bnb
import pytest
import torch

from lightning_hbm import QuantizedPrecision, quantize_model
from lightning_hbm.memory import parameter_bytes

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "fp4", "fp4-dq", "int8"])
def test_fit_on_cuda_in_bf16(mode: str, gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any) -> None:
    model = gpt_factory(lr=1e-2)
    recorder = loss_recorder()
    trainer = trainer_factory(accelerator="cuda", max_steps=12, plugins=[QuantizedPrecision(mode, dtype="bfloat16")], callbacks=[recorder])
    trainer.fit(model, datamodule_factory())
    layer = model.model.h[0].attn.c_attn
    assert isinstance(layer, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    assert layer.weight.device.type == "cuda"
    assert sum(recorder.losses[-3:]) / 3 < sum(recorder.losses[:3]) / 3


def test_quantized_bytes_on_cuda_match_cpu(llama_factory: Any) -> None:
    cpu_model = llama_factory(hidden_size=256, intermediate_size=688)
    quantize_model(cpu_model, "nf4-dq", dtype="bfloat16")
    gpu_model = llama_factory(hidden_size=256, intermediate_size=688)
    quantize_model(gpu_model, "nf4-dq", dtype="bfloat16", device="cuda")
    assert gpu_model.model.model.layers[0].mlp.up_proj.weight.device.type == "cuda"
    assert parameter_bytes(gpu_model) == parameter_bytes(cpu_model)


def test_state_dict_round_trip_on_cuda(gpt_factory: Any) -> None:
    source, target = gpt_factory(seed=0), gpt_factory(seed=1)
    for model in (source, target):
        quantize_model(model, "nf4-dq", dtype="bfloat16", device="cuda")
        model.cuda()
    target.load_state_dict(source.state_dict())
    tokens = torch.randint(0, 256, (2, 16), device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(target(tokens), source(tokens), rtol=0, atol=0)
