"""Under full recompute the last adapted layer of each block computes its LoRA term first, so the recompute stops
before its base matmul (lightning_hbm.adapters.lora.order): one 4-bit matmul less per block and step, same training."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch
from conftest import StepOps, peft_lora_layer

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm.adapters.lora.order import LastAdapted, is_adapter_first

LAYERS = 3


def _fit(llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, loss_recorder: Callable,
         policy: str = "full", steps: int = 3, device: str = "cpu") -> tuple[Any, ActivationCheckpointing, StepOps, Any]:
    model = llama_factory(num_hidden_layers=LAYERS)
    checkpointing, ops, losses = ActivationCheckpointing(policy), StepOps(), loss_recorder()
    trainer = trainer_factory(max_steps=steps, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                              callbacks=[LoRA(r=4), checkpointing, ops, losses], accelerator=device)
    trainer.fit(model, datamodule_factory(seq_len=32, batch_size=2))
    return model, checkpointing, ops, losses


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_recompute_skips_the_last_base_matmul_and_trains_the_same(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, loss_recorder: Callable,
    monkeypatch: pytest.MonkeyPatch, device: str,
) -> None:
    model, checkpointing, ops, losses = _fit(llama_factory, datamodule_factory, trainer_factory, loss_recorder,
                                             device=device)
    # found by running the first step: the last LoRA layer each LlamaDecoderLayer calls
    assert checkpointing.adapter_first == [f"model.model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]
    assert all(is_adapter_first(model.get_submodule(n)) for n in checkpointing.adapter_first)

    monkeypatch.setattr(LastAdapted, "apply", lambda self, model: [])  # peft's order in every step
    same, unchanged, peft_ops, peft_losses = _fit(llama_factory, datamodule_factory, trainer_factory, loss_recorder,
                                                  device=device)
    assert unchanged.adapter_first == [] and not any(map(is_adapter_first, same.modules()))

    # the same training, to the bit
    assert losses.losses == peft_losses.losses and len(losses.losses) == 3
    ours, theirs = _adapters(model), _adapters(same)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    # the first step ran in peft's order in both (and ours probed each chosen base once, on one row, at its end: does
    # it save anything for backward?); from the second on, one base matmul less per block
    # bitsandbytes on CPU runs its gemm_4bit operator; on CUDA, MatMul4Bit dequantizes (one op per matmul) for F.linear
    matmul = "bitsandbytes::gemm_4bit" if device == "cpu" else "bitsandbytes::dequantize_4bit"
    assert ops.steps[0][matmul] == peft_ops.steps[0][matmul] + LAYERS
    assert [s[matmul] for s in ops.steps[1:]] == [s[matmul] - LAYERS for s in peft_ops.steps[1:]]


def test_selective_recompute_keeps_peft_order(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, loss_recorder: Callable,
) -> None:
    # selective checkpointing keeps the matmul outputs: there is no base matmul in its recompute to skip
    model, checkpointing, _, _ = _fit(llama_factory, datamodule_factory, trainer_factory, loss_recorder, "selective", 2)
    assert checkpointing.adapter_first == [] and not any(map(is_adapter_first, model.modules()))


def test_resume_starts_with_the_saved_order_and_matches_the_uninterrupted_run(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, tmp_path: Any,
) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps: int, resume: Any = None, save: bool = False) -> tuple[Any, ActivationCheckpointing, StepOps]:
        model = llama_factory(num_hidden_layers=LAYERS)
        checkpointing, ops = ActivationCheckpointing(), StepOps()
        callbacks: list[Any] = [LoRA(r=4), checkpointing, ops]
        if save:
            callbacks.append(ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1))
        trainer = trainer_factory(max_steps=steps, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                                  callbacks=callbacks, enable_checkpointing=save)
        trainer.fit(model, datamodule_factory(seq_len=32, batch_size=2), ckpt_path=resume)
        return model, checkpointing, ops

    whole, _, whole_ops = run(4, save=True)
    saved = torch.load(next(tmp_path.glob("*step=2.ckpt")), weights_only=False)["callbacks"]
    assert [s for k, s in saved.items() if k.startswith("ActivationCheckpointing")] == [
        {"adapter_first": [f"model.model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]}]
    resumed, checkpointing, ops = run(4, resume=str(next(tmp_path.glob("*step=2.ckpt"))))
    assert checkpointing.adapter_first == [f"model.model.layers.{i}.mlp.down_proj" for i in range(LAYERS)]
    matmul = "bitsandbytes::gemm_4bit"
    assert [s[matmul] for s in ops.steps] == [s[matmul] for s in whole_ops.steps[2:]]  # adapter first from its first step
    ours, theirs = _adapters(resumed), _adapters(whole)
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", ["plain", "4bit"])
def test_adapter_first_with_fp32_adapters_computing_in_bf16(kind: str) -> None:
    """The bf16 path LoRA takes (fp32 adapters, bf16 matmuls through Bf16ComputeLinear, peft's input cast off): in a
    recompute, the same output and gradients as peft's forward on the same layer, to the bit."""
    import copy

    from lightning_hbm.adapters.lora.compute import compute_in_input_dtype
    from lightning_hbm.adapters.lora.forward import lora_forward, recomputing

    reference = peft_lora_layer(kind, torch.bfloat16)
    for container in (reference.lora_A, reference.lora_B):
        container["default"].float()
    assert compute_in_input_dtype(reference)
    changed = copy.deepcopy(reference)
    forward = lora_forward(changed, fuse=False)  # peft's sum: the fused one is tests/adapters/lora/test_lora_forward.py's
    assert forward is not None
    forward.first = True
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    outs = []
    for layer in (reference, changed):
        source = x.clone().requires_grad_(True)
        with recomputing():
            out = layer(source * 1.0)
        out.float().square().sum().backward()
        outs.append((out, source.grad, [p.grad for p in layer.parameters() if p.requires_grad]))
    (a, ga, pa), (b, gb, pb) = outs
    assert a.dtype == torch.bfloat16 and torch.equal(a, b) and torch.equal(ga, gb)
    assert all(p.dtype == torch.float32 for p in pa) and all(torch.equal(p, q) for p, q in zip(pa, pb))


def test_peft_order_in_the_forward_adapter_first_only_in_the_recompute() -> None:
    from lightning_hbm.adapters.lora.order import adapter_first, recomputing

    layer = peft_lora_layer("4bit", torch.float32)
    assert adapter_first(layer)
    calls: list[str] = []
    layer.base_layer.register_forward_pre_hook(lambda m, a: calls.append("base"))
    layer.lora_A["default"].register_forward_pre_hook(lambda m, a: calls.append("lora_A"))
    x = torch.randn(2, 64, requires_grad=True)
    layer(x)
    assert calls == ["base", "lora_A"]  # the forward: peft's order (its graph, peak and gradient order)
    calls.clear()
    with recomputing():
        layer(x)
    assert calls == ["lora_A", "base"]
