"""Module names: the one rule options match them by, and how error messages list them.

:func:`name_matches` is the rule of every option that names modules (LoRA's ``target_modules``,
``exclude_modules`` and ``modules_to_save``, ``QuantizedPrecision(ignore_modules=...)``); :func:`under` says
whether a name is inside another, :func:`selected` what an option covers in a whole model. How messages list names: distinct short names first, then a few full paths.
A model with 28 Linear layers has 7 distinct names (``q_proj``, ``k_proj``, ...): those are what a user
types (``target_modules: [q_proj]`` matches every ``...self_attn.q_proj``), so they come first and in
full; full paths follow as examples only, so the message stays one readable line.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
from collections.abc import Iterable, Sequence
from typing import Any, Union

from torch import nn


def has_submodule(module: nn.Module, name: str) -> bool:
    """Whether ``module.get_submodule(name)`` finds a module (a name read back from a file may not)."""
    try:
        module.get_submodule(name)
    except AttributeError:
        return False
    return True


def under(name: str, prefixes: Iterable[str]) -> bool:
    """Whether module ``name`` is one of ``prefixes`` or inside one (``a.b`` is under ``a``; ``ab`` is not)."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def name_matches(name: str, patterns: Union[str, Sequence[str]]) -> bool:
    """Whether module ``name`` is selected by ``patterns``, as every module-name option selects.

    Args:
        name: a full module name (``model.layers.0.self_attn.q_proj``).
        patterns: one string, a regex that must match the full name; or a list of names and glob patterns. A name
            also matches as a dotted suffix (``q_proj`` is ``model.layers.0.self_attn.q_proj``, as in peft); a glob
            matches the full name (``*.mixer.*_proj``).
    """
    if isinstance(patterns, str):
        return re.fullmatch(patterns, name) is not None
    return any(name == p or name.endswith("." + p) or fnmatch.fnmatchcase(name, p) for p in patterns)


def selected(names: Iterable[str], patterns: Union[str, Sequence[str]]) -> set[str]:
    """The ``names`` that ``patterns`` select, each with every name under it (``a.b`` when ``a`` is selected): what an
    option naming modules covers (``ignore_modules``, ``modules_to_save``), decided once for a whole model.

    Args:
        names: every module name of a model (:meth:`~torch.nn.Module.named_modules`: a name's parents are among them).
        patterns: as :func:`name_matches`.
    """
    names = list(names)
    matched = {n for n in names if name_matches(n, patterns)}
    if not matched:
        return set()
    return {n for n in names if any(".".join(n.split(".")[:i]) in matched for i in range(1, n.count(".") + 2))}


def name_list(paths: Iterable[str], max_short: int = 24, max_paths: int = 3) -> str:
    """``"q_proj, k_proj, ..., lm_head (15 in all, e.g. model.layers.0.self_attn.q_proj, ...)"``.

    Short names are the last dotted component, in order of first appearance; ``max_short`` of them are
    shown (then ``"... and N more names"``), followed by the count and up to ``max_paths`` full paths.
    """
    paths = list(paths)
    if not paths:
        return "(none)"
    short = list(dict.fromkeys(p.rsplit(".", 1)[-1] for p in paths))
    shown = ", ".join(short[:max_short]) + (f", ... and {len(short) - max_short} more names" if len(short) > max_short else "")
    if short == paths:  # top-level names: nothing longer to show
        return shown
    examples = ", ".join(paths[:max_paths]) + (", ..." if len(paths) > max_paths else "")
    return f"{shown} ({len(paths)} in all, e.g. {examples})"


def did_you_mean(word: str, names: Any) -> str:
    """``" Did you mean 'r'?"`` for the names closest to ``word`` (difflib), or ``""`` when none is close."""
    names = [str(n) for n in dict.fromkeys(names)]
    close = difflib.get_close_matches(str(word), names, n=3, cutoff=0.6)
    # a longer or shorter spelling of a name (rank -> r, lora_alpha -> alpha): difflib's ratio misses them
    if "." not in word:
        close += [n for n in names if n and n not in close and (word.startswith(n) or word.endswith(n) or n.startswith(word))]
    close = close[:3]
    return f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""


__all__ = ["did_you_mean", "has_submodule", "name_list", "name_matches", "selected", "under"]
