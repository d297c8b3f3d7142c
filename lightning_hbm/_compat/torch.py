"""torch's internals that lightning_hbm relies on (torch 2.13; ``tests/_compat/test_torch.py`` checks each)."""

from __future__ import annotations

import copy
import functools
import itertools
import random
import sys
import weakref
from collections.abc import Mapping, MutableMapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from functools import wraps
from typing import Any, Callable, Iterator, NamedTuple, Optional, cast

import torch
from torch import nn
from torch._ops import _len_torch_dispatch_stack_pre_dispatch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch._subclasses.fake_tensor import is_fake as _is_fake  # activations.token_chunks
from torch.optim import Optimizer
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _disable_current_modes,  # planner.realvalues, planner.tracing
)
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.data import DataLoader, IterableDataset


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


NormBase = nn.modules.batchnorm._NormBase  # BatchNorm and InstanceNorm
# torch's own norms, these classes exactly: a training forward normalizes by the batch's statistics and only updates
# the running ones (a subclass may read them too: Batch Renormalization's corrections do)
_STATISTICS_ONLY = (
    nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.LazyBatchNorm1d, nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d, nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d, nn.LazyInstanceNorm1d,
    nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d,
)  # fmt: skip


class TrainingBuffers(NamedTuple):
    """The buffers a training-mode forward changes in place, in two kinds."""

    #: read into the forward's output too: a parametrization's state (spectral_norm's power iteration ``_u``, ``_v``,
    #: kept in the modules under its ``ParametrizationList``), a norm subclass's running statistics
    read: list[torch.Tensor]
    #: only updated, never read in training: the running statistics of torch's own BatchNorm / InstanceNorm layers
    updated: list[torch.Tensor]


def training_buffers(module: nn.Module) -> TrainingBuffers:
    """The buffers of ``module`` (and its submodules) that a training-mode forward changes in place (norms' tracked
    statistics, parametrizations' state), each list in no particular order.

    Called at every checkpointed block's training forward (:mod:`lightning_hbm.activations.replay`): the walk goes
    over ``_modules`` by hand, each module once as in ``module.modules()``, which yields every submodule through one
    generator per level of nesting: 52 µs against 21 µs for a LoRA'd nf4 Llama block of 83 modules in a loop, about
    140 against 125 µs inside a CPU training step, where the modules are no longer in the caches
    (``benchmarks/replay_step_time.py``)."""
    lists = torch.nn.utils.parametrize.ParametrizationList
    found = TrainingBuffers([], [])
    todo, seen = [module], {module}
    while todo:
        sub = todo.pop()
        if isinstance(sub, lists):
            found.read.extend(sub.buffers())
        elif isinstance(sub, NormBase) and sub.track_running_stats:
            (found.updated if type(sub) in _STATISTICS_ONLY else found.read).extend(sub.buffers(recurse=False))
        for child in sub._modules.values():
            if child is not None and child not in seen:
                seen.add(child)
                todo.append(child)
    return found


def child_items(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The registered children of ``module`` in order, one entry per registration (``named_children`` drops a child
    registered twice; a Sequential holding one block twice lists it twice here)."""
    return [(name, child) for name, child in module._modules.items() if child is not None]


def set_child_items(module: nn.Module, items: list[tuple[str, nn.Module]]) -> None:
    """Register exactly ``items`` as the children of ``module``, names kept (torch's ``del sequential[i:]`` renumbers a
    Sequential's remaining items; the planner's cuts keep a head's name, looked up by ``layer_modes``)."""
    module._modules = dict(items)


def dispatch_modes_off() -> AbstractContextManager[Any]:
    """``_disable_current_modes()`` where a dispatch mode is on, and nothing to enter where none is: the context
    costs 5 µs a call (its imports), twice per checkpointed block and step in the replay
    (:mod:`lightning_hbm.activations.replay`), where only the selective policy's recompute has a mode on."""
    if torch._C._len_torch_dispatch_stack() == 0 and _len_torch_dispatch_stack_pre_dispatch() == 0:
        return nullcontext()
    return _disable_current_modes()


def buffers_changed_in_training(module: nn.Module) -> list[torch.Tensor]:
    """The buffers of ``module`` (and its submodules) that a training-mode forward changes in place: tracked
    BatchNorm / InstanceNorm statistics, and a parametrization's state (:func:`training_buffers`, both kinds)."""
    read, updated = training_buffers(module)
    return [*read, *updated]


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``tree_map_only(Tensor, fn, tree)``, inside the mappings torch's pytree takes as one leaf too (transformers'
    ``BatchEncoding`` from a tokenizer or ``DataCollatorWithPadding``, ``BatchFeature`` from an image processor, a
    ``UserDict``): copied in their type, each value mapped. Left as leaves, their tensors were not faked for the
    planner's trace, not copied for the probe step, not cast for the accuracy check."""

    def one(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor):
            return fn(leaf)
        if not isinstance(leaf, Mapping):
            return leaf
        return rewrapped(leaf, {key: map_tensors(fn, value) for key, value in leaf.items()})

    return tree_map(one, tree)


def rewrapped(like: Mapping[Any, Any], values: dict[Any, Any]) -> Any:
    """``values`` in a mapping of ``like``'s type where it can be copied and written (a BatchEncoding), else a dict."""
    if not isinstance(like, MutableMapping):
        return values
    new = copy.copy(like)
    for key, value in values.items():
        new[key] = value
    return new


def accumulates_into(params: list[torch.Tensor]) -> bool:
    """Whether the backward running now (call only inside one) adds into the ``.grad`` of each of ``params``: a plain
    ``backward()`` does; ``autograd.grad`` does not (it returns them), nor ``backward(inputs=...)`` for one it leaves
    out (``torch._C._will_engine_execute_node`` on their ``AccumulateGrad`` nodes; no public name)."""
    try:
        return all(bool(torch._C._will_engine_execute_node(torch.autograd.graph.get_gradient_edge(p).node)) for p in params)
    except RuntimeError:  # autograd.grad naming one of them: its gradient is captured, never accumulated
        return False


def tensor_leaves(tree: Any) -> list[torch.Tensor]:
    """The tensors of ``tree``, inside the mappings torch's pytree takes as one leaf too (:func:`map_tensors`)."""
    found: list[torch.Tensor] = []
    for leaf in tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf)
        elif isinstance(leaf, Mapping):
            found += tensor_leaves(dict(leaf))
    return found


