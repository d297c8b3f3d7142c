"""LoRAForward under the profiler's watchers: the hooks that only observe (module attribution, the step recorder) do not
turn the fused sum back into peft's, so a detailed step measures the step that trains unwatched (session 31: the
profiled step of nf4-dq + LoRA + full recompute ran peft's sum and peaked 32,768 B above the plan and MemTracker)."""

from __future__ import annotations

from typing import Any

import torch
from conftest import peft_lora_layer
from test_lora_forward import _Ops  # the aten ops a call runs (pytest puts this folder on sys.path)

from lightning_hbm.adapters.lora.compute import compute_in_input_dtype
from lightning_hbm.adapters.lora.forward import lora_forward
from lightning_hbm.memory import LiveStorageTracker
from lightning_hbm.profiling.timeline import StepRecorder
from lightning_hbm.running import RunningModules, changing_hooks, observing


def _fused_4bit_layer() -> Any:
    layer = peft_lora_layer("4bit", torch.bfloat16)
    for container in (layer.lora_A, layer.lora_B):  # what LoRA does on a bf16 model: fp32 adapters computing in bf16
        container["default"].float()
    assert compute_in_input_dtype(layer)
    assert lora_forward(layer) is not None
    return layer


def _ops_and_peak(layer: Any, x: torch.Tensor, watched: bool) -> tuple[list[str], int]:
    layer.zero_grad(set_to_none=True)  # each run the same: no gradient accumulated into
    tracker = LiveStorageTracker(track_peak=True)
    recorder = StepRecorder(tracker, layer) if watched else None
    if watched:
        tracker.attach_modules(layer)  # the detailed step's module attribution: hooks on every submodule
    ops = _Ops()
    with tracker:
        if recorder is not None:
            recorder.start()  # the step recorder's own hooks on every submodule, lora_B included
        with ops:
            layer(x.detach().requires_grad_(True)).float().sum().backward()
        if recorder is not None:
            recorder.stop()
    tracker.detach_modules()
    return ops.names, tracker.peak_bytes


def test_the_profilers_hooks_keep_the_fused_sum_and_its_peak() -> None:
    layer = _fused_4bit_layer()
    x = torch.randn(4, 16, 64, dtype=torch.bfloat16)
    plain_ops, plain_peak = _ops_and_peak(layer, x, watched=False)
    watched_ops, watched_peak = _ops_and_peak(layer, x, watched=True)
    assert "addmm" in plain_ops and "clone" not in plain_ops  # the fused sum
    # was: peft's sum under the watchers (lora_B's matmul, the scaling multiply, bitsandbytes' clone, the add)
    assert watched_ops == plain_ops
    assert watched_peak == plain_peak
    assert not layer.lora_B["default"]._forward_hooks and not layer.lora_B["default"]._forward_pre_hooks  # removed


def test_only_observing_hooks_are_ignored() -> None:
    module = torch.nn.Linear(2, 2)
    with RunningModules(module):  # its hooks observe
        assert module._forward_pre_hooks and not changing_hooks(module)
    handle = module.register_forward_pre_hook(observing(lambda m, args: None))
    assert not changing_hooks(module)
    handle.remove()
    handle = module.register_forward_hook(lambda m, args, out: out * 2)  # a user's hook may change the output
    assert changing_hooks(module)
    handle.remove()
    module.register_forward_pre_hook(lambda m, args: None)
    assert changing_hooks(module)
