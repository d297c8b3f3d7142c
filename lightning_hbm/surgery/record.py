"""The surgery's face over :mod:`lightning_hbm.record`, where each model's record lives (nothing is set on the model)."""

from __future__ import annotations

from lightning_hbm.record import applied_transforms, as_built, mark_applied

__all__ = ["applied_transforms", "as_built", "mark_applied"]