def int_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``torch._int_mm``: int8 x int8 -> int32 matrix product (cuBLASLt / CPU), torch's only integer GEMM."""
    return torch._int_mm(a, b)


def weight_norm(v: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's own weight_norm kernel, the one its parametrization and hook call (layers.weight_norm)."""
    return torch._weight_norm(v, g, dim)


def foreach_norm(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """``torch._foreach_norm``: the 2-norm of each tensor in a few fused kernels (what ``clip_grad_norm_`` uses)."""
    return list(torch._foreach_norm(tensors))


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


@contextmanager
def loader_as_it_was(loader: Any) -> Iterator[None]:
    """The loader's attributes as they were after the block, a pass begun in it shut down.

    With ``persistent_workers`` a pass keeps its iterator in ``DataLoader._iterator`` (its workers, and the index
    sampler it was built with) for the next ``iter``, which only resets it: left there, the loader's next pass would
    reuse it (a ResumableDataLoader's skip of restored batches lost). Other attributes a pass sets (a
    ResumableDataLoader's pass counter) are put back too, by identity, bypassing ``DataLoader.__setattr__``.
    """
    attributes = getattr(loader, "__dict__", None)  # None: a generator, an object with slots
    before = dict(attributes or {})
    try:
        yield
    finally:
        started = attributes.get("_iterator") if attributes is not None else None
        if attributes is not None:
            attributes.clear()
            attributes.update(before)
        shutdown = getattr(started, "_shutdown_workers", None)
        if started is not before.get("_iterator") and callable(shutdown):
            shutdown()


def passes_once(loader: Any) -> bool:
    """Whether a batch drawn from ``loader`` must be the one its loop trains first: a one-pass iterator (``iter`` gives
    the object itself: a generator) or a ``DataLoader`` over an ``IterableDataset`` whose passes come from its
    ``_get_iterator`` (:func:`hands_its_pass_over`), stateful or not (a stream may be read once: a second pass would
    not start over, and the batch drawn first would be lost; issue 55). A stateful one (``load_state_dict``: torchdata's
    ``StatefulDataLoader``, one of the user's) restored before its loop iterates drops the kept pass first
    (:class:`_KeptPass`): its loop starts where the state says, as without lightning_hbm.

    A map-style ``DataLoader`` is not: a second pass reads the same indices (its batch 0 is loaded once more).
    """
    if not isinstance(loader, DataLoader):
        try:
            return iter(loader) is loader
        except TypeError:
            return False
    return isinstance(loader.dataset, IterableDataset) and hands_its_pass_over(loader)


def hands_its_pass_over(loader: DataLoader) -> bool:
    """Whether each ``iter(loader)`` takes its pass from ``loader._get_iterator()``, where a kept pass is handed over:
    ``DataLoader.__iter__``, or an ``__iter__`` of its own that calls it (torchdata's ``StatefulDataLoader``: its
    ``state_dict`` then asks the pass handed over, which counts the batch drawn) or its parent's (``super().__iter__()``). Another ``__iter__`` makes passes
    lightning_hbm cannot hand back: a batch drawn from it is drawn in a new pass (:func:`streams_drawn_anew`)."""
    for cls in type(loader).__mro__:  # an __iter__ calling super().__iter__() hands over what its parent's does
        own = vars(cls).get("__iter__")
        if own is None:
            continue
        if own is DataLoader.__iter__:
            return True
        names = getattr(getattr(own, "__code__", None), "co_names", ())
        if "_get_iterator" in names:
            return True
        if not ("super" in names and "__iter__" in names):
            return False
    return False


_END = object()


def draw_keeping_the_pass(loader: Any, restore: Optional[Any] = None) -> Optional[tuple[Any, Any]]:
    """The first batch of ``loader`` (see :func:`passes_once`) and what the loop must iterate instead of ``loader``
    (``loader`` itself for a ``DataLoader``), so that it trains that same batch first and the rest of the same pass;
    ``None`` when the loader is empty. Drawn once: asked again (AutoFit's planning batch, then the probe step's), the
    batch already drawn is given, nothing more is read.

    A ``DataLoader`` keeps the pass for its next ``iter`` (its ``_get_iterator``, an instance attribute until a pass
    goes past that batch): no second pass, no stream opened twice, no worker started twice. Creating a pass draws its
    workers' base seed from the loader's generator (or torch's global RNG): that draw is undone here and made at each
    ``iter`` of the loader, as a new pass would. The first batch's own draws (a stream that draws random numbers as it
    reads) are made here, once (restoring them would repeat them for batch 1).

    ``restore``: the state Lightning will restore a stateful ``loader`` to before its loop iterates (a resumed fit):
    applied first, so the batch drawn is the one the resumed loop trains first, and that same restore (the same
    object) keeps the pass (a pass drawn before the restore and dropped took a batch of a stream read once: the
    resumed run started one batch later than without lightning_hbm, torchdata's ``StatefulDataLoader``, session 37).
    """
    if isinstance(loader, FirstAgain) and not loader._given:
        return loader._first, loader
    if not isinstance(loader, DataLoader):
        first = next(loader, _END)
        return None if first is _END else (first, FirstAgain(first, loader))
    kept = vars(loader).get("_get_iterator")
    if isinstance(kept, _KeptPass):
        return kept.first, loader
    stateful = callable(getattr(loader, "load_state_dict", None))
    if restore is not None and stateful:
        loader.load_state_dict(restore)  # type: ignore[attr-defined]  # a stateful loader's (checked)
    generator = loader.generator
    state = generator.get_state() if generator is not None else None
    with torch.random.fork_rng(devices=[]):
        started = iter(loader)
    if generator is not None:
        generator.set_state(state)
    vars(loader)["_iterator"] = None  # persistent workers: the loop's iter must take this pass, not reset it
    first = next(started, _END)
    if first is _END:
        return None
    kept = _KeptPass(loader, first, started, restore if stateful else None)
    vars(loader)["_get_iterator"] = kept
    if stateful:  # a restore before the loop iterates drops the kept pass (but the one it was drawn after)
        vars(loader)["load_state_dict"] = kept.load_state_dict
    return first, loader


class _KeptPass:
    """``DataLoader._get_iterator`` while the pass the probe batch was drawn from is at that batch: each ``iter`` of the
    loader gets that batch first, then the rest of the same pass; once one goes past it, the loader's own method is
    back (its next pass a new one). A stateful loader's ``load_state_dict`` (Lightning restoring a mid-epoch state)
    drops the kept pass, its workers shut down, then restores as the loader's own method does. Picklable."""

    def __init__(self, loader: DataLoader, first: Any, started: Any, restored: Optional[Any] = None) -> None:
        self.loader, self.first, self.started, self.restored = loader, first, started, restored

    def __call__(self) -> "FirstAgain":
        torch.empty((), dtype=torch.int64).random_(generator=self.loader.generator)  # the base seed a new pass draws
        return FirstAgain(self.first, self.started, self)

    def load_state_dict(self, state_dict: Any) -> Any:
        """The loader's own ``load_state_dict``, after the kept pass is dropped (its next pass starts at the state);
        nothing for the state the pass was drawn after (:func:`draw_keeping_the_pass`'s ``restore``, that object)."""
        if state_dict is not None and state_dict is self.restored:
            return None
        self.release()
        if isinstance(vars(self.loader).get("_iterator"), FirstAgain):  # persistent workers: not reset, a new pass
            vars(self.loader)["_iterator"] = None
        shutdown = getattr(self.started, "_shutdown_workers", None)
        if callable(shutdown):
            shutdown()
        return self.loader.load_state_dict(state_dict)  # type: ignore[attr-defined]  # a stateful loader's (checked)

    def release(self) -> None:
        own = vars(self.loader)
        if own.get("_get_iterator") is self:
            del own["_get_iterator"]
        restore = own.get("load_state_dict")
        if getattr(restore, "__self__", None) is self:
            del own["load_state_dict"]


class FirstAgain:
    """Yields ``first``, then the rest of ``rest`` (the pass ``first`` was drawn from). Anything else is the pass's
    (a ``DataLoader`` iterator's workers and length); ``_reset`` (persistent workers' next ``iter``) gives ``first``
    again while the pass has not gone past it."""

    def __init__(self, first: Any, rest: Any, kept: Optional[_KeptPass] = None) -> None:
        self._first, self._rest, self._kept, self._given = first, rest, kept, False

    def __iter__(self) -> "FirstAgain":
        return self

    def __next__(self) -> Any:
        if self._given:
            if self._kept is not None:
                self._kept.release()  # the pass goes on: the loader's next pass is a new one
                self._kept = None
            self._first = None
            return next(self._rest)
        self._given = True
        return self._first

    def _reset(self, *args: Any, **kwargs: Any) -> None:
        if self._kept is None:  # the pass went on: reset it as the loader would
            self._rest._reset(*args, **kwargs)
        else:
            self._given = False

    def __len__(self) -> int:
        return len(self._rest)

    def __getattr__(self, name: str) -> Any:
        rest = self.__dict__.get("_rest")  # absent while unpickling: no recursion
        if rest is None or name.startswith("__"):
            raise AttributeError(name)
        return getattr(rest, name)


#: ``prim.device``: how torch's C++ asks a tensor whose device is Python's (a FakeTensor) for it, through the dispatch.
PRIM_DEVICE = torch.ops.prim.device.default


def fake_device(func: Any, args: tuple) -> Optional[torch.device]:
    """The answer to ``prim.device`` of a FakeTensor, given by a dispatch mode at once (None: any other call).

    torch's C++ asks a FakeTensor for its device through the dispatch at nearly every op, and the query passes through
    every Python dispatch mode above the fake mode (the planner's tracker, real values, grouped mm), each a Python call
    wrapped by torch: 101,664 of the 147,504 calls those modes saw in one plan of a 32-block Llama. The answer is what
    the fake mode's own handler gives (``_device_handler``: meta inside a kernel, else the fake device), which is the
    tensor's ``device`` property; it creates no tensor and reads no value, so a mode that answers it misses nothing.
    """
    if func is PRIM_DEVICE and len(args) == 1 and type(args[0]) is FakeTensor:
        return cast(torch.device, args[0].device)
    return None


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is one of torch's fake tensors (the planner's trace): it has a shape but no values."""
    return bool(_is_fake(tensor))


def chunk_starts(stop: int, step: int, tensor: torch.Tensor) -> range | list[int]:
    """``range(0, stop, step)``; on a fake ``tensor`` (the planner's trace) only the first two starts and the last.

    Why: a loop over equal chunks (a fused loss's token chunks, a sliced head's vocabulary slices) allocates the same
    bytes in each iteration and frees them before the next, so its peak is one iteration's and its outputs are
    allocated before it; fake tensors have no values to compute. Tracing every iteration of a 128k-vocabulary head at
    a long context was most of ``max_context``'s time. The first two show any state carried from one iteration to the
    next, the last a shorter remainder (tests/planner/test_context.py checks the plan is the same to the byte).
    """
    starts = range(0, stop, step)
    if len(starts) <= 3 or not is_fake(tensor):
        return starts
    return [starts[0], starts[1], starts[-1]]


class FakeGroupedMM(TorchDispatchMode):
    """``aten._grouped_mm`` on fake tensors of any dtype its CPU kernel takes; enter it after ``FakeTensorMode``.

    torch 2.13's meta kernel of ``_grouped_mm`` refuses anything but bf16 ("Expected inputs of BF16 type"), while its
    CPU kernel multiplies float32 (``tests/_compat/test_torch.py`` fails once torch's meta kernel agrees). transformers
    5 runs the experts of its MoE models through it whenever torch has it, so without this the probe step of any such
    model in float32 fails on fake tensors (torch logs the failure with a traceback, at ERROR level) and the planner
    cannot trace it. Here the output is made from the shapes alone: ``[tokens, in] x [experts, in, out]`` (grouped by
    ``offs``) is ``[tokens, out]``, and ``[experts, m, in] x [experts, in, out]`` is ``[experts, m, out]``. Any other
    call goes on to the fake mode as it is.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        device = fake_device(func, args)
        if device is not None:
            return device
        kwargs = kwargs or {}
        if func is torch.ops.aten._grouped_mm.default and len(args) >= 2:
            a, b = args[0], args[1]
            if is_fake(a) and b.dim() == 3 and a.dim() in (2, 3):
                shape = (a.shape[0], b.shape[-1]) if a.dim() == 2 else (a.shape[0], a.shape[1], b.shape[-1])
                return torch.empty(shape, dtype=kwargs.get("out_dtype") or a.dtype, device=a.device)
        return func(*args, **kwargs)


@contextmanager
def real_tensors() -> Iterator[None]:
    """Tensors made in the context are real ones, also inside a fake mode (the planner's trace): for a measure that
    builds a small real tensor to read a size from (:func:`lightning_hbm.precision.sensitivity.weight_bytes` quantizes a
    zero weight with bitsandbytes, whose ``Params4bit`` cannot wrap a FakeTensor). torch's own
    ``unset_fake_temporarily``; ``tests/_compat/test_torch.py`` checks it still gives real tensors."""
    with unset_fake_temporarily():
        yield


@contextmanager
def fake_parameters_as_real_ones() -> Iterator[None]:
    """``module.to(...)`` (``Module._apply``) on fake parameters as on real ones: the Parameter keeps what it carries.

    On a real parameter ``_apply`` sets ``param.data``: the Parameter keeps its ``__dict__`` and may be referenced
    anywhere. On a FakeTensor it swaps the parameter with a fresh one (``torch.utils.swap_tensors``), which swaps the
    ``__dict__`` too and refuses a tensor an autograd graph holds. A model that casts a quantized router in every
    forward (Switch Transformers' ``self.classifier = self.classifier.to(self.dtype)``, NLLB-MoE's
    ``_cast_classifier``) lost bitsandbytes' ``quant_state`` of the 4-bit weight (its forward then tried to wrap the
    fake weight in a ``Params4bit`` and failed), and, in a checkpointed block's recompute, could not swap at all.
    Here a swap that changes nothing (the fresh tensor is the same view of the same storage: a uint8 weight "cast" to
    float32, an fp32 bias cast again) is skipped, as ``param.data = param`` changes nothing; any other swap sets back
    the attributes the fresh tensor lacks. For the planner's fake steps only (:class:`~lightning_hbm.planner.tracing._Built`);
    ``tests/_compat/test_torch.py`` checks that torch still swaps fake parameters.
    """
    swap = torch.utils.swap_tensors

    @wraps(swap)
    def as_real(t1: torch.Tensor, t2: torch.Tensor) -> None:
        if not (isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor)):
            return swap(t1, t2)
        if _same_view(t1, t2):
            return None
        kept = {k: v for k, v in vars(t1).items() if k not in vars(t2)}
        swap(t1, t2)
        for key, value in kept.items():
            setattr(t1, key, value)
        return None

    torch.utils.swap_tensors = as_real
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextmanager
def fake_scalars_format_as_values() -> Iterator[None]:
    """``format(t)`` / ``f"{t}"`` of a 0-d fake tensor reads its value (``t.item()``), as a real 0-d tensor formats.

    ``Tensor.__format__`` formats a 0-d tensor as its value only when its type is exactly ``Tensor``; a ``FakeTensor``
    formats as ``"FakeTensor(..., size=())"``. Switch Transformers and NLLB-MoE pick an expert by name
    (``self[f"expert_{expert_idx[0]}"]``): ``KeyError`` on fake tensors. The value comes from the planner's real
    twins (:class:`~lightning_hbm.planner.realvalues.RealValues`, which must be entered for it). Set on torch's
    ``FakeTensor`` class while entered: a torch function mode is not active inside ``Tensor.backward``, where a
    checkpointed block's recompute formats the same index again.
    """
    before: Any = vars(FakeTensor).get("__format__")  # None: inherited from Tensor (torch 2.13)

    def as_value(self: torch.Tensor, spec: str) -> str:
        if self.dim() == 0:
            return format(self.detach().item(), spec)
        return object.__format__(self, spec)

    FakeTensor.__format__ = as_value  # type: ignore[method-assign]
    try:
        yield
    finally:
        if before is not None:
            FakeTensor.__format__ = before  # type: ignore[method-assign]
        else:
            del FakeTensor.__format__


def _same_view(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.untyped_storage()._cdata == b.untyped_storage()._cdata and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
            and a.requires_grad == b.requires_grad)


# ------------------------------------------------------------------ tensor subclasses (layers/read_weight.py)


def wrapper_tensor(cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> Any:
    """A tensor of ``cls`` with this metadata and no storage of its own (torch's private
    ``Tensor._make_wrapper_subclass``, as torchao's ``NF4Tensor`` is made); ``cls`` defines ``__torch_dispatch__``."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=False)  # type: ignore[attr-defined]


def subclass_functions_off() -> Any:
    """A context in which a subclass's ``__torch_function__`` is not called (torch's ``DisableTorchFunctionSubclass``)."""
    return torch._C.DisableTorchFunctionSubclass()


def rng_states() -> dict[str, Any]:
    """The global RNG states a forward may draw from: Python's, NumPy's (if imported), torch's CPU and CUDA (if begun)."""
    numpy_random = sys.modules.get("numpy.random")  # only if the user's code has imported NumPy
    return {
        "python": random.getstate(),
        "numpy": numpy_random.get_state() if numpy_random is not None else None,  # type: ignore[attr-defined]
        "cpu": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None,
    }


def set_rng_states(states: dict[str, Any]) -> None:
    """The global RNGs at ``states`` (:func:`rng_states`)."""
    random.setstate(states["python"])
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None and states["numpy"] is not None:
        numpy_random.set_state(states["numpy"])  # type: ignore[attr-defined]
    torch.set_rng_state(states["cpu"])
    if states["cuda"] is not None:
        torch.cuda.set_rng_state_all(states["cuda"])


@contextmanager
def preserved_rngs() -> Iterator[None]:
    """Python's, NumPy's and torch's (CPU and CUDA) global RNG states as they were, after the block: the probe step
    runs the user's code, which may draw from any of them, and the surgery initializes adapters (issue 55: the same
    seed trained on other draws, and a shuffled DataLoader in another order, with LoRA than without)."""
    before = rng_states()
    try:
        yield
    finally:
        set_rng_states(before)
        if before["cuda"] is None and torch.cuda.is_available() and torch.cuda.is_initialized():
            # CUDA began inside the block (a draw on the GPU started it): its generators as a run without the block
            # finds them when it begins CUDA itself, at their seed (the one torch.manual_seed queued) and offset 0
            for generator in torch.cuda.default_generators:
                generator.manual_seed(generator.initial_seed())


@contextmanager
def drawing_as(states: Optional[dict[str, Any]]) -> Iterator[None]:
    """Within: the global RNGs at ``states`` (a recorded forward's: a forward that draws, a diffusion step's noise,
    draws the same again when measured); after: as they were. ``None``: nothing changed."""
    if states is None:
        yield
        return
    with preserved_rngs():
        set_rng_states(states)
        yield


def leading_batches(loader: Any, enough: Callable[[list[Any]], bool]) -> list[Any]:
    """The first batches of ``loader`` until ``enough(batches)``, drawn leaving no trace.

    A loader read once (:func:`passes_once`: a stream, a generator) gives its first batch only, drawn once and kept
    for its loop (:func:`draw_keeping_the_pass`): more drawn here would be taken from training. A map-style one is
    read in a new pass (a second pass reads the same indices) with the global RNGs, the loader's (and its samplers')
    own generators and its attributes as they were, the pass shut down: a DataLoader's generator draws the epoch's
    order, and advanced here epoch 0 would train in another order than without lightning_hbm (issue 55).
    """
    if passes_once(loader):
        kept = draw_keeping_the_pass(loader)
        return [] if kept is None else [kept[0]]
    stream = isinstance(getattr(loader, "dataset", None), IterableDataset)  # passes lightning_hbm cannot hand back
    if stream:  # a new pass may not start over, and each batch more is lost to training (36 samples, session 36)
        if loader in _DRAWN_ANEW:
            return [_DRAWN_ANEW[loader]]  # one batch per surgery, whoever asks (the probe step, then the measures)
        enough = _first_only
    batches = _drawn_in_a_new_pass(loader, enough)
    if stream and batches:
        _DRAWN_ANEW[loader] = batches[0]
    return batches


#: the first batch drawn in a new pass from a loader over an ``IterableDataset`` whose passes cannot be handed back
#: (:func:`hands_its_pass_over`), until the surgery that drew it says so (:func:`streams_drawn_anew`)
_DRAWN_ANEW: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def streams_drawn_anew() -> list[Any]:
    """The loaders over a stream :func:`leading_batches` drew a batch from in a new pass since the last call (one batch
    each, whoever asked), forgotten now: the surgery that drew them says so at fit start (a stream read once does not
    train that batch)."""
    loaders = list(_DRAWN_ANEW.keys())
    _DRAWN_ANEW.clear()
    return loaders


def _drawn_in_a_new_pass(loader: Any, enough: Callable[[list[Any]], bool]) -> list[Any]:
    restores = _own_rngs_restored(loader)
    batches: list[Any] = []
    try:
        # the loop trains on this same loader object (lightning_compat.stage_dataloader): no pass begun here is left in it
        with preserved_rngs(), loader_as_it_was(loader):
            for batch in loader:
                batches.append(batch)
                if enough(batches):
                    break
    finally:
        for restore in restores:
            restore()
    return batches


def _first_only(batches: list[Any]) -> bool:
    return True


def _own_rngs_restored(loader: Any) -> list[Callable[[], Any]]:
    """One call each putting back an RNG of its own (a ``torch.Generator``, a ``random.Random``, a NumPy ``Generator``,
    ``RandomState`` or bit generator) that ``loader`` reaches through its attributes and their lists, tuples and dicts
    (:func:`_reachable_rngs`), at its state now: its sampler's, its batch sampler's (a bucketing one drawing its
    batches' order: session 36, epoch 0 trained another order with lightning_hbm), a sampler wrapping the one that
    draws (Lightning's ``DistributedSamplerWrapper`` holds the user's two levels down), the dataset's, a ``Subset``'s
    or ``ConcatDataset``'s inner datasets', a transform's (augmentations drawn in this process: the first 32 samples
    trained other draws; session 37 found each of these one level deeper than session 36 looked)."""
    restores: list[Callable[[], Any]] = []
    for rng in _reachable_rngs(loader):
        if isinstance(rng, random.SystemRandom):  # the OS's entropy: no state to put back (getstate raises)
            continue
        if isinstance(rng, torch.Generator):
            restores.append(functools.partial(rng.set_state, rng.get_state()))
        elif isinstance(rng, random.Random):
            restores.append(functools.partial(rng.setstate, rng.getstate()))
        elif hasattr(rng, "bit_generator"):  # numpy.random.Generator
            restores.append(functools.partial(setattr, rng.bit_generator, "state", rng.bit_generator.state))
        elif callable(getattr(rng, "set_state", None)):  # numpy.random.RandomState
            restores.append(functools.partial(rng.set_state, rng.get_state()))
        else:  # a NumPy bit generator held on its own
            restores.append(functools.partial(setattr, rng, "state", rng.state))
    return restores


#: how far :func:`_reachable_rngs` looks: attribute or element hops from the loader, objects walked, elements of one
#: list, tuple or dict (a dataset's list of a million samples is not walked: a generator inside one sample is not found)
_RNG_DEPTH, _RNG_OBJECTS, _RNG_ELEMENTS = 8, 4096, 64
_NOT_WALKED = (str, bytes, int, float, complex, bool, type(None), type, torch.Tensor, nn.Parameter)


def _is_rng(value: Any) -> bool:
    if isinstance(value, (torch.Generator, random.Random)):
        return True
    numpy_random = sys.modules.get("numpy.random")
    kinds = () if numpy_random is None else (numpy_random.Generator, numpy_random.RandomState, numpy_random.BitGenerator)  # type: ignore[attr-defined]
    return isinstance(value, kinds)


def _children(value: Any) -> list[Any]:
    if isinstance(value, Mapping):
        return list(itertools.islice(value.values(), _RNG_ELEMENTS))
    if isinstance(value, (list, tuple, set, frozenset)):
        return list(itertools.islice(value, _RNG_ELEMENTS))
    try:
        attributes = vars(value)
    except Exception:  # no __dict__ (slots, a C type), or a proxy whose attribute look-up fails
        return []
    return list(attributes.values()) if isinstance(attributes, dict) else []


def _reachable_rngs(root: Any) -> list[Any]:
    """The RNGs ``root`` reaches through its attributes (an object's ``__dict__``) and the elements of its lists,
    tuples, sets and dicts, breadth first, within :data:`_RNG_DEPTH` hops and :data:`_RNG_OBJECTS` objects (modules,
    classes, functions, tensors and arrays not walked); each once."""
    seen: set[int] = {id(root)}
    found: list[Any] = []
    level, depth, walked = [root], 0, 0
    while level and depth < _RNG_DEPTH and walked < _RNG_OBJECTS:
        following: list[Any] = []
        for value in level:
            walked += 1
            for child in _children(value):
                if id(child) in seen or isinstance(child, _NOT_WALKED) or _skipped(child):
                    continue
                seen.add(id(child))
                (found if _is_rng(child) else following).append(child)
        level, depth = following, depth + 1
    return found


def _skipped(value: Any) -> bool:
    """Modules, functions and arrays: nothing of a loader's own in them (a module's globals are the global RNGs')."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        return False
    return type(value).__module__ in ("builtins", "numpy")  # a module, a function, a method, a range; an array


#: ``listener(storage, data_ptr, nbytes)`` called after each ``UntypedStorage.resize_`` with the address and size the
#: storage had before (:func:`add_resize_listener`)
ResizeListener = Callable[[torch.UntypedStorage, int, int], None]
_RESIZE_LISTENERS: list[ResizeListener] = []
_RESIZE_SAVED: list[Any] = []  # what ``UntypedStorage.__dict__`` held for ``resize_`` before the wrapper (absent: [])
_NATIVE_RESIZE = torch.UntypedStorage.resize_


def _resize_telling(storage: torch.UntypedStorage, size: int) -> Any:
    before = storage.data_ptr(), storage.nbytes()
    out = (_RESIZE_SAVED[0] if _RESIZE_SAVED else _NATIVE_RESIZE)(storage, size)
    for listener in list(_RESIZE_LISTENERS):
        listener(storage, *before)
    return out


def add_resize_listener(listener: ResizeListener) -> None:
    """Call ``listener(storage, old_data_ptr, old_nbytes)`` after every ``UntypedStorage.resize_`` until
    :func:`remove_resize_listener`.

    ``resize_`` of a storage is no op a ``TorchDispatchMode`` sees, and it is how FSDP2 frees a unit's gathered
    parameters (``resize_(0)`` after the forward and the backward, ``_fsdp_param.free_storage``) and allocates them
    again for the next all-gather (``alloc_storage``): torch's own ``MemTracker`` wraps the method for the same reason.
    The wrapper is on the class only while a listener is registered; the last one removed puts back what was there.
    """
    if not _RESIZE_LISTENERS:
        saved = torch.UntypedStorage.__dict__.get("resize_")  # another wrapper (torch's MemTracker), or none
        _RESIZE_SAVED[:] = [] if saved is None else [saved]
        torch.UntypedStorage.resize_ = _resize_telling  # type: ignore[method-assign,assignment]
    _RESIZE_LISTENERS.append(listener)


def remove_resize_listener(listener: ResizeListener) -> None:
    """Stop calling ``listener`` (:func:`add_resize_listener`); a listener never added is ignored."""
    if listener in _RESIZE_LISTENERS:
        _RESIZE_LISTENERS.remove(listener)
    if _RESIZE_LISTENERS or torch.UntypedStorage.__dict__.get("resize_") is not _resize_telling:
        return
    if _RESIZE_SAVED:
        torch.UntypedStorage.resize_ = _RESIZE_SAVED.pop()  # type: ignore[method-assign]
    else:
        del torch.UntypedStorage.resize_


MEMTRACKER_TOTAL = "Total"  # torch's ``mem_tracker._TOTAL_KEY``: a snapshot's sum over its memory kinds


def total_peak_only(tracker: Any) -> None:
    """``tracker`` (torch's ``MemTracker``) keeps its peak over all tensors per device (``get_tracker_snapshot("peak")``,
    what the planner's reference reads) and no longer each module's. torch 2.13's private ``_update_peak_stats`` runs
    at every operator and walks every module the tracker has seen (a weak dictionary) to update that module's own
    peak: a cost of operators x modules, which dominated a step of a deep model (a 30-layer tiny Llama, nf4-dq +
    LoRA + checkpointing: 43.3 s of CPU with it, 3.3 s without, the same total to the byte, benchmarks/README.md
    "Costs"; the real SmolLM2's step took ~190 s). The total is counted as torch counts it: the same snapshot, taken at the same operators; a module's own
    peak (``memory_tracking``'s ``local_peak``) is then only what its hooks saw, not its forward's top: not to be
    read. ``tests/_compat/test_torch_s42.py`` fails when torch renames what this reads."""
    tracker._update_peak_stats = functools.partial(_update_total_peak, tracker)


def _update_total_peak(tracker: Any, peak_state: Any) -> None:
    """The device part of torch 2.13's ``MemTracker._update_peak_stats``, as it is written there."""
    for device, snapshot in tracker._curr_mem_snap.items():
        if tracker._peak_mem.get(device, 0) < snapshot[MEMTRACKER_TOTAL]:
            tracker._peak_mem[device] = snapshot[MEMTRACKER_TOTAL]
            tracker._peak_mem_snap[device] = copy.deepcopy(snapshot)


def without_module_hooks(tracker: Any) -> None:
    """``tracker`` (torch's ``MemTracker``, not yet entered) installs no module hook: its private ``_mod_tracker`` (a
    ``ModTracker``) is swapped for :class:`_NoModuleHooks`, which answers what ``MemTracker`` asks of it in torch 2.13
    (``tests/_compat/test_torch.py`` fails when that changes). Those hooks keep alive the graph of a module whose output
    never reaches the loss (transformers' Mimi encoder: ``planner/reference.py``); only the total is meant then."""
    tracker._mod_tracker = _NoModuleHooks()


class _NoModuleHooks:
    """What ``MemTracker`` asks of its ``ModTracker`` (torch 2.13), installing no hook: no module is ever running."""

    parents: set[str] = set()
    is_bw = False

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def get_known_fqn(self, module: torch.nn.Module) -> None:
        return None

    def __enter__(self) -> _NoModuleHooks:
        return self

    def __exit__(self, *args: Any) -> None:
        pass


def passed_through_fsdp(tensor: torch.Tensor, output: torch.Tensor) -> bool:
    """Whether ``tensor`` is ``output`` as FSDP2 hands it to the unit it feeds: the output of its pre-forward's
    ``RegisterPostBackwardFunction`` (torch 2.13, ``_fsdp_param_group``; the post-backward hook), which returns its
    inputs as they are, a new tensor of the same data (storage, offset, shape, strides) whose node's input is
    ``output``'s (``tests/strategies/test_fsdp_sequential_blocks_s35.py``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction

    node = tensor.grad_fn
    if node is None or output.grad_fn is None or getattr(node, "_forward_cls", None) is not RegisterPostBackwardFunction:
        return False
    if (tensor.data_ptr(), tensor.shape, tensor.stride(), tensor.dtype) != (
            output.data_ptr(), output.shape, output.stride(), output.dtype):
        return False
    return any(fn is output.grad_fn and nr == output.output_nr for fn, nr in node.next_functions)


def is_fsdp_unit(module: nn.Module) -> bool:
    """Whether ``module`` is an FSDP2 unit (``fully_shard`` made it an ``FSDPModule``)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def own_class_name(module: nn.Module) -> str:
    """The name of ``module``'s own class: ``fully_shard`` swaps a unit's class for a generated ``FSDP<Name>`` (bases
    ``FSDPModule`` and the user's class), a name ``shard_modules`` or a user's code would not know."""
    from torch.distributed.fsdp import FSDPModule

    return next(c.__name__ for c in type(module).__mro__ if not issubclass(c, FSDPModule))


@contextmanager
def fsdp_gathered(module: nn.Module) -> Iterator[None]:
    """``module``'s parameters gathered while in the context when it is an FSDP2 unit (``fully_shard``), so that its
    forward can run outside its ``__call__`` (no pre-forward hook): ``unshard()``, then ``reshard()`` only where it
    was neither gathered nor being gathered before (FSDP2's backward prefetch gathers it for its own backward: left so,
    it is not gathered twice). Not a unit: nothing done."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        yield
        return
    groups = module._get_fsdp_state()._fsdp_param_groups
    ready = all(g.is_unsharded or g._all_gather_result is not None for g in groups)
    module.unshard()
    try:
        yield
    finally:
        if not ready:
            module.reshard()
