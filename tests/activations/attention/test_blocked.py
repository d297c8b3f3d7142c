"""lightning_hbm's blocked attention kernel and its routing by ``AttentionKernel("blocked"/"auto")``.

The kernel is checked against torch's own attention in float64 (outputs and every input gradient), for what it
saves for backward (no more than torch's fused CPU kernel), for its transient memory (torch's ``MemTracker``), on fake
tensors, and in real fits: under full and selective checkpointing (the recompute routes as the forward did), resumed
bit-exact, with "auto" choosing by timing and keeping its choice in the checkpoint.
"""

from __future__ import annotations

import copy
import logging
import pickle
import re
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from conftest import StepOps
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import lightning_hbm.activations.attention.blocked as blocked
import lightning_hbm.activations.attention.kernel as attention_kernel
from lightning_hbm import ActivationCheckpointing, AttentionKernel
from lightning_hbm.activations.attention.blocked import RoutedForward, Timing, attention, resolve
from lightning_hbm.memory.torch_tracker import torch_peak_bytes

BLOCKED_OP = "lightning_hbm::blocked_attention"
FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _qkv(b: int, hq: int, hkv: int, lq: int, lk: int, d: int, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    shapes = [(b, hq, lq, d), (b, hkv, lk, d), (b, hkv, lk, d)]
    return [torch.randn(s, dtype=dtype, requires_grad=True) for s in shapes]


def _forward_backward(fn: Callable[..., torch.Tensor], q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      grad: torch.Tensor, **kwargs: Any) -> list[torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out.backward(grad)
    return [out.detach(), q.grad, k.grad, v.grad]  # type: ignore[list-item]


CASES = {
    "causal": dict(shape=(2, 4, 4, 16, 16, 8), causal=True),
    "gqa-causal": dict(shape=(2, 6, 2, 16, 16, 8), causal=True),
    "causal-more-keys": dict(shape=(1, 4, 2, 12, 20, 8), causal=True),  # top-left aligned, as torch's is_causal
    "no-mask": dict(shape=(1, 6, 3, 24, 16, 8), causal=False),
    "bool-mask": dict(shape=(2, 4, 2, 16, 16, 8), causal=False, mask="bool"),
    "float-mask": dict(shape=(2, 4, 2, 16, 16, 8), causal=False, mask="float"),
}


@pytest.mark.parametrize("chunk_bytes", [blocked.CHUNK_BYTES, 700], ids=["one-chunk", "many-chunks"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_equals_torch_attention_in_float64(case: str, chunk_bytes: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(blocked, "CHUNK_BYTES", chunk_bytes)
    torch.manual_seed(0)
    spec = CASES[case]
    b, hq, hkv, lq, lk, d = spec["shape"]
    q, k, v = _qkv(b, hq, hkv, lq, lk, d)
    mask = None
    if spec.get("mask") == "bool":
        mask = torch.rand(b, 1, lq, lk) > 0.3
        mask[..., 0] = True  # no row fully masked here (see the next test)
    elif spec.get("mask") == "float":
        mask = torch.randn(1, hq, lq, lk, dtype=torch.float64)
    grad = torch.randn(b, hq, lq, d, dtype=torch.float64)
    got = _forward_backward(attention, q, k, v, grad, mask=mask, causal=spec["causal"])
    want = _forward_backward(F.scaled_dot_product_attention, q, k, v, grad, attn_mask=mask, is_causal=spec["causal"],
                             enable_gqa=hq != hkv)
    for name, g, w in zip(("output", "dq", "dk", "dv"), got, want):
        # the scores go through an fp32 softmax (the same for every input dtype): fp32 rounding, not float64's
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5, msg=f"{case}: {name}")


def test_a_fully_masked_row_gives_zeros_as_torch_does() -> None:
    torch.manual_seed(0)
    q, k, v = _qkv(1, 2, 2, 4, 4, 8, torch.float32)
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    mask[..., 2, :] = False
    grad = torch.randn(1, 2, 4, 8)
    got = _forward_backward(attention, q, k, v, grad, mask=mask)
    want = _forward_backward(F.scaled_dot_product_attention, q, k, v, grad, attn_mask=mask)
    assert torch.isfinite(got[0]).all() and (got[0][:, :, 2] == 0).all() and (got[1][:, :, 2] == 0).all()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_bf16_error_is_of_the_order_of_torchs_own() -> None:
    """bf16 matmuls, the scores rounded after their row's offset; the fused kernel keeps fp32 scores: within 2x its
    error (the real model's gradients: ``benchmarks/blocked_attention.py``)."""
    torch.manual_seed(0)
    q, k, v = (t.detach() for t in _qkv(1, 9, 3, 256, 256, 64, torch.float32))
    reference = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    low = [t.bfloat16() for t in (q, k, v)]
    ours = (attention(*low, causal=True).float() - reference).abs().max()
    torchs = (F.scaled_dot_product_attention(*low, is_causal=True, enable_gqa=True).float() - reference).abs().max()
    assert ours <= 2 * torchs, (ours, torchs)


def _saved_bytes(fn: Callable[[], torch.Tensor]) -> int:
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total


def test_saves_no_more_for_backward_than_torchs_fused_kernel() -> None:
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(1, 9, 3, 512, 512, 64))
    ours = _saved_bytes(lambda: attention(q, k, v, causal=True))
    flash = _saved_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    inputs = sum(t.numel() * t.element_size() for t in (q, k, v))
    rows = 9 * 512 * 2  # one bf16 offset per query row
    assert ours == inputs + rows  # backward recomputes the probabilities: no output, no fp32 log-sum-exp
    assert ours < flash  # the fused kernel also keeps its output and a log-sum-exp


def test_scores_live_one_chunk_at_a_time() -> None:
    """torch's MemTracker over forward + backward: the transient is a few chunks, not the b*h*s*s scores."""
    torch.manual_seed(0)
    q, k, v = (t.detach().bfloat16().requires_grad_() for t in _qkv(1, 8, 8, 1024, 1024, 32))
    grad = torch.randn(1, 8, 1024, 32, dtype=torch.bfloat16)
    io = 8 * q.numel() * q.element_size()  # q, k, v, output, grad and three input gradients
    scores = 8 * 1024 * 1024 * 2  # every bf16 score at once: 16 MiB

    def step() -> None:
        attention(q, k, v, causal=True).backward(grad)

    peak = torch_peak_bytes(step, q, k, v, grad)
    assert scores > 8 * blocked.CHUNK_BYTES  # the shape needs many chunks
    assert peak - io <= 6 * blocked.CHUNK_BYTES + 2 * k.numel() * 4, (peak, io)  # + the fp32 dk, dv sums


def test_fake_tensors_get_the_output_shapes() -> None:
    with FakeTensorMode():
        q, k, v = torch.empty(2, 6, 16, 8), torch.empty(2, 2, 16, 8), torch.empty(2, 2, 16, 4)
        assert attention(q, k, v, causal=True).shape == (2, 6, 16, 4)


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        (dict(dropout_p=0.1), r"attention dropout \(0.1\)"),
        (dict(attn_mask=torch.zeros(1, 1, 4, 4, requires_grad=True)), "a mask that needs a gradient"),
        (dict(attn_mask=torch.ones(4, 4, dtype=torch.bool), is_causal=True), "explicit mask together with is_causal"),
        (dict(attn_mask=torch.ones(3, 4, dtype=torch.bool)), r"mask of shape \[3, 4\] that does not broadcast"),
    ],
)
def test_calls_the_kernel_does_not_take_say_why(kwargs: dict, reason: str) -> None:
    q = torch.randn(1, 2, 4, 8)
    call, why = resolve((q, q, q), kwargs)
    assert call is None
    assert re.search(reason, why), why


def test_gqa_needs_enable_gqa_as_torch_does() -> None:
    q, kv = torch.randn(1, 4, 8, 8), torch.randn(1, 2, 8, 8)
    assert resolve((q, kv, kv), {})[1] == "4 query heads for 2 key/value heads without enable_gqa"
    assert resolve((q, kv, kv), {"enable_gqa": True})[0] is not None


@pytest.mark.parametrize("policy", ["full", "selective"])
@pytest.mark.parametrize("model", ["nanogpt", "llama"])
def test_blocked_runs_in_forward_and_in_the_recompute(
    model: str, policy: str, gpt_factory: Callable, llama_factory: Callable, datamodule_factory: Callable,
    trainer_factory: Callable,
) -> None:
    module = gpt_factory() if model == "nanogpt" else llama_factory()
    kernel, ops = AttentionKernel("blocked"), StepOps()
    trainer = trainer_factory(max_steps=3, callbacks=[ActivationCheckpointing(policy), kernel, ops])
    trainer.fit(module, datamodule=datamodule_factory(seq_len=16, batch_size=2))
    layers = 2
    assert kernel.chosen == "blocked" and len(kernel.routed or []) == layers
    assert all(isinstance(module.get_submodule(n).forward, RoutedForward) for n in kernel.routed or [])
    assert FLASH_CPU_OP in ops.steps[0]  # the first step runs torch's kernel and finds the modules that call it
    for step in ops.steps[1:]:  # then the blocked kernel, forward and recompute alike
        assert FLASH_CPU_OP not in step and BLOCKED_OP in step
        # the kernel's softmax (one chunk here) runs in its forward, in the recompute with "full" (selective keeps the
        # op's output, so backward does not run it again: the profiler still lists the cached call) and in backward
        assert step["aten::_softmax"] == (3 * layers if policy == "full" else 2 * layers)
        assert step["lightning_hbm::blocked_attention_backward"] == layers


def test_blocked_trains_like_torchs_kernel_and_resumes_bit_exact(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, tmp_path: Any
) -> None:
    data = datamodule_factory(seq_len=16, batch_size=2)
    reference = gpt_factory()
    trainer_factory(max_steps=4, callbacks=[ActivationCheckpointing()]).fit(reference, datamodule=data)
    whole = gpt_factory()
    trainer_factory(max_steps=4, callbacks=[ActivationCheckpointing(), AttentionKernel("blocked")]).fit(whole, datamodule=data)
    for name, p in whole.named_parameters():  # fp32: the same training, to fp32 rounding (AdamW moves every weight
        # by up to lr = 3e-3 a step whatever its gradient's size: 4 steps, 1.2e-2)
        torch.testing.assert_close(p, reference.get_parameter(name), rtol=1e-3, atol=2e-4)

    # resumed at an epoch's end (Lightning does not restore a loader's position inside an epoch): two fixed batches
    data.setup("fit")
    batches = [next(iter(data.train_dataloader())) for _ in range(2)]

    def run(epochs: int, seed: int, ckpt: Any = None) -> pl.LightningModule:
        model = gpt_factory(seed=seed)
        trainer = trainer_factory(max_epochs=epochs, max_steps=-1, callbacks=[ActivationCheckpointing(), AttentionKernel("blocked")])
        trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None), ckpt_path=ckpt)
        if ckpt is None:
            trainer.save_checkpoint(tmp_path / f"{epochs}.ckpt")
        return model

    straight, _ = run(2, 0), run(1, 0)
    resumed = run(2, 1, tmp_path / "1.ckpt")
    for name, p in resumed.named_parameters():
        assert torch.equal(p, straight.get_parameter(name)), name


