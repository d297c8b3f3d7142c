"""The internals of torch, Lightning, bitsandbytes, peft and transformers that lightning_hbm relies on, in one place.

One module per library (:mod:`.torch`, :mod:`.lightning`, :mod:`.bitsandbytes`, :mod:`.peft`,
:mod:`.transformers`): each private name read, private attribute touched, global written or method
replaced on a foreign object lives in a small named function there, with the reason no public API does
it. Any of them may change in a minor release of its library: ``tests/_compat/`` has, for each function,
a test on the installed library that fails when the internal changes, and ``tests/test_layering.py``
fails on a private name of a library imported or reached (``torch.cuda.memory._x``) anywhere else.
The table of every touch is in ``docs/extending.md`` ("Foreign internals").

Modules under private paths that are their library's de facto API for a feature (``torch.utils._pytree``,
``torch._subclasses.fake_tensor``, ``torch.utils._python_dispatch``, ``torch.distributed._tools``) are
imported where they are used.

The private names below are re-exported for the modules that imported them from here before the split.
"""

from __future__ import annotations

from lightning_hbm._compat.lightning import (
    _PATH,
    _PRECISION_INPUT_STR,
    _RICH_AVAILABLE,
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
    _materialize_distributed_module,
    _optimizers_to_device,
)
from lightning_hbm._compat.torch import _disable_current_modes
from lightning_hbm._compat.transformers import _default_gate

__all__ = [
    "_PATH",
    "_PRECISION_INPUT_STR",
    "_RICH_AVAILABLE",
    "_configure_optimizers",
    "_configure_schedulers_automatic_opt",
    "_default_gate",
    "_disable_current_modes",
    "_materialize_distributed_module",
    "_optimizers_to_device",
]
