"""LoRAForward (lightning_hbm.adapters.lora.forward): the adapter term added inside one addmm, where that is peft's
function; peft's own forward everywhere else."""

from __future__ import annotations

import copy
from typing import Any, Callable

import peft
import pytest
import torch
from conftest import peft_lora_layer
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision
from lightning_hbm._compat.torch import forward_override
from lightning_hbm.adapters.lora.compute import compute_in_input_dtype
from lightning_hbm.adapters.lora.forward import LoRAForward, lora_forward, recomputing


class _Ops(TorchDispatchMode):
    """The aten ops a call runs (overload packets' names)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _pair(kind: str, dtype: torch.dtype, fp32_adapters: bool = False) -> tuple[Any, Any]:
    """(peft's layer, a copy with the fused LoRAForward)."""
    reference = peft_lora_layer(kind, dtype)
    if fp32_adapters:  # what LoRA does on a bf16 model: fp32 adapters computing in bf16
        for container in (reference.lora_A, reference.lora_B):
            container["default"].float()
        assert compute_in_input_dtype(reference)
    fused = copy.deepcopy(reference)
    assert isinstance(lora_forward(fused), LoRAForward)
    return reference, fused


def _run(layer: Any, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor], list[int]]:
    """Output, input gradient, parameter gradients and the sizes of the tensors saved for backward."""
    saved: list[int] = []
    source = x.clone().requires_grad_(True)

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(source * 1.0)
    out.float().square().sum().backward()
    return out, source.grad, [p.grad for p in layer.parameters() if p.requires_grad], saved


@pytest.mark.parametrize("kind", ["plain", "4bit"])
@pytest.mark.parametrize("dtype,fp32_adapters", [(torch.float32, False), (torch.bfloat16, True), (torch.bfloat16, False)])
def test_fused_sum_is_peft_forward_within_rounding_and_saves_the_same(kind: str, dtype: torch.dtype,
                                                                      fp32_adapters: bool) -> None:
    reference, fused = _pair(kind, dtype, fp32_adapters)
    x = torch.randn(3, 5, 64, dtype=dtype)
    out_a, gx_a, g_a, saved_a = _run(reference, x)
    ops = _Ops()
    with ops:
        fused(x)
    out_b, gx_b, g_b, saved_b = _run(fused, x)
    assert "addmm" in ops.names and "mul" not in ops.names and "clone" not in ops.names  # one op for the sum
    assert out_b.dtype == out_a.dtype == dtype and out_b.shape == out_a.shape
    # the sum rounds once instead of three times: the difference is rounding in the output's dtype (bf16: 2**-8)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert len(g_a) == len(g_b) == 2 and all(g.dtype == p.dtype for g, p in zip(g_b, g_a))
    for a, b in [(out_a, out_b), (gx_a, gx_b), *zip(g_a, g_b)]:
        assert float((b.double() - a.double()).norm() / a.double().norm()) < tol
    # the same tensors for backward (lora_A's input and weight, lora_B's input and weight): memory unchanged
    assert sorted(saved_b) == sorted(saved_a)


def test_fused_sum_is_the_exact_function_in_float64() -> None:
    layer = peft_lora_layer("plain", torch.float64)
    x = torch.randn(7, 64, dtype=torch.float64)
    lora_a, lora_b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    expected = layer.base_layer(x) + (x @ lora_a.T @ lora_b.T) * layer.scaling["default"]
    lora_forward(layer)
    torch.testing.assert_close(layer(x), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["dora", "merged", "disabled", "hooked lora_B", "autocast", "kwargs", "two adapters"])
def test_peft_forward_where_the_fused_sum_would_not_be_its_function(case: str) -> None:
    layer = peft_lora_layer("plain", torch.float32, dora=case == "dora")
    expected_layer = copy.deepcopy(layer)
    assert lora_forward(layer) is not None
    kwargs: dict[str, Any] = {}
    if case == "merged":
        layer.merge(), expected_layer.merge()
    elif case == "disabled":
        layer.enable_adapters(False), expected_layer.enable_adapters(False)
    elif case == "hooked lora_B":  # a user's hook on lora_B must still run: peft calls the module
        seen: list[int] = []
        layer.lora_B["default"].register_forward_hook(lambda m, a, o: seen.append(1))
    elif case == "kwargs":
        kwargs = {"adapter_names": ["default"] * 4}
    elif case == "two adapters":
        for target in (layer, expected_layer):
            target.update_layer("other", 4, 8, config=peft.LoraConfig(r=4, lora_alpha=8))
            target.set_adapter(["default", "other"])
    x = torch.randn(4, 64)
    ops = _Ops()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=case == "autocast"):
        with ops:
            out = layer(x, **kwargs)
        expected = expected_layer(x, **kwargs)
    assert ops.names.count("addmm") == 1  # the base Linear's bias only: no fused sum, peft's own forward
    assert torch.equal(out, expected)
    if case == "hooked lora_B":
        assert seen == [1]


