"""The memory report: CSV, JSON, PNG and console summary of measured steps, for the profiler and the CLI.

One renderer for :class:`~lightning_hbm.HBMProfiler` (at the end of fit and on out-of-memory) and for
``lightning-hbm report RUN_DIR`` (re-rendering a finished run from its JSON), so both show the same
thing. A report is a list of rows, one per measured step, in bytes: ``step``, ``mode`` (``light``:
the forward's end; ``detailed``: the whole step's tracked peak; ``oom``: the forward of a failed
step), one value per :data:`~lightning_hbm.memory.CATEGORIES`, ``total``, ``tracked_peak`` and any
further columns the profiler adds (CUDA allocator figures, ...): those are written and printed too.

Two figures are kept apart because they are measured at different points of a step:

- **forward end** (light rows): the graph holds every activation and the previous step's gradients
  are still alive. Cheap to measure, so it is measured often.
- **step peak** (detailed rows): the largest live total over the whole step, backward and optimizer
  temporaries included (as ``other``). This is what :func:`lightning_hbm.plan` predicts, so this is
  the figure to compare with the planner's.
"""

from __future__ import annotations

import csv
import json
import math
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

from lightning_utilities.core.imports import RequirementCache

from lightning_hbm.memory.categories import CATEGORIES, MemoryBreakdown
from lightning_hbm.memory.facts import RunFacts
from lightning_hbm.memory.terms import TERMS, host_terms, term

_RICH_AVAILABLE = RequirementCache("rich")
_MATPLOTLIB_AVAILABLE = RequirementCache("matplotlib")
_MIB = 2**20

#: The lightning_hbm feature that shrinks each term (used by the diagnosis): the registry's ``remedy``.
REMEDIES: dict[str, str] = {t.name: t.remedy for t in TERMS}

def advice(category: str, facts: RunFacts) -> str:
    """What shrinks the term ``category`` next, given what the run applied (``facts``).

    The term's ``advise`` in :data:`~lightning_hbm.memory.terms.TERMS` (the step after the features the run already
    uses, so a QLoRA run is not told to quantize and add LoRA), else its ``remedy`` (:data:`REMEDIES`).

    Args:
        category: a term's name (a category, or a term beside the sum).
        facts: what the run applied, filled by the caller (``HBMProfiler`` from its Trainer).

    Raises:
        KeyError: ``category`` is not a memory term.
    """
    entry = term(category)
    said = entry.advise(facts) if entry.advise is not None else None
    return entry.remedy if said is None else said


#: Columns every row has; any other column is an extra figure, written and printed when present.
REQUIRED = ("step", "mode", *CATEGORIES, "total")
_NOT_EXTRA = frozenset((*REQUIRED, "batch_idx", "tracked_peak"))

FORWARD_END = "forward end: graph alive, previous gradients not yet zeroed (light mode)"
STEP_PEAK = "step peak: whole step incl. backward/optimizer temporaries (detailed mode; what the planner predicts)"


