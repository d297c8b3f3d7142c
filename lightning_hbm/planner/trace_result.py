"""What one traced step held (:class:`Trace`), and the lines drawn through the traces of cut models.

A trace of a model cut to k blocks and one cut to k+1 give a line per figure (each phase's categories, scope terms,
host bytes) that extends to the model's depth (:meth:`Trace.extrapolate`, :meth:`Trace.combine`); the regions where
each phase peaked (:mod:`lightning_hbm.planner.peaks`) say when such a line is not the model's
(:meth:`Trace.peaks_apart`). The step itself is traced by :func:`lightning_hbm.planner.tracing.trace`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from lightning_hbm.memory import CATEGORIES
from lightning_hbm.planner.candidates import format_bytes

PHASES = ("forward", "backward", "step")


@dataclass
class Trace:
    """What one traced step held: per phase (forward, backward, step), the categories at that phase's peak."""

    phases: dict[str, dict[str, int]]
    trainable: int
    total: int
    depth: int  # number of repeated blocks of the full model (0: none found)
    kept: int  # blocks traced
    block_bytes: int = 0  # what FSDP2 gathers for the largest repeated block: its parameters, constants excluded
    guessed: int = 0  # values read without a real twin (answered 0 / False)
    # per phase: each scope term's bytes at its peak (loss: what FusedLoss allocated; inside the categories)
    scopes: dict[str, dict[str, int]] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # module name -> why it ran on real zeros
    host: int = 0  # bytes ActivationCheckpointing(offload=True) moved to host memory (device="cuda"), pinned footprint
    # selections by a mask without values in the LightningModule's own code, planned at their largest: op -> what
    selections: dict[str, str] = field(default_factory=dict)
    host_sizes: tuple[int, ...] = ()  # bytes of each tensor in ``host`` before the pinned rounding, ascending
    offloaded: int = 0  # checkpointed blocks whose inputs went through the offload hooks
    # per phase: where its peak was reached, relative to the cut list of blocks (:class:`_PeakPoints`)
    where: dict[str, str] = field(default_factory=dict)
    regions: dict[str, dict[str, int]] = field(default_factory=dict)  # per phase: each region's peak bytes
    # parameter bytes FSDP2 keeps whole on every rank: the quantization constants (absmax, code books, row scales)
    replicated: int = 0
    # parameter bytes outside the repeated blocks, constants excluded: what FSDP2's remainder unit(s) gather
    remainder: int = 0
    # checkpointed blocks run without checkpoint, their activations kept: their forward changes a list or dict it is
    # given (ActivationCheckpointing's first training forward decides it, here too): block name -> what it changes
    unchecked: dict[str, str] = field(default_factory=dict)
    # FSDP2's units outside the blocks apart from the one around them (a head beside the backbone), by name: the
    # parameter bytes each gathers (constants excluded), in its own region (``unit <name>``) of the step
    units: dict[str, int] = field(default_factory=dict)
    # no unit around the blocks (the LightningModule holds their list): each block an FSDP2 root of its own
    rooted_blocks: bool = False
    # MoE expert containers some of whose experts the traced step did not route to, their optimizer states counted
    # (a long run updates every expert; :mod:`lightning_hbm.planner.routed`): container name -> how many
    routed: dict[str, str] = field(default_factory=dict)
    # the gradient bytes the largest block's backward makes (its trainable parameters'): FSDP2 keeps a shard of each
    block_gradients: int = 0
    # optimizer-state bytes FSDP2 keeps whole on every rank: the 0-dim states (Adam's ``step``), not DTensor shards
    replicated_states: int = 0
    # the gradient bytes each unit apart's backward makes (its trainable parameters': a trained or adapted head), by
    # name: FSDP2 keeps a shard of them and the whole reduce-scatter input to the backward's end (each unit a root)
    unit_gradients: dict[str, int] = field(default_factory=dict)
    # FSDP2's units inside the unit around the blocks that are no block (ConvNext's downsampling members), by name: the
    # parameter bytes each gathers (constants excluded), in its own region (``unit <name>``), where the unit around the blocks is gathered too
    inner_units: dict[str, int] = field(default_factory=dict)
    # the gradient bytes of the unit around the blocks (its trainable parameters outside the blocks and inner units: an
    # embedding trained inside the backbone), reduce-scattered at its backward's end
    remainder_gradients: int = 0

    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: sum(self.phases[phase].values()))

    def peak_categories(self) -> dict[str, int]:
        return self.phases[self.peak_phase()]

    def extrapolate(self, deeper: Trace, depth: int) -> Trace:
        """Extend linearly from ``self`` (k blocks) and ``deeper`` (k+1 blocks) to ``depth`` blocks."""
        return self.combine([(deeper, depth - self.kept)], depth)

    def combine(self, steps: Sequence[tuple[Trace, int]], depth: int) -> Trace:
        """``self`` plus, for each ``(other, n)`` of ``steps``, ``n`` times what ``other`` adds to it (one block more of
        its kind: a block that keeps its input, or one that offloads it), every figure line by line, at ``depth``."""

        def line(value: Callable[[Trace], int]) -> int:
            base = value(self)
            return max(0, base + sum(n * (value(other) - base) for other, n in steps))

        others = [other for other, _ in steps]
        phases: dict[str, dict[str, int]] = {
            phase: {c: line(_phase_value(phase, c)) for c in CATEGORIES}
            for phase in self.phases
            if all(phase in other.phases for other in others)
        }
        scopes = {phase: {name: line(_scope_value(phase, name)) for name in _scope_names(phase, [self, *others])}
                  for phase in phases}
        fallbacks: dict[str, str] = {}
        selections: dict[str, str] = {}
        unchecked: dict[str, str] = {}
        routed: dict[str, str] = {}
        for each in (self, *others):
            fallbacks.update(each.fallbacks)
            selections.update(each.selections)
            unchecked.update(each.unchecked)
            routed.update(each.routed)
        # the tensors one more block moved, once per block added
        sizes = Counter(self.host_sizes)
        for other, n in steps:
            sizes.update({size: count * n for size, count in (Counter(other.host_sizes) - Counter(self.host_sizes)).items()})
        return Trace(phases, line(_field("trainable")), line(_field("total")), depth, depth, self.block_bytes,
                     max(t.guessed for t in (self, *others)), scopes, fallbacks, line(_field("host")), selections,
                     tuple(sorted(sizes.elements())), line(_field("offloaded")), regions=self._region_lines(steps),
                     replicated=line(_field("replicated")), remainder=self.remainder, unchecked=unchecked,
                     replicated_states=line(_field("replicated_states")),
                     units=self.units, rooted_blocks=self.rooted_blocks, routed=routed,
                     block_gradients=self.block_gradients, unit_gradients=self.unit_gradients,
                     inner_units=self.inner_units, remainder_gradients=self.remainder_gradients)

    def _region_lines(self, steps: Sequence[tuple[Trace, int]]) -> dict[str, dict[str, int]]:
        """Each region's peak, phase by phase, drawn as :meth:`combine` draws every figure (the regions of every trace
        only: a region of one cut names no point of the model)."""
        lines: dict[str, dict[str, int]] = {}
        for phase, mine in self.regions.items():
            theirs = [other.regions.get(phase, {}) for other, _ in steps]
            lines[phase] = {region: max(0, value + sum(n * (other[region] - value) for other, (_, n) in zip(theirs, steps)))
                            for region, value in mine.items() if all(region in other for other in theirs)}
        return lines

    def peaks_apart(self, deeper: Trace, depth: int) -> list[str]:
        """Why the line from ``self`` (k blocks) and ``deeper`` (k+1) to ``depth`` blocks is not the model's, per phase
        (empty: it holds): the two peak at points that do not correspond (one before the blocks, the other after the
        last), or another region of the step, extended to ``depth`` as the peak is, holds more than the peak's.

        A line through two peaks extends one point of the step only when both are that point and stay the largest: a
        peak that moves is the max of two lines, under its real value beyond the cut (session 20: 11.16 GiB planned by
        the line, 6.17 the model's). Regions: :class:`_PeakPoints`; those of one cut only are not compared."""
        return self.lines_apart([(deeper, depth - self.kept)], depth)

    def lines_apart(self, steps: Sequence[tuple[Trace, int]], depth: int, offloading: bool = False) -> list[str]:
        """:meth:`peaks_apart` for the combination :meth:`combine` draws (``self`` plus ``n`` times what each ``other``
        adds): every trace must peak, phase by phase, in the same region, and no region of all of them, combined as the
        peak is, may hold more at ``depth`` than the peak's. ``offloading``: name each trace with its offloading blocks
        (a partial offload's traces have the same lengths)."""

        def name(trace: Trace, first: bool) -> str:
            return f"{trace.kept}{' blocks' if first else ''}{f' ({trace.offloaded} offloading)' if offloading else ''}"

        traces = [self, *(other for other, _ in steps)]
        apart = []
        for phase, point in self.where.items():
            moved = [f"{other.where[phase]} with {name(other, False)}" for other in traces[1:]
                     if other.where.get(phase, point) != point]
            if moved:
                apart.append(f"{phase}: {point} with {name(self, True)}, {', '.join(moved)}")
                continue
            regions = [trace.regions.get(phase, {}) for trace in traces]
            mine = regions[0]
            lines = {r: mine[r] + sum(n * (theirs[r] - mine[r]) for theirs, (_, n) in zip(regions[1:], steps))
                     for r in mine if all(r in theirs for theirs in regions[1:])}
            over = max(lines, key=lambda r: lines[r], default=point)
            if point in lines and lines[over] > lines[point]:
                cuts = [name(trace, False) for trace in traces]
                apart.append(f"{phase}: {point} with {', '.join(cuts[:-1])} and {cuts[-1]} blocks, but {over} extended to "
                             f"{depth} blocks holds {format_bytes(lines[over])} against {format_bytes(lines[point])}")
        return apart

    def peak_scopes(self) -> dict[str, int]:
        """Each scope term's bytes at the peak phase (the registry's scope terms, :func:`~lightning_hbm.memory.terms.scope_terms`)."""
        return dict(self.scopes.get(self.peak_phase(), {}))


def _phase_value(phase: str, category: str) -> Callable[[Trace], int]:
    return lambda trace: trace.phases[phase][category]


def _scope_value(phase: str, name: str) -> Callable[[Trace], int]:
    return lambda trace: trace.scopes.get(phase, {}).get(name, 0)


def _scope_names(phase: str, traces: Sequence[Trace]) -> dict[str, None]:
    return {name: None for trace in traces for name in trace.scopes.get(phase, {})}


def _field(name: str) -> Callable[[Trace], int]:
    return lambda trace: int(getattr(trace, name))
