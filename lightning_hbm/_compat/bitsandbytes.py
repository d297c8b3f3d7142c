"""bitsandbytes' internals that lightning_hbm relies on (bitsandbytes 0.50; ``tests/_compat/test_bitsandbytes.py`` checks each).

bitsandbytes is imported on first use (its import loads native libraries): callers have imported it already.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Any, Iterator, Optional, cast

import torch
from torch import nn


def disable_cpu_repack(layer: nn.Module) -> None:
    """Keep a ``Linear4bit`` off its AVX512-BF16 CPU kernel.

    On CPUs with AVX512-BF16 the first no-grad eval forward repacks the weight for a kernel that bypasses
    autograd; training forwards after it give upstream layers no gradient. The instance flag bitsandbytes
    reads (``support_avx512bf16_for_cpu``) is the only switch. A weight repacked already (a model evaluated before
    lightning_hbm saw it) is unpacked as bitsandbytes' own ``state_dict`` does.
    """
    cast(Any, layer).support_avx512bf16_for_cpu = False  # a plain attribute: nn.Module's __setattr__ is typed for tensors and modules
    if _flatten_input not in layer._forward_pre_hooks.values():  # a 1-D input as one row (see there); once, copies too
        layer.register_forward_pre_hook(_flatten_input)
        layer.register_forward_hook(_shape_output)
    weight: Any = getattr(layer, "weight", None)  # set whenever state is
    state: Any = getattr(weight, "quant_state", None)
    if getattr(state, "packing_format_for_cpu", False):
        from bitsandbytes.functional import _convert_weight_packed_for_cpu_inverse

        weight.data, weight.quant_state = _convert_weight_packed_for_cpu_inverse(weight.data, state)


def disable_cpu_repacks(module: nn.Module) -> int:
    """:func:`disable_cpu_repack` on every ``Linear4bit`` in ``module``, whoever made it; returns how many."""
    layers = [m for m in module.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for layer in layers:
        disable_cpu_repack(layer)
    return len(layers)


def undo_int8_states(module: nn.Module) -> int:
    """Put the int8 rows and row scales of every ``Linear8bitLt`` in ``module`` that ran a forward back on its weight, as
    they were when it was made; returns how many. Its first forward moves them to the layer's matmul state
    (``init_8bit_state``: ``weight.CB``/``weight.SCB`` to ``state.CB``/``state.SCB``, the weight's set to ``None``), and
    its ``load_state_dict`` then refuses a checkpoint ("Loading a quantized checkpoint into non-quantized Linear8bitLt"):
    the fit-start accuracy check's forward (session 32) broke every int8 resume. The next forward moves them again."""
    undone = 0
    for layer in module.modules():
        if type(layer).__name__ != "Linear8bitLt":  # first: another layer's weight may be computed at each read (an
            continue  # int8 embedding dequantizes its whole table: 0.3 s of SmolLM2's fit start, session 33)
        state, weight = getattr(layer, "state", None), getattr(layer, "weight", None)
        if state is None or weight is None:
            continue
        if getattr(weight, "SCB", None) is None and getattr(state, "SCB", None) is not None:
            weight.CB, weight.SCB = state.CB, state.SCB
            state.CB, state.SCB = None, None
            undone += 1
    return undone


@contextmanager
def forward_as_quantized(module: nn.Module) -> Iterator[None]:
    """A forward of ``module`` right after its quantization (the fit-start accuracy check) that leaves its bitsandbytes
    layers as quantized: their CPU repacks disabled before (:func:`disable_cpu_repacks`: an eval forward on an
    AVX512-BF16 CPU would repack 4-bit layers for a kernel that bypasses autograd, as the surgery disables them after the
    quantization), their int8 states put back after (:func:`undo_int8_states`: a checkpoint being resumed loads next)."""
    disable_cpu_repacks(module)
    yield
    undo_int8_states(module)


def drop_int8_kept_input(module: nn.Module, args: tuple, output: Any) -> None:
    """A ``Linear8bitLt`` forward hook: free the input that bitsandbytes' int8 matmul keeps for a frozen weight.

    Both of its autograd Functions keep the input ``A`` as a plain attribute, not through ``save_for_backward``:
    ``MatMul8bitFp`` (CPU and XPU) as ``ctx.A``, read only for the weight's gradient, and ``MatMul8bitLt`` (CUDA) in
    ``ctx.tensors = (CAt, subA, A)``, never read (``CAt, subA, _A = ctx.tensors``). Activation checkpointing frees only
    what autograd saves, so every int8 layer's input stayed alive until the backward: measured on a 4-layer Llama
    (hidden 256, 4 x 256 tokens, LoRA, CPU), full checkpointing peaked at 68.0 MiB over an int8 base against 39.1 MiB
    over nf4-dq.
    """
    node: Any = output.grad_fn if isinstance(output, torch.Tensor) else None
    kind = type(node).__name__
    if kind == "MatMul8bitFpBackward" and not node.needs_input_grad[1]:
        node.A = None
    elif kind == "MatMul8bitLtBackward" and isinstance(getattr(node, "tensors", None), tuple) and len(node.tensors) == 3:
        node.tensors = (node.tensors[0], node.tensors[1], None)


# each layer's flattened input shape and the input's own, until its output is shaped back (a Linear's forward does not
# call itself: one at a time per layer). Shapes, not the tensor: a pre-hook registered later may hand the forward
# another tensor of the same shape (a copy on another device, as the accuracy check's layers quantized on a GPU get),
# and the output kept the 2-D shape.
_FLATTENED: weakref.WeakKeyDictionary[nn.Module, tuple[torch.Size, torch.Size]] = weakref.WeakKeyDictionary()


def _flatten_input(module: nn.Module, args: tuple) -> Optional[tuple]:
    """A bitsandbytes Linear's forward pre-hook: a 1-D input as one row; into an int8 layer, an input of more than 3
    dimensions as one of 2 (its leading ones as rows). A Linear acts on the last dimension alone: the same computation.

    - bitsandbytes 0.50's 4-bit and int8 matmuls fail on a 1-D input, which ``nn.Linear`` takes (a head applied to one
      pooled vector): "MatMul4BitBackward returned an invalid gradient at index 2" in backward, int8's eval forward
      "Dimension out of range".
    - its LLM.int8 forward (eval on CPU; on CUDA, where every forward takes it, untested) indexes the input's outlier
      columns as if it had at most 3 dimensions: a Swin's ``[batch, windows, tokens, channels]`` failed with "The size
      of tensor a (4) must match the size of tensor b (16)".
    ``tests/_compat/test_bitsandbytes.py`` (4-D) and ``test_bitsandbytes_battery.py`` (1-D) fail when bitsandbytes fixes them."""
    _FLATTENED.pop(module, None)  # a forward that raised left its entry
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or not (x.dim() == 1 or (x.dim() > 3 and type(module).__name__ == "Linear8bitLt")):
        return None
    flat = x.reshape(-1, x.shape[-1])
    _FLATTENED[module] = (flat.shape, x.shape)
    return (flat, *args[1:])


def _shape_output(module: nn.Module, args: tuple, output: Any) -> Any:
    """A forward hook: the output of :func:`_flatten_input`'s rows with the input's leading dimensions."""
    flat, shape = _FLATTENED.pop(module, (None, None))
    if flat is None or shape is None or not args or not isinstance(args[0], torch.Tensor) or args[0].shape != flat:
        return None
    return output.reshape(*shape[:-1], output.shape[-1]) if isinstance(output, torch.Tensor) else None


def drop_kept_inputs(module: nn.Module) -> int:
    """:func:`drop_int8_kept_input` as a forward hook of every ``Linear8bitLt`` in ``module`` (once each), whoever
    made it (lightning_hbm's ``int8`` mode, transformers' ``load_in_8bit``), with :func:`_flatten_input` and
    :func:`_shape_output` around its forward; returns how many layers have them."""
    layers = [m for m in module.modules() if type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")]
    for layer in layers:
        # once, told by the hooks themselves: a deep copy of a hooked layer (an EMA copy, a reference model) keeps them,
        # where a set of the layers hooked did not know the copy and hooked it twice
        if _flatten_input not in layer._forward_pre_hooks.values():
            layer.register_forward_pre_hook(_flatten_input)
            layer.register_forward_hook(drop_int8_kept_input)  # first: it reads the matmul's own grad_fn
            layer.register_forward_hook(_shape_output)
    return len(layers)


def _int8_gathered_weight(module: nn.Module, args: tuple) -> None:
    """A ``Linear8bitLt`` forward pre-hook under FSDP2: hand bitsandbytes the weight FSDP2 gathered.

    bitsandbytes 0.50's ``Linear8bitLt.forward`` reads ``self.weight.CB`` (the int8 rows, an ``Int8Params``
    attribute) and computes with ``self.state.CB`` / ``state.SCB``. FSDP2 replaces the weight by a DTensor shard and,
    for each forward, by a plain ``Parameter`` over the all-gathered rows: ``weight.CB`` is gone
    (``AttributeError``). Here the layer's state takes the gathered rows (a view: no copy) and the gathered weight
    says it holds no rows of its own (``CB = None``, as an ``Int8Params`` after its first forward). The row scales
    stay whole on the layer (``state.SCB``, kept there at quantization). FSDP2 frees and refills that same storage
    between forward and backward, so the backward (``grad_A`` from ``state.CB``) reads the rows it gathers again.
    """
    weight: Any = module._parameters.get("weight")
    if weight is None or type(weight).__name__ == "DTensor":
        return None  # not gathered: this layer is not inside an FSDP unit's forward
    cast(Any, module).state.CB = weight.data
    weight.CB = None  # the gathered Parameter FSDP2 reuses at every all-gather (bitsandbytes reads the attribute)
    return None


def shard_int8_layers(module: nn.Module) -> int:
    """Prepare every bitsandbytes ``Linear8bitLt`` in ``module`` for FSDP2 sharding (before ``fully_shard``);
    returns how many. A row-scale copy kept only on the weight moves to the layer (``state.SCB``), a full copy of the
    rows kept by an earlier forward (``state.CB``) is dropped (it would stay whole on every rank), and
    :func:`_int8_gathered_weight` runs before each forward (once per layer)."""
    layers = [m for m in module.modules() if type(m).__name__ == "Linear8bitLt" and type(m).__module__.startswith("bitsandbytes")]
    for layer in layers:
        state: Any = cast(Any, layer).state
        weight: Any = layer.weight
        if getattr(state, "SCB", None) is None:
            state.SCB = getattr(weight, "SCB", None)
        state.CB = None
        if _int8_gathered_weight not in layer._forward_pre_hooks.values():
            # first: the int8 layer's other pre-hooks (_flatten_input) do not read the weight
            layer.register_forward_pre_hook(_int8_gathered_weight, prepend=True)
    return len(layers)


def ensure_nested_code() -> None:
    """Build double quantization's code book into bitsandbytes' module-wide cache, as its first real call would.

    ``quantize_4bit(compress_statistics=True)`` fills ``bitsandbytes.functional.name2qmap["dynamic"]`` from
    Python floats on first use; under a FakeTensorMode that first use would cache a fake tensor.
    """
    import bitsandbytes.functional as F

    if "dynamic" not in F.name2qmap:
        F.name2qmap["dynamic"] = F.create_dynamic_map()


# ------------------------------------------------------------------------- faster exact 4-bit quantization on CPU

_CPU_QUANTIZE_OK: Optional[bool] = None  # decided once per process: the fast kernel equals bitsandbytes' own
_CPU_QUANTIZE_DEPTH = 0  # > 0 while fast_cpu_quantize_4bit's kernel is registered


def _quantize_4bit_cpu(A: torch.Tensor, blocksize: int, quant_type: str, quant_storage: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """bitsandbytes 0.50's default ``quantize_4bit`` kernel (``backends/default/ops.py``), bucketize excepted.

    ``torch.bucketize(x, bounds)`` (right=False) is the number of bounds strictly below ``x``: with 15 sorted bounds,
    15 vectorized comparisons summed into uint8 give the same codes ~2x faster on CPU (bucketize was ~75% of the
    quantization, half of the time to the first step of a QLoRA run). NaN inputs take bitsandbytes' own path.
    """
    from bitsandbytes.backends.default.ops import _get_4bit_quantize_bounds

    bounds, order = _get_4bit_quantize_bounds(quant_type, A.device)
    A_flat = A.reshape(-1).float()
    n = A_flat.numel()
    rem = n % blocksize
    full = n - rem
    blocks = full // blocksize
    A_com = A_flat[:full].reshape(blocks, blocksize)
    absmax = A_com.abs().max(dim=-1)[0]
    scaled = torch.clamp(A_com * (1.0 / absmax.clamp(min=1e-38).view(-1, 1)), -1, 1).reshape(-1)
    if rem:
        am = A_flat[full:].abs().max().clamp(min=1e-38)
        absmax = torch.cat([absmax, am.unsqueeze(0)])
        scaled = torch.cat([scaled, torch.clamp(A_flat[full:] / am, -1, 1)])
    if scaled.numel() % 2:
        scaled = torch.nn.functional.pad(scaled, (0, 1))
    if torch.isnan(scaled).any():  # comparisons and bucketize disagree on NaN: bitsandbytes' own codes
        q8 = torch.bucketize(scaled, bounds, out_int32=True).to(torch.uint8)
    else:
        q8 = torch.zeros(scaled.shape, dtype=torch.uint8, device=scaled.device)
        for bound in bounds.tolist():
            q8 += scaled > bound
    if quant_type != "nf4":
        q8 = order[q8.long()].to(torch.uint8)
    packed = ((q8[::2] << 4) | q8[1::2]).unsqueeze(1)
    if quant_storage != torch.uint8:
        packed = packed.squeeze().view(quant_storage).unsqueeze(1)
    return packed, absmax


def _cpu_quantize_checked() -> bool:
    """Whether :func:`_quantize_4bit_cpu` gives bitsandbytes' exact bytes here (checked once: odd sizes, both types)."""
    global _CPU_QUANTIZE_OK
    if _CPU_QUANTIZE_OK is None:
        try:
            import bitsandbytes  # noqa: F401  (registers its ops)

            own = torch.ops.bitsandbytes.quantize_4bit.default
            generator = torch.Generator().manual_seed(0)
            ok = True
            for shape, blocksize, quant_type, dtype in (
                ((96, 80), 64, "nf4", torch.float32), ((33, 7), 64, "nf4", torch.bfloat16), ((5, 129), 128, "fp4", torch.float16),
                ((64, 64), 64, "fp4", torch.float32),
            ):
                A = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
                A.view(-1)[::17] = 0  # exact zeros and block maxima: values on the bounds' edges
                mine, theirs = _quantize_4bit_cpu(A, blocksize, quant_type, torch.uint8), own(A, blocksize, quant_type, torch.uint8)
                ok = ok and all(torch.equal(a, b) for a, b in zip(mine, theirs))
            _CPU_QUANTIZE_OK = ok
        except Exception:  # noqa: BLE001 - another bitsandbytes layout: its own kernel, unchanged
            _CPU_QUANTIZE_OK = False
    return _CPU_QUANTIZE_OK


@contextmanager
def fast_cpu_quantize_4bit() -> Iterator[None]:
    """Within: bitsandbytes' ``quantize_4bit`` on CPU tensors runs :func:`_quantize_4bit_cpu` (same bytes, ~2x faster).

    Scoped (the registration is dropped on exit, bitsandbytes' own kernel is back for everyone else) and used only
    where its output was checked equal to bitsandbytes' on this machine (:func:`_cpu_quantize_checked`).
    """
    global _CPU_QUANTIZE_DEPTH
    if _CPU_QUANTIZE_DEPTH or not _cpu_quantize_checked():  # nested: the outer block registered it already
        yield
        return
    library = torch.library.Library("bitsandbytes", "IMPL")  # noqa: TOR901 - a fragment whose lifetime is this block
    _CPU_QUANTIZE_DEPTH += 1
    try:
        torch.library.register_kernel("bitsandbytes::quantize_4bit", "cpu", _quantize_4bit_cpu, lib=library)
        yield
    finally:
        _CPU_QUANTIZE_DEPTH -= 1
        library._destroy()
