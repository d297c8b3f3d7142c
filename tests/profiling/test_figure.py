"""The picture of a step (``hbm_profile.png``) and its data (``hbm_figure.json``), read from a real tiny fit on CPU."""

from __future__ import annotations

import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import Logger

from lightning_hbm import ActivationCheckpointing, FusedLoss, HBMProfiler
from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.memory import CATEGORIES, TERMS
from lightning_hbm.models import NanoGPT
from lightning_hbm.profiling.figure import ProfileFigure, draw_figure, figure_path, load_figure
from lightning_hbm.profiling.timeline import TRAINING_STEP

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)
BUDGET, PREDICTION = 6 * 2**20, 4 * 2**20


class _Metrics(Logger):
    """Keeps what the profiler logs."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: list[dict[str, float]] = []

    @property
    def name(self) -> str:
        return "metrics"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: Any = None) -> None:
        self.metrics.append(dict(metrics))


def _fit(out: Path, *callbacks: pl.Callback, **profiler_args: Any) -> tuple[NanoGPT, HBMProfiler, _Metrics]:
    torch.manual_seed(0)
    model = NanoGPT(**TINY)
    profiler = HBMProfiler(**{"every_n_steps": 1, "detailed_steps": [1], "summary": False, "dirpath": str(out), **profiler_args})
    logger = _Metrics()
    trainer = pl.Trainer(accelerator="cpu", max_steps=3, logger=logger, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         num_sanity_val_steps=0, default_root_dir=out, callbacks=[*callbacks, profiler])  # fmt: skip
    trainer.fit(model, ByteTextDataModule(seq_len=32, batch_size=4, train_samples=64, val_samples=8, max_bytes=100_000))
    return model, profiler, logger


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[NanoGPT, HBMProfiler, _Metrics, Path]:
    out = tmp_path_factory.mktemp("figure")
    model, profiler, logger = _fit(out, budget=BUDGET, prediction=PREDICTION)
    return model, profiler, logger, out


def test_the_figure_data_is_written_next_to_the_png(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    _, profiler, _, out = run
    figure = load_figure(out / "hbm_figure.json")
    assert figure == profiler.figure_data()
    assert sorted(p.name for p in out.glob("hbm_*")) == ["hbm_figure.json", "hbm_profile.csv", "hbm_profile.json", "hbm_profile.png"]
    png = (out / "hbm_profile.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    assert struct.unpack(">II", png[16:24]) == (1400, 800)  # 14 x 8 in at 100 dpi
    assert len(png) > 30_000  # drawn, not an empty canvas


def test_phases_in_order_cover_the_step(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    figure = run[1].figure_data()
    assert [p.name for p in figure.phases] == ["forward", "loss", "zero_grad", "backward", "optimizer"]
    assert figure.phases[0].start == 0 and figure.phases[-1].end == figure.samples
    assert all(a.end == b.start and a.start < a.end for a, b in zip(figure.phases, figure.phases[1:]))
    assert [p.phase for p in figure.phase_peaks] == [p.name for p in figure.phases]
    assert max(p.bytes for p in figure.phase_peaks) == figure.peak.bytes


def test_every_term_at_every_sample_and_the_peak_equals_the_logged_one(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    _, profiler, logger, _ = run
    figure = profiler.figure_data()
    assert list(figure.terms) == [t.name for t in TERMS] and figure.kinds == {t.name: t.kind for t in TERMS}
    assert all(len(values) == figure.samples for values in figure.terms.values())
    for i in range(figure.samples):
        assert sum(figure.terms[c][i] for c in CATEGORIES) == figure.total[i]
    (row,) = [r for r in profiler.rows if r["mode"] == "detailed"]
    # exact bytes on CPU: the picture's peak is the row's tracked peak, term by term
    assert figure.peak.bytes == figure.total[figure.peak.index] == row["tracked_peak"] == row["total"]
    assert {c: figure.peak.terms[c] for c in CATEGORIES} == {c: row[c] for c in CATEGORIES}
    assert figure.peak.terms["loss"] == row["loss"] == 0  # no FusedLoss
    logged = [m for m in logger.metrics if "hbm/tracked_peak" in m]
    assert [m["hbm/tracked_peak"] for m in logged] == [figure.peak.bytes / 2**20]
    assert figure.terms["host_offload"] == [0] * figure.samples
    assert figure.stack[-1] == "other" and sorted(figure.stack) == sorted(CATEGORIES)


def test_the_peak_is_attributed_to_an_op_and_where_it_ran(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    model, profiler, _, _ = run
    figure = profiler.figure_data()
    peak = figure.peak
    # NanoGPT computes its loss in training_step on fp32 logits: the peak is there, made of activations
    assert (peak.phase, peak.op, peak.where) == ("loss", "aten.nll_loss_forward.default", TRAINING_STEP)
    assert (peak.allocated, peak.allocated_part, peak.largest) == ("activations", "loss", "activations")
    assert peak.op in figure.ops[peak.index] and hasattr(torch.ops.aten, peak.op.split(".")[1])
    modules = {name or "<root>" for name, _ in model.named_modules()}
    parameters = {name for name, _ in model.named_parameters()}
    for phase in figure.phases:
        where = {w for w in figure.where[phase.start : phase.end] if w}
        if phase.name == "forward":
            assert where <= modules | {TRAINING_STEP} and "model.h.0.attn.c_attn" in where
        if phase.name == "backward":
            assert {w.removeprefix("backward of ") for w in where} <= modules | {TRAINING_STEP} | parameters
            assert "backward of model.h.1.mlp.c_proj" in where
        if phase.name == "optimizer":  # outside any module: named by the parameter, gradient or state it works on
            assert any(w.split(" ")[0].removesuffix(".grad") in parameters for w in where)


def test_other_is_broken_down_into_what_it_is(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    figure = run[1].figure_data()
    for term, parts in figure.parts.items():
        for i in range(figure.samples):
            assert sum(values[i] for values in parts.values()) == figure.terms[term][i]
    other = figure.parts["other"]
    assert list(other) == ["batch", "backward temporaries", "optimizer temporaries"]
    assert set(other["batch"]) == {2 * 4 * 32 * 8}  # input ids and targets, int64, the whole step
    backward = next(p for p in figure.phases if p.name == "backward")
    assert max(other["backward temporaries"][backward.start : backward.end]) > 0
    assert list(figure.parts["activations"]) == ["forward", "loss"]
    assert figure.labels["other"]["backward temporaries"].startswith("backward temporaries")
    assert figure.notes and figure.notes[0].startswith("CPU: the areas are exact tensor bytes")


def test_the_drawing_shows_every_term_the_peak_budget_and_prediction(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    figure = run[1].figure_data()
    assert (figure.budget, figure.prediction) == (BUDGET, PREDICTION)
    drawn = draw_figure(figure)
    ax = drawn.axes[0]
    areas = [c.get_label() for c in ax.collections]
    assert areas == ["parameters", "optimizer_states", "gradients", "activations: made by the forward",
                     "activations: made by the loss", "other: the batch",
                     "other: backward temporaries (gradients w.r.t. activations)", "other: optimizer-step temporaries"]  # fmt: skip
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert lines["budget 6.00 MiB"].get_ydata()[0] == 6.0 and lines["planner prediction 4.00 MiB"].get_ydata()[0] == 4.0
    assert "loss term: 0 B (no FusedLoss: the loss's bytes are activations)" in lines
    assert "host_offload: 0 B (nothing moved to the host)" in lines
    assert list(lines["peak"].get_xdata()) == [figure.peak.index]
    note = next(t.get_text() for t in ax.texts if t.get_text().startswith("peak "))
    assert "aten.nll_loss_forward.default in training_step" in note and "it allocated activations (loss)" in note
    assert [t.get_text() for t in ax.texts if t.get_text() in {p.name for p in figure.phases}] == [p.name for p in figure.phases]
    assert ax.get_ylim()[1] > BUDGET / 2**20  # the budget is on the axes
    plain = draw_figure(replace(figure, budget=None, prediction=None)).axes[0]
    assert not [line for line in plain.get_lines() if line.get_label().startswith(("budget", "planner"))]


def test_a_budget_far_above_the_step_is_named_not_squashing_it(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path]) -> None:
    figure = replace(run[1].figure_data(), budget=80 * 2**30)
    ax = draw_figure(figure).axes[0]
    assert "budget 80.00 GiB (above the axes)" in [line.get_label() for line in ax.get_lines()]
    assert ax.get_ylim()[1] < 2 * figure.peak.bytes / 2**20


def test_checkpointing_and_fused_loss_show_recomputation_and_the_loss_term(tmp_path: Path) -> None:
    _, profiler, _ = _fit(tmp_path, FusedLoss(chunk_size=32), ActivationCheckpointing())
    figure = load_figure(tmp_path / "hbm_figure.json")
    loss = next(p for p in figure.phases if p.name == "loss")
    assert max(figure.terms["loss"][loss.start : loss.end]) > 0  # FusedLoss's chunks, drawn as their line
    assert max(figure.parts["other"]["recomputed activations"]) > 0
    (row,) = [r for r in profiler.rows if r["mode"] == "detailed"]
    assert figure.peak.bytes == row["tracked_peak"] and figure.peak.terms["loss"] == row["loss"]
    assert any(line.get_label() == "loss (a term inside the areas)" for line in draw_figure(figure).axes[0].get_lines())


def test_without_a_detailed_step_no_figure_is_written(tmp_path: Path) -> None:
    _, profiler, _ = _fit(tmp_path, detailed_steps=[])
    assert profiler.figure_data() is None and not (tmp_path / "hbm_figure.json").exists()
    assert (tmp_path / "hbm_profile.png").exists()  # the forward ends over the steps, as before


def test_a_prediction_from_the_planner_and_bad_arguments() -> None:
    class _Prediction:
        peak = 123

    assert HBMProfiler(prediction=_Prediction()).prediction == 123
    with pytest.raises(ValueError, match=r"HBMProfiler: budget must be >= 1, got 0\."):
        HBMProfiler(budget=0)
    with pytest.raises(TypeError, match="prediction"):
        HBMProfiler(prediction="4GiB")  # type: ignore[arg-type]


def test_load_figure_refuses_another_file(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"rows": []}')
    with pytest.raises(ValueError, match="not an HBMProfiler figure record"):
        load_figure(tmp_path / "x.json")
    with pytest.raises(ValueError, match="not an HBMProfiler figure record"):
        ProfileFigure.from_dict({"step": 1})


def test_the_report_command_redraws_the_picture(run: tuple[NanoGPT, HBMProfiler, _Metrics, Path], tmp_path: Path) -> None:
    from lightning_hbm.cli import main

    main(["report", str(run[3] / "hbm_profile.json"), "--out", str(tmp_path)])
    png = (tmp_path / "hbm_profile.png").read_bytes()
    assert struct.unpack(">II", png[16:24]) == (1400, 800)  # the step's picture, not the forward ends over steps


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d["total"].__setitem__(0, float("nan")), r"holds NaN, which is no byte count"),
        (lambda d: d["total"].__setitem__(0, "12"), r"field '0' is '12', not a number of bytes"),
        (lambda d: d["peak"].__setitem__("index", 10**12), r"field 'peak.index' is 1000000000000, outside the \d+ samples"),
        (lambda d: d.__setitem__("total", [1] * 3_000_000), r"field 'total' holds 3000000 samples; a figure record holds 1 to 2000"),
    ],
    ids=["nan", "string", "peak-index", "3M-samples"],
)
def test_a_bad_figure_record_is_one_line_and_untouched(
    run: tuple[NanoGPT, HBMProfiler, _Metrics, Path], tmp_path: Path, edit: Any, message: str, capsys: pytest.CaptureFixture
) -> None:
    """Issue 55: NaN, strings, a peak index of 1e12 gave tracebacks (matplotlib's "raster overflow"); 3,000,000 samples
    took 79 s and 4.7 GiB to draw."""
    import json
    import shutil

    from lightning_hbm.cli import main

    shutil.copy(run[3] / "hbm_profile.json", tmp_path / "hbm_profile.json")
    data = json.loads(figure_path(run[3] / "hbm_profile.json").read_text())
    edit(data)
    figure = figure_path(tmp_path / "hbm_profile.json")
    figure.write_text(json.dumps(data))
    before = figure.read_bytes()
    with pytest.raises(ValueError, match=message):
        load_figure(figure)
    assert main(["report", str(tmp_path / "hbm_profile.json"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and str(figure) in err
    assert figure.read_bytes() == before
