"""The floors of lightning_hbm's dependencies, read from ``requirements.txt`` (which ``pyproject.toml`` reads too)."""

from __future__ import annotations

import functools
from importlib import resources

from packaging.requirements import Requirement


@functools.cache
def requirement(name: str) -> str:
    """``name``'s requirement as this package states it, e.g. ``"peft>=0.15"`` (for ``RequirementCache``)."""
    text = resources.files("lightning_hbm").joinpath("requirements.txt").read_text()
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            parsed = Requirement(line)
            if parsed.name == name:
                return f"{parsed.name}{parsed.specifier}"
    raise KeyError(f"{name} is not a core dependency of lightning_hbm (see lightning_hbm/requirements.txt)")


__all__ = ["requirement"]
