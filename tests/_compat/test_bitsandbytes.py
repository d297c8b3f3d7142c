"""lightning_hbm._compat.bitsandbytes against the installed bitsandbytes: each test fails when it changes the internal."""

from __future__ import annotations

import inspect
from typing import Iterator

import bitsandbytes as bnb
import bitsandbytes.functional as F
import pytest
import torch

from lightning_hbm._compat import bitsandbytes as compat
from lightning_hbm.precision.registry import get_format


def _layer4bit() -> bnb.nn.Linear4bit:
    torch.manual_seed(0)
    layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4")
    layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4").to("cpu")
    return layer


def test_disable_cpu_repack_sets_the_flag_linear4bit_reads() -> None:
    layer = _layer4bit()
    assert hasattr(layer, "support_avx512bf16_for_cpu")  # set in __init__ (from has_avx512bf16())
    assert "support_avx512bf16_for_cpu" in inspect.getsource(bnb.nn.Linear4bit.forward)  # and read by forward
    # a repacked weight is unpacked by this private function (its state_dict calls it too), on every CPU kind
    assert "_convert_weight_packed_for_cpu_inverse" in inspect.getsource(bnb.nn.Linear4bit._save_to_state_dict)
    assert callable(F._convert_weight_packed_for_cpu_inverse)
    compat.disable_cpu_repack(layer)
    assert layer.support_avx512bf16_for_cpu is False
    # eval no-grad forward, then training: the input still gets its gradient (on either CPU kind)
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, 64))
    layer.train()
    x = torch.randn(2, 64, requires_grad=True)
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


@pytest.mark.skipif(not F.has_avx512bf16(), reason="the repack path exists only on AVX512-BF16 CPUs")
def test_disable_cpu_repack_unpacks_a_weight_repacked_already() -> None:
    """A pre-quantized model evaluated before lightning_hbm saw it: its weights are repacked; training must work."""
    layer = _layer4bit()
    layer.support_avx512bf16_for_cpu = True
    layer.eval()
    x = torch.randn(2, 64)
    with torch.no_grad():
        before = layer(x)
    assert layer.weight.quant_state.packing_format_for_cpu  # what bitsandbytes' private inverse undoes
    compat.disable_cpu_repack(layer)
    assert not getattr(layer.weight.quant_state, "packing_format_for_cpu", False)
    layer.train()
    x.requires_grad_(True)
    out = layer(x)
    out.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    torch.testing.assert_close(out.detach(), before, rtol=2e-2, atol=2e-2)  # the same weights, unpacked


def test_disable_cpu_repacks_finds_every_linear4bit() -> None:
    model = torch.nn.Sequential(_layer4bit(), torch.nn.ReLU(), _layer4bit(), torch.nn.Linear(64, 2))
    for layer in (model[0], model[2]):
        layer.support_avx512bf16_for_cpu = True
    assert compat.disable_cpu_repacks(model) == 2
    assert model[0].support_avx512bf16_for_cpu is False and model[2].support_avx512bf16_for_cpu is False


@pytest.fixture
def no_cached_code() -> Iterator[None]:
    saved = F.name2qmap.pop("dynamic", None)
    yield
    if saved is not None:
        F.name2qmap["dynamic"] = saved


@pytest.mark.usefixtures("no_cached_code")
def test_ensure_nested_code_fills_the_cache_double_quant_reads() -> None:
    assert "dynamic" not in F.name2qmap
    compat.ensure_nested_code()
    code = F.name2qmap["dynamic"]
    torch.testing.assert_close(code, F.create_dynamic_map())
    compat.ensure_nested_code()
    assert F.name2qmap["dynamic"] is code  # built once
    # bitsandbytes' double quantization reads the cached code book: a changed cache shows in its state
    F.name2qmap["dynamic"] = code * 0.5
    _, state = F.quantize_4bit(torch.randn(64, 64), compress_statistics=True, quant_type="nf4")
    torch.testing.assert_close(state.state2.code, code * 0.5)
    del F.name2qmap["dynamic"]


