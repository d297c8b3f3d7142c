"""A checkpointed block's recompute sees the state its forward saw: the buffers a training forward changes in place.

Two kinds of layer change buffers in a training forward. BatchNorm updates its running statistics (``running_mean``,
``running_var``, ``num_batches_tracked``; InstanceNorm too with ``track_running_stats=True``); spectral_norm computes
its weight by one step of a power iteration that updates its buffers ``_u``, ``_v``. Recomputed in the backward, the
block did it a second time: BatchNorm's momentum was applied twice per step (a two-block Conv-BN LoRA net, 4 steps:
``num_batches_tracked`` 8 instead of 4, ``running_var`` 0.18 away from the run without checkpointing, so the eval-mode
model differed), and spectral_norm's recompute divided by another estimate of the largest singular value than its
forward (the gradients were not those of the loss computed: adapters up to 0.015 apart after 4 AdamW steps at lr
1e-2). Here the recompute starts from the values the forward started from (of the buffers it reads: a norm's
statistics are only updated in training), and the values the forward left are put back after it: the run is the one
without checkpointing, bit for bit (``tests/activations/test_replay.py``,
``tests/adapters/lora/test_merge_parametrized.py``).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor, nn
from torch.nn.modules.module import register_module_buffer_registration_hook

from lightning_hbm._compat import torch as torch_compat

#: bytes up to which a buffer outside torch's norms is copied on a block's first training forward, before it is known
#: whether the forward writes it
PROBE_BYTES = 1 << 20

#: block -> names of the buffers outside torch's norms and parametrizations its training forward writes in place,
#: learnt on its first training forward (:class:`ForwardState`); weak, a dropped model takes its entry with it
_WRITTEN: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()

#: block -> names of the buffers outside torch's norms its first training forward did not write: watched (their version
#: counters) on later training forwards, since a buffer first written at a later step (an average started after a
#: warm-up) was updated twice per step from then on, its recompute reading the updated value, silently (session 29)
_UNWRITTEN: weakref.WeakKeyDictionary[nn.Module, list[str]] = weakref.WeakKeyDictionary()


class ForwardState:
    """The buffers of ``block`` that its training forward changes, those it also reads as the forward is about to
    find them (none: nothing is copied).

    Torch's norms and parametrizations are known by their type (:func:`training_buffers`). Any other buffer a
    forward writes in place (a norm from another library or the user's own, keeping running statistics with
    ``register_buffer``: its statistics were updated twice per step, and the recompute read other values than the
    forward, gradients 8.6 apart in ``tests/activations/test_replay.py``) is found by running: on the block's first
    training forward every other buffer is copied and the ones whose version moved are kept, by name, for the later
    steps (treated as read: the recompute starts from the forward's values, the forward's end values are put back).
    A buffer the forward replaces (``self.count = self.count + 1``) is warned about by name: it cannot be replayed.
    A buffer the forward creates (``register_buffer(name, None)`` then assigned, or registered on the first batch) is
    seen by torch's buffer registration hook at any step: the recompute finds it as the forward did (None or absent)
    and it is replayed from the next step on; one first written at a later step than the first (watched by its version
    counter) is put back after that step's recompute, said, and replayed from the next step on (session 29: both were
    updated twice per step and read updated by the recompute, silently).
    """

    def __init__(self, block: nn.Module) -> None:
        # Looked up at each forward, not kept from the last one: a move to another device or dtype replaces the
        # buffers, and a block can gain a BatchNorm through ``Sequential.insert``, which no registration hook sees.
        found = torch_compat.training_buffers(block)
        self.block = block
        known = _WRITTEN.get(block)
        self.probe: Optional[list[tuple[str, Tensor, int]]] = None
        # Learnt from the first training forward only, not from a forward in eval mode with gradients before it (a
        # saliency map, a gradient penalty measured first): a norm updates its statistics only in training, "writes
        # none" was learnt there and its statistics were then updated twice per training step. An eval forward before
        # it is probed for itself.
        self.training = any(m.training for m in block.modules())
        if known is None:  # the first training forward: which other buffers does it write? (see replayed)
            typed = {id(b) for b in (*found.read, *found.updated)}
            self.probe = [(name, b, b._version) for name, b in block.named_buffers() if id(b) not in typed]
            # copied only up to PROBE_BYTES each (a running statistic is a few KiB): a large buffer the first forward
            # writes is put back after that step's recompute, and replayed exactly from the next step on
            extra = [b for _, b, _ in self.probe if b.numel() * b.element_size() <= PROBE_BYTES]
        else:
            extra = [b for name in known for b in [_buffer(block, name)] if b is not None]
        self.updated = found.updated
        # Only what the forward reads is copied here: a BatchNorm in training normalizes by the batch's statistics,
        # so its recompute needs no restart, only its second update undone (half the copies: the replay's own time
        # inside an EfficientNet-B0's CPU step, 144 buffers, went from 1.8-2.0 % to 1.2-1.3 %, benchmarks/README.md).
        self.read = [*found.read, *extra]
        self.buffers = [*self.read, *found.updated]
        with torch.no_grad():
            self.before = [b.clone() for b in self.read]
        #: buffers its forward creates (None or absent before, a tensor assigned): their slot, whether it held None, the
        #: tensor the forward left (a norm creating its statistics on its first batch: the recompute found them and took
        #: the other branch, updating them a second time; never learnt, twice per step from then on, session 29)
        self.created: list[tuple[nn.Module, str, bool, str]] = []
        self.watched = [(name, b, b._version) for name in _UNWRITTEN.get(block, ()) for b in [_buffer(block, name)] if b is not None]

    def _learn(self) -> None:
        """After the first training forward: keep only the probed buffers it wrote; warn about those it replaced."""
        assert self.probe is not None
        written = [(name, b) for name, b, version in self.probe if b._version != version]
        replaced = [name for name, b, _ in self.probe if _buffer(self.block, name) is not b]
        if replaced:
            warnings.warn(
                f"lightning_hbm: {type(self.block).__name__}'s training forward replaces its buffer(s) "
                f"{', '.join(replaced[:5])} (a new tensor assigned): the checkpoint's recompute in the backward "
                f"updates them a second time, and cannot replay them. Update them in place "
                f"(self.{replaced[0].rsplit('.', 1)[-1]}.copy_(...) or add_), or leave {type(self.block).__name__} "
                f"out of ActivationCheckpointing(blocks=...).",
                stacklevel=4,
            )
        if self.training:
            _WRITTEN[self.block] = [name for name, _ in written]
            _UNWRITTEN[self.block] = [name for name, b, version in self.probe if b._version == version and _buffer(self.block, name) is b]
        keep, probed = {id(b) for _, b in written}, {id(b) for _, b, _ in self.probe}
        pairs = [(b, v) for b, v in zip(self.read, self.before) if id(b) not in probed or id(b) in keep]
        self.read, self.before = [b for b, _ in pairs], [v for _, v in pairs]
        copied = {id(b) for b in self.read}
        self.updated = [*self.updated, *(b for _, b in written if id(b) not in copied)]  # large: only put back
        self.buffers, self.probe = [*self.read, *self.updated], None

    @contextmanager
    def replayed(self, recompute: bool) -> Iterator[None]:
        """Around a call of the block: the recompute (``recompute``) runs from the forward's starting values of what
        it reads, and the values the forward left are put back after it."""
        if not recompute:
            handle = register_module_buffer_registration_hook(self._creating)
            try:
                yield
            finally:
                handle.remove()
            if self.probe is not None:
                self._learn()
            self._first_written()
            return
        with self._as_before_created():
            if not self.buffers:
                yield
                return
            # outside the recompute's dispatch modes: the selective policy's would find copies its forward never made
            with torch_compat.dispatch_modes_off(), torch.no_grad():
                after = [b.clone() for b in self.buffers]
                for buffer, value in zip(self.read, self.before):
                    buffer.copy_(value)
            try:
                yield
            finally:
                with torch_compat.dispatch_modes_off(), torch.no_grad():
                    for buffer, value in zip(self.buffers, after):
                        buffer.copy_(value)

    def _creating(self, module: nn.Module, name: str, tensor: Optional[Tensor]) -> None:
        """The global buffer registration hook during the block's forward: a buffer of the block created (its slot
        None or absent before) is noted, with its name in the block."""
        if tensor is None or module._buffers.get(name) is not None:
            return  # a buffer replaced is warned about by name (:meth:`_learn`)
        prefix = next((n for n, m in self.block.named_modules() if m is module), None)
        if prefix is not None:
            self.created.append((module, name, name in module._buffers, f"{prefix}.{name}" if prefix else name))

    def _first_written(self) -> None:
        """After a training forward: the buffers it created, and those written for the first time since the block's
        first training forward, replayed exactly from the next step on; this step's recompute puts the values the
        forward left back after it (a buffer first written now was not copied before it)."""
        moved = [(name, b) for name, b, version in self.watched if b._version != version]
        if not (self.training and (moved or self.created)):
            return
        written = _WRITTEN.setdefault(self.block, [])
        # each name once: a buffer slot a forward fills and empties at every step (a scratch space) is created again
        # at each (was: its name appended at every step, the list, read at every forward, growing without end)
        written.extend(dict.fromkeys(n for n in [*(name for name, _ in moved), *(c[3] for c in self.created)] if n not in written))
        _UNWRITTEN[self.block] = [name for name in _UNWRITTEN.get(self.block, ()) if name not in {n for n, _ in moved}]
        self.updated = [*self.updated, *(b for _, b in moved)]
        self.buffers = [*self.read, *self.updated]
        if moved:
            names = ", ".join(name for name, _ in moved[:5])
            warnings.warn(
                f"lightning_hbm: {type(self.block).__name__}'s training forward wrote its buffer(s) {names} for the first "
                "time since its first training step (a statistic started after a warm-up): this step's checkpoint "
                "recompute reads the value its forward left, not the one it started from (this step's gradients through "
                "it are approximate; not updated twice), and from the next step on it is replayed exactly. Write it "
                "(even unchanged, buffer.add_(0)) from the first training step, or leave "
                f"{type(self.block).__name__} out of ActivationCheckpointing(blocks=...).",
                stacklevel=4,
            )

    @contextmanager
    def _as_before_created(self) -> Iterator[None]:
        """The recompute finds the buffers the forward created as the forward did (None, or no such buffer), and
        the forward's are put back after it (the recompute creates its own, as the forward did)."""
        left = [(module, name, module._buffers.get(name)) for module, name, _, _ in self.created]
        for module, name, held_none, _ in self.created:
            if held_none:
                module._buffers[name] = None
            else:
                module._buffers.pop(name, None)
        try:
            yield
        finally:
            for module, name, tensor in left:
                module._buffers[name] = tensor


def _buffer(block: nn.Module, name: str) -> Optional[Tensor]:
    module, _, leaf = name.rpartition(".")
    owner = block.get_submodule(module) if module else block
    return owner._buffers.get(leaf)


__all__ = ["ForwardState"]
