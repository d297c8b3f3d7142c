"""Where each phase of a traced step peaks: the regions of the step relative to the list of blocks the planner cuts.

The live-storage tracker's peak is read and restarted at each region's end (:class:`_PeakPoints`), so a trace says
in which region each phase peaked and what each region held at its own peak; under a partial offload each phase's
two peaks are recorded apart (:func:`_peaks_apart`). :meth:`lightning_hbm.planner.trace_result.Trace.peaks_apart`
compares them across cuts.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from lightning_hbm.memory import LiveStorageTracker
from lightning_hbm.planner.block_cuts import _ALIKE_FROM

#: The region after the backward's last op, before the optimizer step: where the unit around the blocks, an FSDP2 root,
#: reduce-scatters its gradients (``Prediction.per_rank``; marked only where such a unit exists).
END_OF_BACKWARD = "end of the backward"


#: A block region's name past ``block ``: ``3``, ``-2``, ``1 of unit -1`` (``regenerate=n``), ``offloading -1``
_BLOCK_NAME = re.compile(r"(?P<offloading>offloading )?(?P<index>-?\d+)(?: of unit (?P<unit>-?\d+))?")


def block_index(region: str, depth: int, unit: int = 1, kept_from: Optional[int] = None) -> Optional[int]:
    """The index from the start of the block whose region is ``region`` (``block <name>`` as
    :meth:`_PeakPoints.watching` names it: the inverse of its naming), in a model of ``depth`` blocks named by units of
    ``unit`` blocks (``ActivationCheckpointing(regenerate=n)``) with, under a partial offload, the first block keeping
    its input at ``kept_from``. None: not a block's region, or a block of a list the planner does not cut (``block
    stages.1.layers.1``). Session 37: FSDP2's per-rank gradients in the backward (``fsdp2_gradient_bytes``) were left
    as traced in the regions named by unit or by offloading part, 10.1 % and 0.9 % over on 2 gloo ranks."""
    match = _BLOCK_NAME.fullmatch(region[6:]) if region.startswith("block ") else None
    if match is None:
        return None
    index = int(match["index"])
    if match["offloading"]:
        return None if kept_from is None or match["unit"] is not None else kept_from + index
    if match["unit"] is not None:
        number = int(match["unit"])
        return (number if number >= 0 else number + -(-depth // unit)) * unit + index
    return index if index >= 0 else depth + index


class _PeakPoints:
    """Where each phase's peak is reached, relative to the list of blocks the planner cuts, and the peak of each
    region of the step (decided by running: the tracker's peak is read and restarted at each region's end).

    Regions: ``before the blocks``, ``block i`` (its forward; in the backward, from its output's gradient on),
    ``after block i`` (the forward between it and the next block, or the head and loss after the last), each block
    named from the start below :data:`_ALIKE_FROM` and from the end from there on (``block -1``: the last kept), so
    that a region of a cut to 3 blocks is one of a cut to 4 (:meth:`Trace.peaks_apart`). The optimizer step is one
    region. A phase's peak is its regions' largest (the first reached on a tie, as one peak over the phase had it)."""

    def __init__(self, tracker: LiveStorageTracker) -> None:
        self.tracker = tracker
        self.where: dict[str, str] = {}  # per closed phase: the region of its peak
        self.peaks: dict[str, dict[str, int]] = {}  # per closed phase: each region's peak bytes
        self.region = ""
        self.model_ran = False  # the ``model`` of :meth:`watching` ran its forward (around the blocks)
        self.restart()

    def restart(self, region: Optional[str] = None) -> None:
        """A new phase starts here (``tracker.reset_peak`` ran), in ``region`` (None: the current one)."""
        self.region = self.region if region is None else region
        self.regions: dict[str, int] = {}
        self.best, self.found, self.records = -1, self.region, self.tracker.peak_records

    def mark(self, region: str) -> None:
        """The current region ends (its peak kept, the phase's if larger), ``region`` starts."""
        tracker = self.tracker
        tracker.finish_peak()
        self.regions[self.region] = max(self.regions.get(self.region, 0), tracker.peak_bytes)
        if tracker.peak_bytes > self.best:  # the tracker rebinds its records at each peak: this dict stays as it is
            self.best, self.found, self.records = tracker.peak_bytes, self.region, tracker.peak_records
        tracker.reset_peak()
        self.region = region

    def close(self, name: str) -> dict:
        """The phase ``name`` ends: its peak's live records (the tracker's ``peak_records`` over the phase)."""
        self.mark(self.region)
        self.where[name], self.peaks[name] = self.found, self.regions
        return self.records

    @contextmanager
    def watching(self, blocks: Sequence[nn.Module], kept_from: Optional[int] = None, unit: int = 1,
                 model: Optional[nn.Module] = None, apart: Sequence[tuple[str, nn.Module]] = (),
                 others: Sequence[tuple[str, nn.Module]] = ()) -> Iterator[None]:
        """Mark the regions as ``blocks`` run forward (hooks) and their outputs' gradients arrive (tensor hooks).

        ``kept_from``: under a partial offload, the index of the first block of the part that keeps its inputs; the
        blocks before it from :data:`_ALIKE_FROM` on are named from the end of the offloading part (``offloading -1``:
        the last), as the cuts that draw its line add blocks in the middle of each part (``Trace.combine``).

        ``unit`` > 1 (``ActivationCheckpointing(regenerate=n)``, the cuts in units of ``n`` blocks): each block is named
        by its place in its unit and the unit's number (``block 1 of unit -1``), the units below :data:`_ALIKE_FROM`
        from the start, the others from the end. Every unit then holds the same at the same place once nothing
        accumulates, and the phase's peak, the first reached on a tie, is in the same named region of each cut (by
        blocks, block 3 of a cut to 6 was ``-3``, of a cut to 8 ``-5``: the 8B plans were refused and traced whole).

        ``model``: the LightningModule's submodule holding the blocks (a causal LM's ``model``), when the loss is
        computed outside it: the step from its forward's end to its output's gradient (the loss and its backward) is
        the region ``after the model``, where FSDP2 holds none of its parameters gathered (``Prediction.per_rank``).

        ``apart``: FSDP2's other units outside the blocks, by name (a head beside the backbone: ``remainder_units``):
        each one's forward, and its backward from its output's gradient to its input's, is the region ``unit <name>``,
        where FSDP2 holds that unit gathered and no other (:meth:`_watch_apart`); or, inside the unit around the blocks
        (ConvNext's downsampling members), that one too.

        ``others``: the blocks of the lists the planner does not cut (ConvNext's later stages' layers), by name: each
        the region ``block <name>`` (``after block <name>`` after it), never cut, so named alike in every cut (session
        36: their backward was in ``after block -1``, planned with one block gathered instead of two, 1.6 % under)."""
        tracker, handles = self.tracker, [h for name, module in apart for h in self._watch_apart(name, module)]
        last_out: list[Callable[[], Optional[torch.Tensor]]] = [lambda: None]  # the last block's output, weakly
        if model is not None:

            def model_done(module: nn.Module, args: Any, output: Any) -> None:
                if tracker.phase != "forward":
                    return
                self.model_ran = True
                self.mark("after the model")
                out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
                # a model whose output is its last block's (an nn.Sequential of blocks) has nothing after that block:
                # its gradient starts the block's backward, whose hook on that tensor runs first (session 35: the
                # block's backward was named "after block -1", one gathered block short under FSDP2)
                if out is not None and out is not last_out[0]():
                    out.register_hook(lambda grad: self.mark("after block -1"))

            handles.append(model.register_forward_hook(model_done))
        for index, block in enumerate(blocks):
            name = str(index) if index < _ALIKE_FROM else str(index - len(blocks))
            if kept_from is not None and _ALIKE_FROM <= index < kept_from:
                name = f"offloading {index - kept_from}"
            elif unit > 1:
                number = index // unit
                name = f"{index % unit} of unit {number if number < _ALIKE_FROM else number - -(-len(blocks) // unit)}"
            handles += self._watch_block(name, block, last_out)
        for name, block in others:
            handles += self._watch_block(name, block, last_out)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


    def _watch_block(self, name: str, block: nn.Module, last_out: list[Callable[[], Optional[torch.Tensor]]]) -> list[Any]:
        """Hooks marking ``block <name>`` while ``block`` runs forward and from its output's gradient on, ``after block
        <name>`` after its forward; ``last_out`` keeps its output (weakly) once it ran, the last block's at the end."""
        tracker = self.tracker

        def enter(module: nn.Module, args: Any) -> None:
            if tracker.phase == "forward":  # not a checkpoint's recomputation in the backward
                self.mark(f"block {name}")

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if tracker.phase != "forward":
                return
            self.mark(f"after block {name}")
            out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if out is not None:
                out.register_hook(lambda grad: self.mark(f"block {name}"))
                last_out[0] = weakref.ref(out)

        return [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]

    def _watch_apart(self, name: str, module: nn.Module) -> list[Any]:
        """Hooks marking ``unit <name>`` while ``module`` runs forward, and in the backward from its output's gradient
        until its input's gradient (or the backward's end: an input without gradient, token ids), the region left
        then taken up again unless another region started meanwhile (the backbone's output is the head's input)."""
        tracker, region = self.tracker, f"unit {name}"
        left: dict[str, str] = {}  # per pass: the region the unit's own one interrupted

        def back(grad: Any) -> None:
            if self.region == region:
                self.mark(left["backward"])

        def output_grad(grad: Any) -> None:
            left["backward"] = self.region
            self.mark(region)

        def enter(module: nn.Module, args: Any) -> None:
            if tracker.phase != "forward":
                return
            left["forward"] = self.region
            self.mark(region)
            inp = next((t for t in tree_leaves(args) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if inp is not None:
                inp.register_hook(back)

        def leave(module: nn.Module, args: Any, output: Any) -> None:
            if tracker.phase != "forward":
                return
            self.mark(left["forward"])
            out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
            if out is not None:
                out.register_hook(output_grad)

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]


@contextmanager
def _peaks_apart(boundary: tuple[nn.Module, nn.Module], close: Callable[[str], None]) -> Iterator[None]:
    """Close the forward's first peak when the first block that keeps its input starts, and the backward's first
    peak when the gradient reaches the last block that offloads its input (a hook on its output)."""
    last, first = boundary

    def reached(module: nn.Module, args: Any, output: Any) -> None:
        grad_out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if grad_out is not None:
            grad_out.register_hook(lambda grad: close("backward"))

    handles = [first.register_forward_pre_hook(lambda module, args: close("forward (offloaded blocks)")),
               last.register_forward_hook(reached)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