@dataclass
class MemoryReport:
    """Measured steps (``rows``, bytes), per-module breakdowns of detailed steps, CUDA snapshot path, and
    what the run used (``used``: ``transforms``, ``optimizers``, ``precision``, AutoFit's ``budget`` and
    ``predicted_peak``, and ``facts``, the :class:`~lightning_hbm.memory.facts.RunFacts` the advice reads, as
    :meth:`RunFacts.as_dict` wrote it; see :func:`lightning_hbm.profiling.profiler.run_setup`)."""

    rows: list[dict[str, Any]]
    columns: Sequence[str] = ()  # CSV columns; default: the first row's keys
    modules: dict[int, dict[str, dict[str, int]]] = field(default_factory=dict)
    snapshot: Optional[str] = None
    used: dict[str, Any] = field(default_factory=dict)

    @property
    def facts(self) -> RunFacts:
        """What the run applied (``used["facts"]``; a plain run when the report holds none)."""
        return RunFacts.from_dict(self.used.get("facts"))

    # -- the figures ----------------------------------------------------------------------------
    def peak_row(self) -> Optional[dict[str, Any]]:
        """The measured step with the largest category total, whatever its mode."""
        return max(self.rows, key=lambda r: r["total"]) if self.rows else None

    def forward_end_peak(self) -> Optional[dict[str, Any]]:
        """The light (or out-of-memory) row with the largest total: the largest forward-end figure."""
        rows = [r for r in self.rows if r["mode"] != "detailed"]
        return max(rows, key=lambda r: r["total"]) if rows else None

    def step_peak(self) -> Optional[dict[str, Any]]:
        """The detailed row with the largest tracked peak: the whole-step peak, comparable with the planner."""
        rows = [r for r in self.rows if r["mode"] == "detailed"]
        return max(rows, key=lambda r: r["total"]) if rows else None

    def diagnosis(self) -> str:
        """The terms of the last measured step, largest first, each with advice the run does not already follow."""
        if not self.rows:
            return "No step was measured before the failure (it happened in the first forward or before training)."
        row, facts = self.rows[-1], self.facts
        breakdown = MemoryBreakdown(**{c: row[c] for c in CATEGORIES})
        top = breakdown.dominant()
        share = 100.0 * row[top] / max(breakdown.total, 1)
        text = (
            f"At step {row['step']} {top} held {row[top] / _MIB:.1f} MiB ({share:.0f}% of "
            f"{breakdown.total / _MIB:.1f} MiB measured). To shrink it: {advice(top, facts)}."
        )
        # the next terms too: once the largest is already as small as the features make it, they are what is left
        rest = sorted((c for c in CATEGORIES if c != top and row[c] >= 0.1 * max(breakdown.total, 1)), key=lambda c: -row[c])
        nexts = [f"{c} ({row[c] / _MIB:.1f} MiB): {advice(c, facts)}" for c in rest[:2]]
        return text + (f" Next: {'; '.join(nexts)}." if nexts else "")

    # -- files ----------------------------------------------------------------------------------
    def write(self, directory: Union[str, Path], stem: str, keep: Optional[Union[str, Path]] = None) -> dict[str, str]:
        """Write ``{stem}.csv``, ``{stem}.json`` and (matplotlib installed) ``{stem}.png``; return their paths.

        Each file goes through a temp file beside it and a rename (:func:`atomic_write`): a full disk leaves the
        previous file whole. ``keep``: a file never written (the report's own input, when re-rendered beside it).
        """
        directory = str(directory)
        os.makedirs(directory, exist_ok=True)
        paths = {"csv": os.path.join(directory, f"{stem}.csv"), "json": os.path.join(directory, f"{stem}.json")}
        kept = Path(keep).resolve() if keep is not None else None
        columns = list(self.columns or (self.rows[0] if self.rows else REQUIRED))

        def write_csv(f: Any) -> None:
            writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
            writer.writeheader()
            writer.writerows({k: ("" if row.get(k) is None else row[k]) for k in columns} for row in self.rows)

        atomic_write(paths["csv"], write_csv, newline="")
        peak, forward_end, step_peak = self.peak_row(), self.forward_end_peak(), self.step_peak()
        report = {
            "categories": list(CATEGORIES),
            "unit": "bytes",
            "columns": columns,
            "rows": self.rows,
            "peak_step": peak["step"] if peak else None,
            "peak": peak,
            "forward_end_peak": forward_end,
            "step_peak": step_peak,
            "modules": {str(step): modules for step, modules in self.modules.items()},
            "used": self.used,
            "diagnosis": self.diagnosis(),
            "snapshot": self.snapshot,
        }
        if kept is None or Path(paths["json"]).resolve() != kept:
            atomic_write(paths["json"], lambda f: json.dump(report, f, indent=1))
        if _MATPLOTLIB_AVAILABLE and self.rows:
            paths["png"] = os.path.join(directory, f"{stem}.png")
            figure = plot(self.rows, None, self.used)
            atomic_write(paths["png"], lambda f: figure.savefig(f, dpi=100, format="png"), binary=True)
        return paths

    @classmethod
    def load(cls, path: Union[str, Path]) -> "MemoryReport":
        """Read a report written by :meth:`write` (``path``: the JSON, or a run directory searched for the newest)."""
        json_path = find_report(path)
        report = read_json(json_path, "HBMProfiler report")
        try:
            rows = report["rows"]
            modules = {int(step): m for step, m in report.get("modules", {}).items()}
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as err:
            raise ValueError(f"report: {str(json_path)!r} is not an HBMProfiler report ({type(err).__name__}: {err}).") from err
        if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) and all(c in row for c in REQUIRED) for row in rows):
            raise ValueError(f"report: {str(json_path)!r} holds no complete measured step; nothing to render.")
        for i, row in enumerate(rows):
            check_numbers(json_path, f"rows[{i}]", row, ("step", *CATEGORIES, "total"))
        return cls(rows, report.get("columns") or (), modules, report.get("snapshot"), report.get("used") or {})

    # -- console ----------------------------------------------------------------------------------
    def summary_lines(self) -> tuple[str, list[tuple[str, ...]], list[str]]:
        """(title, table rows with a header first, notes): each category at the forward-end and step peaks."""
        forward_end, step_peak = self.forward_end_peak(), self.step_peak()
        shown = [(f"forward end, step {r['step']}", r) for r in (forward_end,) if r is not None]
        shown += [(f"step peak, step {r['step']}", r) for r in (step_peak,) if r is not None]
        last = shown[-1][1]
        header = ("category", *(name for name, _ in shown), "share")
        lines: list[tuple[str, ...]] = [header]
        for category in (*CATEGORIES, "total"):
            share = 100.0 * last[category] / max(last["total"], 1)
            lines.append((category, *(f"{r[category] / _MIB:,.2f}" for _, r in shown), f"{share:.0f}%"))
        host = {t.name for t in host_terms()}
        for extra in self._extra_columns():
            # a host term (host_offload) only when a feature moved memory there: 0 on every plain run
            if any(r.get(extra) is not None and (extra not in host or r[extra]) for _, r in shown):
                values = ("" if r.get(extra) is None else f"{r[extra] / _MIB:,.2f}" for _, r in shown)
                lines.append((extra, *values, ""))
        steps = sorted({r["step"] for r in self.rows})
        title = f"HBMProfiler (MiB): {len(steps)} steps measured ({_ranges(steps)})"
        notes = [FORWARD_END] if forward_end is not None else []
        if step_peak is not None:
            notes.append(STEP_PEAK)
        else:
            notes.append("step peak: not measured (no detailed step ran); HBMProfiler(detailed_steps=[1]) measures it")
        return title, lines, notes

    def print_summary(self, paths: Optional[dict[str, str]] = None) -> None:
        """Print :meth:`summary_lines` (a rich table when rich is installed) and the report's paths."""
        if not self.rows:
            return
        title, lines, notes = self.summary_lines()
        footer = [*notes, *([f"Report: {', '.join(paths.values())}"] if paths else [])]
        if _RICH_AVAILABLE:
            from rich.console import Console
            from rich.table import Table

            table = Table(title=title)
            for i, name in enumerate(lines[0]):
                table.add_column(name, justify="left" if i == 0 else "right")
            for line in lines[1:]:
                table.add_row(*line)
            console = Console()
            console.print(table)
            for note in footer:
                console.print(note, highlight=False, soft_wrap=True)
        else:
            print(title)
            print("\n".join(format_table(lines)))
            print("\n".join(footer))

    def _extra_columns(self) -> list[str]:
        columns = self.columns or (self.rows[0] if self.rows else ())
        return [c for c in columns if c not in _NOT_EXTRA]


