"""The categories, checked against bytes computed by hand on tiny models."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from lightning_hbm.memory import CATEGORIES, MemoryBreakdown, classify, owned_storages, parameter_bytes, tensor_bytes
from lightning_hbm.models import NanoGPT
from lightning_hbm.precision import quantize_model


def _adamw_step(module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    idx = torch.randint(0, 256, (2, 16))
    module(idx).float().sum().backward()
    optimizer.step()


def test_categories_are_the_documented_five() -> None:
    assert CATEGORIES == ("parameters", "gradients", "optimizer_states", "activations", "other")
    assert list(MemoryBreakdown().as_dict()) == list(CATEGORIES)


def test_adamw_step_params_grads_states_by_hand(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    params = list(model.parameters())
    fp32_bytes = sum(p.numel() * 4 for p in params)
    optimizer = torch.optim.AdamW(params)
    assert classify(model, optimizer) == MemoryBreakdown(parameters=fp32_bytes)  # nothing else exists yet
    _adamw_step(model, optimizer)
    got = classify(model, optimizer)
    assert got.parameters == fp32_bytes
    assert got.gradients == fp32_bytes
    # AdamW: exp_avg + exp_avg_sq (fp32, one each per element) + a 0-dim fp32 `step` per parameter
    assert got.optimizer_states == 2 * fp32_bytes + 4 * len(params)
    assert got.activations == 0 and got.other == 0


def test_frozen_parameters_have_no_grads_or_states(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    for name, p in model.named_parameters():
        p.requires_grad_("lm_head" in name or "ln_f" in name)
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_bytes = sum(p.numel() * 4 for p in trainable)
    optimizer = torch.optim.AdamW(model.parameters())  # user code passes everything; frozen get no state
    _adamw_step(model, optimizer)
    got = classify(model, optimizer)
    assert got.parameters == sum(p.numel() * 4 for p in model.parameters())
    assert got.gradients == trainable_bytes
    assert got.optimizer_states == 2 * trainable_bytes + 4 * len(trainable)


def test_tied_and_viewed_storages_are_counted_once(gpt_factory: Callable[..., NanoGPT]) -> None:
    untied, tied = gpt_factory(), gpt_factory(tie_weights=True)
    head = untied.model.lm_head.weight.numel() * 4
    assert classify(tied).parameters == classify(untied).parameters - head
    view = untied.model.wte.weight[:3]  # a view of a parameter is a parameter, not an activation
    assert classify(untied, activations=[view]).activations == 0


def test_buffers_are_other() -> None:
    model = nn.BatchNorm1d(10)  # running_mean, running_var (fp32) + num_batches_tracked (int64)
    assert classify(model) == MemoryBreakdown(parameters=2 * 10 * 4, other=2 * 10 * 4 + 8)


def test_quantized_parameters_match_storage_count_and_hand_count() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128, bias=False), nn.Linear(128, 64, bias=False))
    quantize_model(model, "nf4", dtype="float32")
    got = classify(model).parameters
    assert got == parameter_bytes(model)
    # nf4, 64-element blocks: 4 bits per weight + one fp32 absmax per block + a 16-entry fp32 code book
    numel = 64 * 128
    assert got == 2 * (numel // 2 + numel // 64 * 4 + 16 * 4)
    assert got < numel * 2 * 4 / 6  # vs. fp32 storage


def test_bitsandbytes_8bit_optimizer_states() -> None:
    import bitsandbytes as bnb

    torch.manual_seed(0)
    model = nn.Linear(256, 256)
    optimizer = bnb.optim.AdamW8bit(model.parameters(), min_8bit_size=0)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    states = classify(model, optimizer).optimizer_states
    numel = sum(p.numel() for p in model.parameters())
    # two uint8 states per element, plus per-block absmax and the quantization maps: far below AdamW's 8 B/elem
    assert 2 * numel < states < 2.2 * numel


def test_torchao_nf4_tensor_counts_its_inner_storage() -> None:
    from torchao.quantization import to_nf4

    module = nn.Module()
    module.weight = nn.Parameter(to_nf4(torch.randn(256, 128)), requires_grad=False)
    got = classify(module).parameters
    numel = 256 * 128
    # the wrapper reports an fp32-sized storage; the bytes are in its packed inner tensors
    assert numel // 2 < got < numel // 2 * 1.1


def test_device_filter_and_owned_priority(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    assert classify(model, device="cuda").total == 0
    assert classify(model, device="cpu").parameters == parameter_bytes(model)
    p = model.model.ln_f.weight
    p.grad = p.data  # a gradient aliasing its parameter is counted once, as a parameter
    owned = owned_storages(model)
    assert {c for c, _ in owned.values()} == {"parameters"}


def test_dominant() -> None:
    assert MemoryBreakdown(parameters=1, activations=5).dominant() == "activations"
    assert MemoryBreakdown().dominant() == "parameters"


def test_tensor_bytes_counts_each_storage_once() -> None:
    a, b = torch.zeros(10), torch.zeros(3, dtype=torch.float64)
    assert tensor_bytes([a, a[2:], a.view(2, 5), b]) == 10 * 4 + 3 * 8
