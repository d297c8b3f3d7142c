"""HBMProfiler names another run's report in its directory at fit start (session 29 review): two runs writing to the
same ``dirpath`` had the second replace the first's ``hbm_profile.json``, ``.csv``, ``.png`` without a word. Lightning's
ModelCheckpoint warns "Checkpoint directory ... exists and is not empty"; nothing is deleted."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any, Callable

import lightning.pytorch as pl
import pytest

from lightning_hbm import HBMProfiler
from lightning_hbm.memory.report import render_report
from lightning_hbm.models import NanoGPT


def _fit(profiler: HBMProfiler, gpt_factory: Callable[..., NanoGPT], datamodule_factory: Callable[..., Any],
         trainer_factory: Callable[..., pl.Trainer], steps: int) -> None:  # fmt: skip
    trainer_factory(callbacks=[profiler], max_steps=steps).fit(gpt_factory(), datamodule_factory())


def _earlier(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "already holds another run's report" in str(w.message)]


def test_a_second_run_into_the_same_dirpath_is_warned_by_name_and_nothing_is_deleted(
    gpt_factory: Callable[..., NanoGPT], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer], tmp_path: Path
) -> None:
    folder = tmp_path / "report"
    with warnings.catch_warnings(record=True) as caught:  # a fresh folder: no word
        warnings.simplefilter("always")
        _fit(HBMProfiler(every_n_steps=1, detailed_steps=(), summary=False, dirpath=str(folder)), gpt_factory, datamodule_factory, trainer_factory, 2)
    assert _earlier(caught) == []
    assert len(json.loads((folder / "hbm_profile.json").read_text())["rows"]) == 2
    (folder / "hbm_profile.orig").write_text("{}")  # a copy the user kept: not the report's, not named
    match = (
        r"HBMProfiler: the report directory '.*report' already holds another run's report: hbm_profile.csv, "
        r"hbm_profile.json(, hbm_profile.png)?\. This fit replaces them .*nothing was deleted\. To keep them, pass a "
        r"fresh directory, e.g. HBMProfiler\(dirpath='.*report/run2'\), or move them away before fitting\."
    )
    with pytest.warns(UserWarning, match=match):
        _fit(HBMProfiler(every_n_steps=1, detailed_steps=(), summary=False, dirpath=str(folder)), gpt_factory, datamodule_factory, trainer_factory, 3)
    assert len(json.loads((folder / "hbm_profile.json").read_text())["rows"]) == 3  # replaced, as it was said
    assert (folder / "hbm_profile.orig").read_text() == "{}"
    for _ in range(2):  # re-rendering the report beside itself still works, and says nothing
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            render_report(folder / "hbm_profile.json")
        assert _earlier(caught) == []


def test_a_reused_profiler_without_dirpath_names_the_first_fits_report(
    gpt_factory: Callable[..., NanoGPT], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., pl.Trainer], tmp_path: Path
) -> None:
    profiler = HBMProfiler(every_n_steps=1, detailed_steps=(), summary=False)
    _fit(profiler, gpt_factory, datamodule_factory, trainer_factory, 1)
    assert (tmp_path / "hbm_profile.json").is_file()  # the Trainer's default_root_dir
    with pytest.warns(UserWarning, match=r"hbm_profile.json.*pass HBMProfiler\(dirpath=<a fresh directory>\) or use a logger"):
        _fit(profiler, gpt_factory, datamodule_factory, trainer_factory, 1)
