"""One training step recorded op by op: what is alive after every op, and what was running then.

``HBMProfiler``'s detailed steps already follow every live storage with a
:class:`~lightning_hbm.memory.LiveStorageTracker`, which keeps the live set at the peak only. :class:`StepRecorder`
runs on top of it (a second ``TorchDispatchMode``, entered after the tracker, so it sees every op the tracker sees,
just after the tracker recorded the op's outputs) and writes down, without classifying anything during the step:

- every storage the tracker holds, the moment it appears (the tracker's own record: bytes, phase, module, scope)
  and the moment it is released (a weak-reference callback on the storage);
- one sample after every op: how many of those events had happened, the op, where it ran (the innermost module of
  the forward, ``training_step`` outside it; in backward the module whose gradient nodes last started: a pre-hook on
  the node of each module's output names the module, one on the node of its input names the caller; otherwise the
  tensor the op works on, as in the optimizer step), and the phase of the step (set by the profiler's hooks).

:func:`lightning_hbm.profiling.figure.build_figure` classifies each storage once, after the step, with the
profiler's own peak classifier, and replays the events: every term at every sample, the peak's terms equal to the
profiler's row to the byte. Cost: a few microseconds per op and per storage on top of the tracker's, on detailed
steps only.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.optim import Optimizer
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.memory.categories import StorageKey, plain_tensors
from lightning_hbm.memory.storage import storage_key, storage_key_at, storages, tensor_storage_key
from lightning_hbm.memory.tracker import LiveStorageTracker, StorageRecord
from lightning_hbm.running import observing

#: The phases of a training step, in Lightning's order under automatic optimization (the loss is the forward's
#: tail, split off after the step: :func:`lightning_hbm.profiling.figure.build_figure`).
PHASES = ("forward", "loss", "zero_grad", "backward", "optimizer")
#: The creation phase of the storages alive when the step started (parameters, previous gradients, states, batch).
BEFORE = "before the step"
#: Where a forward op ran outside any module: the LightningModule's ``training_step`` code (the loss, usually).
TRAINING_STEP = "training_step (outside forward)"


class Entry(NamedTuple):
    """One storage of the step (a storage key is reused once its storage dies: each life is its own entry)."""

    key: StorageKey
    record: StorageRecord  # the tracker's record: bytes, tracker phase, module, scope
    phase: str  # the step's phase when it appeared (:data:`BEFORE` for those alive at the start)
    recomputed: bool  # created by a forward run inside backward (activation checkpointing's recomputation)
    sample: int  # the sample of the op that created it (0 for those alive at the start)


class Sample(NamedTuple):
    """The step just after one op (or at a phase boundary, ``op`` empty)."""

    events: int  # how many entries of :attr:`RecordedStep.events` had happened
    op: str  # the aten op (``aten.mm.default``), "" at a phase boundary
    where: str  # module (forward), "backward of <module>", "<tensor name>" (optimizer) or ""
    segment: int  # index into :attr:`RecordedStep.segments`
    created: int  # the first entry the op created, -1 when it created none


@dataclass
class RecordedStep:
    """What :class:`StepRecorder` wrote: entries, their appear/release events, the samples and the phases.

    ``events`` holds ``i`` when entry ``i`` appeared and ``~i`` (a negative number) when it was released.
    ``segments`` are ``(phase, first sample)`` in the order the phases began. ``last_leaf_end`` is the sample at which
    the forward's last leaf module returned (what follows is the loss on the logits); ``cuda_allocated`` the CUDA
    allocator's allocated bytes at every sample (None off CUDA).
    """

    entries: list[Entry] = field(default_factory=list)
    events: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    segments: list[tuple[str, int]] = field(default_factory=list)
    last_leaf_end: Optional[int] = None
    cuda_allocated: Optional[list[int]] = None


class StepRecorder(TorchDispatchMode):
    """Record a step op by op on top of a peak-tracking ``tracker``; see the module's docstring.

    Args:
        tracker: the detailed step's tracker (``track_peak=True``), seeded and entered before :meth:`start`.
        module: the LightningModule (its submodules name where each op ran).
        optimizers: its optimizers (their states name the optimizer step's ops).
        cuda_device: sample the CUDA allocator's allocated bytes after every op on this device (None: no).

    Raises:
        ValueError: ``tracker`` does not track its peak (then it does not follow releases).
    """

    def __init__(
        self, tracker: LiveStorageTracker, module: nn.Module, optimizers: Sequence[Optimizer] = (),
        cuda_device: Optional[torch.device] = None,
    ) -> None:
        if not tracker.track_peak:
            raise ValueError("StepRecorder needs a LiveStorageTracker(track_peak=True): only then are releases followed.")
        super().__init__()
        self.tracker = tracker
        self.module = module
        self.optimizers = list(optimizers)
        self.cuda_device = cuda_device
        self.recorded = RecordedStep(cuda_allocated=[] if cuda_device is not None else None)
        self._known: dict[StorageKey, StorageRecord] = {}
        self._entry_at: dict[StorageKey, int] = {}  # the entry of each known storage, by key
        self._gone: set[int] = set()  # entries released by a resize (their storage lives on, resized)
        self._refs: list[weakref.ref] = []  # kept alive so that their callbacks fire
        self._names: dict[StorageKey, str] = {}  # parameter, gradient, state storages -> a name (the optimizer's ops)
        self._stack: list[str] = []  # modules running now (forward, or a recomputation in backward)
        self._backward_module = ""
        self._claimed: set[int] = set()  # id() of gradient nodes already given to an (inner) module
        self._handles: list[Any] = []
        self._phase = ""
        self._open = False

    # -- lifecycle -----------------------------------------------------------------------------------
    def start(self) -> None:
        """Take the tracker's live storages as the step's start, hook the modules and enter (phase ``forward``)."""
        for key, record in list(self.tracker.live.items()):
            storage = record.ref()
            if storage is not None:
                self._add(key, record, storage, BEFORE)
        for name, sub in self.module.named_modules():
            label = name or "<root>"
            self._handles.append(sub.register_forward_pre_hook(self._push(label)))
            leaf = next(sub.children(), None) is None
            self._handles.append(sub.register_forward_hook(self._pop(leaf), always_call=True))
        self._open = True
        self.enter_phase("forward")
        torch_compat.add_resize_listener(self._resized)  # after the tracker's: it has recorded the new size
        self.__enter__()

    def enter_phase(self, phase: str) -> None:
        """A phase of the step begins now (the profiler's hooks); a boundary sample marks it."""
        if not self._open or phase == self._phase:
            return
        self._phase = phase
        if phase == "optimizer":  # its ops run outside any module: named by the tensors they work on
            self._names = tensor_names(self.module, self.optimizers)
        self.recorded.segments.append((phase, len(self.recorded.samples)))
        self._sample("", "", -1)

    def stop(self) -> RecordedStep:
        """Exit (before the tracker exits), drop the hooks and return what was recorded; a last sample ends it."""
        if self._open:
            self._sample("", "", -1)
            self.__exit__(None, None, None)
            torch_compat.remove_resize_listener(self._resized)
            self._open = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._claimed.clear()
        return self.recorded

    # -- recording -----------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        out = func(*args, **(kwargs or {}))  # the tracker, below this mode, records the outputs first
        if func.namespace == "profiler":  # Lightning's record_function markers: no memory, not an op of the step
            return out
        created = -1
        for tensor in (out,) if type(out) is torch.Tensor else tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                index = self._note(tensor)
                created = index if created < 0 else created
        self._sample(str(func), self._where(args), created)
        return out

    def _note(self, tensor: torch.Tensor) -> int:
        """The first new entry among ``tensor``'s storages (-1: none is new)."""
        first = -1
        for plain in plain_tensors(tensor):
            if plain.is_meta or plain.is_sparse:
                continue
            storage = plain.untyped_storage()
            key = storage_key(storage)
            record = self.tracker.live.get(key)
            if record is None or self._known.get(key) is record:
                continue  # not tracked (empty), or a view of a storage already known
            index = self._add(key, record, storage, self._phase)
            first = index if first < 0 else first
        return first

    def _add(self, key: StorageKey, record: StorageRecord, storage: Any, phase: str) -> int:
        entries = self.recorded.entries
        index = len(entries)
        recomputed = phase == "backward" and bool(self._stack)
        entries.append(Entry(key, record, phase, recomputed, len(self.recorded.samples)))
        self._known[key] = record
        self._entry_at[key] = index
        self._refs.append(weakref.ref(storage, self._released(index)))
        self.recorded.events.append(index)
        return index

    def _released(self, index: int) -> Callable[[Any], None]:
        def callback(_: Any) -> None:
            if self._open and index not in self._gone:
                self.recorded.events.append(~index)

        return callback

    def _resized(self, storage: torch.UntypedStorage, data_ptr: int, nbytes: int) -> None:
        """A storage was resized (FSDP2's reshard and all-gather, as the tracker follows them): its entry is released,
        the new size, if any, is a new entry; a sample marks it."""
        if not self._open:
            return
        old = storage_key_at(storage, data_ptr)
        index = self._entry_at.get(old) if nbytes else None
        if index is not None and index not in self._gone:
            self._gone.add(index)
            self.recorded.events.append(~index)
            self._known.pop(old, None)
            self._entry_at.pop(old, None)
        created = -1
        key = storage_key(storage)
        record = self.tracker.live.get(key) if storage.nbytes() else None
        if record is not None and self._known.get(key) is not record:
            created = self._add(key, record, storage, self._phase)
        self._sample("resize_", self._where(()), created)

    def _sample(self, op: str, where: str, created: int) -> None:
        recorded = self.recorded
        segment = len(recorded.segments) - 1
        recorded.samples.append(Sample(len(recorded.events), op, where, segment, created))
        if recorded.cuda_allocated is not None:
            recorded.cuda_allocated.append(torch.cuda.memory_allocated(self.cuda_device))

    def _where(self, args: Iterable[Any]) -> str:
        if self._stack:
            return self._stack[-1]
        if self._phase == "backward" and self._backward_module:
            return f"backward of {self._backward_module}"
        if self._phase == "forward":
            return TRAINING_STEP
        for leaf in tree_leaves(args):  # outside any module (the optimizer step): the parameter it works on
            if isinstance(leaf, torch.Tensor) and not leaf.is_meta:
                key = tensor_storage_key(leaf)  # a DTensor's local shard (FSDP2)
                name = self._names.get(key) if key is not None else None
                if name is not None:
                    return name
        return ""

    # -- module scope --------------------------------------------------------------------------------
    def _push(self, label: str) -> Callable[..., None]:
        @observing  # LoRAForward still fuses a lora_B the recorder watches: the recorded step is the step unrecorded
        def hook(module: nn.Module, args: Any) -> None:
            if self._phase == "forward" and torch.is_grad_enabled():
                # the node that made this module's input is the caller's own code (a functional op between two
                # submodules): in backward, it runs once this module's backward is done
                self._claim_gradient_nodes(self._stack[-1] if self._stack else TRAINING_STEP, args)
            self._stack.append(label)

        return hook

    def _pop(self, leaf: bool) -> Callable[..., None]:
        @observing
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            label = self._stack.pop() if self._stack else ""
            if leaf and self._phase == "forward":
                self.recorded.last_leaf_end = len(self.recorded.samples)
            if self._phase == "forward" and torch.is_grad_enabled():
                self._claim_gradient_nodes(label, output)

        return hook

    def _claim_gradient_nodes(self, label: str, tensors: Any) -> None:
        """In backward, ``label``'s code begins when the gradient node of one of ``tensors`` starts (its output's; for
        a caller, the node of a submodule's input): a pre-hook there names it. The first claim of a node holds (the
        innermost module, which returns first, claims the output node its parents share)."""
        for tensor in tree_leaves(tensors):
            node = tensor.grad_fn if isinstance(tensor, torch.Tensor) else None
            if node is None or id(node) in self._claimed:
                continue
            self._claimed.add(id(node))
            node.register_prehook(self._entering_backward(label))

    def _entering_backward(self, label: str) -> Callable[..., None]:
        def prehook(grad_outputs: Any) -> None:
            if self._open:
                self._backward_module = label

        return prehook


def tensor_names(module: nn.Module, optimizers: Sequence[Optimizer]) -> dict[StorageKey, str]:
    """Storage -> name of every parameter of ``module``, its gradient (``<name>.grad``) and optimizer state
    (``<name> (exp_avg)``), so that an op outside any module is named by the tensor it works on."""
    names: dict[StorageKey, str] = {}
    params = {id(p): n for n, p in module.named_parameters()}
    for name, param in module.named_parameters():
        for tensor, label in ((param, name), (param.grad, f"{name}.grad")):
            if tensor is not None and not tensor.is_meta and tensor.numel():
                for key, _ in storages([tensor]):  # a DTensor shard (FSDP2) has no storage of its own: its local one
                    names.setdefault(key, label)
    for optimizer in optimizers:
        for param, state in lightning_compat.unwrap_optimizer(optimizer).state.items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor) and id(param) in params and value.numel() and not value.is_meta:
                    for storage, _ in storages([value]):
                        names.setdefault(storage, f"{params[id(param)]} ({key})")
    return names


__all__ = ["BEFORE", "PHASES", "TRAINING_STEP", "Entry", "RecordedStep", "Sample", "StepRecorder", "tensor_names"]
