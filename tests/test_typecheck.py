"""mypy over the package (``[tool.mypy]`` in pyproject.toml says what it checks and what it does not yet).

The package's annotations are checked against each other and against the libraries' own (torch, Lightning): a call
with the wrong type, an ``Optional`` used without a check, a wrong return type. Every module of the package is
checked (no module's errors are ignored), and a new module is checked from the start. Every function must be
annotated (``disallow_untyped_defs``), so no function's body escapes the check (``check_untyped_defs`` for the rest).
transformers' model families are analysed only where the package names them (pyproject.toml says why: a fresh clone's
run took 33 s, 19.5 s without the others); the second test fails a family imported but not listed there.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_mypy_finds_nothing() -> None:
    # mypy is in the dev extra: a missing mypy is a failure here, not a skip. The cache is the repository's own
    # .mypy_cache (git-ignored): incremental after the first run.
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "lightning_hbm", "lightning_hbm_factory.py", "--cache-dir", str(ROOT / ".mypy_cache")],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_transformers_family_the_package_imports_is_analysed() -> None:
    # pyproject.toml skips transformers.models.* but the families it lists: a module of an unlisted family imported by
    # its full name would be Any to mypy, unchecked and unsaid. (From the top level it is an attr-defined error.)
    pyproject = (ROOT / "pyproject.toml").read_text()  # text, not tomllib: Python 3.10 is supported
    followed = set(re.findall(r'"transformers\.models\.(\w+)\.\*"', pyproject))
    assert {"auto", "llama"} <= followed, followed
    sources = [*(ROOT / "lightning_hbm").rglob("*.py"), ROOT / "lightning_hbm_factory.py"]
    imported = {(path.relative_to(ROOT).as_posix(), family) for path in sources
                for family in re.findall(r"transformers\.models\.(\w+)", path.read_text())}
    assert imported, "the scan found no transformers.models import (heads.py reads transformers.models.auto)"
    unlisted = sorted((path, family) for path, family in imported if family not in followed)
    assert not unlisted, (f"{unlisted}: add each family to the followed transformers.models overrides in pyproject.toml "
                          "([[tool.mypy.overrides]], follow_imports = \"silent\") so mypy checks its calls")
