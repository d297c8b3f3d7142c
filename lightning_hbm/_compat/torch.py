"""torch's internals that lightning_hbm relies on (torch 2.13; ``tests/_compat/test_torch.py`` checks each)."""

from __future__ import annotations

import weakref
from functools import wraps
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch._subclasses.fake_tensor import is_fake as _is_fake  # callbacks.token_chunks
from torch.utils._python_dispatch import _disable_current_modes  # planner.realvalues, planner.tracing


def forward_override(module: nn.Module) -> Optional[Callable[..., Any]]:
    """The ``forward`` set on this instance by :func:`override_forward` (``None``: the class's own)."""
    return module.__dict__.get("forward")


def override_forward(module: nn.Module, forward: Optional[Callable[..., Any]]) -> None:
    """Give one module instance another ``forward`` (``None``: back to its class's).

    ``nn.Module.__call__`` calls ``self.forward``: an instance attribute shadows the class's method and the
    module's hooks still run. torch has no public per-instance forward replacement.
    """
    if forward is None:
        module.__dict__.pop("forward", None)
    else:
        module.forward = forward


def record_memory_history(**kwargs: Any) -> None:
    """``torch.cuda.memory._record_memory_history``: the allocator trace behind ``memory_viz`` (no public name)."""
    torch.cuda.memory._record_memory_history(**kwargs)


def dump_memory_snapshot(path: str) -> None:
    """``torch.cuda.memory._dump_snapshot``: write the recorded trace (a pickle ``memory_viz`` reads)."""
    torch.cuda.memory._dump_snapshot(path)


def load_state_dict_pre_hooks(module: nn.Module) -> list[Callable[..., Any]]:
    """The callables registered with ``register_load_state_dict_pre_hook`` (torch lists them nowhere public;
    it keeps each in a ``_WrappedHook`` whose ``hook`` is the callable)."""
    return [getattr(h, "hook", h) for h in module._load_state_dict_pre_hooks.values()]


# Base classes torch keeps private: an isinstance check on every convolution / batch norm kind needs them.
ConvNd = nn.modules.conv._ConvNd
BatchNormBase = nn.modules.batchnorm._BatchNorm


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``: int8 x int8 -> int32 matrix product (cuBLASLt / CPU), torch's only integer GEMM."""
    return torch._int_mm(a, b)


def make_wrapper_subclass(cls: type, shape: Any, **kwargs: Any) -> Any:
    """``torch.Tensor._make_wrapper_subclass``: a tensor subclass instance that owns no storage (torch's
    documented recipe for wrapper subclasses; no public name)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, **kwargs)


def disable_torch_function_subclass() -> Any:
    """``torch._C.DisableTorchFunctionSubclass()``: run a torch function on a subclass as on a plain tensor
    (what ``Tensor.__torch_function__`` itself does; no public name)."""
    return torch._C.DisableTorchFunctionSubclass()


def parse_to(*args: Any, **kwargs: Any) -> tuple[Any, Any, Any, Any]:
    """``torch._C._nn._parse_to``: ``Tensor.to``'s arguments as ``(device, dtype, non_blocking, memory_format)``."""
    return torch._C._nn._parse_to(*args, **kwargs)


def child_schedulers(scheduler: Any) -> list[Any]:
    """The schedulers inside a ``SequentialLR`` / ``ChainedScheduler`` (``_schedulers``; none for others)."""
    return list(getattr(scheduler, "_schedulers", []))


def packed_qkv(mha: nn.MultiheadAttention) -> bool:
    """Whether ``mha`` keeps q, k, v in one ``in_proj_weight`` (``_qkv_same_embed_dim``) or in three weights."""
    return mha._qkv_same_embed_dim


def track_step_called(optimizer: Optimizer) -> None:
    """What ``torch.optim.lr_scheduler.LRScheduler.__init__`` does to its optimizer's ``step``.

    torch defines that wrapper inside ``LRScheduler.__init__`` (not importable), so it is repeated here.
    """
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    opt_ref = weakref.ref(optimizer)
    func = optimizer.step.__func__  # type: ignore[attr-defined]

    @wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        opt = opt_ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return func.__get__(opt, opt.__class__)(*args, **kwargs)

    wrapper._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = wrapper  # type: ignore[method-assign]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of torch's fake tensors (the planner's trace): it has a shape but no values."""
    return bool(_is_fake(tensor))
