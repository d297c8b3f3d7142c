"""Library log lines a lightning_hbm user can do nothing about, filtered at their own loggers, by message.

Installed when ``lightning_hbm`` is imported (before it imports peft, which imports torchao). Each entry is
one logger and the start of the messages dropped; every other record of that logger passes unchanged,
and no log level is touched:

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

To see them again: ``logging.getLogger(name).removeFilter(lightning_hbm.quiet.FILTERS[name])``.
"""

from __future__ import annotations

import logging
import warnings

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


def install() -> None:
    """Add each filter to its logger (idempotent)."""
    for name, noise_filter in FILTERS.items():
        logger = logging.getLogger(name)
        if noise_filter not in logger.filters:
            logger.addFilter(noise_filter)
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated")


install()

__all__ = ["FILTERS", "NOISE", "DropMessages", "install"]
