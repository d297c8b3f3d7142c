"""What the surgery leaves on the model: the attributes it sets, and the names of the transforms applied."""

from __future__ import annotations

from typing import Optional

from torch import nn

_APPLIED_ATTR = "_lightning_hbm_applied"
_RECORD_ATTR = "_lightning_hbm_record"  # the model as built: schema, fingerprints; set by the first surgery
_STATE_ATTR = "_lightning_hbm_spine"
_APPLIERS_ATTR = "_lightning_hbm_appliers"  # transform name -> id() of the instance that applied it last
SAVED_MODULES_ATTR = "_lightning_hbm_modules_to_save"  # set by run_surgery: the transforms' modules_to_save


def as_built(module: nn.Module) -> Optional[dict]:
    """The record (schema, fingerprints) of ``module`` as the user built it, taken by its first surgery (else None)."""
    return getattr(module, _RECORD_ATTR, None)


def applied_transforms(module: nn.Module) -> list[str]:
    """Names of the transforms applied to ``module``, in the order they ran."""
    return list(getattr(module, _APPLIED_ATTR, []))


def mark_applied(module: nn.Module, name: str) -> None:
    """Record that ``name`` changed ``module`` (used by the engine and the precision plugin)."""
    applied = getattr(module, _APPLIED_ATTR, None)
    if applied is None:
        applied = []
        # object.__setattr__: a plain list must not become an nn.Module attribute lookup problem
        object.__setattr__(module, _APPLIED_ATTR, applied)
    applied.append(name)
