"""docs/extending.md's map of the package names every module (issue 54: "docs/extending.md draws the new map").

Session 33 found 49 modules the map did not name (the layer kinds, the modes, `activations/regenerate`, the memory
modules, the planner's API, the strategies, `_compat`, ...). A module added without its line in the map fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_hbm"


def _layout() -> str:
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("## Project layout and the layering rule"):]
    return section[: section.index("\n## ", 1)]


def _items(section: str) -> list[str]:
    """The map's top-level items, each with its nested items and continuation lines."""
    return [item for item in re.split(r"\n(?=- )", section) if item.startswith("- ")]


def _named(stem: str, text: str) -> bool:
    return re.search(rf"`[^`\n]*\b{re.escape(stem)}\b[^`\n]*`", text) is not None


def unnamed_modules(section: str) -> list[str]:
    items = _items(section)
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if path.name in ("__init__.py", "__main__.py"):
            continue
        stem = path.stem
        if len(relative.parts) == 1:  # a top-level module: named anywhere in the section
            found = _named(stem, section)
        else:  # a package's module: named in the item that names its package
            package = f"lightning_hbm/{relative.parts[0]}/"
            found = any(package in item and _named(stem, item) for item in items)
        if not found:
            missing.append(str(relative))
    return missing


def test_the_map_names_every_module_of_the_package() -> None:
    missing = unnamed_modules(_layout())
    assert missing == [], (
        f"docs/extending.md's 'Project layout' does not name {missing}: add each to the item of its package, with its job"
    )


def test_the_check_catches_a_module_the_map_leaves_out() -> None:
    section = _layout().replace("`cpu_offload` (`CPUOffloadStrategy`)", "(`CPUOffloadStrategy`)")
    assert unnamed_modules(section) == ["strategies/cpu_offload.py"]
