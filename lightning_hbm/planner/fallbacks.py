"""Modules that cannot run on fake tensors: named (:class:`UntraceableModule`), or run for real on zeros.

A fake-tensor failure inside a submodule's forward is turned into :class:`UntraceableModule` naming the innermost
module (:func:`_name_untraceable`); the planner then traces again with that module's class run for real on zeros of
the fake inputs' shapes (:func:`_run_for_real`, at most :data:`MAX_REAL_RUN_BYTES` of host memory), its outputs and
saved bytes standing in the trace as fakes (:class:`_RealRun`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    UnsupportedOperatorException,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from lightning_hbm._compat import _disable_current_modes
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.planner.candidates import format_bytes

#: What FakeTensorMode raises when an op needs values (or a kernel) a fake tensor does not have.
_FAKE_FAILURES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class UntraceableModule(RuntimeError):
    """A submodule's forward cannot run on fake tensors; :attr:`module_name` names the innermost one.

    ``module_name`` ``"training_step"``: the LightningModule's own code (its ``training_step`` or ``forward``), which no
    fallback runs for real (that would be the whole model): :attr:`runs_for_real` is False.
    """

    def __init__(self, module_name: str, module_type: str, error: Exception) -> None:
        self.module_name, self.module_type = module_name, module_type
        self.runs_for_real = module_name != "training_step"
        where = f"the forward of {module_name} ({module_type})" if self.runs_for_real else f"{module_type}.training_step"
        super().__init__(
            f"{where} cannot run on fake tensors: {type(error).__name__}: {error}. "
            "Its Python reads values of a tensor too large for a real twin (more than "
            "lightning_hbm.planner.realvalues.MAX_TWIN_ELEMENTS elements) or calls an op with no fake kernel. Fix: "
            "write the branch without reading values (torch.where instead of `if tensor...:`, masks instead of "
            "nonzero/boolean indexing), or measure this configuration with a real step "
            "(lightning_hbm.planner.reference.memtracker_peak)."
        )


@contextmanager
def _name_untraceable(model: nn.Module) -> Iterator[None]:
    """Turn a fake-tensor failure inside a submodule's forward into :class:`UntraceableModule` naming it.

    Global forward hooks keep the stack of forwards in progress; a forward that raises never pops
    itself, so at the failure the top of the stack is the innermost module whose forward raised. Not
    :class:`lightning_hbm.running.RunningModules` on purpose: its leaving hook also runs when a forward raises,
    which would empty the stack before the failure is named.
    """
    names = {id(m): name for name, m in model.named_modules() if m is not model}
    stack: list[nn.Module] = []

    def push(module: nn.Module, args: Any) -> None:
        stack.append(module)

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        while stack and stack.pop() is not module:
            pass  # entries left by an exception the model caught itself

    pre = nn.modules.module.register_module_forward_pre_hook(push)
    post = nn.modules.module.register_module_forward_hook(pop)
    try:
        yield
    except _FAKE_FAILURES as err:
        inner = next((m for m in reversed(stack) if id(m) in names), None)
        if inner is None:  # the LightningModule's own code: no module to run for real but the whole model
            raise UntraceableModule("training_step", type(model).__name__, err) from err
        raise UntraceableModule(names[id(inner)], type(inner).__name__, err) from err
    finally:
        pre.remove()
        post.remove()


class _RealRun(torch.autograd.Function):
    """A fake stand-in for a forward that ran for real: fake outputs of the real shapes, ``saved`` bytes held
    for backward (what the real run saved, as one fake buffer), zero gradients for every input."""

    @staticmethod
    def forward(ctx: Any, shapes: list, saved: int, *inputs: torch.Tensor) -> Any:
        ctx.save_for_backward(torch.empty(saved, dtype=torch.uint8))
        ctx.inputs = [(t.shape, t.dtype) for t in inputs]
        return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in shapes)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        needed = ctx.needs_input_grad[2:]
        return (None, None, *(torch.zeros(s, dtype=d) if n else None for (s, d), n in zip(ctx.inputs, needed)))


#: Values besides tensors a forward that ran for real may return (they are the zeros' values, kept as they are).
_PLAIN_VALUES = (bool, int, float, str, type(None))


#: Most host memory the zeros of a module run for real may take (inputs and weights); beyond, the plan stops with the
#: fix instead: a submodule that is most of a large model (a VLM's language model) would take the model's size for real.
MAX_REAL_RUN_BYTES = 2 * 2**30


def _check_real_run(name: str, module: nn.Module, reason: str, tensors: tuple[torch.Tensor, ...]) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes > MAX_REAL_RUN_BYTES:
        raise RuntimeError(
            f"the forward of {name} ({type(module).__name__}) cannot run on fake tensors ({reason}), and running it for "
            f"real on zeros would take {format_bytes(nbytes)} of host memory (inputs and weights; more than "
            f"lightning_hbm.planner.fallbacks.MAX_REAL_RUN_BYTES = {format_bytes(MAX_REAL_RUN_BYTES)}). Fix: write the "
            "branch without reading values (torch.where instead of `if tensor...:`, masks instead of nonzero/boolean "
            "indexing), or measure this configuration with a real step (lightning_hbm.planner.reference.memtracker_peak)."
        )


def _run_for_real(module: nn.Module, fallbacks: dict[str, str], reason: str, name: str) -> None:
    """Replace ``module``'s forward (in place) by a real run on zeros of the fake inputs' shapes, traced as
    :class:`_RealRun`; ``fallbacks[name]`` says so once it ran."""
    fake_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        fakes = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weights = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
        _check_real_run(name, module, reason, (*fakes, *weights.values()))
        with _disable_current_modes(), torch.enable_grad():
            real = {id(t): torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad) for t in fakes}
            real_weights = {k: torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad) for k, t in weights.items()}
            saved: dict[int, int] = {}

            # storages told apart by their data pointer (every one here is alive until the sum below): the id() of
            # ``untyped_storage()``, a new Python object at each call, could be reused by the next one, so the sum
            # depended on the heap and a checkpointed block's recompute could count other bytes than its forward
            # (torch's CheckpointError "different metadata", seen once in the full suite)
            def pack(t: torch.Tensor) -> torch.Tensor:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            torch_compat.override_forward(module, fake_forward)  # the module's own forward, on real tensors
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = torch.func.functional_call(
                        module, real_weights, *tree_map_only(torch.Tensor, lambda t: real[id(t)], (args, kwargs))
                    )
            finally:
                torch_compat.override_forward(module, forward)
            # lists and dicts too: torchvision's RPN returns (a list of boxes per image, a dict of losses)
            leaves, spec = tree_flatten(out)
            other = next((t for t in leaves if not isinstance(t, (torch.Tensor, *_PLAIN_VALUES))), None)
            if other is not None:
                raise TypeError(f"{name} returns {type(out).__name__} holding {type(other).__name__}: the real-tensor "
                                "fallback handles tensors, numbers and strings in tuples, lists and dicts")
            outs = [t for t in leaves if isinstance(t, torch.Tensor)]
            # inputs, weights and outputs are in the trace already: only what the forward saved besides them
            known = {t.untyped_storage().data_ptr() for t in (*real.values(), *real_weights.values(), *outs)}
            saved_bytes = sum(n for key, n in saved.items() if key not in known)
            shapes = [(t.shape, t.dtype) for t in outs]
        result = iter(_RealRun.apply(shapes, saved_bytes, *fakes, *weights.values()))
        fallbacks[name] = reason
        return tree_unflatten([next(result) if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    torch_compat.override_forward(module, forward)
