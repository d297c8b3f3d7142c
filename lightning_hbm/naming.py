"""How error messages list module names: distinct short names first, then a few full paths.

A model with 28 Linear layers has 7 distinct names (``q_proj``, ``k_proj``, ...): those are what a user
types (``target_modules: [q_proj]`` matches every ``...self_attn.q_proj``), so they come first and in
full; full paths follow as examples only, so the message stays one readable line.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


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


__all__ = ["did_you_mean", "name_list"]
