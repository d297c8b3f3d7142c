"""Fingerprints of the frozen base, taken before quantization on every fit, and the record of the model as built.

A resume compares the fingerprints saved for each omitted base tensor with those of the model being resumed, so
adapters never land silently on another base (another seed, other pretrained weights).
"""

from __future__ import annotations

import hashlib
import zlib
from typing import Any, Optional

import torch
from torch import nn

# Fingerprints (of the frozen base, before quantization, on every fit): every byte of tensors up to 16 MiB
# (all of a 135M model's but its embedding), else exact row and column sums over all elements plus 4096 samples,
# in chunks of 4M elements (32 MiB of int64 temporaries on the tensor's device).
_EXACT_BYTES = 16 << 20
_SAMPLES = 4096
_ROW = 1024
_CHUNK = 1 << 22


def spread_indices(n: int, k: int, device: Any = None) -> torch.Tensor:
    """``min(n, k)`` evenly spread indices into ``n`` elements, first and last included.

    Integer arithmetic in int64 on purpose: a float32 ``torch.linspace`` rounds above 2**24 elements (its
    last index can be ``n`` itself: an IndexError on every real LLM's embedding), and int32 overflows
    above 2**31.
    """
    k = min(n, k)
    if k <= 1:
        return torch.zeros(k, dtype=torch.int64, device=device)
    return torch.arange(k, dtype=torch.int64, device=device) * (n - 1) // (k - 1)


def _plain(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and type(tensor) in (torch.Tensor, nn.Parameter) and not tensor.is_meta


def fingerprint_v1(tensor: torch.Tensor) -> Optional[str]:
    """Version-1 fingerprint: a hash of the shape and of 64 evenly spread elements (None for meta tensors)."""
    if not _plain(tensor):
        return None
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        values = torch.zeros(0, dtype=torch.float64)
    else:
        values = flat[spread_indices(flat.numel(), 64, flat.device)].to(torch.float64).cpu()
    return hashlib.sha1(repr(tuple(tensor.shape)).encode() + values.numpy().tobytes()).hexdigest()[:16]


def _bits(flat: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as signed integers of their own width (a bit-exact, device-independent view)."""
    kind = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
    return flat.view(kind) if flat.dtype != torch.bool else flat.to(torch.int8)


def _block_sums(bits: torch.Tensor) -> tuple[Any, Any]:
    """Exact int64 sums of every row and every column of ``bits`` viewed as (rows, _ROW) (wrapping modulo 2**64).

    Integers, so the numbers are the same on every device and with any chunking: numpy on CPU (fast without
    threads), torch in chunks on an accelerator (no copy of the tensor to the host; 32 MiB temporaries).
    """
    grid = bits.reshape(-1, _ROW)
    if grid.device.type == "cpu":
        values = grid.numpy()
        return values.sum(axis=1, dtype="int64"), values.sum(axis=0, dtype="int64")
    rows, cols = [], torch.zeros(_ROW, dtype=torch.int64, device=grid.device)
    for start in range(0, grid.shape[0], _CHUNK // _ROW):
        chunk = grid[start : start + _CHUNK // _ROW].to(torch.int64)
        rows.append(chunk.sum(dim=1))
        cols += chunk.sum(dim=0)
    return torch.cat(rows).cpu().numpy(), cols.cpu().numpy()


def fingerprint(tensor: torch.Tensor) -> Optional[str]:
    """A hash that tells two tensors apart even where they agree at most elements (None for meta tensors).

    Up to ``_EXACT_BYTES`` the hash covers every byte (CRC32). Above (the big matrices of a real LLM, which may sit
    on an accelerator), it covers the exact integer sums of every row and every column of the tensor's bits viewed
    as (n / 1024, 1024), computed where the tensor lives, plus ``_SAMPLES`` spread elements: any single changed
    element, and any swap of two elements, changes it. The method depends on the size only, never on the device.
    """
    if not _plain(tensor):
        return None
    flat = tensor.detach().reshape(-1)
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    digest = hashlib.sha1(repr((tuple(tensor.shape), str(tensor.dtype))).encode())
    if flat.numel() * flat.element_size() <= _EXACT_BYTES:
        digest.update(zlib.crc32(flat.cpu().contiguous().view(torch.uint8).numpy()).to_bytes(4, "little"))  # type: ignore[arg-type]  # ndarray is a buffer (numpy types __buffer__ from 3.12)
        return digest.hexdigest()[:16]
    bits = _bits(flat)
    whole = flat.numel() - flat.numel() % _ROW
    rows, cols = _block_sums(bits[:whole])
    samples = bits[spread_indices(flat.numel(), _SAMPLES, flat.device)]
    for part in (rows, cols, bits[whole:].cpu().numpy(), samples.cpu().numpy()):
        digest.update(part.tobytes())
    return digest.hexdigest()[:16]


def as_built_record(module: nn.Module) -> dict[str, Any]:
    """Schema ``{key: (shape, is_floating_point)}`` and fingerprints of the model as the user built it."""
    schema: dict[str, tuple[tuple[int, ...], bool]] = {}
    prints: dict[str, Optional[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            schema[key] = (tuple(value.shape), value.is_floating_point())
            prints[key] = fingerprint(value)
    # version-1 checkpoints hold the older, 64-sample fingerprints: keep those too (cheap) to compare with them
    v1 = {key: fingerprint_v1(value) for key, value in module.state_dict(keep_vars=True).items() if isinstance(value, torch.Tensor)}
    return {"schema": schema, "fingerprints": prints, "fingerprints_v1": v1}

