"""The profiler's files written through a temp file and a rename (``atomic_write``: the report, its CSV and PNG,
``hbm_figure.json``, a drawn figure) get the mode a plain ``open`` gives them: the user's umask on a new file, the
file's own mode on one replaced (session 30 review: ``tempfile.mkstemp`` made each 0600, unreadable by the team
sharing a run folder, where ``open`` had given 0644; session 29 moved the figure files onto this path too)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_hbm.memory.report import atomic_write


@pytest.fixture
def umask_022():  # type: ignore[no-untyped-def]
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_a_new_file_gets_the_umasks_mode(tmp_path: Path, umask_022: None) -> None:
    atomic_write(tmp_path / "hbm_figure.json", lambda f: f.write("{}"))
    with open(tmp_path / "plain.json", "w") as f:
        f.write("{}")
    assert _mode(tmp_path / "hbm_figure.json") == _mode(tmp_path / "plain.json") == 0o644  # was 0o600


def test_a_replaced_file_keeps_its_mode_and_a_link_there_is_replaced_not_followed(tmp_path: Path, umask_022: None) -> None:
    target = tmp_path / "hbm_profile.csv"
    target.write_text("old")
    os.chmod(target, 0o640)
    atomic_write(target, lambda f: f.write("new"), newline="")
    assert target.read_text() == "new" and _mode(target) == 0o640
    elsewhere = tmp_path / "elsewhere.txt"
    elsewhere.write_text("mine")
    os.chmod(elsewhere, 0o600)
    link = tmp_path / "hbm_profile.png"
    link.symlink_to(elsewhere)
    atomic_write(link, lambda f: f.write(b"png"), binary=True)
    assert not link.is_symlink() and link.read_bytes() == b"png" and elsewhere.read_text() == "mine"
    assert _mode(link) == 0o644  # a new file (the link's target's mode is not taken)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere.txt", "hbm_profile.csv", "hbm_profile.png"]


def test_a_failed_write_leaves_the_file_and_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "hbm_profile.json"
    target.write_text("whole")

    def fail(f: object) -> None:
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(target, fail)
    assert target.read_text() == "whole" and [p.name for p in tmp_path.iterdir()] == ["hbm_profile.json"]
