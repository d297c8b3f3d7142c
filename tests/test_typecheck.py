"""mypy over the package (``[tool.mypy]`` in pyproject.toml says what it checks and what it does not yet).

The package's annotations are checked against each other and against the libraries' own (torch, Lightning): a call
with the wrong type, an ``Optional`` used without a check, a wrong return type. Every module of the package is
checked (no module's errors are ignored), and a new module is checked from the start. Every function must be
annotated (``disallow_untyped_defs``), so no function's body escapes the check (``check_untyped_defs`` for the rest).
"""

from __future__ import annotations

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
