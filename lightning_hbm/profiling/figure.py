"""The picture of one training step: every memory term over the step's ops, its phases, the peak attributed.

Two functions and one plain record, so a user and a test read what the PNG draws:

- :func:`build_figure` turns a step recorded by :class:`~lightning_hbm.profiling.timeline.StepRecorder` into a
  :class:`ProfileFigure`: the phases (forward, loss, zero_grad, backward, optimizer) as sample ranges, one byte series
  per term of :data:`lightning_hbm.memory.terms.TERMS`, ``other`` broken down into what it is, the peak (its bytes,
  terms, the op and the module running then), the planner's prediction and the budget.
- :func:`draw_figure` draws it (matplotlib, imported when called): the category terms stacked over the samples,
  ``other`` in its parts, the phases shaded and named, the peak marked and explained, the scope terms (``loss``) as
  lines inside the stack, prediction and budget as horizontal lines on the same axes.

``HBMProfiler`` writes the record as ``hbm_figure.json`` (:meth:`ProfileFigure.as_dict`, read back with
:func:`load_figure`) next to ``hbm_profile.png``.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Optional, Protocol, Union, runtime_checkable

from lightning_hbm.memory.categories import StorageKey, classify_records
from lightning_hbm.memory.report import atomic_write, check_numbers, read_json
from lightning_hbm.memory.terms import TERMS, category_terms, created_term, rest_term, scope_terms
from lightning_hbm.memory.tracker import LOSS_SCOPE, scope_term_bytes
from lightning_hbm.profiling.timeline import BEFORE, Entry, RecordedStep

#: What each part of the ``rest`` category (``other``) is: the keys of ``ProfileFigure.parts["other"]`` and their
#: legend labels, in stacking order.
REST_PARTS: dict[str, str] = {
    "buffers": "buffers",
    "batch": "the batch",
    "backward temporaries": "backward temporaries (gradients w.r.t. activations)",
    "recomputed activations": "activations recomputed in backward (checkpointing)",
    "optimizer temporaries": "optimizer-step temporaries",
    "other temporaries": "temporaries of the forward's end and zero_grad",
}
#: The forward-created category (``activations``) by the phase that made it: the model's forward or the loss.
CREATED_PARTS: dict[str, str] = {"forward": "made by the forward", "loss": "made by the loss"}
#: Samples kept in a figure: a longer step keeps, per bucket, the sample with the largest total (the envelope), plus
#: every phase boundary and the peak.
MAX_SAMPLES = 2000
CPU_NOTE = (
    "CPU: the areas are exact tensor bytes (every storage tracked); allocator slack and library workspaces are not "
    "visible off CUDA (no device allocator to ask)"
)
CUDA_NOTE = (
    "CUDA: the areas are tensor bytes; the 'CUDA allocated' line above them adds allocator rounding, library "
    "workspaces and tensors made outside the tracked step"
)


@runtime_checkable
class PeakPrediction(Protocol):
    """A planner prediction (:class:`lightning_hbm.planner.Prediction`): its ``peak``, bytes."""

    @property
    def peak(self) -> int: ...


@dataclass(frozen=True)
class Phase:
    """One phase of the step: samples ``start`` up to ``end`` (excluded)."""

    name: str
    start: int
    end: int


@dataclass(frozen=True)
class PhasePeak:
    """A phase's own largest instant: sample ``index``, ``bytes`` (the category terms' sum) and every term then."""

    phase: str
    index: int
    bytes: int
    terms: dict[str, int]


@dataclass(frozen=True)
class Peak:
    """The step's peak: sample ``index``, ``bytes`` (the sum of the category terms), each term then, and what ran.

    Attributes:
        index: the sample of the peak (the first, when it is reached several times).
        bytes: live tensor bytes then: the profiler's ``tracked_peak``.
        terms: every term's bytes at the peak.
        largest: the category term holding the most then.
        allocated: the category term of the storage whose creation reached the peak ("" when none).
        allocated_part: which part of that term (a key of ``ProfileFigure.parts[allocated]``), else "".
        op: the aten op that reached it (``aten.mm.default``).
        where: the module running it (forward: its name; backward: ``backward of <module>``; the optimizer step:
            the parameter it works on).
        phase: the phase it fell in.
    """

    index: int
    bytes: int
    terms: dict[str, int]
    largest: str
    allocated: str
    allocated_part: str
    op: str
    where: str
    phase: str


@dataclass
class ProfileFigure:
    """The data :func:`draw_figure` draws (bytes; series indexed by sample, one sample after every op).

    Attributes:
        step: the global step drawn.
        device: the device the terms were counted on.
        phases: the step's phases, in order.
        kinds: every term's kind (``category`` terms sum to ``total``; ``scope`` ones lie inside them; ``host``
            ones are off the device).
        terms: one series per term of :data:`~lightning_hbm.memory.terms.TERMS` (a host term: constant).
        parts: terms broken down, ``{term: {part: series}}`` summing to ``terms[term]``: ``other`` (the registry's
            ``rest``) by what its storages are (:data:`REST_PARTS`), ``activations`` by the phase that made them
            (:data:`CREATED_PARTS`); only parts that hold bytes.
        labels: the legend label of every part, ``{term: {part: label}}``.
        stack: the category terms bottom up as drawn: the steadiest first, the rest term last.
        total: the category terms' sum at every sample.
        ops: the op of every sample ("" at a phase boundary).
        where: where each op ran (see :class:`Peak`).
        peak: the peak, attributed.
        phase_peaks: each phase at its own largest instant (every term then): the table under the picture.
        prediction: the planner's predicted peak, when known.
        budget: the memory budget, when known.
        cuda_allocated: the CUDA allocator's allocated bytes at every sample (None off CUDA).
        notes: what the areas cannot separate on this device.
    """

    step: int
    device: str
    phases: list[Phase]
    kinds: dict[str, str]
    terms: dict[str, list[int]]
    parts: dict[str, dict[str, list[int]]]
    labels: dict[str, dict[str, str]]
    stack: list[str]
    total: list[int]
    ops: list[str]
    where: list[str]
    peak: Peak
    phase_peaks: list[PhasePeak] = field(default_factory=list)
    prediction: Optional[int] = None
    budget: Optional[int] = None
    cuda_allocated: Optional[list[int]] = None
    notes: list[str] = field(default_factory=list)

    @property
    def samples(self) -> int:
        return len(self.total)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready; :func:`load_figure` reads it back."""
        return {"unit": "bytes", **asdict(self)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProfileFigure:
        """The record :meth:`as_dict` wrote.

        Raises:
            ValueError: ``data`` is not a figure record.
        """
        try:
            values = {k: v for k, v in data.items() if k != "unit"}
            values["phases"] = [Phase(**p) for p in values["phases"]]
            values["peak"] = Peak(**values["peak"])
            values["phase_peaks"] = [PhasePeak(**p) for p in values.get("phase_peaks", [])]
            return cls(**values)
        except (KeyError, TypeError) as err:
            raise ValueError(f"not an HBMProfiler figure record ({type(err).__name__}: {err})") from err


def prediction_bytes(prediction: Union[int, PeakPrediction, None]) -> Optional[int]:
    """Bytes of a prediction given as bytes or as a planner :class:`~lightning_hbm.planner.Prediction`."""
    if prediction is None or isinstance(prediction, int):
        return prediction
    return int(prediction.peak)


# -- building -------------------------------------------------------------------------------------------------
def build_figure(
    recorded: RecordedStep,
    owned: Mapping[StorageKey, tuple[str, int]],
    *,
    step: int,
    device: str,
    host: Optional[Mapping[str, int]] = None,
    prediction: Optional[int] = None,
    budget: Optional[int] = None,
    max_samples: int = MAX_SAMPLES,
) -> ProfileFigure:
    """The figure of a recorded step, classified the way the profiler's row is (so its peak equals the row).

    Args:
        recorded: what :class:`~lightning_hbm.profiling.timeline.StepRecorder` wrote.
        owned: :func:`~lightning_hbm.memory.categories.owned_storages` read after the step (as for the row).
        step: the global step.
        device: count only storages on this device (the profiler's ``pl_module.device``).
        host: the host terms' bytes of the step (``{"host_offload": n}``; missing ones: 0).
        prediction: the planner's predicted peak, bytes.
        budget: the memory budget, bytes.
        max_samples: keep at most this many samples (:data:`MAX_SAMPLES`).

    Raises:
        ValueError: ``recorded`` holds no sample.
    """
    if not recorded.samples:
        raise ValueError("build_figure: the recorded step holds no sample (was the recorder started?).")
    phases = _phases(recorded)
    columns, entry_columns = _columns(recorded.entries, owned, device, _loss_range(phases))
    by_column = dict(zip(columns, _replay(recorded, entry_columns, len(columns))))
    categories = [t.name for t in category_terms()]
    total = [sum(values) for values in zip(*(by_column[("category", c, "")] for c in categories))]
    peak_index = max(range(len(total)), key=total.__getitem__)
    keep = _kept(total, [p.start for p in phases] + [peak_index], max_samples)
    terms: dict[str, list[int]] = {}
    for t in TERMS:
        constant = [int((host or {}).get(t.name, 0))] * len(keep)
        terms[t.name] = constant if t.kind == "host" else [by_column[(t.kind, t.name, "")][i] for i in keep]
    parts: dict[str, dict[str, list[int]]] = {}
    for kind, name, part in columns:
        if kind == "part" and any(by_column[(kind, name, part)]):
            parts.setdefault(name, {})[part] = [by_column[(kind, name, part)][i] for i in keep]
    samples = recorded.samples
    peak = _peak(recorded, by_column, peak_index, keep.index(peak_index), phases)
    allocated = _allocated(columns, entry_columns, samples[peak_index].created)
    kept_phases = [Phase(p.name, bisect.bisect_left(keep, p.start), bisect.bisect_left(keep, p.end)) for p in phases]
    kept_total = [total[i] for i in keep]
    return ProfileFigure(
        step=step,
        device=device,
        phases=kept_phases,
        kinds={t.name: t.kind for t in TERMS},
        terms=terms,
        parts=parts,
        labels={rest_term(): dict(REST_PARTS), created_term("forward"): dict(CREATED_PARTS)},
        stack=_stack_order(terms, categories),
        total=kept_total,
        ops=[samples[i].op for i in keep],
        where=[samples[i].where for i in keep],
        peak=replace(peak, allocated=allocated[0], allocated_part=allocated[1]),
        phase_peaks=_phase_peaks(kept_phases, kept_total, terms),
        prediction=prediction,
        budget=budget,
        cuda_allocated=[recorded.cuda_allocated[i] for i in keep] if recorded.cuda_allocated is not None else None,
        notes=[CUDA_NOTE if recorded.cuda_allocated is not None else CPU_NOTE],
    )


def _phase_peaks(phases: Sequence[Phase], total: Sequence[int], terms: Mapping[str, Sequence[int]]) -> list[PhasePeak]:
    """Each phase at its largest instant (the first, on a tie), every term then."""
    peaks: list[PhasePeak] = []
    for phase in phases:
        if phase.end <= phase.start:
            continue
        index = max(range(phase.start, phase.end), key=total.__getitem__)
        peaks.append(PhasePeak(phase.name, index, total[index], {name: values[index] for name, values in terms.items()}))
    return peaks


def _stack_order(terms: Mapping[str, Sequence[int]], categories: Sequence[str]) -> list[str]:
    """The category terms bottom up: the steadiest over the step first (a term that moves sits on those that do not,
    so each band's own change shows), the rest term (everything else) on top."""
    rest = rest_term()
    steady = sorted((c for c in categories if c != rest), key=lambda c: max(terms[c]) - min(terms[c]))
    return [*steady, rest]


Column = tuple[str, str, str]  # ("category" | "scope" | "part", term, part or "")


def _columns(
    entries: Sequence[Entry], owned: Mapping[StorageKey, tuple[str, int]], device: str, loss: Optional[range]
) -> tuple[list[Column], list[tuple[int, list[int]]]]:
    """The series' columns, and per entry (its bytes, the columns it counts in): its category (by the profiler's
    peak classifier), the part of that category it is, the scope terms it lies in. Entries off ``device``: none.

    ``loss``: the samples of the loss phase (activations made there are the loss's part).
    """
    rest, created = rest_term(), created_term("forward")
    columns: list[Column] = [("category", t.name, "") for t in category_terms()]
    columns += [("scope", t.name, "") for t in scope_terms()]
    columns += [("part", rest, p) for p in REST_PARTS] + [("part", created, p) for p in CREATED_PARTS]
    index = {c: i for i, c in enumerate(columns)}
    per_entry: list[tuple[int, list[int]]] = []
    for entry in entries:
        one = {entry.key: entry.record}
        category = next((c for c, n in classify_records(one, owned, device).items() if n), None)
        if category is None:
            per_entry.append((0, []))
            continue
        cols = [index[("category", category, "")]]
        cols += [index[("scope", name, "")] for name, nbytes in scope_term_bytes(one, owned).items() if nbytes]
        if category == rest:
            cols.append(index[("part", rest, _rest_part(entry, owned, rest))])
        elif category == created:
            cols.append(index[("part", created, "loss" if loss is not None and entry.sample in loss else "forward")])
        per_entry.append((entry.record.nbytes, cols))
    return columns, per_entry


def _rest_part(entry: Entry, owned: Mapping[StorageKey, tuple[str, int]], rest: str) -> str:
    """What a storage counted in the rest category (``other``) is: a key of :data:`REST_PARTS`."""
    alive_and_owned = entry.key in owned and entry.record.ref() is not None
    if (alive_and_owned and owned[entry.key][0] == rest) or entry.record.phase == rest:
        return "buffers"  # owned as a buffer now, or seeded as one
    if entry.phase == BEFORE:
        return "batch" if entry.record.phase == "batch" else "other temporaries"
    if entry.phase == "backward":
        return "recomputed activations" if entry.recomputed else "backward temporaries"
    if entry.phase == "optimizer":
        return "optimizer temporaries"
    return "other temporaries"


def _replay(recorded: RecordedStep, entry_columns: Sequence[tuple[int, list[int]]], width: int) -> list[list[int]]:
    """Every column's bytes at every sample, by replaying the appear/release events in order."""
    running = [0] * width
    series: list[list[int]] = [[] for _ in range(width)]
    events, position = recorded.events, 0
    for sample in recorded.samples:
        while position < sample.events:
            event = events[position]
            position += 1
            nbytes, cols = entry_columns[event if event >= 0 else ~event]
            signed = nbytes if event >= 0 else -nbytes
            for col in cols:
                running[col] += signed
        for col in range(width):
            series[col].append(running[col])
    return series


def _phases(recorded: RecordedStep) -> list[Phase]:
    """The recorded segments as phases; the forward's tail after its last leaf module (or from the first op in the
    loss's scope, FusedLoss) is the ``loss`` phase."""
    segments = recorded.segments
    ends = [start for _, start in segments[1:]] + [len(recorded.samples)]
    phases: list[Phase] = []
    for (name, start), end in zip(segments, ends):
        loss = _loss_start(recorded, start, end) if name == "forward" and not phases else None
        if loss is not None:
            phases += [Phase("forward", start, loss), Phase("loss", loss, end)]
        else:
            phases.append(Phase(name, start, end))
    return phases


def _loss_start(recorded: RecordedStep, start: int, end: int) -> Optional[int]:
    candidates = [recorded.last_leaf_end] if recorded.last_leaf_end is not None else []
    for i in range(start, end):
        created = recorded.samples[i].created
        if created >= 0 and recorded.entries[created].record.scope == LOSS_SCOPE:
            candidates.append(i)
            break
    first = min(candidates, default=None)
    # a loss phase needs an op of its own, and some forward before it
    return first if first is not None and start < first < end - 1 else None


def _loss_range(phases: Sequence[Phase]) -> Optional[range]:
    return next((range(p.start, p.end) for p in phases if p.name == "loss"), None)


def _kept(total: Sequence[int], must: Sequence[int], limit: int) -> list[int]:
    """The sample indices kept: all when few; else the largest of each of ``limit`` buckets, plus ``must``."""
    if len(total) <= limit:
        return list(range(len(total)))
    size = len(total) / limit
    keep = {max(range(int(b * size), max(int((b + 1) * size), int(b * size) + 1)), key=total.__getitem__) for b in range(limit)}
    keep.update(i for i in must if i < len(total))
    keep.add(len(total) - 1)
    return sorted(keep)


def _peak(
    recorded: RecordedStep, by_column: Mapping[Column, list[int]], index: int, kept: int, phases: Sequence[Phase]
) -> Peak:
    """The peak at sample ``index`` (``kept``: its place among the kept samples): its terms, op, module and phase."""
    terms = {t.name: by_column[(t.kind, t.name, "")][index] for t in TERMS if t.kind != "host"}
    categories = [t.name for t in category_terms()]
    sample = recorded.samples[index]
    phase = next((p.name for p in phases if p.start <= index < p.end), phases[-1].name)
    nbytes = sum(terms[c] for c in categories)
    largest = max(categories, key=lambda c: terms[c])
    return Peak(kept, nbytes, terms, largest, "", "", sample.op, sample.where, phase)


def _allocated(columns: Sequence[Column], entry_columns: Sequence[tuple[int, list[int]]], created: int) -> tuple[str, str]:
    """(category term, part of ``other`` or "") of the storage the peak's op created; ("", "") when it created none."""
    if created < 0:
        return "", ""
    names = [columns[c] for c in entry_columns[created][1]]
    category = next((name for kind, name, _ in names if kind == "category"), "")
    part = next((part for kind, _, part in names if kind == "part"), "")
    return category, part


# -- drawing --------------------------------------------------------------------------------------------------
_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"), (1, "B"))
#: A budget or prediction above this many times the step's peak is named at the top instead of squashing the areas.
OFF_SCALE = 3.0


def format_bytes(nbytes: float) -> str:
    """``3.21 MiB``: the largest binary unit that keeps the number at 1 or more."""
    scale, unit = next(((s, u) for s, u in _UNITS if abs(nbytes) >= s), (1, "B"))
    return f"{nbytes / scale:,.2f} {unit}" if scale > 1 else f"{int(nbytes)} B"


def draw_figure(figure: ProfileFigure, path: Optional[Union[str, Path]] = None) -> Any:
    """Draw ``figure``; saved to ``path`` (PNG) when given. Returns the matplotlib ``Figure``.

    Every artist carries a ``label`` naming what it draws (a term, ``other: <part>``, ``budget``, ``planner
    prediction``, ``peak``), so a test reads the data back from the drawing.
    """
    # Figure + Agg canvas directly: no global pyplot backend switch in the user's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    top = max(figure.total + (figure.cuda_allocated or []) + [1])
    scale, unit = next(((s, u) for s, u in _UNITS if top >= s), (1, "B"))
    canvas = Figure(figsize=(14, 8), layout="constrained")
    FigureCanvasAgg(canvas)
    grid = canvas.add_gridspec(2, 1, height_ratios=[3.2, 1])
    ax = canvas.add_subplot(grid[0])
    _draw_table(canvas.add_subplot(grid[1]), figure)
    _draw_areas(ax, figure, scale)
    shown = [top] + [v for v in (figure.prediction, figure.budget) if v is not None and v <= OFF_SCALE * top]
    ax.set_ylim(0, max(shown) / scale * 1.45)  # room above for the phase names and the peak's note
    ax.set_xlim(-0.5, figure.samples - 0.5)
    _draw_phases(ax, figure)
    _draw_lines(ax, figure, scale, top)
    _draw_peak(ax, figure, scale)
    ax.set_ylabel(unit)
    ax.set_xlabel(f"ops of step {figure.step}, in order (one sample after every op: {figure.samples} samples)")
    ax.set_title(
        f"HBMProfiler: step {figure.step}, every memory term over the step; peak {format_bytes(figure.peak.bytes)} "
        f"in {figure.peak.phase}", fontsize="medium",
    )
    handles, labels = ax.get_legend_handles_labels()
    canvas.legend(handles[::-1], labels[::-1], loc="outside right upper", fontsize="small")  # top of the stack first
    canvas.supxlabel("\n".join(figure.notes), fontsize="x-small", color="dimgray", x=0.01, ha="left")
    if path is not None:  # as write_figure: renamed over the name, never written through a link there
        suffix = Path(path).suffix[1:].lower() or "png"
        atomic_write(path, lambda f: canvas.savefig(f, dpi=100, format=suffix), binary=True)
    return canvas


def _layers(figure: ProfileFigure) -> list[tuple[str, str, list[int]]]:
    """The stacked areas bottom up, ``(term, label, series)``: each category term of :attr:`ProfileFigure.stack`,
    in its parts when it has some."""
    layers: list[tuple[str, str, list[int]]] = []
    for name in figure.stack:
        parts = figure.parts.get(name)
        if parts:
            labels = figure.labels.get(name, {})
            layers += [(name, f"{name}: {labels.get(part, part)}", values) for part, values in parts.items()]
        else:
            layers.append((name, name, figure.terms[name]))
    return layers


def _draw_areas(ax: Any, figure: ProfileFigure, scale: float) -> None:
    """The category terms stacked (steps: a value holds until the next op); a term's parts in lighter shades."""
    from matplotlib.colors import to_rgb

    x = range(figure.samples)
    bottom = [0.0] * figure.samples
    categories = [n for n, k in figure.kinds.items() if k == "category"]  # colours by registry order, stable
    layers = _layers(figure)
    for name, label, values in layers:
        siblings = [lab for n, lab, _ in layers if n == name]
        lighter = 0.55 * siblings.index(label) / max(len(siblings) - 1, 1)  # the parts of one term: one hue
        color = tuple(c + (1.0 - c) * lighter for c in to_rgb(f"C{categories.index(name) % 10}"))
        upper = [b + v / scale for b, v in zip(bottom, values)]
        ax.fill_between(x, bottom, upper, step="post", color=color, linewidth=0, label=label)
        bottom = upper
    if figure.cuda_allocated is not None:
        ax.step(x, [v / scale for v in figure.cuda_allocated], where="post", color="black", linewidth=1,
                label="CUDA allocated (allocator)")  # fmt: skip


def _draw_phases(ax: Any, figure: ProfileFigure) -> None:
    """Shade every other phase, draw each boundary and name each phase at the top (narrow ones turned upright)."""
    for i, phase in enumerate(figure.phases):
        if i % 2:
            ax.axvspan(phase.start - 0.5, phase.end - 0.5, color="gray", alpha=0.08, linewidth=0)
        if i:
            ax.axvline(phase.start - 0.5, color="gray", linewidth=0.8, linestyle="-", alpha=0.7)
        narrow = (phase.end - phase.start) < 0.06 * figure.samples
        middle = (phase.start + phase.end - 1) / 2
        ax.text(middle, 0.985, phase.name, transform=ax.get_xaxis_transform(), ha="center", va="top",
                rotation=90 if narrow else 0, fontsize="small", color="dimgray")  # fmt: skip


def _draw_lines(ax: Any, figure: ProfileFigure, scale: float, top: float) -> None:
    """Scope terms (inside the areas) as lines, host terms named; prediction and budget as horizontal lines."""
    x = range(figure.samples)
    for name, kind in figure.kinds.items():
        values = figure.terms[name]
        if kind == "scope" and any(values):
            ax.step(x, [v / scale for v in values], where="post", color="black", linestyle="--", linewidth=1.2,
                    label=f"{name} (a term inside the areas)")  # fmt: skip
        elif kind == "scope":  # said, not hidden: the term exists and held nothing
            why = " (no FusedLoss: the loss's bytes are activations)" if name == LOSS_SCOPE else " (nothing ran in its scope)"
            ax.plot([], [], color="black", linestyle="--", label=f"{name} term: 0 B{why}")
        elif kind == "host":
            where = "in host memory, not drawn" if any(values) else "nothing moved to the host"
            ax.plot([], [], color="none", label=f"{name}: {format_bytes(max(values, default=0))} ({where})")
    for value, label, style in ((figure.prediction, "planner prediction", ":"), (figure.budget, "budget", "--")):
        if value is None:
            continue
        off = " (above the axes)" if value > OFF_SCALE * top else ""  # said, rather than squashing the step
        ax.axhline(value / scale, color="red" if label == "budget" else "black", linestyle=style, linewidth=1.5,
                   label=f"{label} {format_bytes(value)}{off}")  # fmt: skip


def _draw_table(ax: Any, figure: ProfileFigure) -> None:
    """Every term (rows) at each phase's own largest instant (columns), and the step's peak."""
    ax.axis("off")
    if not figure.phase_peaks:
        return
    names = [n for n, k in figure.kinds.items() if k != "host"]
    columns = [f"{p.phase}" for p in figure.phase_peaks] + ["step peak"]
    rows = [[format_bytes(p.terms[n]) for p in figure.phase_peaks] + [format_bytes(figure.peak.terms[n])] for n in names]
    rows.append([format_bytes(p.bytes) for p in figure.phase_peaks] + [format_bytes(figure.peak.bytes)])
    labels = [n if figure.kinds[n] == "category" else f"{n} (inside)" for n in names] + ["total"]
    table = ax.table(cellText=rows, rowLabels=labels, colLabels=columns, loc="center", cellLoc="right")
    table.auto_set_font_size(False)
    table.set_fontsize(8)
    ax.set_title("each term at each phase's own largest instant", fontsize="small", color="dimgray")


def _draw_peak(ax: Any, figure: ProfileFigure, scale: float) -> None:
    peak = figure.peak
    y = peak.bytes / scale
    ax.plot([peak.index], [y], marker="v", color="red", markersize=9, linestyle="none", label="peak")
    share = 100.0 * peak.terms[peak.largest] / max(peak.bytes, 1)
    allocated = peak.allocated + (f" ({peak.allocated_part})" if peak.allocated_part else "")
    lines = [
        f"peak {format_bytes(peak.bytes)} in {peak.phase}",
        f"op {peak.op or '(phase boundary)'}" + (f" in {peak.where}" if peak.where else ""),
        *([f"it allocated {allocated}"] if allocated else []),
        f"largest term: {peak.largest} {format_bytes(peak.terms[peak.largest])} ({share:.0f}%)",
    ]
    right = peak.index > 0.5 * figure.samples  # the note in the top corner away from the peak, in the free band
    ax.annotate("\n".join(lines), (peak.index, y), xytext=(0.02 if right else 0.98, 0.92), textcoords="axes fraction",
                ha="left" if right else "right", va="top", fontsize="small",
                bbox={"boxstyle": "round", "facecolor": "white", "alpha": 0.9, "edgecolor": "red"},
                arrowprops={"arrowstyle": "->", "color": "red"})  # fmt: skip


# -- files ----------------------------------------------------------------------------------------------------
def figure_path(report: Union[str, Path]) -> Path:
    """Where a report's figure data lies: ``hbm_figure{suffix}.json`` beside ``hbm_profile{suffix}.json`` (any path
    whose name starts ``hbm_profile``: its JSON, PNG or CSV). Not ``hbm_profile*``: that pattern finds reports."""
    report = Path(report)
    return report.with_name(report.stem.replace("hbm_profile", "hbm_figure", 1) + ".json")


def redraw(report: Union[str, Path], png: Union[str, Path]) -> Optional[str]:
    """Draw the figure data beside ``report`` (:func:`figure_path`) into ``png``, if there is one (``lightning-hbm
    report`` re-renders a run this way); return the PNG's path, or None when the run has no figure data."""
    path = figure_path(report)
    if not path.is_file():
        return None
    draw_figure(load_figure(path), png)
    return str(png)


def write_figure(figure: ProfileFigure, path: Union[str, Path]) -> str:
    """Write the figure's data as JSON (``hbm_figure.json``); return its path."""
    # a temp file renamed over the name: a link planted there (hbm_figure.json -> a file elsewhere) is replaced, never
    # written through, and a kill mid-write leaves the previous file whole (issue 55)
    atomic_write(path, lambda f: json.dump(figure.as_dict(), f))
    return str(path)


def load_figure(path: Union[str, Path]) -> ProfileFigure:
    """Read a figure written by :func:`write_figure`.

    Raises:
        ValueError: the file is not a figure record.
    """
    data = read_json(path, "HBMProfiler figure record")
    if not isinstance(data, dict):
        raise ValueError(f"report: {str(path)!r} is not an HBMProfiler figure record (not an object).")
    try:
        figure = ProfileFigure.from_dict(data)
    except ValueError as err:
        raise ValueError(f"report: {str(path)!r}: {err}.") from err
    _check_figure(path, figure)
    return figure


def _check_figure(path: Union[str, Path], figure: ProfileFigure) -> None:
    """Numbers where numbers belong, series no longer than :data:`MAX_SAMPLES` (what the profiler writes), the peak
    inside them: else one line naming the file and the field, before anything is drawn."""
    n = len(figure.total) if isinstance(figure.total, list) else -1
    if not 0 < n <= MAX_SAMPLES:
        raise ValueError(f"report: {str(path)!r}: field 'total' holds {n} samples; a figure record holds 1 to {MAX_SAMPLES}.")
    series = {"total": figure.total, **{f"terms.{k}": v for k, v in figure.terms.items()}}
    series.update({f"parts.{t}.{k}": v for t, parts in figure.parts.items() for k, v in parts.items()})
    for name, values in series.items():
        if not isinstance(values, list) or len(values) > MAX_SAMPLES:
            raise ValueError(f"report: {str(path)!r}: field {name!r} is not a series of at most {MAX_SAMPLES} samples.")
        check_numbers(path, name, {str(i): v for i, v in enumerate(values)}, [str(i) for i in range(len(values))])
    check_numbers(path, "peak", {"index": figure.peak.index, "bytes": figure.peak.bytes}, ("index", "bytes"))
    if not 0 <= figure.peak.index < n:
        raise ValueError(f"report: {str(path)!r}: field 'peak.index' is {figure.peak.index!r}, outside the {n} samples.")


__all__ = [
    "MAX_SAMPLES",
    "CREATED_PARTS",
    "REST_PARTS",
    "Peak",
    "PhasePeak",
    "PeakPrediction",
    "Phase",
    "ProfileFigure",
    "build_figure",
    "draw_figure",
    "figure_path",
    "format_bytes",
    "load_figure",
    "prediction_bytes",
    "redraw",
    "write_figure",
]