def _cpu_kernel_registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("bitsandbytes::quantize_4bit", "CPU")


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fast_cpu_quantize_4bit_gives_bitsandbytes_own_bytes_and_is_scoped(quant_type: str, dtype: torch.dtype) -> None:
    """Issue 37: bucketize was most of the CPU quantization; the comparison kernel must give the same packed codes,
    absmax and double-quant state, NaN included, and leave bitsandbytes' own kernel in place outside the block."""
    assert compat._cpu_quantize_checked()
    generator = torch.Generator().manual_seed(1)
    for shape, blocksize in (((576, 1536), 64), ((37, 29), 64), ((3, 1000), 128), ((1, 1), 64)):
        A = (torch.randn(shape, generator=generator) * 0.03).to(dtype)
        A.view(-1)[::11] = 0
        if A.numel() > 100:
            A.view(-1)[50] = float("nan")
        before = _cpu_kernel_registered()
        theirs = F.quantize_4bit(A, blocksize=blocksize, compress_statistics=True, quant_type=quant_type)
        with compat.fast_cpu_quantize_4bit():
            assert _cpu_kernel_registered()
            with compat.fast_cpu_quantize_4bit():  # nested: one registration
                pass
            assert _cpu_kernel_registered()
            mine = F.quantize_4bit(A, blocksize=blocksize, compress_statistics=True, quant_type=quant_type)
        assert _cpu_kernel_registered() == before
        assert torch.equal(mine[0], theirs[0])
        for name in ("absmax", "offset"):
            torch.testing.assert_close(getattr(mine[1], name), getattr(theirs[1], name), rtol=0, atol=0, equal_nan=True)
        torch.testing.assert_close(mine[1].state2.absmax, theirs[1].state2.absmax, rtol=0, atol=0, equal_nan=True)


def _layer8bit() -> bnb.nn.Linear8bitLt:
    torch.manual_seed(0)
    layer = bnb.nn.Linear8bitLt(64, 32, bias=True, has_fp16_weights=False, threshold=6.0)
    layer.weight = bnb.nn.Int8Params(torch.randn(32, 64), requires_grad=False, has_fp16_weights=False).to("cpu")
    return layer


def test_int8_matmul_keeps_its_input_and_its_backward_does_without_it() -> None:
    layer = _layer8bit()
    x = torch.randn(2, 8, 64, requires_grad=True)
    out = layer(x)
    node = out.grad_fn
    # CPU: MatMul8bitFp keeps the input as ctx.A, a plain attribute (not saved_tensors: checkpointing cannot free it)
    assert type(node).__name__ == "MatMul8bitFpBackward"
    assert node.A.data_ptr() == x.data_ptr() and not node.needs_input_grad[1]
    (expected,) = torch.autograd.grad(out.square().sum(), x)
    out = layer(x)
    compat.drop_int8_kept_input(layer, (x,), out)
    assert out.grad_fn.A is None
    (got,) = torch.autograd.grad(out.square().sum(), x)  # the backward does not read it for a frozen weight
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert layer.bias.grad is None  # (autograd.grad: nothing accumulated)


def test_lightning_hbm_int8_layers_drop_the_kept_input() -> None:
    layer = get_format("int8").replace(torch.nn.Linear(64, 32), torch.float32, torch.device("cpu"))
    x = torch.randn(2, 8, 64, requires_grad=True)
    assert layer(x).grad_fn.A is None


@pytest.mark.gpu
def test_int8_matmul_on_cuda_keeps_its_input_and_its_backward_does_without_it() -> None:
    layer = _layer8bit().cuda()
    x = torch.randn(2, 8, 64, device="cuda", dtype=torch.float16, requires_grad=True)
    out = layer(x)
    assert type(out.grad_fn).__name__ == "MatMul8bitLtBackward" and len(out.grad_fn.tensors) == 3
    (expected,) = torch.autograd.grad(out.float().square().sum(), x)
    out = layer(x)
    compat.drop_int8_kept_input(layer, (x,), out)
    assert out.grad_fn.tensors[2] is None
    (got,) = torch.autograd.grad(out.float().square().sum(), x)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_drop_kept_inputs_hooks_every_int8_layer_once() -> None:
    model = torch.nn.Sequential(bnb.nn.Linear8bitLt(8, 4, has_fp16_weights=False), torch.nn.Linear(4, 4))
    assert compat.drop_kept_inputs(model) == 1
    assert compat.drop_kept_inputs(model) == 1
    assert list(model[0]._forward_hooks.values()) == [compat.drop_int8_kept_input, compat._shape_output]  # once, not twice
    assert list(model[0]._forward_pre_hooks.values()) == [compat._flatten_input]
    assert not model[1]._forward_hooks


