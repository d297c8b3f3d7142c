"""The checkpoint a run is resuming: verified once, by this module, and its saved parts handed to whoever needs them.

A resume reaches several readers at different moments: the checked IO that reads the file, the load hook (before
Lightning copies a tensor into the model), the surgery (before its first change) and the precision plugin (its saved
plan, rounding CRC and smoothing exponents). None of them verifies or reads the file: they ask here.
:func:`opened` is the one caller of :func:`~lightning_hbm.resume.sealing.verify`; the first reader that asks verifies
(the checked IO for every strategy that loads through it), the later ones get the part already verified.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.resume.packing import META_KEY
from lightning_hbm.resume.sealing import VERIFIED_KEY, verify

# meta[VERIFIED_KEY] once verified in this process: a file cannot hold this object (torch.load weights_only), so a
# checkpoint read anew is verified anew; kept inside the part, so it lives and dies with the loaded checkpoint
_VERIFIED = object()


def opened(checkpoint: Any, path: Any) -> Optional[dict[str, Any]]:
    """The lightning_hbm part of a loaded ``checkpoint``, verified (once per loaded checkpoint); ``None`` without one.

    Args:
        checkpoint: what the IO or a strategy loaded from ``path``.
        path: the file, named in the errors.

    Raises:
        ValueError: the part's structure, version, digest, values or tensor CRCs are wrong (nothing was loaded).
    """
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    if meta is None:
        return None
    if not is_verified(meta):
        verify(checkpoint, path)
        meta[VERIFIED_KEY] = _VERIFIED
    return meta


def is_verified(meta: Any) -> bool:
    """Whether :func:`opened` verified this lightning_hbm part in this process."""
    return isinstance(meta, dict) and meta.get(VERIFIED_KEY) is _VERIFIED


def pending(trainer: Any) -> Optional[dict[str, Any]]:
    """The checkpoint ``trainer`` is resuming, between Lightning's weight restore and the end of setup (else ``None``).

    Lightning 2.6 has no public accessor: see :func:`lightning_hbm._compat.lightning.loaded_checkpoint`.
    """
    return lightning_compat.loaded_checkpoint(trainer)


def saved_part(trainer: Any) -> dict[str, Any]:
    """The lightning_hbm part of the checkpoint ``trainer`` is resuming, verified (empty when none): what the precision
    plugin recovers its saved plan, rounding CRC and smoothing exponents from.

    Raises:
        ValueError: the checkpoint's structure, version or CRCs are wrong (:func:`opened`).
    """
    checkpoint = pending(trainer)
    meta = opened(checkpoint, trainer.ckpt_path) if checkpoint else None
    return meta or {}