def format_table(lines: Sequence[Sequence[str]]) -> list[str]:
    """Plain-text table: first column left-aligned, the others right-aligned, widths from the content."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return [
        "  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths))) for line in lines
    ]


#: the largest report or figure file read (a run's report is kilobytes; a figure at most MAX_SAMPLES per series)
MAX_INPUT_BYTES = 64 << 20


def _no_constant(name: str) -> Any:
    raise ValueError(f"holds {name}, which is no byte count")


def read_json(path: Union[str, Path], what: str) -> Any:
    """The JSON in ``path``, read only (never written), as one clear ``ValueError`` naming the file when it is too
    large, not JSON, nested too deep, or holds NaN/Infinity (issue 55: tracebacks, and 79 s / 4.7 GiB to draw)."""
    path = Path(path)
    size = path.stat().st_size
    if size > MAX_INPUT_BYTES:
        raise ValueError(f"report: {str(path)!r} is {size / 2**20:.0f} MiB, over the {MAX_INPUT_BYTES >> 20} MiB an {what} can be; it is not one.")
    try:
        return json.loads(path.read_text(), parse_constant=_no_constant)
    except RecursionError:
        raise ValueError(f"report: {str(path)!r} is nested too deep to be an {what}.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"report: {str(path)!r} is not an {what} (not JSON: {err}).") from err
    except ValueError as err:
        raise ValueError(f"report: {str(path)!r} is not an {what}: it {err}.") from err


def check_numbers(path: Union[str, Path], where: str, values: Mapping[str, Any], fields: Sequence[str], optional: bool = False) -> None:
    """Each of ``fields`` of ``values`` a finite int or float (``optional``: or None/absent), else a ``ValueError``
    naming the file, the place and the field."""
    for name in fields:
        value = values.get(name)
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"report: {str(path)!r}: {where} field {name!r} is {value!r}, not a number of bytes.")


def _umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux ``/proc``)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and put back at once (the only portable way to read it)
    os.umask(mask)
    return mask


def plain_file_mode(path: Union[str, Path]) -> int:
    """The permission bits ``open(path, "w")`` would leave ``path`` with: those of the regular file there (a
    replaced file keeps its mode), else ``0o666`` less the umask. A file written through a temp file (``mkstemp``:
    0600) and renamed into place gets these, so a run's files in a team folder stay readable as a plain Lightning
    run's are (were 0600: the team lost access to every checkpoint, report and adapter weights file)."""
    try:
        stat = os.lstat(path)
        if (stat.st_mode & 0o170000) == 0o100000:  # a regular file, not a link or a folder
            return stat.st_mode & 0o7777
    except OSError:
        pass
    return 0o666 & ~_umask()


