"""transformers' internals that lightning_hbm relies on (transformers 5; ``tests/_compat/test_transformers.py`` checks each).

transformers is optional: it is imported on first use, or found in ``sys.modules`` when the caller's code imported it.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional, cast


def _default_gate() -> Optional[object]:
    """transformers' default expert gate function (``None`` without transformers 5's MoE integration)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:
        return None
    return _default_apply_gate


def from_config(cls: type, config: Any, **options: Any) -> Any:
    """``cls._from_config``: a model of class ``cls`` built from ``config`` with ``from_pretrained``'s options
    (``dtype``, ``attn_implementation``); the public ``from_config`` lives on the Auto classes only."""
    return cast(Any, cls)._from_config(config, **options)


@contextmanager
def replaced_from_pretrained(transformers: Any, replacement: Callable[..., Any]) -> Iterator[None]:
    """``PreTrainedModel.from_pretrained`` is ``replacement`` (a function of ``cls, path, ...``) inside the block.

    Every model class (and every Auto class, which resolves to one) reaches the base class's classmethod; the
    planner's factories call it and must not read weights. No hook of transformers skips the weight load.
    """
    base = transformers.PreTrainedModel
    original = base.__dict__["from_pretrained"]
    base.from_pretrained = classmethod(replacement)
    try:
        yield
    finally:
        base.from_pretrained = original


def uses_default_gate(module: Any) -> bool:
    """Whether a transformers-5 experts layer routes with transformers' default gate (its private ``_apply_gate``)."""
    default = _default_gate()
    return default is not None and getattr(type(module), "_apply_gate", None) is default
