"""Structure the layering test cannot see (issue #35): small functions where the engine and the formats live, and
the engine behind a face."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "lightning_hbm"
MAX_LINES = 60


def _long_functions_without_reason(folder: Path) -> list[str]:
    """Functions over MAX_LINES lines whose body has no comment saying why ("on purpose")."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
                if length > MAX_LINES and "on purpose" not in body:
                    found.append(f"{path.relative_to(folder.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_long_function_without_a_reason_in_precision_surgery_resume() -> None:
    long = [f for sub in ("precision", "surgery", "resume") for f in _long_functions_without_reason(ROOT / sub)]
    assert not long, "split these, or say in a comment why the function is long 'on purpose':\n" + "\n".join(long)


def test_the_check_catches_a_long_function(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "m.py").write_text(f"def f():\n{body}\n\n\ndef g():\n    # one function on purpose\n{body}\n")
    assert _long_functions_without_reason(tmp_path) == [f"{tmp_path.name}/m.py:1 f (61 lines)"]


def test_the_surgery_package_is_a_face_over_its_engine() -> None:
    face = ast.parse((ROOT / "surgery" / "__init__.py").read_text())
    defined = [n.name for n in face.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
    assert not defined, f"surgery/__init__.py defines {defined}: the engine lives in surgery/engine.py"
    assert (ROOT / "surgery" / "engine.py").exists()