def test_auto_times_each_shape_after_its_first_step_and_keeps_the_choice(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tmp_path: Any,
) -> None:
    timed: list[Any] = []

    def fake_timing(shapes: Any) -> Timing:  # the rule, not this machine's speed, is under test
        timed.append(shapes)
        return Timing(torch_s=0.010, blocked_s=0.005)

    monkeypatch.setattr(attention_kernel, "time_kernels", fake_timing)
    kernel, ops = AttentionKernel("auto"), StepOps()
    trainer = trainer_factory(max_steps=3, callbacks=[ActivationCheckpointing(), kernel, ops])
    with caplog.at_level(logging.INFO):
        trainer.fit(gpt_factory(), datamodule=datamodule_factory(seq_len=16, batch_size=2))
    assert kernel.chosen == "flash" and len(timed) == 1  # one shape, timed once
    assert timed[0].q == (2, 2, 16, 32) and timed[0].causal
    assert FLASH_CPU_OP in ops.steps[0] and BLOCKED_OP not in ops.steps[0]  # not timed yet: torch's kernel
    assert all(BLOCKED_OP in s and FLASH_CPU_OP not in s for s in ops.steps[1:])
    assert "10.00 ms on torch's flash kernel, 5.00 ms blocked -> blocked kernel from the next step on" in caplog.text

    # kept in the checkpoint: a resumed run computes as the first did, from its first step
    path = tmp_path / "auto.ckpt"
    trainer.save_checkpoint(path)
    again, ops = AttentionKernel("auto"), StepOps()
    trainer_factory(max_steps=4, callbacks=[ActivationCheckpointing(), again, ops]).fit(
        gpt_factory(), datamodule=datamodule_factory(seq_len=16, batch_size=2), ckpt_path=path
    )
    assert again.timings == kernel.timings and len(timed) == 1
    assert BLOCKED_OP in ops.steps[0] and FLASH_CPU_OP not in ops.steps[0]