def set_mode(fd: Optional[int], path: Union[str, Path], mode: int) -> None:
    """Give the file open as ``fd`` (or, without one, at ``path``) the permission bits ``mode``; where the system
    refuses (a filesystem without modes), the file keeps the one it has."""
    try:
        if fd is not None and hasattr(os, "fchmod"):
            os.fchmod(fd, mode)
        else:
            os.chmod(path, mode)
    except OSError:
        pass


def atomic_write(path: Union[str, Path], write: Callable[[Any], Any], binary: bool = False, newline: Optional[str] = None) -> None:
    """Call ``write(file)`` on a temp file beside ``path``, fsync it, then rename it over ``path`` in one step.

    On any error the temp file is removed and ``path`` is as it was (a report's input is never cut half-way).
    """
    path = Path(path)
    mode = plain_file_mode(path)
    fd, temp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".lightning_hbm-partial")
    try:
        set_mode(fd, temp, mode)
        with os.fdopen(fd, "wb" if binary else "w", newline=newline) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    except BaseException:
        Path(temp).unlink(missing_ok=True)
        raise


def find_report(path: Union[str, Path]) -> Path:
    """The report ``hbm_profile*.json`` at ``path`` (a file, or the newest one under a run directory)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_dir():
        raise ValueError(f"report: {str(path)!r} is neither a run directory nor an hbm_profile.json file.")
    found = sorted(path.rglob("hbm_profile*.json"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise ValueError(
            f"report: no hbm_profile*.json under {str(path)!r}. Train with the HBMProfiler callback "
            "(`- class_path: HBMProfiler` in trainer.callbacks) to write one."
        )
    return found[-1]


def render_report(path: Union[str, Path], out_dir: Optional[Union[str, Path]] = None) -> dict[str, str]:
    """Re-render a finished run's profiler report: summary table, CSV, JSON and plot, from its JSON.

    Written next to the JSON unless ``out_dir`` is given. Returns the paths written.
    """
    json_path = find_report(path)
    report = MemoryReport.load(json_path)
    out = Path(out_dir or json_path.parent)
    _refuse_replacing(out, json_path, report)
    try:
        paths = report.write(out, json_path.stem, keep=json_path)  # the input is only read, never written
    except OSError as err:  # a full disk, a read-only folder: one line; each file written is whole or as it was
        raise ValueError(f"report: could not write the report under {str(out)!r} ({err}); {str(json_path)!r} is unchanged.") from err
    report.print_summary(paths)
    print(report.diagnosis())
    return paths


def _refuse_replacing(out: Path, json_path: Path, report: MemoryReport) -> None:
    """A ``ValueError`` before anything is written when re-rendering ``json_path`` into ``out`` would replace a file
    that is not this report's: another report's JSON (``hbm_profile.orig`` re-rendered beside the live
    ``hbm_profile.json``), or a user's file beside an input not named ``hbm_profile*`` (``results.json``'s
    ``results.csv``). Issue 55: both were replaced without a word."""
    stem, kept = json_path.stem, json_path.resolve()
    target = out / f"{stem}.json"
    if target.is_file() and target.resolve() != kept:
        try:
            same = read_json(target, "HBMProfiler report").get("rows") == report.rows
        except (OSError, ValueError, AttributeError):
            same = False
        if not same:
            raise ValueError(
                f"report: re-rendering {str(json_path)!r} would replace {str(target)!r}, which holds another report "
                f"(or no report), and nothing was written. Pass --out to another folder, or rename the input "
                f"hbm_profile_<name>.json."
            )
    if stem.startswith("hbm_profile") or _written_here(out / f"{stem}.csv", report):
        return  # its CSV and PNG are the report's own files (or an earlier re-render's): replaced as before
    for suffix in (".csv", ".png"):
        other = out / f"{stem}{suffix}"
        if other.exists() or other.is_symlink():
            raise ValueError(
                f"report: re-rendering {str(json_path)!r} would replace {str(other)!r}, a file that is not the "
                f"profiler's (its name does not start with hbm_profile), and nothing was written. Pass --out to "
                f"another folder, or rename the input hbm_profile_<name>.json."
            )


def _written_here(csv_path: Path, report: MemoryReport) -> bool:
    """Is ``csv_path`` a report's CSV (an earlier re-render of this input wrote it): its first line the header
    :meth:`MemoryReport.write` writes."""
    columns = list(report.columns or (report.rows[0] if report.rows else REQUIRED))
    try:
        with open(csv_path, newline="") as f:
            return f.readline().rstrip("\r\n") == ",".join(columns)
    except (OSError, UnicodeDecodeError):
        return False


def _ranges(steps: list[int]) -> str:
    """``[0, 1, 2, 3, 4, 10, 20]`` -> ``"steps 0-4, 10, 20"``."""
    parts: list[str] = []
    start = prev = steps[0]
    for step in (*steps[1:], None):
        if step is not None and step == prev + 1:
            prev = step
            continue
        parts.append(f"{start}-{prev}" if prev > start else str(start))
        if step is not None:
            start = prev = step
    return "steps " + ", ".join(parts)


def plot(rows: list[dict[str, Any]], path: Optional[str] = None, used: Optional[dict[str, Any]] = None) -> Any:
    """The report's figure: forward-end categories over steps (left), each detailed step's peak by category (right).

    Left: the light rows' categories stacked over the global steps (a single step as a stacked bar).
    Right: one stacked bar per detailed step, the step peak broken down the way the console table is,
    so ``other`` (backward and optimizer temporaries) shows where it matters. Both panels share the
    y axis and draw the budget (``used["budget"]``) and, on the right, the planner's prediction
    (``used["predicted_peak"]``, when :class:`~lightning_hbm.AutoFit` ran). Each bar series and line
    carries a ``label`` (category, ``"budget"``, ``"planner prediction"``) so its data can be read back.
    Returns the matplotlib ``Figure`` (saved to ``path`` when given).
    """
    # Figure + Agg canvas directly: no global pyplot backend switch in the user's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    used = used or {}
    light = [r for r in rows if r["mode"] != "detailed"]
    detailed = [r for r in rows if r["mode"] == "detailed"]
    figure = Figure(figsize=(11, 4.5))
    FigureCanvasAgg(figure)
    panels = [("forward end (light steps)", light, "stack"), ("step peak (detailed steps)", detailed, "bars")]
    panels = [p for p in panels if p[1]]
    axes = figure.subplots(1, len(panels), sharey=True, squeeze=False, width_ratios=[3, 1][: len(panels)])[0]
    colors = {c: f"C{i}" for i, c in enumerate(CATEGORIES)}
    top = max([r["total"] for r in rows] + [used.get("budget") or 0, used.get("predicted_peak") or 0]) / _MIB
    for ax, (title, panel_rows, kind) in zip(axes, panels):
        steps = [r["step"] for r in panel_rows]
        if kind == "stack" and len(panel_rows) > 1:
            ax.stackplot(steps, [[r[c] / _MIB for r in panel_rows] for c in CATEGORIES], labels=list(CATEGORIES),
                         colors=[colors[c] for c in CATEGORIES])  # fmt: skip
        else:  # stacked bars, one per step: positions 0..n-1 on the peak panel (detailed steps are sparse)
            x = list(range(len(steps))) if kind == "bars" else steps
            bottom = [0.0] * len(steps)
            for c in CATEGORIES:
                values = [r[c] / _MIB for r in panel_rows]
                ax.bar(x, values, bottom=bottom, width=0.6, label=c, color=colors[c])
                bottom = [b + v for b, v in zip(bottom, values)]
            ax.set_xticks(x, [str(s) for s in steps])
            for xi, total in zip(x, bottom):
                ax.annotate(f"{total:.1f}", (xi, total), xytext=(0, 3), textcoords="offset points", ha="center", fontsize="small")
        if used.get("budget"):
            ax.axhline(used["budget"] / _MIB, color="red", linestyle="--", label="budget")
        if kind == "bars" and used.get("predicted_peak"):
            ax.axhline(used["predicted_peak"] / _MIB, color="black", linestyle=":", label="planner prediction")
        if any(r.get("cuda_peak_allocated") is not None for r in panel_rows) and kind == "stack":
            ax.plot(steps, [(r["cuda_peak_allocated"] or 0) / _MIB for r in panel_rows], color="black", label="CUDA peak allocated")
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("global step")
    axes[0].set_ylabel("MiB")
    axes[0].set_ylim(0, top * 1.2)  # room above the tallest bar for its label
    figure.suptitle("HBMProfiler: memory by category")
    handles = {h.get_label(): h for ax in axes for h in ax.get_legend_handles_labels()[0]}
    # outside the axes: a legend inside would cover the bars on long runs
    axes[-1].legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(1.02, 1.0), fontsize="small")
    figure.tight_layout()
    if path is not None:
        figure.savefig(path, dpi=100)
    return figure


__all__ = [
    "FORWARD_END",
    "REMEDIES",
    "STEP_PEAK",
    "MemoryReport",
    "RunFacts",
    "advice",
    "find_report",
    "format_table",
    "plain_file_mode",
    "plot",
    "set_mode",
    "MAX_INPUT_BYTES",
    "atomic_write",
    "check_numbers",
    "read_json",
    "render_report",
]