def test_recompute_of_a_first_fused_layer_saves_the_term_before_the_base_and_gives_the_forward_values() -> None:
    layer = peft_lora_layer("4bit", torch.float32)
    forward = lora_forward(layer)
    assert forward is not None
    forward.first = True
    calls: list[str] = []
    layer.base_layer.register_forward_pre_hook(lambda m, a: calls.append("base"))
    layer.lora_A["default"].register_forward_pre_hook(lambda m, a: calls.append("lora_A"))
    x = torch.randn(2, 3, 64, requires_grad=True)
    saved: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}

    def run(key: str) -> torch.Tensor:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved[key].append(t) or t, lambda t: t):
            return layer(x * 1.0)

    out = run("forward")
    assert calls == ["base", "lora_A"]  # the forward: peft's order
    calls.clear()
    with recomputing():
        again = run("recompute")
    assert calls == ["lora_A", "base"]  # the term's saved tensors first: checkpoint's early stop ends before the base
    assert torch.equal(again, out)  # a recompute that goes on gets the forward's values
    # the forward's saved tensors, re-created in the same order with the same values, and nothing more
    assert len(saved["recompute"]) == len(saved["forward"])
    assert all(torch.equal(a, b) for a, b in zip(saved["forward"], saved["recompute"]))


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_lora_gives_fused_forwards_and_trains_as_peft_within_rounding(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, loss_recorder: Callable,
    monkeypatch: pytest.MonkeyPatch, dropout: float,
) -> None:
    """Under full recompute, with the adapter-first layers; with LoRA dropout the recompute draws the same masks."""
    def fit() -> tuple[Any, list[float], dict[str, torch.Tensor]]:
        model, losses = llama_factory(num_hidden_layers=2), loss_recorder()
        trainer = trainer_factory(max_steps=4, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
                                  callbacks=[LoRA(r=4, dropout=dropout), ActivationCheckpointing(), losses])
        trainer.fit(model, datamodule_factory(seq_len=32, batch_size=2))
        return model, losses.losses, {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    model, losses, adapters = fit()
    from peft.tuners.lora import LoraLayer

    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    assert layers and all(isinstance(forward_override(m), LoRAForward) and forward_override(m).fuse for m in layers)
    monkeypatch.setattr(LoRAForward, "__init__", _unfused_init)  # peft's sum everywhere
    same, peft_losses, peft_adapters = fit()
    assert not any(forward_override(m).fuse for m in same.modules() if isinstance(m, LoraLayer))
    assert len(losses) == 4 and losses == pytest.approx(peft_losses, rel=1e-5)
    for name, value in adapters.items():
        torch.testing.assert_close(value, peft_adapters[name], rtol=1e-3, atol=1e-5)


_init = LoRAForward.__init__


def _unfused_init(self: LoRAForward, layer: torch.nn.Module, fuse: bool) -> None:
    _init(self, layer, False)


@pytest.mark.parametrize("change", ["fuse off", "adapters off"])
def test_a_recompute_saves_what_its_own_forward_saved_after_the_forward_path_changed(change: str) -> None:
    """A fused forward, then one that runs peft's sum (fusing turned off, the adapters disabled): the recompute after
    the second follows the second, not the first."""
    layer = peft_lora_layer("4bit", torch.float32)
    forward = lora_forward(layer)
    assert forward is not None
    forward.first = True
    x = torch.randn(2, 3, 64, requires_grad=True)
    layer(x * 1.0)  # fused
    if change == "fuse off":
        forward.fuse = False
    else:
        layer.enable_adapters(False)
    saved: dict[str, list[torch.Tensor]] = {"forward": [], "recompute": []}
    for key in saved:
        with recomputing(key == "recompute"), torch.autograd.graph.saved_tensors_hooks(
                lambda t, key=key: saved[key].append(t) or t, lambda t: t):
            layer(x * 1.0)
    assert [(t.shape, t.dtype) for t in saved["recompute"]] == [(t.shape, t.dtype) for t in saved["forward"]]


def test_a_fused_layer_copies_and_pickles_with_its_forward() -> None:
    import pickle

    layer = peft_lora_layer("plain", torch.float32)
    assert lora_forward(layer) is not None
    x = torch.randn(3, 64)
    for copied in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        forward = forward_override(copied)
        assert isinstance(forward, LoRAForward) and forward.layer is copied  # its own layer, not the original
        assert torch.equal(copied(x), layer(x))


def test_the_longest_context_configuration_takes_the_fused_sum_in_forward_and_recompute(
    llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """benchmarks/max_context.py's configuration (bf16 nf4-dq with the embedding and head quantized, LoRA on the 7
    projections, full recompute with offload and MLP chunks, FusedLoss): no layer falls back to peft's sum, in the forward
    or in the block's recompute (benchmarks/README.md had said o_proj's recompute took peft's sum)."""
    from lightning_hbm import FusedLoss, MemoryEfficientOptimizer
    from lightning_hbm.adapters.lora import forward as forward_module

    peft_sums: list[bool] = []
    fused: list[bool] = []  # one per fused addmm, True in a recompute
    real_sum, real_weight = forward_module._peft_sum, forward_module._fused_weight

    def peft_sum(*args: Any) -> torch.Tensor:
        peft_sums.append(forward_module._RECOMPUTING.get())
        return real_sum(*args)

    def fused_weight(*args: Any) -> Any:
        weight = real_weight(*args)
        if weight is not None:
            fused.append(forward_module._RECOMPUTING.get())
        return weight

    monkeypatch.setattr(forward_module, "_peft_sum", peft_sum)
    monkeypatch.setattr(forward_module, "_fused_weight", fused_weight)
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    plugin = QuantizedPrecision("nf4-dq", dtype="bfloat16", quantize_embeddings=True, quantize_head=True)
    callbacks = [LoRA(r=8, alpha=16.0, target_modules=projections), MemoryEfficientOptimizer(kind="adamw8bit"),
                 ActivationCheckpointing("full", offload=True, mlp_chunks=4), FusedLoss()]
    trainer_factory(max_steps=1, plugins=[plugin], callbacks=callbacks).fit(
        llama_factory(num_hidden_layers=2), datamodule_factory(seq_len=64, batch_size=1))
    assert peft_sums == []
    assert any(fused) and not all(fused)  # in the forward and in the recompute