def test_auto_keeps_torchs_kernel_within_the_margin(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_kernel, "time_kernels", lambda shapes: Timing(torch_s=0.010, blocked_s=0.0095))
    kernel, ops = AttentionKernel("auto"), StepOps()
    trainer_factory(max_steps=2, callbacks=[kernel, ops]).fit(gpt_factory(), datamodule=datamodule_factory(seq_len=16, batch_size=2))
    assert all(BLOCKED_OP not in s for s in ops.steps)


class _DropoutAttention(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, dropout_p=0.5, is_causal=True).sum()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_blocked_names_the_calls_it_leaves_to_torch(trainer_factory: Callable) -> None:
    data = torch.utils.data.DataLoader(torch.randn(4, 6, 8), batch_size=2)
    with pytest.warns(UserWarning, match=r"AttentionKernel\('blocked'\): attention calls with attention dropout \(0.5\): "
                      r"the kernel has none \(e.g. q, k, v of shapes \[\[2, 2, 6, 4\].*\]\) ran on torch's kernel"):
        trainer_factory(max_steps=1, callbacks=[AttentionKernel("blocked")]).fit(_DropoutAttention(), data)


class _NoAttention(_DropoutAttention):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).sum()


def test_blocked_with_no_attention_call_is_a_warning(trainer_factory: Callable) -> None:
    data = torch.utils.data.DataLoader(torch.randn(4, 6, 8), batch_size=2)
    with pytest.warns(UserWarning, match=r"no module of _NoAttention called F.scaled_dot_product_attention"):
        trainer_factory(max_steps=1, callbacks=[AttentionKernel("blocked")]).fit(_NoAttention(), data)


