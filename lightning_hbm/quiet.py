"""Library log lines a lightning_hbm user can do nothing about, filtered at their own loggers, by message.

Active only inside lightning_hbm's own work, never for the rest of the process (issue 55: a plain Trainer in the
same environment must behave as without us): around the imports ``lightning_hbm``'s public names trigger (peft,
torchao, bitsandbytes print at their import), and for the whole ``lightning-hbm`` command. Each entry is one logger
and the start of the messages dropped; every other record of that logger passes unchanged, and no log level is
touched:

- ``torchao``: "Failed to load .../_C_mxfp8...so" (torchao's optional compiled kernels, absent from
  its CPU or mismatched builds; lightning_hbm calls none of them), and ``torchao.kernel.intmm``'s
  "Detected no triton" (its int-matmul kernels, also unused).
- ``torch.utils._pytree``: "<enum ...> is an Enum subclass and is now natively supported by
  torch.compile": a deprecation addressed to torchao's own registration code, printed at its import.
- ``bitsandbytes.backends.cpu.ops``: "Failed to load CPU gemm_4bit_forward from kernels-community":
  an optional kernel for the AVX512-BF16 path, which lightning_hbm turns off on every 4-bit layer.
- Lightning (``lightning.pytorch.utilities.rank_zero``): the "💡 Tip:" lines advertising litlogger and
  litmodels on every run; and one warning, Lightning's own "`isinstance(treespec, LeafSpec)` is
  deprecated" (its code calling torch's pytree, fixed by Lightning, not by its user), matched by message.

``quieted()`` is the context manager; ``install()``/``uninstall()`` its two halves.
"""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator, Optional

#: logger name -> the message prefixes dropped on it.
NOISE: dict[str, tuple[str, ...]] = {
    "torchao": ("Failed to load ",),
    "torchao.kernel.intmm": ("Warning: Detected no triton",),
    "torch.utils._pytree": ("%s is an Enum subclass and is now natively supported",),
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "lightning.pytorch.utilities.rank_zero": ("💡 Tip: For seamless cloud",),
}


class DropMessages(logging.Filter):
    """Drops the records whose unformatted message starts with one of ``prefixes``."""

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


FILTERS: dict[str, DropMessages] = {name: DropMessages(prefixes) for name, prefixes in NOISE.items()}


_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_depth = 0  # nested quieted() blocks: the outermost one removes the filters
_before: list = []  # warnings.filters when the outermost quieted() block began


def install() -> None:
    """Add each filter to its logger and the warnings filter (idempotent)."""
    for name, noise_filter in FILTERS.items():
        logger = logging.getLogger(name)
        if noise_filter not in logger.filters:
            logger.addFilter(noise_filter)
    warnings.filterwarnings("ignore", message=_LEAFSPEC)


def uninstall(before: Optional[list] = None) -> None:
    """Remove what :func:`install` added, and nothing else; with ``before`` (``warnings.filters`` as it was), also
    the process-wide filters the libraries imported meanwhile added at their import (accelerate's "ignore every
    UserWarning of torch.optim.lr_scheduler", torchao's NumPy one): imported by lightning_hbm's work, they silenced
    a plain Trainer's own warnings for the rest of the process (issue 55)."""
    for name, noise_filter in FILTERS.items():
        logging.getLogger(name).removeFilter(noise_filter)
    kept = [
        f for f in warnings.filters
        if not (f[0] == "ignore" and f[1] is not None and f[1].pattern == _LEAFSPEC) and (before is None or f in before)
    ]  # fmt: skip
    warnings.filters[:] = kept  # type: ignore[index]  # a list at run time
    mutated = getattr(warnings, "_filters_mutated", None)  # as warnings.filterwarnings does after a change (3.10-3.12)
    if mutated is not None:
        mutated()


@contextmanager
def quieted() -> Iterator[None]:
    """The filters for the block only (nested blocks: the outermost removes them)."""
    global _depth, _before
    if _depth == 0:
        _before = list(warnings.filters)
        install()
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if _depth == 0:
            uninstall(_before)


__all__ = ["FILTERS", "NOISE", "DropMessages", "install", "quieted", "uninstall"]
