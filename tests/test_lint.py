"""ruff (``[tool.ruff.lint]`` in pyproject.toml) over the package, the tests, benchmarks and examples. pyflakes: an
unused import or variable, or a name that does not exist (a call that would raise ``NameError`` only on its path).
bugbear: a closure that reads a loop variable after the loop moved on, a mutable default argument, an unused loop
variable, a warning without a stacklevel. simplify: nested ifs and withs, repeated branches, needless booleans. isort:
imports in three sorted groups (standard library, third party, lightning_hbm), except in the ``__init__.py`` faces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_ruff_finds_nothing() -> None:
    # ruff is in the dev extra: a missing ruff is a failure here, not a skip
    done = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "lightning_hbm", "lightning_hbm_factory.py", "tests", "benchmarks", "examples"],
        cwd=ROOT, capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
