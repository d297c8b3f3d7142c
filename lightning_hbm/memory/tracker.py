"""Live tensor storages, tracked by a ``TorchDispatchMode``: the measurement behind activations and peaks.

Why by hand: on CPU there is no allocator to ask, ``saved_tensors_hooks`` miscount under
activation checkpointing (checkpoint installs its own hooks), and torch's private ``MemTracker``
refuses frozen parameters and labels everything "OPT" inside Lightning (shared notes). Recording
a weak reference to the storage of every op output (checked when read, or with a callback when
it dies where peaks are wanted) gives exact live bytes on any device and works with
checkpointing, bitsandbytes and peft layers. Cost: Python dispatch runs for every op while the
tracker is active (~10-25 us per op on the CPU dev machine).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.memory.categories import StorageKey, plain_tensors
from lightning_hbm.memory.storage import storage_key, storage_key_at
from lightning_hbm.memory.terms import scope_terms, term
from lightning_hbm.running import RunningModules


class StorageRecord(NamedTuple):
    """What the tracker knows about one live storage."""

    ref: weakref.ref
    nbytes: int
    phase: str  # the tracker's ``phase`` when the storage was first seen
    module: str  # innermost module running then ("" outside any, or without module tracking)
    scope: str = ""  # the innermost :func:`memory_scope` then (e.g. ``LOSS_SCOPE``)


#: The scope of what ``FusedLoss`` allocates (chunk logits, the fp32 rows being softmaxed, a dequantized head): the loss term.
LOSS_SCOPE = term("loss").name
_SCOPES: list[str] = []


@contextmanager
def memory_scope(name: str) -> Iterator[None]:
    """Label every storage created inside (by any tracker) with ``name``: a term reported next to the categories.

    A term is not a sixth category: its bytes stay in the category their owner gives them (an unowned chunk of
    logits is an activation or ``other``), so the five categories still sum to the total.
    """
    _SCOPES.append(name)
    try:
        yield
    finally:
        _SCOPES.pop()


def scoped_bytes(records: dict[StorageKey, StorageRecord], scope: str, owned: Iterable[StorageKey] = ()) -> int:
    """Bytes of the ``records`` created in ``scope``, less those a parameter, gradient or optimizer state owns now
    (a dead record's key may have been reused: it counts)."""
    owned = set(owned)
    return sum(r.nbytes for key, r in records.items() if r.scope == scope and not (key in owned and r.ref() is not None))


def scope_term_bytes(records: dict[StorageKey, StorageRecord], owned: Iterable[StorageKey] = ()) -> dict[str, int]:
    """``{term: bytes}`` of every scope term of the registry (:func:`~lightning_hbm.memory.terms.scope_terms`, registered
    ones included), each the :func:`scoped_bytes` of its :func:`memory_scope`, in registry order."""
    owned = set(owned)
    return {t.name: scoped_bytes(records, t.name, owned) for t in scope_terms()}


class LiveStorageTracker(TorchDispatchMode):
    """Records the storage of every tensor an op creates while active, and forgets it when it dies.

    Use as a context manager (or ``__enter__``/``__exit__`` across hooks). :meth:`seed` adds storages
    that existed before (parameters, gradients, optimizer states) so that :attr:`peak_bytes` is the
    peak of everything the step holds. Storages are deduplicated (views share their base's record).

    Args:
        track_peak: follow every release (a weak-reference callback per storage) to keep
            :attr:`live_bytes`, :attr:`peak_bytes` and :attr:`peak_records`, the live set at the peak.
            Costs ~15 us per new storage plus a copy of the live set at each new peak's end: for
            detailed steps. Without it, liveness is checked only when read (:meth:`live_records`).
    """

    def __init__(self, track_peak: bool = False) -> None:
        super().__init__()
        self.track_peak = track_peak
        self.phase = "forward"
        # with track_peak exactly the live storages; without, released ones linger until read
        self.live: dict[StorageKey, StorageRecord] = {}
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_records: dict[StorageKey, StorageRecord] = {}
        self._peak_pending = False  # a new peak was reached and not copied yet
        self._running: Optional[RunningModules] = None  # attach_modules: the modules running, innermost last
        self._module_names: dict[int, str] = {}  # their names, by id

    # -- recording -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        device = torch_compat.fake_device(func, args)  # a device query, most calls on fake tensors: nothing created
        if device is not None:
            return device
        out = func(*args, **(kwargs or {}))
        if type(out) is torch.Tensor:  # the common case, without pytree's cost
            self._record_plain(out, self.phase)
        else:
            for leaf in tree_leaves(out):
                if isinstance(leaf, torch.Tensor):
                    self._record(leaf, self.phase)
        return out

    def seed(self, tensors: Iterable[torch.Tensor], phase: str) -> None:
        """Track storages that already exist (e.g. ``phase="parameters"``), counting them as live."""
        for tensor in tensors:
            self._record(tensor, phase)

    def _record(self, tensor: torch.Tensor, phase: str) -> None:
        for plain in plain_tensors(tensor):
            self._record_plain(plain, phase)

    def _record_plain(self, tensor: torch.Tensor, phase: str) -> None:
        if tensor.is_meta or tensor.is_sparse:
            return
        self._record_storage(tensor.untyped_storage(), phase)

    def _record_storage(self, storage: torch.UntypedStorage, phase: str) -> None:
        nbytes = storage.nbytes()
        if nbytes == 0:
            return
        key = storage_key(storage)
        known = self.live.get(key)
        # With callbacks a known key is alive; without, its storage may have died and the address
        # been reused by this new one.
        if known is not None and (self.track_peak or known.ref() is not None):
            return
        running = self._running.stack if self._running is not None else None
        module = self._module_names[id(running[-1])] if running else ""
        scope = _SCOPES[-1] if _SCOPES else ""
        if not self.track_peak:
            self.live[key] = StorageRecord(weakref.ref(storage), nbytes, phase, module, scope)
            return
        # torch keeps one Python object per storage alive as long as the storage, so a weak
        # reference's callback tells exactly when the bytes are released.
        ref = weakref.ref(storage, self._released(key))
        self.live[key] = StorageRecord(ref, nbytes, phase, module, scope)
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
            self._peak_pending = True

    def _released(self, key: StorageKey) -> Callable[[Any], None]:
        def callback(ref: Any) -> None:
            record = self.live.get(key)
            if record is not None and record.ref is ref:  # not a storage resized away from ``key`` since
                self._forget(key, record)

        return callback

    def _forget(self, key: StorageKey, record: StorageRecord) -> None:
        """``record``'s bytes are released now."""
        if self.track_peak:
            if self._peak_pending:  # the live set just before the first release after a new peak
                self.peak_records = dict(self.live)
                self._peak_pending = False
            self.live_bytes -= record.nbytes
        del self.live[key]

    def _resized(self, storage: torch.UntypedStorage, data_ptr: int, nbytes: int) -> None:
        """``storage.resize_`` ran (FSDP2 frees a unit's gathered parameters with ``resize_(0)`` and allocates them
        again with ``resize_(n)``; no dispatch mode sees it): its bytes at ``data_ptr`` are released, and the new ones,
        if any, are a storage created now, in the phase, module and scope running."""
        if nbytes:
            key = storage_key_at(storage, data_ptr)
            record = self.live.get(key)
            if record is not None and record.ref() is storage:
                self._forget(key, record)
        self._record_storage(storage, self.phase)

    def __enter__(self) -> LiveStorageTracker:
        torch_compat.add_resize_listener(self._resized)
        try:
            return super().__enter__()
        except BaseException:
            torch_compat.remove_resize_listener(self._resized)
            raise

    def __exit__(self, *args: Any) -> None:
        try:
            super().__exit__(*args)
        finally:
            torch_compat.remove_resize_listener(self._resized)

    def finish_peak(self) -> None:
        """Copy the live set if the peak is now (no storage released since it was reached)."""
        if self._peak_pending:
            self.peak_records = dict(self.live)
            self._peak_pending = False

    def reset_peak(self) -> None:
        """Start a new peak from what is live now (e.g. per phase of a step)."""
        self.finish_peak()
        self.peak_bytes = self.live_bytes
        self.peak_records = dict(self.live)
        self._peak_pending = False

    # -- reading -------------------------------------------------------------------------------
    def live_records(self) -> dict[StorageKey, StorageRecord]:
        """The tracked storages alive now."""
        return {k: r for k, r in self.live.items() if r.ref() is not None}

    def live_storages(self, phase: Optional[str] = None) -> dict[StorageKey, int]:
        """``{key: bytes}`` of the tracked storages alive now (only those first seen in ``phase``)."""
        return {k: r.nbytes for k, r in self.live_records().items() if phase is None or r.phase == phase}

    # -- module attribution (detailed mode) --------------------------------------------------------
    def attach_modules(self, module: nn.Module) -> None:
        """Tag storages with the innermost submodule of ``module`` running when they are created (one model at a
        time: attaching again detaches the previous one)."""
        self.detach_modules()
        self._module_names = {id(sub): name or "<root>" for name, sub in module.named_modules()}
        self._running = RunningModules(module).__enter__()  # left by detach_modules

    def detach_modules(self) -> None:
        if self._running is not None:
            self._running.__exit__(None, None, None)
        self._running = None
        self._module_names = {}


__all__ = ["LOSS_SCOPE", "LiveStorageTracker", "StorageRecord", "memory_scope", "scope_term_bytes", "scoped_bytes"]
