"""The offload hooks of ``ActivationCheckpointing(offload=...)``: what autograd saves, moved off the device and back.

:class:`OffloadSavedTensors` (saved-tensor hooks) copies each checkpointed block's saved inputs to the target device
in the forward and brings them back in the backward, prefetching the next one; from CUDA the host copy is pinned and
made on a side stream, stored in power-of-two pieces (:func:`pinned_pieces`, :class:`_Pieces`) so that torch's pinned
allocator rounds it by less than :data:`PIECE_BYTES`; :func:`host_footprint` is what such a copy takes (the planner
counts it). :mod:`lightning_hbm.activations.recompute` gives a block these hooks.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union, cast

import torch
from torch import Tensor, nn

#: the smallest pinned piece of a large host copy (see :func:`pinned_pieces`): a copy wastes less than this to rounding.
PIECE_BYTES = 2 << 20


def _one_request(nbytes: int) -> int:
    """Host bytes torch's pinned allocator takes for one request of ``nbytes`` (> 0): the next power of two."""
    return 1 << (nbytes - 1).bit_length()


def pinned_pieces(nbytes: int) -> list[int]:
    """Byte sizes of the pinned pieces a host copy of ``nbytes`` is stored in: powers of two, largest first.

    torch's ``CachingHostAllocator`` rounds every pinned allocation up to a power of two (``PowerOf2Ceil`` in
    ``ATen/core/CachingHostAllocator.h``, unless the process sets ``pinned_max_round_threshold_mb``): one 6.8 GiB
    block input would pin 8 GiB, 32 of them 256 GiB instead of 218. So a copy larger than :data:`PIECE_BYTES` is
    stored as the binary decomposition of its size (rounded up to a multiple of :data:`PIECE_BYTES`): every piece is
    a power of two the allocator takes as asked, at most one per bit of the size (13 for 8 GiB), and the waste is
    under 2 MiB a copy. Written by hand because the allocator's threshold is a process-wide setting: setting it would
    change every other pinned allocation of the user's process. A copy of at most :data:`PIECE_BYTES` is one piece,
    rounded as the allocator rounds it.
    """
    if nbytes <= 0:
        return []
    if nbytes <= PIECE_BYTES:
        return [_one_request(nbytes)]
    total = -(-nbytes // PIECE_BYTES) * PIECE_BYTES
    return [1 << bit for bit in reversed(range(total.bit_length())) if total >> bit & 1]


def pinned_footprint(nbytes: int) -> int:
    """Host bytes a pinned host copy of ``nbytes`` takes: the sum of its :func:`pinned_pieces` (within 2 MiB of
    ``nbytes`` above :data:`PIECE_BYTES`; the next power of two up to it)."""
    return sum(pinned_pieces(int(nbytes)))


def _memory_order(tensor: Tensor) -> Optional[list[int]]:
    """The order of ``tensor``'s dimensions in memory, outermost first, when its elements fill their span once (contiguous,
    channels-last, a transpose: the permutation is a contiguous view); ``None`` for overlapping (expanded) or gapped
    (sliced) ones."""
    strides = tensor.stride()
    order = sorted(range(tensor.dim()), key=lambda d: -strides[d])
    return order if tensor.permute(order).is_contiguous() else None


class _Pieces:
    """A host copy stored as pinned pieces (:func:`pinned_pieces`): flat tensors of the copy's dtype, in order; the
    last may hold a few elements more than the copy. The elements are stored in the tensor's memory order and restored
    with its strides: a channels-last block input (a conv net's, on a GPU) came back contiguous, and was pinned in
    one power-of-two request (up to twice its bytes)."""

    __slots__ = ("dtype", "order", "pieces", "shape", "stride")

    def __init__(self, tensor: Tensor, device: torch.device, pin: bool) -> None:
        order = _memory_order(tensor)
        if order is None:
            raise ValueError(f"a tensor of shape {tuple(tensor.shape)} and strides {tensor.stride()} overlaps or has gaps: copy it whole")
        self.shape, self.dtype, self.stride, self.order = tensor.shape, tensor.dtype, tensor.stride(), order
        size = tensor.element_size()
        sizes = pinned_pieces(tensor.numel() * size)
        self.pieces = [torch.empty(max(1, n // size), dtype=tensor.dtype, device=device, pin_memory=pin) for n in sizes]

    def spans(self) -> list[tuple[int, int, Tensor]]:
        """(start, end, piece) of each piece over the flat copy."""
        numel, start, spans = self.shape.numel(), 0, []
        for piece in self.pieces:
            end = min(numel, start + piece.numel())
            spans.append((start, end, piece))
            start = end
        return spans

    def fill(self, tensor: Tensor, non_blocking: bool = False) -> None:
        flat = tensor.permute(self.order).reshape(-1)  # a view: the permutation is contiguous
        for start, end, piece in self.spans():
            piece[: end - start].copy_(flat[start:end], non_blocking=non_blocking)

    def restore(self, device: torch.device, non_blocking: bool = False) -> Tensor:
        restored = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device=device)
        flat = restored.permute(self.order).view(-1)
        for start, end, piece in self.spans():
            flat[start:end].copy_(piece[: end - start], non_blocking=non_blocking)
        return restored


def host_footprint(tensor: Tensor) -> int:
    """Pinned host bytes the offload's copy of ``tensor`` takes: :func:`pinned_footprint` of its bytes when its
    elements fill their span once (stored in pieces, in memory order); the next power of two otherwise (an expanded or
    sliced tensor: one pinned tensor, splitting it would need a contiguous device copy first)."""
    nbytes = tensor.numel() * tensor.element_size()
    return pinned_footprint(nbytes) if _memory_order(tensor) is not None else _one_request(nbytes)


def _pinned_copy(tensor: Tensor, device: torch.device) -> Union[Tensor, _Pieces]:
    """``tensor`` copied (asynchronously) into pinned memory on ``device``, as :func:`host_footprint` counts it."""
    if _memory_order(tensor) is not None:
        pieces = _Pieces(tensor, device, pin=True)
        pieces.fill(tensor, non_blocking=True)
        return pieces
    packed = torch.empty(tensor.shape, dtype=tensor.dtype, device=device, pin_memory=True)
    packed.copy_(tensor, non_blocking=True)
    return packed


def _on_device(host: Union[Tensor, _Pieces], device: torch.device) -> Tensor:
    """A pinned host copy back on ``device`` (asynchronously, on the current stream)."""
    if isinstance(host, _Pieces):
        return host.restore(device, non_blocking=True)
    return host.to(device, non_blocking=True)


class _Offloaded:
    """One tensor moved off the device: where it came from, its host copy, the one packed before it (weakly: a
    handle never keeps another step's copy alive) and, once prefetched, its device copy."""

    __slots__ = ("__weakref__", "host", "previous", "ready", "source")

    def __init__(self, source: torch.device, host: Union[Tensor, _Pieces], previous: Optional["_Offloaded"]) -> None:
        self.source, self.host = source, host
        self.previous = weakref.ref(previous) if previous is not None else None
        self.ready: Optional[Tensor] = None


class OffloadSavedTensors(torch.autograd.graph.saved_tensors_hooks):
    """Move the tensors autograd saves for backward to ``device`` and bring them back in backward.

    Written by hand instead of ``torch.autograd.graph.save_on_cpu`` because that one (a) always
    targets CPU and leaves tensors already there in place, so its logic cannot be tested on a
    CPU-only machine, (b) also copies parameters that autograd saves (weights of every Linear), which
    live on the device anyway, and (c) copies synchronously. Here the target is injectable,
    parameters are skipped, and on CUDA the device-to-host copy runs on a side stream into pinned
    memory so that it overlaps with the forward compute.

    What stays on the device, by construction (the planner counts exactly this): the last tensor packed, until the
    next one is (its copy may still be reading it: at most one block input in flight in the forward); in the
    backward, the tensor being restored and the one packed before it, prefetched when the later one is restored (on
    CUDA on the side stream, overlapping the recompute of the block in between). On CUDA the overlap is untested on
    a GPU (``benchmarks/gpu_checks.sh`` measures its step-time cost).

    ``copies`` and ``copied_bytes`` count what was moved since the last :meth:`reset_counts`; ``host_bytes`` what
    of it left the device's memory (0 when the target is the source's own device, as on a CPU-only run), at the size
    the host allocator takes (pinned: :func:`pinned_footprint`).
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.copies = 0
        self.copied_bytes = 0
        self.host_bytes = 0
        self._stream: Optional[torch.cuda.Stream] = None
        self._last: Optional[weakref.ref] = None  # the handle packed last (weak: it belongs to the graph)
        # id(tensor) -> (the tensor, its version, its handle), all weak: a tensor every block gets (an attention mask,
        # T5's position bias) is copied once, its later handles share that copy (see _pack)
        self._copied: dict[int, tuple[weakref.ref, int, weakref.ref]] = {}
        self._in_flight: Optional[Tensor] = None  # the device tensor packed last: its copy may still read it
        #: blocks called with a keyword tensor at least as large as their largest positional one (looked at on each
        #: block's first training forward): checkpoint holds keyword tensors in its closure, never through these hooks,
        #: so they stay on the device (name -> (key, bytes))
        self.keywords_kept: dict[str, list[tuple[str, int]]] = {}
        super().__init__(self._pack, self._unpack)

    def __getstate__(self) -> dict[str, Any]:
        # what a step leaves behind (weak references to its handles and tensors, the device tensor in flight, the CUDA
        # side stream) belongs to that step, not to the model: a model pickled after a step (torch.save(model)) failed
        # with "cannot pickle 'weakref.ReferenceType' object"
        return {**self.__dict__, "_stream": None, "_last": None, "_copied": {}, "_in_flight": None}

    def reset_counts(self) -> None:
        self.copies = 0
        self.copied_bytes = 0
        self.host_bytes = 0

    def settle(self) -> None:
        """Stop holding the device tensor packed last: a block whose inputs stay on the device runs next (partial
        offload), and on CUDA ``record_stream`` keeps its memory from reuse until the side stream's copy is done."""
        self._in_flight = None

    def _side_stream(self, source: torch.device) -> Optional[torch.cuda.Stream]:
        if source.type != "cuda" or self.device.type != "cpu":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(source)
        return self._stream

    def _host_copy(self, tensor: Tensor) -> Union[Tensor, _Pieces]:
        """The copy on ``device`` (from CUDA: pinned host memory in :func:`pinned_pieces`, on the side stream)."""
        stream = self._side_stream(tensor.device)
        if stream is None:
            # empty_like + copy_ (not .to): a real copy even when source == target device, which
            # is what a CPU-only test can check; empty_like keeps a dense tensor's strides (a channels-last conv
            # activation came back contiguous from torch.empty(shape): its backward then ran on another layout)
            plain = torch.empty_like(tensor, device=self.device)
            plain.copy_(tensor)
            return plain
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            packed = _pinned_copy(tensor, self.device)
        # The caching allocator must not hand the device memory to another tensor before the copy
        # on the side stream has read it.
        tensor.record_stream(stream)
        return packed

    def _footprint(self, tensor: Tensor) -> int:
        """Host bytes the copy of ``tensor`` takes off its device (0: the target is the same memory)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self.device == tensor.device or (self.device.type == "cpu" and tensor.device.type == "cpu"):
            return 0
        return host_footprint(tensor) if self.device.type == "cpu" and tensor.device.type == "cuda" else nbytes

    def _pack(self, tensor: Tensor) -> Any:
        # Parameters (and frozen quantized weights) are saved by reference and live on the device for
        # the whole step anyway: copying them would cost time and save nothing.
        if isinstance(tensor, nn.Parameter) or tensor.numel() == 0:
            return tensor
        previous = self._last() if self._last is not None else None
        shared = self._copy_of(tensor)
        handle = _Offloaded(tensor.device, shared if shared is not None else self._host_copy(tensor), previous)
        self._last = weakref.ref(handle)
        if shared is not None:  # nothing copied: the earlier copy's bytes are counted, its copy is in flight or done
            return handle
        self._copied[id(tensor)] = (weakref.ref(tensor), tensor._version, weakref.ref(handle))
        self._in_flight = tensor  # released by the next pack or the first unpack
        self.copies += 1
        self.copied_bytes += tensor.numel() * tensor.element_size()
        self.host_bytes += self._footprint(tensor)
        return handle

    def _copy_of(self, tensor: Tensor) -> Optional[Union[Tensor, _Pieces]]:
        """The host copy of ``tensor`` made for an earlier block, if that very tensor (alive since: its storage was not
        reused) is unchanged since (its version) and the earlier handle is alive. Every block's input that the model
        passes to each block (BERT's extended attention mask ``[B, 1, S, S]``, T5's position bias ``[1, H, S, S]``) was
        copied once per block: the host held one copy per layer, several times the hidden states' bytes."""
        if len(self._copied) > 256:  # forget the dead (a run packs a few tensors per block)
            self._copied = {k: v for k, v in self._copied.items() if v[0]() is not None and v[2]() is not None}
        earlier = self._copied.get(id(tensor))
        if earlier is None or earlier[0]() is not tensor or earlier[1] != tensor._version:
            return None
        handle = cast(Optional[_Offloaded], earlier[2]())
        return handle.host if handle is not None and handle.source == tensor.device else None

    def _restore(self, handle: _Offloaded, prefetch: bool) -> Tensor:
        """``handle``'s tensor on its device again: on CUDA on the side stream when ``prefetch``, else on the
        current stream after every pending copy of the side stream."""
        source, host = handle.source, handle.host
        if self._stream is not None and source.type == "cuda":
            if not prefetch:
                torch.cuda.current_stream(source).wait_stream(self._stream)
                return _on_device(host, source)
            self._stream.wait_stream(torch.cuda.current_stream(source))
            with torch.cuda.stream(self._stream):
                return _on_device(host, source)
        if isinstance(host, _Pieces):
            return host.restore(source)
        restored = torch.empty_like(host, device=source)  # the host copy's strides: the forward's layout
        restored.copy_(host)
        return restored

    def _unpack(self, packed: Any) -> Tensor:
        if isinstance(packed, Tensor):
            return packed
        self._in_flight = None  # the backward has begun: every forward copy was issued long before
        handle = cast(_Offloaded, packed)
        tensor, handle.ready = handle.ready, None
        if tensor is None:
            tensor = self._restore(handle, prefetch=False)
        elif self._stream is not None and handle.source.type == "cuda":  # prefetched on the side stream
            current = torch.cuda.current_stream(handle.source)
            current.wait_stream(self._stream)
            tensor.record_stream(current)
        # the backward runs the blocks in reverse: the tensor packed before this one is the next one needed
        previous = handle.previous() if handle.previous is not None else None
        if previous is not None and previous.ready is None:
            previous.ready = self._restore(previous, prefetch=True)
        return tensor


__all__ = ["PIECE_BYTES", "OffloadSavedTensors", "host_footprint", "pinned_footprint", "pinned_pieces"]