def test_routed_model_copies_and_pickles(gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable) -> None:
    model = gpt_factory()
    kernel = AttentionKernel("blocked")
    trainer_factory(max_steps=1, callbacks=[kernel]).fit(model, datamodule=datamodule_factory(seq_len=16, batch_size=2))
    x = torch.randint(0, 50, (2, 16))
    want = model(x)
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        attn = twin.get_submodule(kernel.routed[0])  # type: ignore[index]
        assert isinstance(attn.forward, RoutedForward) and attn.forward.module is attn
        assert torch.equal(twin(x), want)


def test_a_new_trainer_routes_again_with_its_own_kernel(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    model, data = gpt_factory(), datamodule_factory(seq_len=16, batch_size=2)
    trainer_factory(max_steps=1, callbacks=[AttentionKernel("blocked")]).fit(model, datamodule=data)
    ops = StepOps()
    trainer_factory(max_steps=2, callbacks=[AttentionKernel("flash"), ops]).fit(model, datamodule=data)
    assert not any(isinstance(m.forward, RoutedForward) for m in model.modules())
    assert BLOCKED_OP not in ops.steps[-1] and FLASH_CPU_OP in ops.steps[-1]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_on_cuda_equals_torchs_and_auto_chooses_by_timing(
    dtype: torch.dtype, gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    torch.manual_seed(0)
    q, k, v = (t.detach().to("cuda", dtype).requires_grad_() for t in _qkv(2, 8, 2, 256, 256, 64, torch.float32))
    grad = torch.randn(2, 8, 256, 64, device="cuda", dtype=dtype)
    got = _forward_backward(attention, q, k, v, grad, causal=True)
    want = _forward_backward(F.scaled_dot_product_attention, q, k, v, grad, is_causal=True, enable_gqa=True)
    tolerance = 1e-4 if dtype == torch.float32 else 3e-2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=tolerance, atol=tolerance)
    kernel = AttentionKernel("auto")
    precision = "32-true" if dtype == torch.float32 else "bf16-true"
    trainer_factory(accelerator="cuda", precision=precision, max_steps=2, callbacks=[kernel]).fit(
        gpt_factory(), datamodule=datamodule_factory(seq_len=64, batch_size=2)
    )
    assert len(kernel.timings) == 1  # which kernel wins on this GPU is the figure, not the test
    print(f"cuda {dtype}: {kernel.timings}")
