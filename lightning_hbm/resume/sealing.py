"""The seal of a checkpoint: a CRC32 of every tensor, a SHA-256 of every other value and a digest of the
lightning_hbm part, written last before a save (:func:`seal`) and checked before anything loads (:func:`verify`)."""

from __future__ import annotations

import hashlib
import re
import warnings
import zlib
from typing import Any, Iterator, Optional

import torch
from torch import nn

from lightning_hbm.resume.fingerprints import _plain
from lightning_hbm.resume.packing import FORMAT_VERSION, META_KEY, is_placeholder

VERIFIED_KEY = "verified"  # set by resume.pending.opened once it verified a loaded checkpoint (never in a file)
_NOT_SEALED = ("checksums", "digest", VERIFIED_KEY)  # written by seal() / opened(): no tensors of their own


def _damaged(path: Any, what: str) -> ValueError:
    return ValueError(
        f"Checkpoint {path} is damaged: {what} (flipped bytes on disk or in transfer, or an edited file). Resume "
        "from another checkpoint (e.g. the previous 'last.ckpt' or a top-k one) instead; nothing was loaded."
    )


def checksum(tensor: torch.Tensor) -> Optional[int]:
    """CRC32 of the tensor's bytes (None for tensors that are not plain, e.g. DTensor shards)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
        return None
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy()) if data.numel() else 0  # type: ignore[arg-type]  # ndarray is a buffer (numpy types __buffer__ from 3.12)


def _walk(value: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _walk(item, f"{path}/{key}")
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            yield from _walk(item, f"{path}/{index}")


def tensor_entries(checkpoint: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Every tensor of ``checkpoint`` by a stable key: the weights by their state_dict key (both parts), every other
    tensor (optimizer states, ``step`` counters, lr schedulers, loops, callbacks, ...) by ``@`` and its path."""
    entries: dict[str, torch.Tensor] = {}
    meta = checkpoint.get(META_KEY, {})
    for part in (checkpoint.get("state_dict", {}), meta.get("state_dict", {})):
        entries.update((k, v) for k, v in part.items() if isinstance(v, torch.Tensor))
    rest = {k: v for k, v in checkpoint.items() if k not in ("state_dict", META_KEY)}
    rest[META_KEY] = {k: v for k, v in meta.items() if k not in ("state_dict", *_NOT_SEALED)}
    for key, value in rest.items():
        entries.update(_walk(value, f"@{key}"))
    return {k: v for k, v in entries.items() if not is_placeholder(v) and _plain(v)}


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _canonical_form(value: Any) -> Any:
    """A form of ``value`` that is equal after a save and a load (tensors by shape and dtype: their bytes are CRC'd)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype))
    if isinstance(value, dict):
        return sorted((repr(k), _canonical_form(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_canonical_form(v) for v in value]
    if isinstance(value, (set, frozenset)):  # iteration order of a set of str changes from process to process
        return ("set", sorted(repr(_canonical_form(v)) for v in value))
    if isinstance(value, (str, bytes, int, float, complex, type(None))) or not hasattr(value, "__dict__"):
        return _ADDRESS.sub("", repr(value))
    return (type(value).__qualname__, _canonical_form(vars(value)))  # an allow-listed object: its attributes


def _sha(value: Any) -> str:
    return hashlib.sha256(repr(_canonical_form(value)).encode()).hexdigest()


# Lightning's checkpoint migration rewrites the version of a file saved by another Lightning (and keeps the old one)
_PL_VERSION, _PL_LEGACY = "pytorch-lightning_version", "legacy_pytorch-lightning_version"


def value_digests(checkpoint: dict[str, Any]) -> dict[str, str]:
    """SHA-256 of every top-level entry but the lightning_hbm part, with all its values (ints, floats, strings)."""
    entries = {str(k): v for k, v in checkpoint.items() if k != META_KEY}
    if _PL_LEGACY in entries:  # migrated after the load: compare what the file held
        entries[_PL_VERSION] = entries.pop(_PL_LEGACY)
    return {k: _sha(v) for k, v in entries.items()}


def meta_digest(meta: dict[str, Any]) -> str:
    """SHA-256 of the lightning_hbm part (settings, omitted keys, fingerprints, checksum table), tensors by shape."""
    return _sha({k: v for k, v in meta.items() if k not in ("state_dict", "digest")})


def seal(checkpoint: dict[str, Any]) -> None:
    """Add a CRC32 of every tensor of ``checkpoint`` and a digest of its lightning_hbm part (in place, last thing
    before writing: hooks that run after the packing, e.g. the model's ``on_save_checkpoint``, are covered)."""
    meta = checkpoint.get(META_KEY)
    if not isinstance(meta, dict):
        return
    meta.pop("digest", None)
    meta.pop(VERIFIED_KEY, None)
    meta["version"] = FORMAT_VERSION
    meta["checksums"] = {k: c for k, c in ((k, checksum(v)) for k, v in tensor_entries(checkpoint).items()) if c is not None}
    meta["values"] = value_digests(checkpoint)
    meta["digest"] = meta_digest(meta)


def validate_meta(meta: Any, path: Any) -> None:
    """A clear error for a lightning_hbm part of the wrong structure or of an unknown format version."""
    if not isinstance(meta, dict):
        raise ValueError(
            f"Checkpoint {path}: checkpoint[{META_KEY!r}] is a {type(meta).__name__}, not the dict lightning_hbm writes. "
            "The file was edited or written by another tool; resume from a checkpoint lightning_hbm saved."
        )
    version = meta.get("version")
    if type(version) is not int or not 1 <= version <= FORMAT_VERSION:
        raise ValueError(
            f"Checkpoint {path} has lightning_hbm format version {version!r}; this lightning_hbm reads versions 1 to "
            f"{FORMAT_VERSION}. A newer lightning_hbm wrote it: upgrade lightning_hbm (pip install -U lightning_hbm), or "
            "resume from a checkpoint of this version."
        )
    shapes = {
        "state_dict": dict, "placeholders": list, "omitted": list, "fingerprints": dict, "configs": dict,
        "checksums": dict, "digest": str,
    }
    if version >= 3:
        shapes["values"] = dict
    required = [k for k in shapes if version >= 2 or k != "digest"]
    for key in required:
        if not isinstance(meta.get(key), shapes[key]):
            raise ValueError(
                f"Checkpoint {path} is damaged: checkpoint[{META_KEY!r}][{key!r}] is "
                f"{type(meta.get(key)).__name__ if key in meta else 'missing'}, expected a {shapes[key].__name__}. "
                "Resume from another checkpoint; nothing was loaded."
            )
    lists = {k: meta[k] for k in ("placeholders", "omitted")}
    if any(not isinstance(item, str) for items in lists.values() for item in items) or any(
        not isinstance(v, int) for v in meta["checksums"].values()
    ) or any(not isinstance(v, dict) for v in meta["configs"].values()) or any(
        not isinstance(v, str) for v in meta.get("values", {}).values()
    ):
        raise ValueError(
            f"Checkpoint {path} is damaged: its {META_KEY!r} part holds entries of the wrong type (key names must be "
            "strings, checksums integers, settings dicts, value digests strings). Resume from another checkpoint; "
            "nothing was loaded."
        )


def verify(checkpoint: dict[str, Any], path: Any) -> None:
    """Check a loaded checkpoint's lightning_hbm part and every tensor against its CRC, before anything loads.

    Checks every time it is called: a resume calls it once, through :func:`lightning_hbm.resume.pending.opened` (its
    one caller), which hands the verified part to every later reader. Version-1 checkpoints (weights checksummed,
    nothing else) load with a warning.
    """
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    if meta is None:
        return
    validate_meta(meta, path)
    sums = meta["checksums"]
    if meta["version"] == 1:
        warnings.warn(
            f"Checkpoint {path} has lightning_hbm format version 1: its weights are checked, but its optimizer states, "
            "loops and settings carry no checksum. Save again with this version to have them checked.",
            stacklevel=2,
        )
        entries = {k: v for part in (checkpoint.get("state_dict", {}), meta["state_dict"]) for k, v in part.items()}
        entries = {k: v for k, v in entries.items() if k in sums and isinstance(v, torch.Tensor) and not is_placeholder(v)}
    else:
        if meta_digest(meta) != meta["digest"]:
            raise _damaged(path, f"its {META_KEY!r} part (settings, fingerprints, checksum table) does not match its digest")
        _check_values(checkpoint, meta, path)
        entries = tensor_entries(checkpoint)
        gone = [key for key in sums if key not in entries]
        if gone:  # was: only the tensors present were checked, so a deleted one was found after the model changed
            raise _damaged(path, f"tensor {gone[0]!r} written with it is missing ({len(gone)} missing)")
    for key, value in entries.items():
        if key not in sums:
            raise _damaged(path, f"tensor {key!r} has no checksum")
        if checksum(value) != sums[key]:
            raise _damaged(path, f"tensor {key!r} does not match the checksum written with it")


def _check_values(checkpoint: dict[str, Any], meta: dict[str, Any], path: Any) -> None:
    """Every value outside the tensors' bytes (loop progress, epoch, learning rates, ...) as written (version 3)."""
    if meta["version"] < 3:
        warnings.warn(
            f"Checkpoint {path} has lightning_hbm format version 2: its tensors and settings are checked, but its loop "
            "progress, epoch, learning rates and other non-tensor values carry no checksum. Save again with this "
            "version to have them checked.",
            stacklevel=3,
        )
        return
    saved, now = meta["values"], value_digests(checkpoint)
    for key in sorted(set(saved) | set(now)):
        if key not in now:
            raise _damaged(path, f"its entry {key!r} is missing")
        if key not in saved:
            raise _damaged(path, f"it holds an entry {key!r} that was not written with it")
        if saved[key] != now[key]:
            raise _damaged(path, f"the values of its entry {key!r} (e.g. loop progress, epoch, learning rates, key names) "
                                 "do not match the digest written with them")
