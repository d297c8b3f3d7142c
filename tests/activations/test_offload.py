"""The offload's host copy in pinned pieces (``activations/offload.py``: ``_Pieces``, ``pinned_pieces``,
``host_footprint``), attacked from outside (session 25) on CPU: the pieces without pinning (``pin=False``; pinning
needs a CUDA build), every dtype at and around ``PIECE_BYTES``, special float bit patterns, empty and 0-dim tensors,
views sharing storage, strided layouts, tensors that require grad. Restored values must be bit-exact.

Was: a channels-last (or transposed) block input was pinned as one power-of-two request (a 5 MiB one: 8 MiB, where
its pieces take 6) and came back contiguous, in another memory format than the forward saw; a tensor the model passes
to every block (BERT's extended attention mask, T5's position bias) was copied once per block.
"""

from __future__ import annotations

import pytest
import torch

from lightning_hbm.activations import offload as offload_hooks
from lightning_hbm.activations.offload import PIECE_BYTES, host_footprint, pinned_footprint

CPU = torch.device("cpu")
DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
          torch.float32, torch.float64, torch.complex64, torch.complex128]  # fmt: skip


def _random(numel: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(numel)
    if dtype == torch.bool:
        return torch.rand(numel, generator=generator) > 0.5
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(numel, generator=generator, dtype=dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, (numel,), generator=generator, dtype=torch.int64).to(dtype)


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as raw bytes, in logical order (NaN payloads and -0.0 included)."""
    flat = tensor.contiguous().reshape(-1)
    return (torch.view_as_real(flat) if flat.is_complex() else flat).contiguous().view(torch.uint8)


def _round_trip(tensor: torch.Tensor) -> tuple[torch.Tensor, offload_hooks._Pieces]:
    pieces = offload_hooks._Pieces(tensor, CPU, pin=False)
    with torch.no_grad():  # as the pack hook runs (test_the_pack_hook_runs_without_grad)
        pieces.fill(tensor)
    return pieces.restore(CPU), pieces


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("extra", [-1, 0, 1, PIECE_BYTES + 1], ids=["under", "at", "over", "over-two"])
def test_every_dtype_at_and_around_a_piece_comes_back_bit_exact(dtype: torch.dtype, extra: int) -> None:
    size = torch.empty(0, dtype=dtype).element_size()
    tensor = _random((PIECE_BYTES + extra * size) // size, dtype).reshape(-1, 1)
    restored, pieces = _round_trip(tensor)
    assert restored.dtype == dtype and restored.shape == tensor.shape and torch.equal(_bytes(restored), _bytes(tensor))
    held = [p.numel() * size for p in pieces.pieces]
    assert all(n & (n - 1) == 0 for n in held) and sum(held) == host_footprint(tensor) == pinned_footprint(tensor.numel() * size)
    assert sum(held) < tensor.numel() * size + PIECE_BYTES or len(held) == 1


def test_nan_payloads_signed_zeros_and_infinities_come_back_bit_exact() -> None:
    bits = torch.tensor([0x7FC00001, 0x7FA00000, -0x80000000, 0x7F800000, -0x00800000, 0x00000001, -1], dtype=torch.int32)
    tensor = bits.view(torch.float32)  # quiet and signalling NaNs with payloads, -0.0, inf, -inf, a denormal, a NaN
    restored, _ = _round_trip(tensor)
    assert torch.equal(restored.view(torch.int32), bits)


@pytest.mark.parametrize("shape", [(), (0,), (0, 3, 5), (1,)], ids=["0-dim", "empty", "empty-3d", "one"])
def test_empty_and_0_dim_tensors(shape: tuple[int, ...]) -> None:
    tensor = torch.randn(shape)
    restored, pieces = _round_trip(tensor)
    assert restored.shape == tensor.shape and torch.equal(restored, tensor)
    assert host_footprint(tensor) == sum(p.numel() * 4 for p in pieces.pieces) == (0 if not tensor.numel() else 4)


def test_a_view_sharing_storage_is_copied_not_aliased() -> None:
    base = torch.randn(3 * PIECE_BYTES // 4)
    view = base[PIECE_BYTES // 4 :]  # contiguous, at an offset into a larger storage
    want = view.clone()
    restored, _ = _round_trip(view)
    base.zero_()  # the forward's storage reused after the copy
    assert torch.equal(restored, want) and restored.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()


@pytest.mark.parametrize("layout", ["channels-last", "channels-last-3d", "transposed"])
def test_dense_strided_inputs_are_pieced_and_come_back_with_their_strides(layout: str) -> None:
    """A conv net's channels-last block input of 5 MiB: pieces of 4 + 2 MiB, not one request of 8."""
    if layout == "channels-last":
        tensor = torch.randn(4, 80, 64, 64).to(memory_format=torch.channels_last)
    elif layout == "channels-last-3d":
        tensor = torch.randn(2, 40, 8, 32, 32).to(memory_format=torch.channels_last_3d)
    else:
        tensor = torch.randn(1280, 1024).T
    assert not tensor.is_contiguous()
    nbytes = tensor.numel() * 4
    assert host_footprint(tensor) == pinned_footprint(nbytes) < nbytes + PIECE_BYTES
    restored, _ = _round_trip(tensor)
    assert restored.stride() == tensor.stride() and torch.equal(restored, tensor)


@pytest.mark.parametrize("make", [lambda: torch.randn(1, 4096).expand(512, 4096), lambda: torch.randn(1024, 2048)[:, ::2]], ids=["expanded", "sliced"])
def test_overlapping_or_gapped_inputs_are_one_request(make: object) -> None:
    tensor = make()  # type: ignore[operator]
    nbytes = tensor.numel() * 4
    assert host_footprint(tensor) == 1 << (nbytes - 1).bit_length()
    with pytest.raises(ValueError, match="overlaps or has gaps"):
        offload_hooks._Pieces(tensor, CPU, pin=False)


def test_the_pack_hook_runs_without_grad_so_pieces_of_a_tensor_that_requires_grad_hold_no_graph() -> None:
    """The pieces are filled inside the offload's pack hook: torch runs it with grad disabled, so ``copy_`` from a
    tensor that requires grad records nothing (the restored tensor is a plain one, as autograd's unpack wants)."""
    seen: list[tuple[bool, bool]] = []
    pieces: list[offload_hooks._Pieces] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_grad_enabled(), tensor.requires_grad))
        copy = offload_hooks._Pieces(tensor, CPU, pin=False)
        copy.fill(tensor)
        pieces.append(copy)
        return tensor

    x = torch.randn(64, 64, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = (x * 2).sin()
    y.sum().backward()
    assert (False, True) in seen
    restored = pieces[-1].restore(CPU)
    assert not restored.requires_grad and restored.grad_fn is None and all(p.grad_fn is None for c in pieces for p in c.pieces)


def _encoder(kind: str) -> torch.nn.Module:
    from transformers import BertConfig, BertModel, T5Config, T5EncoderModel

    torch.manual_seed(0)
    if kind == "t5":
        return T5EncoderModel(T5Config(vocab_size=100, d_model=32, d_kv=8, d_ff=64, num_layers=4, num_heads=4, dropout_rate=0.0))
    config = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
                        attn_implementation="eager", hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # fmt: skip
    return BertModel(config)


@pytest.mark.parametrize("kind", ["bert", "t5"])
def test_a_tensor_every_block_gets_is_copied_once_with_the_same_gradients(kind: str) -> None:
    """BERT's extended attention mask ``[B, 1, S, S]`` and T5's position bias ``[1, H, S, S]`` go to every layer: each
    was copied once per layer (BERT: 4 masks beside 4 hidden states, 0.188 MiB for 0.094)."""
    from lightning_hbm import ActivationCheckpointing

    ids = torch.randint(0, 100, (2, 64), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 64, dtype=torch.long)
    mask[0, :5] = 0
    grads = []
    for offload in (False, True):
        model = _encoder(kind).train()
        callback = ActivationCheckpointing(offload=offload)
        callback.transform_model(model)
        model(input_ids=ids, attention_mask=mask).last_hidden_state.square().mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert callback.offload is not None
    hidden = 2 * 64 * 32 * 4
    shared = 2 * 64 * 64 * (1 if kind == "t5" else 4) + (4 * 64 * 64 * 4 if kind == "t5" else 0)  # bool/fp32 mask, fp32 bias
    assert callback.offload.copied_bytes == 4 * hidden + shared
    assert grads[0].keys() == grads[1].keys() and all(torch.equal(grads[0][n], grads[1][n]) for n in grads[0])


def test_a_tensor_changed_in_place_since_its_copy_is_copied_again() -> None:
    """Sharing an earlier copy needs the very tensor, unchanged (its version): else each use gets its own value."""
    from lightning_hbm.activations import OffloadSavedTensors

    hooks = OffloadSavedTensors("cpu")
    x = torch.randn(4, requires_grad=True)
    scale = torch.full((4,), 0.5)
    with hooks:
        first = x * scale  # saves scale (0.5)
        again = x * scale  # the same tensor, unchanged: shares the copy
        scale.mul_(4.0)  # a new value in the same tensor
        second = x * scale  # saves 2.0: a copy of its own
    (first + again + second).sum().backward()
    assert x.grad is not None and torch.equal(x.grad, torch.full((4,), 3.0))
    assert hooks.copies == 2  # scale twice (mul saves only what the gradient of x needs)


@pytest.mark.parametrize("layout", ["channels-last", "transposed"])
def test_a_cpu_offload_keeps_the_memory_format_of_what_it_copies(layout: str) -> None:
    """The offload without a CUDA stream (target and source on the CPU) copied into ``torch.empty(shape)`` and
    restored the same way: a channels-last conv activation came back contiguous (its backward on another layout)."""
    conv = torch.nn.Conv2d(8, 8, 3, padding=1).to(memory_format=torch.channels_last)
    x = torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last)
    tensor = conv(x).detach() if layout == "channels-last" else torch.randn(16, 12).T
    assert not tensor.is_contiguous()
    offload = offload_hooks.OffloadSavedTensors("cpu")
    with torch.no_grad():  # as autograd runs the pack hook
        packed = offload._pack(tensor)
    assert packed.host.stride() == tensor.stride()
    restored = offload._unpack(packed)
    assert restored.stride() == tensor.stride() and torch.equal(restored, tensor)
    with offload:  # and through autograd: a conv's saved channels-last input, its gradients as without the offload
        y = conv(x.requires_grad_(True))
    (grad,) = torch.autograd.grad(y.square().sum(), x)
    assert grad.stride() == x.stride() and torch.equal(grad, torch.autograd.grad(conv(x).square().sum(), x)[0])
