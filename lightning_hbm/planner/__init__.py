"""The HBM planner: predict every configuration's peak memory before training, and pick one that fits."""

from lightning_hbm.planner.api import *  # noqa: F401,F403
from lightning_hbm.planner.api import LIGHTNING_PRECISIONS, __all__ as _api_all  # noqa: F401
from lightning_hbm.planner.autofit import AutoFit

__all__ = [*_api_all, "AutoFit"]