def test_int8_matmul_fails_on_inputs_of_more_than_3_dimensions_in_eval() -> None:
    """bitsandbytes 0.50's LLM.int8 forward (eval on CPU) fails on a 4-D input (a Swin's windows): when this test fails,
    bitsandbytes has fixed it and ``_flatten_input`` / ``_shape_output`` can go."""
    layer = _layer8bit().eval()
    with pytest.raises(RuntimeError, match="must match the size of tensor"):
        layer(torch.randn(2, 3, 4, 64))


def test_lightning_hbm_int8_layers_take_inputs_of_any_rank() -> None:
    """Issue 53 (found with a Swin stored in int8: its eval forward failed): the int8 layer on a 4-D or 5-D input gives
    the rows of the same input as 2-D, in eval and in training, and gradients flow to the input."""
    layer = get_format("int8").replace(torch.nn.Linear(64, 32), torch.float32, torch.device("cpu"))
    for training in (False, True):
        layer.train(training)
        for shape in ((2, 3, 4, 64), (2, 1, 3, 2, 64)):
            x = torch.randn(*shape, requires_grad=True)
            out = layer(x)
            assert out.shape == (*shape[:-1], 32)
            torch.testing.assert_close(out, layer(x.detach().reshape(-1, 64)).reshape(*shape[:-1], 32), rtol=0, atol=0)
            out.square().sum().backward()
            assert x.grad is not None and x.grad.shape == x.shape


def test_int8_forward_reads_weight_cb_which_a_gathered_weight_lacks() -> None:
    """bitsandbytes 0.50's ``Linear8bitLt.forward`` reads ``self.weight.CB``: FSDP2's gathered weight, a plain
    ``Parameter`` over the all-gathered int8 rows, has no such attribute. When this test fails, bitsandbytes reads the
    rows another way and ``shard_int8_layers``' hook may change."""
    assert "self.weight.CB" in inspect.getsource(bnb.nn.Linear8bitLt.forward)
    layer = get_format("int8").replace(torch.nn.Linear(64, 32), torch.float32, torch.device("cpu"))
    layer.weight = torch.nn.Parameter(layer.weight.data.clone(), requires_grad=False)  # what FSDP2 puts there
    with pytest.raises(AttributeError, match="CB"):
        layer(torch.randn(2, 64))


def test_shard_int8_layers_computes_with_the_gathered_rows_forward_and_backward() -> None:
    """Issue 51: after ``shard_int8_layers`` an int8 layer whose weight FSDP2 replaced (a plain ``Parameter`` over the
    gathered rows, reused at each all-gather, its storage freed and refilled in between) gives the same output and
    input gradient as before sharding, the row scales kept on the layer, no full copy of the rows left on its state."""
    layer = get_format("int8").replace(torch.nn.Linear(64, 32), torch.float32, torch.device("cpu"))
    x = torch.randn(2, 8, 64, requires_grad=True)
    expected = layer(x)
    (expected_grad,) = torch.autograd.grad(expected.square().sum(), x)
    rows, scales = layer.state.CB, layer.state.SCB
    model = torch.nn.Sequential(layer)
    assert compat.shard_int8_layers(model) == compat.shard_int8_layers(model) == 1  # hooked once
    assert layer.state.CB is None and layer.state.SCB is scales  # the whole rows (a forward kept them) dropped
    gathered = torch.nn.Parameter(rows.clone(), requires_grad=False)  # FSDP2's unsharded parameter
    layer.weight = gathered
    for _ in range(2):  # the second forward: the same gathered Parameter, refilled
        out = layer(x)
        storage = gathered.untyped_storage()
        storage.resize_(0)  # FSDP2 frees it after the forward (reshard_after_forward) ...
        storage.resize_(rows.numel())  # ... and gathers into it again before the backward
        gathered.data.copy_(rows)
        (grad,) = torch.autograd.grad(out.square().sum(), x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        torch.testing.assert_close(grad, expected_grad, rtol=0, atol=0)
    assert layer.state.CB.untyped_storage().data_ptr() == gathered.untyped_storage().data_ptr()  # a view, not a copy
