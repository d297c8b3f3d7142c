"""Data-dependent Python on fake tensors: small tensors get a real twin, so ``.item()`` reads a real value.

A fake tensor has no data, so ``FakeTensorMode`` raises ``DataDependentOutputException`` on any read
of a value (``.item()``, ``bool(tensor)``, ``torch.equal``) and ``DynamicOutputShapeException`` on ops
whose output shape depends on values (``nonzero``, boolean indexing). Ordinary models do both: torch's
own ``trunc_normal_`` (``.item()`` of its bounds, ``if not mask.any()`` in its rejection loop), a
drop-path that draws ``torch.rand(1).item()``, RoPE scaling with ``if wavelen < ...`` on a small
frequency tensor, ``nn.Transformer``'s ``_detect_is_causal_mask`` (``torch.equal`` of the mask),
transformers' padding-mask checks, ``loss.item()`` in ``training_step``.

:class:`RealValues` sits above the fake mode and keeps, next to every *small* fake tensor (at most
:data:`MAX_TWIN_ELEMENTS` elements), a real twin computed by the same op on the twins of its inputs
(factory ops such as ``torch.rand(1)`` and ``arange`` have no inputs; the example batch is its own
twin). A read of a value then runs on the twin and is exact; an op with a data-dependent output shape
runs on the twins and its result is turned into a fake tensor of the real shape. A read of a large
tensor (a weight in ``trunc_normal_``, the loss of a real-size model) has no twin: it is answered with
0 / ``False`` (which ends rejection loops and changes nothing the planner counts) and counted in
:attr:`RealValues.guessed`, which the plan reports. Twins are real memory, so they stay small by
construction; they are computed with every mode switched off, so the planner's tracker never sees them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hbm._compat import _disable_current_modes
from lightning_hbm._compat import torch as torch_compat

#: Largest fake tensor (elements) that gets a real twin: 64 Ki elements, at most 512 KiB in fp64.
MAX_TWIN_ELEMENTS = 2**16

_aten = torch.ops.aten
# Ops that return Python values read from the data; without a twin they are answered with a guess.
_FAILED = object()  # no twin could be computed (None is a valid result: in-place foreach ops return it)
_VALUE_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
# torch's CTC loss: its output's shape depends on the target lengths' values, and it has no fake kernel
_CTC_LOSSES = {_aten._ctc_loss.default, _aten._ctc_loss.Tensor}


class RealValues(TorchDispatchMode):
    """Real twins of small fake tensors (see the module docstring); enter it after ``fake_mode``."""

    def __init__(self, fake_mode: FakeTensorMode, max_elements: int = MAX_TWIN_ELEMENTS) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.max_elements = max_elements
        # storage -> {view: twin}. Keyed by the storage, not the tensor: nn.Module.to swaps parameter
        # tensors in place (torch.utils.swap_tensors), which refuses a tensor something holds a weak reference to.
        self._twins: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.guessed: list[str] = []  # values read without a twin (op names), answered 0 / False
        self._data_modes: list[tuple[_FakeDataAsValues, Any]] = []  # one per entry of this mode (see __enter__)
        # where a selection by a mask without a twin may be answered by its largest size (None: nowhere), and
        # {op: why} of those answered so (see _largest_selection)
        self.bound_selections: Optional[Callable[[], bool]] = None
        self.selections: dict[str, str] = {}

    def __enter__(self) -> RealValues:
        # torch.tensor(data) reads the data of tensors inside `data` directly, past this dispatch mode
        data_mode = _FakeDataAsValues()
        data_mode.__enter__()
        # f"expert_{idx}" (Switch Transformers, NLLB-MoE pick an expert module by name) reads idx's value, as a real
        # 0-d tensor formats; a function mode does not see it in a checkpoint's recompute (run inside Tensor.backward)
        formats = torch_compat.fake_scalars_format_as_values()
        formats.__enter__()
        self._data_modes.append((data_mode, formats))
        return super().__enter__()

    def __exit__(self, exc_type: Any, exc: Any, traceback: Any) -> None:
        try:
            super().__exit__(exc_type, exc, traceback)
        finally:
            data_mode, formats = self._data_modes.pop()
            formats.__exit__(exc_type, exc, traceback)
            data_mode.__exit__(exc_type, exc, traceback)

    def add(self, fake: torch.Tensor, real: torch.Tensor) -> None:
        """Make ``real`` the twin of ``fake`` (e.g. the real example batch)."""
        views = self._twins.get(fake.untyped_storage())
        if views is None:
            views = self._twins[fake.untyped_storage()] = {}
        views[_view(fake)] = real

    def twin(self, fake: torch.Tensor) -> Optional[torch.Tensor]:
        """The real twin of ``fake``, or None."""
        views = self._twins.get(fake.untyped_storage())
        return None if views is None else views.get(_view(fake))

    def _forget(self, fake: torch.Tensor) -> None:
        self._twins.pop(fake.untyped_storage(), None)  # every view of a storage written without its twin

    def _real(self, tree: Any) -> Optional[Any]:
        """``tree`` with every fake tensor replaced by its twin; None if one has none."""
        leaves, spec = tree_flatten(tree)
        real = []
        for leaf in leaves:
            if isinstance(leaf, FakeTensor):
                leaf = self.twin(leaf)
                if leaf is None:
                    return None
            real.append(leaf)
        return tree_unflatten(real, spec)

    def _real_arguments(self, values: Any) -> Any:
        """The aten arguments ``values`` (a tuple, or a list of ``Tensor[]``) with every fake tensor replaced by its
        twin, without pytree (flattening them was a tenth of a small model's plan, session 36);
        ``_FAILED`` if one has none, ``None`` for what this does not read (a container other than a list or tuple)."""
        real = []
        for value in values:
            if isinstance(value, FakeTensor):
                value = self.twin(value)
                if value is None:
                    return _FAILED
            elif type(value) is list or type(value) is tuple:
                value = self._real_arguments(value)
                if value is None or value is _FAILED:
                    return value
            elif not isinstance(value, _PLAIN_ARGUMENTS):
                return None
            real.append(value)
        return real if type(values) is list else tuple(real)

    def _run_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """``func`` on the twins of its inputs; ``_FAILED`` if one has none or the op fails on them."""
        real_args: Any = self._real_arguments(args) if type(args) is tuple else None
        real_kwargs: Any = real_args if real_args is None or real_args is _FAILED else self._real_arguments(tuple(kwargs.values()))
        if real_args is None or real_kwargs is None:  # an argument the fast path does not read: pytree's path
            real = self._real((args, kwargs))
            if real is None:
                return _FAILED
            real_args, real_kwargs = real[0], tuple(real[1].values())
        if real_args is _FAILED or real_kwargs is _FAILED:
            return _FAILED
        try:
            with _disable_current_modes():
                return func(*real_args, **dict(zip(kwargs, real_kwargs)))
        except Exception:  # a twin is a help, never a new failure: the op simply gets none
            return _FAILED

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        device = torch_compat.fake_device(func, args)  # a device query: no value, no tensor (most calls)
        if device is not None:
            return device
        kwargs = kwargs or {}
        if func in _VALUE_READS:
            return self._read(func, args, kwargs)
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            real = self._run_real(func, args, kwargs)
            if real is _FAILED and func in _CTC_LOSSES:
                return self._ctc_loss(args, kwargs)
            if real is _FAILED:
                largest = self._largest_selection(func, args, kwargs)
                if largest is _FAILED:
                    raise
                return largest
            out = tree_map(lambda t: self._fake_of(t) if isinstance(t, torch.Tensor) else t, real)
            return out
        self._twin(func, args, kwargs, out)
        return out

    def _largest_selection(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """A selection by a boolean mask that has no twin (``boxes[fg]`` over the anchors of a detection loss), planned
        with every element of the mask True: the largest size it can have, so the plan is an upper bound. Only where
        :attr:`bound_selections` says so (the LightningModule's own code; a submodule runs for real instead, see
        :mod:`lightning_hbm.planner.tracing`); ``_FAILED`` for any other op."""
        if self.bound_selections is None or not self.bound_selections():
            return _FAILED
        if func is _aten.nonzero.default:
            mask = args[0]
            out = torch.empty((mask.numel(), mask.dim()), dtype=torch.long)
        elif func is _aten.masked_select.default:
            mask = args[1]
            out = torch.empty(torch.broadcast_shapes(args[0].shape, mask.shape).numel(), dtype=args[0].dtype)
        elif func is _aten.index.Tensor and any(_is_mask(i) for i in args[1]):
            mask = next(i for i in args[1] if _is_mask(i))
            # each mask of k dims selects with k index tensors, one entry per element (torch's own expansion)
            indices = [idx for i in args[1] for idx in ([torch.empty(i.numel(), dtype=torch.long)] * i.dim()
                                                         if _is_mask(i) else [i])]
            out = func(args[0], indices)
        else:
            return _FAILED
        self.selections[str(func)] = f"{str(func)} by a mask of {mask.numel():,} elements without real values"
        return out

    def _ctc_loss(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's CTC loss, which has no fake kernel: its outputs are the per-sample losses ``[batch]`` and ``log_alpha``
        ``[batch, time, 2 x the longest target + 1]`` (as the CPU and CUDA kernels allocate them), made from the target
        lengths' values: a list (``_ctc_loss.default``) or the twin of a tensor. Without a twin, the longest target is
        the targets' width (padded ``[batch, width]``) or their count (concatenated): the largest it can be, named in
        :attr:`selections` as a selection planned at its largest is. Its log-probabilities need no values (a
        CTC head's, computed from the model's weights, have no twin)."""
        log_probs, targets = args[0], args[1]
        lengths = args[3] if len(args) > 3 else kwargs["target_lengths"]
        if isinstance(lengths, FakeTensor):
            twin = self.twin(lengths)
            if twin is None:
                longest = targets.shape[-1] if targets.dim() == 2 else targets.numel()
                self.selections["aten._ctc_loss"] = (f"aten._ctc_loss: target lengths without real values, planned at the "
                                                     f"longest the targets allow ({longest})")  # fmt: skip
            else:
                with _disable_current_modes():
                    longest = int(twin.max()) if twin.numel() else 0
        else:
            longest = max(lengths, default=0)
        time, batch = log_probs.shape[0], log_probs.shape[1] if log_probs.dim() == 3 else 1
        with self.fake_mode:
            losses = torch.empty((batch,), dtype=log_probs.dtype, device=log_probs.device)
            log_alpha = torch.empty((batch, time, 2 * longest + 1), dtype=log_probs.dtype, device=log_probs.device)
        return losses, log_alpha

    def _read(self, func: Any, args: tuple, kwargs: dict) -> Any:
        real = self._run_real(func, args, kwargs)
        if real is not _FAILED:
            return real
        tensor = args[0]
        self.guessed.append(str(func.overloadpacket.__name__))
        if func is _aten._local_scalar_dense.default:
            return False if tensor.dtype == torch.bool else 0 if not tensor.is_floating_point() else 0.0
        return False

    def _fake_of(self, real: torch.Tensor) -> torch.Tensor:
        with self.fake_mode:
            fake = torch.empty_strided(real.size(), real.stride(), dtype=real.dtype, device="cpu")
        self.add(fake, real)
        return fake

    def _twin(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if isinstance(out, FakeTensor) and out.numel() > self.max_elements and not func._schema.is_mutable:
            return  # the common case in a real-size model, decided without flattening anything
        written = _written(func, args, kwargs)  # in-place ops (foreach ones return nothing)
        leaves = _leaves(out)
        outs = [t for t in leaves if isinstance(t, FakeTensor)]
        small = bool(outs or written) and all(t.numel() <= self.max_elements for t in (*outs, *written))
        real = self._run_real(func, args, kwargs) if small else _FAILED
        if real is _FAILED:
            for tensor in written:  # written without their twins: those are stale now
                self._forget(tensor)
            return
        for fake, twin in zip(leaves, _leaves(real)):
            if isinstance(fake, FakeTensor) and isinstance(twin, torch.Tensor):
                self.add(fake, twin)


#: Factories that copy the values of their ``data`` (a nested list may hold tensors: read element by element).
_DATA_FACTORIES = (torch.tensor, torch.as_tensor, torch.asarray)


class _FakeDataAsValues(TorchFunctionMode):
    """``torch.tensor(data)`` whose ``data`` is a list holding fake tensors reads their values through the dispatch.

    torch copies a tensor element of such a list from its memory, which a fake tensor does not have ("its data is not
    allocated yet"): transformers' Qwen2-VL ``get_rope_index`` builds ``torch.tensor([llm_positions.max() + 1 - n,
    ...])``. Each fake element becomes its values (``tolist``: :class:`RealValues` answers from the real twin, or
    guesses and counts it), in the elements' dtype when they share one, as torch would infer it.

    ``F.ctc_loss`` (``nn.CTCLoss``, ``torch.ctc_loss``) with its lengths as lists of ints (``input_lengths=[...]``, ``target_lengths=[...]``)
    gets them as tensors: its ``reduction='mean'`` (the default) makes a tensor of the target lengths in C++, from
    memory a fake tensor does not have (the same error; session 39). The tensors' overload computes the same loss.
    """

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.ctc_loss or func is F.ctc_loss:
            args, kwargs = _ctc_lengths_as_tensors(args, kwargs)
        if func in _DATA_FACTORIES and args and isinstance(args[0], (list, tuple)):
            leaves = tree_flatten(args[0])[0]
            fakes = [t for t in leaves if isinstance(t, FakeTensor)]
            if fakes:
                dtypes = {t.dtype for t in fakes}
                if "dtype" not in kwargs and len(dtypes) == 1 and len(fakes) == len(leaves):
                    kwargs = {**kwargs, "dtype": dtypes.pop()}
                args = (tree_map(lambda t: t.tolist() if isinstance(t, FakeTensor) else t, args[0]), *args[1:])
        return func(*args, **kwargs)


#: ``F.ctc_loss``'s and ``torch.ctc_loss``'s length arguments: (position, name)
_CTC_LENGTHS = ((2, "input_lengths"), (3, "target_lengths"))


def _ctc_lengths_as_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``F.ctc_loss``'s arguments with both lengths as ``long`` tensors where both are sequences of ints (torch
    takes both as lists or both as tensors); as they were otherwise."""
    given = [args[i] if i < len(args) else kwargs.get(name) for i, name in _CTC_LENGTHS]
    if not all(isinstance(g, (list, tuple)) for g in given):
        return args, kwargs
    positional, named = list(args), dict(kwargs)
    for (position, name), lengths in zip(_CTC_LENGTHS, given):
        tensor = torch.tensor(lengths, dtype=torch.long)
        if position < len(positional):
            positional[position] = tensor
        else:
            named[name] = tensor
    return tuple(positional), named


def _is_mask(index: Any) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


def _written(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    schema = func._schema
    if not schema.is_mutable:
        return []
    written: list[torch.Tensor] = []
    for position, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[position] if position < len(args) else kwargs.get(arg.name)
        written += [t for t in _leaves(value) if isinstance(t, FakeTensor)]
    return written


#: aten arguments that are leaves: what :meth:`RealValues._real_arguments` passes on as they are
_PLAIN_ARGUMENTS = (torch.Tensor, int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                    torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool)


def _leaves(value: Any) -> list:
    """``tree_flatten(value)[0]`` for what an aten op takes or returns (a tensor, a list or tuple of them), without
    pytree's cost on every op; anything else by pytree."""
    if isinstance(value, torch.Tensor) or value is None:
        return [value]
    if (type(value) is list or type(value) is tuple) and all(isinstance(v, torch.Tensor) or v is None for v in value):
        return list(value)
    return tree_flatten(value)[0]


def _view(tensor: torch.Tensor) -> tuple:
    return tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


__all__ = ["MAX_TWIN_ELEMENTS", "RealValues"]
