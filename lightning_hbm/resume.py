"""What a lightning_hbm checkpoint holds, and how a resume is checked against the run that saved it.

Lightning restores ``checkpoint["state_dict"]`` into the model *as the user built it*, before the
surgery (:mod:`lightning_hbm.surgery`) quantizes and adapts it. So a checkpoint of a changed model
is written in two parts:

* ``checkpoint["state_dict"]``: every tensor that fits the model as built (embeddings, norms,
  buffers, ...) under its own key, plus a *placeholder* for each as-built weight whose changed form
  (a 4-bit weight and its constants, an int8 weight) is kept in the second part. A placeholder is a
  NaN expanded to the weight's shape (stride 0: it costs 4 bytes in the file), so Lightning's strict
  loading accepts the file and a model loaded without lightning_hbm visibly computes NaN instead
  of silently training on wrong weights.
* ``checkpoint["lightning_hbm"]``: the changed tensors (``state_dict``), the as-built keys
  deliberately left out (``omitted``: the frozen base of an adapter-only LoRA checkpoint), a
  fingerprint of each omitted tensor taken before quantization, the configuration of the precision
  plugin and of every transform (``configs``), the format ``version``, a CRC32 of every tensor in
  the whole checkpoint, optimizer states and loops included (``checksums``, by :func:`seal`), a SHA-256
  of every other top-level entry with all its values (``values``: loop progress, epoch, learning rates,
  scheduler and callback states; tensors in it by shape and dtype, their bytes by the CRCs), and a
  SHA-256 ``digest`` of this part itself (so a flipped bit in the tables cannot turn the checks off).

Saves go through :class:`CheckedCheckpointIO`: sealed last, refused if a trained tensor is NaN/inf,
written atomically beside the target. On resume, before the first change: the structure and version of
the lightning_hbm part, its digest, every other value against its entry's SHA-256, and every tensor against
its CRC (``torch.load`` does not verify the zip CRC of tensor data, so flipped bytes would load silently); the
pickled metadata is bounded in size and must match its zip CRC before torch unpickles it; the configurations must be equal, and the
omitted base must have the fingerprint of the base the adapters were trained on. After the surgery the
changed tensors are loaded and every key of the changed model must come from the checkpoint or from an
omitted (fingerprinted) base weight. Version-1 checkpoints (weights-only CRCs, 64-sample fingerprints,
no digest) and version-2 ones (no ``values``) still load, with a warning.
"""

from __future__ import annotations

import hashlib
import os
import re
import warnings
import zipfile
import zlib
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, TorchCheckpointIO
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn

from lightning_hbm.layers import converted_keys

# 2: every tensor checksummed, the lightning_hbm part sealed by a digest, stronger fingerprints; 3: every value too
FORMAT_VERSION = 3
META_KEY = "lightning_hbm"
# Fingerprints (of the frozen base, before quantization, on every fit): every byte of tensors up to 16 MiB
# (all of a 135M model's but its embedding), else exact row and column sums over all elements plus 4096 samples,
# in chunks of 4M elements (32 MiB of int64 temporaries on the tensor's device).
_EXACT_BYTES = 16 << 20
_SAMPLES = 4096
_ROW = 1024
_CHUNK = 1 << 22


# ------------------------------------------------------------------------------------ fingerprints


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
        digest.update(zlib.crc32(flat.cpu().contiguous().view(torch.uint8).numpy()).to_bytes(4, "little"))
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


def _fits(schema: dict[str, tuple[tuple[int, ...], bool]], key: str, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and schema.get(key) == (tuple(value.shape), value.is_floating_point())


def _canonical(key: str) -> str:
    """The as-built name behind a changed key: peft wraps a layer and moves its weight to ``base_layer``."""
    return key.replace(".base_layer.", ".")


class KeyMap:
    """Which as-built key a changed key is a form of, for one changed model.

    Besides peft's ``base_layer`` and quantization constants (``x.weight.absmax``, ``x.weight_scale``), a
    layer converted by a kind's ``prepare`` renames its tensors (``in_proj_weight`` ->
    ``q_proj.weight``, 3-D ``gate_up_proj`` -> ``gate_up_proj.0.weight``): each kind declares that map
    (``LayerKind.as_built_keys``). Under a converted as-built key only the mapped tensors are its forms,
    not the adapters that now sit below its name (``gate_up_proj.0.lora_A.default.weight``).
    """

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.converted = converted_keys(module) if module is not None else {}
        self.targets = set(self.converted.values())

    def as_built(self, changed_key: str) -> tuple[str, bool]:
        """``(key in as-built names, whether a conversion mapped it)``."""
        canonical = _canonical(changed_key)
        head, _, last = canonical.rpartition(".")
        if last in _BESIDE_WEIGHT and f"{head}.weight" in self.converted:
            return self.converted[f"{head}.weight"], True
        parts = canonical.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.converted:  # x.q_proj.weight(.absmax) -> x.in_proj_weight(.absmax)
                return self.converted[prefix] + canonical[len(prefix) :], True
        return canonical, False

    def covers(self, changed_key: str, as_built_key: str) -> bool:
        return self._form_of(self.as_built(changed_key), as_built_key)

    def covered(self, key: str, omitted: Iterable[str]) -> bool:
        """Whether ``key`` (as built or changed) is a form of one of the ``omitted`` as-built keys."""
        mapped = self.as_built(key)
        return any(self._form_of(mapped, o) for o in omitted)

    def any_form_of(self, changed_keys: Iterable[str]) -> Callable[[str], bool]:
        """``f(as_built_key)``: whether any of ``changed_keys`` is a form of it; the same answer as
        ``any(self.covers(k, as_built_key) for k in changed_keys)``, from sets built once (that loop was
        O(keys x keys) per checkpoint save: ~10^5 calls for a 135M Llama)."""
        covered: tuple[set[str], set[str]] = (set(), set())  # (from unconverted forms, from converted ones)
        for changed_key in changed_keys:
            key, converted = self.as_built(changed_key)
            names = covered[converted]
            canonical = _canonical(key)  # as _covers does
            names.add(canonical)
            end = canonical.find(".")
            while end > 0:  # canonical.startswith(k + "."): every dotted prefix
                names.add(canonical[:end])
                end = canonical.find(".", end + 1)
            head, dot, last = canonical.rpartition(".")
            if dot and last in _BESIDE_WEIGHT:  # x.weight_scale is a form of x.weight
                names.add(f"{head}.weight")
        unconverted, converted_ = covered
        return lambda as_built_key: as_built_key in converted_ or (as_built_key in unconverted and as_built_key not in self.targets)

    def _form_of(self, mapped: tuple[str, bool], as_built_key: str) -> bool:
        key, converted = mapped
        if not converted and as_built_key in self.targets:
            return False  # an adapter or other new tensor under a converted layer's name
        return _covers(key, as_built_key)


def covered(key: str, omitted: Iterable[str], module: Optional[nn.Module] = None) -> bool:
    """Whether ``key`` (as built or changed) is a form of one of the ``omitted`` as-built keys of ``module``."""
    return KeyMap(module).covered(key, omitted)


# int8-dynamic keeps its constants as buffers beside the weight (``x.weight_scale``, ``x.input_shift``), not under it
_BESIDE_WEIGHT = ("weight_scale", "input_shift")


def _covers(changed_key: str, as_built_key: str) -> bool:
    """Whether ``changed_key`` (``x.weight.absmax``, ``x.base_layer.weight``, ``x.weight_scale``) is a form of
    ``as_built_key`` (``x.weight``), by name alone (see :class:`KeyMap` for converted layers)."""
    canonical = _canonical(changed_key)
    if as_built_key.endswith(".weight") and canonical in {as_built_key[: -len("weight")] + n for n in _BESIDE_WEIGHT}:
        return True
    return canonical == as_built_key or canonical.startswith(as_built_key + ".")


# ---------------------------------------------------------------------------------------- checksums


def checksum(tensor: torch.Tensor) -> Optional[int]:
    """CRC32 of the tensor's bytes (None for tensors that are not plain, e.g. DTensor shards)."""
    if type(tensor) not in (torch.Tensor, nn.Parameter) or tensor.is_meta:
        return None
    data = tensor.detach().cpu().contiguous().reshape(-1)
    return zlib.crc32(data.view(torch.uint8).numpy()) if data.numel() else 0


def _placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full((), float("nan")).expand(shape)


def is_placeholder(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


# --------------------------------------------------------------------------------------------- save


def pack(
    module: nn.Module,
    checkpoint: dict[str, Any],
    record: dict[str, Any],
    configs: dict[str, Any],
    trainable_only: bool,
) -> None:
    """Rewrite ``checkpoint`` in place into the two-part form described in the module docstring."""
    schema = record["schema"]
    full: dict[str, Any] = checkpoint.get("state_dict", {})
    if trainable_only:
        # the adapters and modules_to_save, and the buffers the model had as built (BatchNorm
        # statistics change while training; a 4-bit layer's constants are not buffers)
        keep = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        keep |= {n for n, b in module.named_buffers(remove_duplicate=False) if _fits(schema, n, b)}
        full = {k: v for k, v in full.items() if k in keep}
    fitting = {k: v for k, v in full.items() if _fits(schema, k, v)}
    changed = {k: v for k, v in full.items() if k not in fitting}
    placeholders, omitted = [], []
    saved_in_changed_form = KeyMap(module).any_form_of(changed) if trainable_only else None
    for key, (shape, floating) in schema.items():
        if key in fitting:
            continue
        # a full checkpoint saved every tensor in some changed form (even one renamed by a layer-kind
        # conversion, e.g. in_proj_weight -> q_proj/k_proj/v_proj); an adapter-only one left the base out
        if floating and (saved_in_changed_form is None or saved_in_changed_form(key)):
            placeholders.append(key)
        else:
            omitted.append(key)
    state_dict = dict(fitting)
    state_dict.update({k: _placeholder(schema[k][0]) for k in placeholders})
    checkpoint["state_dict"] = state_dict
    checkpoint[META_KEY] = {
        "version": FORMAT_VERSION,
        "state_dict": changed,
        "placeholders": placeholders,
        "omitted": omitted,
        "fingerprints": {k: record["fingerprints"].get(k) for k in omitted},
        "configs": configs,
    }  # the checksums and the digest are added last, by seal(), when the file is written (CheckedCheckpointIO)


# ------------------------------------------------------------------------------------------- resume


_NOT_SEALED = ("checksums", "digest", "verified")  # written by seal() / verify(): no tensors of their own


def _damaged(path: Any, what: str) -> ValueError:
    return ValueError(
        f"Checkpoint {path} is damaged: {what} (flipped bytes on disk or in transfer, or an edited file). Resume "
        "from another checkpoint (e.g. the previous 'last.ckpt' or a top-k one) instead; nothing was loaded."
    )


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
    meta.pop(_VERIFIED_KEY, None)
    meta["version"] = FORMAT_VERSION
    meta["checksums"] = {k: c for k, c in ((k, checksum(v)) for k, v in tensor_entries(checkpoint).items()) if c is not None}
    meta["values"] = value_digests(checkpoint)
    meta["digest"] = meta_digest(meta)


_VERIFIED_KEY = "verified"
_VERIFIED = object()  # meta[_VERIFIED_KEY] once checked in this process: a file (weights_only) cannot hold this object


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

    Idempotent per loaded checkpoint. Version-1 checkpoints (weights checksummed, nothing else) load with a warning.
    """
    meta = checkpoint.get(META_KEY) if isinstance(checkpoint, dict) else None
    if meta is None or (isinstance(meta, dict) and meta.get(_VERIFIED_KEY) is _VERIFIED):
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
    for key, value in entries.items():
        if key not in sums:
            raise _damaged(path, f"tensor {key!r} has no checksum")
        if checksum(value) != sums[key]:
            raise _damaged(path, f"tensor {key!r} does not match the checksum written with it")
    meta[_VERIFIED_KEY] = _VERIFIED


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


def is_verified(meta: Any) -> bool:
    return isinstance(meta, dict) and meta.get(_VERIFIED_KEY) is _VERIFIED


# torch.save(..., _use_new_zipfile_serialization=False): a pickle (protocol 2) starting with torch's magic number
_LEGACY_MAGIC = b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19"


#: the largest pickled metadata (``data.pkl``) :func:`check_file` lets torch unpickle: a real checkpoint's holds key
#: names, settings and loop counters (tensors are stored apart), a few MiB for the largest models; junk above it
#: would cost about twice its size in memory before torch's unpickler fails
MAX_PICKLE_BYTES = 64 << 20


def check_file(path: Any) -> None:
    """A clear error for a checkpoint path that is a directory, or a file that is empty or cut short (torch says
    EOFError / Errno 22 / IsADirectoryError), and for a zip whose pickled metadata is too large or does not match
    its zip CRC (flipped bytes). A complete file in torch's legacy (non-zip) format passes: it loads."""
    if path is None:
        return
    try:
        file = Path(path)
        is_dir = file.is_dir()
        size = 0 if is_dir else file.stat().st_size
    except (OSError, TypeError, ValueError):
        return  # a remote URL or an unusual path: leave it to Lightning's own loader
    if is_dir:
        raise ValueError(
            f"Checkpoint {path} is a directory, not a checkpoint file. If it is a distributed (sharded) checkpoint, "
            "resume it with the strategy that wrote it (e.g. FSDP with state_dict_type='sharded'); otherwise pass the "
            "path of a .ckpt file inside it."
        )
    if size == 0:
        raise ValueError(f"Checkpoint {path} is empty (0 bytes): the save was interrupted. Resume from another checkpoint.")
    if zipfile.is_zipfile(file):
        _check_pickle(file, path)
        return
    with open(file, "rb") as handle:
        if handle.read(len(_LEGACY_MAGIC)) == _LEGACY_MAGIC:
            return  # torch's legacy format (_use_new_zipfile_serialization=False): torch.load reads it
    raise ValueError(
        f"Checkpoint {path} is not a complete torch checkpoint ({size} bytes; neither a zip archive with its directory "
        "nor torch's legacy format): the file was cut short, e.g. by a kill during save or a full disk, or it is "
        "not a checkpoint. Resume from another checkpoint."
    )


def _check_pickle(file: Path, path: Any) -> None:
    """Refuse, from the zip's central directory alone, a ``data.pkl`` above :data:`MAX_PICKLE_BYTES`; then check it
    against its zip CRC (torch's reader does not), so a flipped byte never reaches the unpickler."""
    try:
        with zipfile.ZipFile(file) as archive:
            pickles = [i for i in archive.infolist() if i.filename.count("/") == 1 and i.filename.endswith("/data.pkl")]
            for info in pickles:
                if info.file_size > MAX_PICKLE_BYTES or info.compress_size > MAX_PICKLE_BYTES:
                    raise ValueError(
                        f"Checkpoint {path} is damaged or not a checkpoint: its pickled metadata ({info.filename}) is "
                        f"{max(info.file_size, info.compress_size) / 2**20:.0f} MiB, above the "
                        f"{MAX_PICKLE_BYTES / 2**20:.0f} MiB a checkpoint's metadata needs (its tensors are stored "
                        "apart); it was refused unread. Resume from another checkpoint (to read such a file anyway, "
                        "raise lightning_hbm.resume.MAX_PICKLE_BYTES)."
                    )
                if info.CRC:  # 0: written without CRCs (torch.serialization.set_crc32_options(False))
                    with archive.open(info) as member:
                        while member.read(1 << 20):
                            pass
    except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, EOFError, RuntimeError) as err:
        raise _damaged(path, f"its zip archive does not read back ({err})") from None


def _unreadable(path: Any, err: Exception) -> ValueError:
    """torch's unpickler failing on a file that passed :func:`check_file`: one clear error instead of its raw one."""
    detail = " ".join(str(err).split())[:300]
    if "Weights only load failed" in str(err):
        what = (f"it holds an object that torch's safe loader refuses to build (Weights only load failed: {detail}); "
                "a file that would run code is never loaded")
    else:
        what = f"its pickled metadata does not load ({type(err).__name__}: {detail})"
    return _damaged(path, what)


# key parts only a changed model writes: peft's adapters here; each quantized format adds the keys of its constants
# (``QuantFormat.state_marks``, registered by lightning_hbm.precision, which sits above this level)
_CHANGED_MARKS: list[str] = [".lora_A.", ".lora_B.", ".base_layer."]


def register_changed_marks(marks: Iterable[str]) -> None:
    """Make :func:`check_layout` also recognize state_dict keys containing one of ``marks`` as changed tensors."""
    _CHANGED_MARKS.extend(mark for mark in marks if mark not in _CHANGED_MARKS)


def check_layout(checkpoint: Any, path: Any, model_keys: Iterable[str] = ()) -> None:
    """A clear error, before anything loads, for a checkpoint in lightning_hbm's older layout: the changed tensors
    (adapters, 4-bit constants) in ``state_dict`` itself, where Lightning's strict load into the model as built fails
    half-way with a raw "Unexpected key(s)" error."""
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        return
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and "version" in meta:
        return  # the two-part layout (validated by verify)
    known = set(model_keys)  # a model built with such layers on purpose loads them as they are
    changed = [k for k in checkpoint["state_dict"] if k not in known and any(m in k for m in _CHANGED_MARKS)]
    if changed:
        raise ValueError(
            f"Checkpoint {path} holds tensors of an already changed model in its state_dict ({changed[:3]}): it was "
            "written in an older lightning_hbm layout (or by a plain peft/bitsandbytes model) that cannot be resumed. "
            "Start a new run from its weights instead: load them into your model yourself (model.load_state_dict("
            "torch.load(path, weights_only=True)['state_dict'], strict=False)) and call fit without ckpt_path."
        )


# checks of entries of the lightning_hbm part that levels above this one write (the smoothing exponents): each gets
# (meta, path, module as it is when the file is loaded) and raises a ValueError naming the file
_META_CHECKS: list[Callable[[dict[str, Any], Any, nn.Module], None]] = []


def register_meta_check(check: Callable[[dict[str, Any], Any, nn.Module], None]) -> None:
    """Make :func:`check_contents` run ``check`` on the lightning_hbm part of every checkpoint loaded into a model."""
    if check not in _META_CHECKS:
        _META_CHECKS.append(check)


def _is_changed(keys: Iterable[str]) -> bool:
    return any(mark in key for key in keys for mark in _CHANGED_MARKS)


def _owners(module: nn.Module) -> tuple[set[str], set[str]]:
    """Names of all modules, and of those holding tensors of their own (the layers a changed tensor can belong to)."""
    names, holders = set(), set()
    for name, sub in module.named_modules(remove_duplicate=False):
        names.add(name)
        if next(sub.parameters(recurse=False), None) is not None or next(sub.buffers(recurse=False), None) is not None:
            holders.add(name)
    return names, holders


def stray_keys(checkpoint: dict[str, Any], module: nn.Module) -> list[str]:
    """Tensors of ``checkpoint`` that no layer of ``module`` can take: ``state_dict`` keys a model as built lacks
    (Lightning's strict load), and changed tensors (adapters, 4-bit constants) under no layer holding tensors."""
    model_keys = module.state_dict().keys()
    stray = []
    # a model's own on_load_checkpoint runs before Lightning's strict load and may rename or drop keys (a migration)
    migrates = isinstance(module, pl.LightningModule) and is_overridden("on_load_checkpoint", module, pl.LightningModule)
    if getattr(module, "strict_loading", True) and not migrates and not _is_changed(model_keys):
        stray = [k for k in checkpoint.get("state_dict", {}) if k not in model_keys]
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict) and isinstance(meta.get("state_dict"), dict):
        names, holders = _owners(module)
        # by its own name (into a changed model: x.base_layer) or its as-built one (into the model as built: x)
        stray += [k for k in meta["state_dict"] if not any(_owner(f, names) in holders for f in _forms(str(k)))]
    return stray


# peft's copy of a module trained in full (modules_to_save, possibly a container): x.modules_to_save.default.0.weight
_SAVED_COPY = re.compile(r"\.(?:modules_to_save\.[^.]+|original_module)\.")


def _forms(key: str) -> tuple[str, ...]:
    return key, _canonical(key), _SAVED_COPY.sub(".", _canonical(key))


def _owner(key: str, names: set[str]) -> str:
    """The deepest module of ``names`` that ``key`` lies under (``""``: the root)."""
    parts = key.split(".")
    return next((p for p in (".".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)) if p in names), "")


def check_contents(checkpoint: Any, path: Any, module: Optional[nn.Module], resumes_training: bool) -> None:
    """Before Lightning loads anything from ``checkpoint``: a file holding no dict, a weights-only file given to
    ``fit(ckpt_path=...)``, tensors that fit no layer of ``module`` (one short message, not Lightning's list of
    every key) and the registered checks of the lightning_hbm part (:func:`register_meta_check`)."""
    if not isinstance(checkpoint, dict):
        raise _damaged(path, f"it holds a {type(checkpoint).__name__}, not the dict of a Lightning checkpoint")
    lacking = [k for k in ("optimizer_states", "lr_schedulers") if k not in checkpoint]
    if resumes_training and lacking:
        raise ValueError(
            f"Checkpoint {path} holds only weights (no {' / '.join(lacking)}: saved with ModelCheckpoint("
            "save_weights_only=True) or trainer.save_checkpoint(..., weights_only=True)): fit(ckpt_path=...) resumes a "
            "whole training state and cannot start from it; nothing was loaded. Resume from a full checkpoint (e.g. "
            "last.ckpt), or use these weights with trainer.validate/test/predict(model, ckpt_path=...)."
        )
    if module is None:
        return
    stray = stray_keys(checkpoint, module)
    if stray:
        raise ValueError(
            f"Checkpoint {path} holds {len(stray)} tensor(s) that fit no layer of this model (first: {stray[:5]}): it "
            "was saved from another model or edited. Build the model of the run that saved it; nothing was loaded."
        )
    meta = checkpoint.get(META_KEY)
    if isinstance(meta, dict):
        for check in _META_CHECKS:
            check(meta, path, module)


def config_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Human-readable differences between the configurations saved in a checkpoint and those of this run."""
    lines = []
    for name in sorted(set(saved) | set(current)):
        if name not in current:
            lines.append(f"{name} was used by the run that saved it but is not in this run ({saved[name]})")
        elif name not in saved:
            lines.append(f"{name} is in this run but was not used by the run that saved it ({current[name]})")
        else:
            for key in sorted(set(saved[name]) | set(current[name])):
                old, new = saved[name].get(key), current[name].get(key)
                if old != new:
                    lines.append(f"{name}.{key}: checkpoint {old!r}, this run {new!r}")
    return lines


def fingerprint_differences(meta: dict[str, Any], record: dict[str, Any]) -> list[str]:
    """Omitted base tensors whose fingerprint differs from the one saved (other seed, other weights)."""
    now = record["fingerprints"] if meta.get("version", 1) >= 2 else record.get("fingerprints_v1", {})
    return [
        key
        for key, saved in meta.get("fingerprints", {}).items()
        if saved is not None and key in now and now[key] is not None and now[key] != saved
    ]


def unrestored_keys(module: nn.Module, loaded: Iterable[str], omitted: Iterable[str]) -> list[str]:
    """Keys of the changed model that neither the checkpoint nor an omitted (fingerprinted) base weight provides."""
    loaded, omitted, keys = set(loaded), list(omitted), KeyMap(module)
    return [
        key
        for key in module.state_dict(keep_vars=True)
        if key not in loaded and _canonical(key) not in loaded and not keys.covered(key, omitted)
    ]


# --------------------------------------------------------------------------------------- atomic save

_PARTIAL = ".lightning_hbm-partial"  # ``.{name}.{pid}.lightning_hbm-partial``: a save in progress, beside its target


def _partial_path(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}{_PARTIAL}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def clean_partials(folder: Path) -> list[Path]:
    """Remove the partial files that killed saves of ours left in ``folder`` (their process is gone)."""
    removed = []
    for partial in folder.glob(f".*{_PARTIAL}"):
        pid = partial.name[: -len(_PARTIAL)].rsplit(".", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            partial.unlink(missing_ok=True)
            removed.append(partial)
    return removed


def fsync_dir(folder: Path) -> None:
    """Make a rename inside ``folder`` survive a power cut (checkpoints here, adapter folders in ``LoRA.save_adapter``)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # e.g. Windows: no directory handles; the rename is still atomic
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_save(checkpoint: dict[str, Any], path: Any) -> None:
    """``torch.save`` that never leaves a partial file under ``path``, nor replaces a good one by it.

    Lightning writes into the temp folder and ``shutil.move`` s the file over the target: across
    filesystems (a mounted checkpoint volume) that move is a copy *over the target*, so a kill or a full
    disk mid-copy leaves a 0-byte or partial checkpoint under its final name. Here the file is written
    beside the target (same folder, so same filesystem), flushed and fsynced, then renamed over it in one
    step (``os.replace``); the folder is fsynced so the rename survives a power cut. On any error the
    partial file is removed and the previous checkpoint is untouched.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    clean_partials(path.parent)
    partial = _partial_path(path)
    try:
        with open(partial, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
    except BaseException as err:
        partial.unlink(missing_ok=True)
        if not isinstance(err, Exception):
            raise  # KeyboardInterrupt, SystemExit: as they are
        # torch's zip writer hides a full disk behind "unexpected pos": name the real cause
        cause = next((e for e in _chain(err) if isinstance(e, OSError)), err)
        previous = "the previous checkpoint there is untouched" if path.exists() else "no file was left there"
        raise OSError(
            getattr(cause, "errno", None) or 0,
            f"Could not save checkpoint {path} ({cause}); {previous}. Free space on that disk or save elsewhere.",
        ) from err
    fsync_dir(path.parent)


def _chain(err: BaseException) -> Iterator[BaseException]:
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


def _is_local(path: Any) -> bool:
    return isinstance(path, (str, os.PathLike)) and "://" not in str(path)


class CheckedCheckpointIO(CheckpointIO):
    """The strategy's checkpoint IO, made safe: atomic saves and clear errors for damaged files.

    Every lightning_hbm run gets one (wrapping the strategy's IO). To set its options, pass it yourself:
    ``Trainer(plugins=[CheckedCheckpointIO(refuse_non_finite=False)])``.

    Args:
        inner: the IO that reads and deletes files (and writes those that are not local files); default
            Lightning's ``TorchCheckpointIO``.
        refuse_non_finite: refuse (ValueError, nothing written) to save a checkpoint whose trained tensors hold
            NaN or inf, so a diverged step cannot replace the last good checkpoint.
    """

    def __init__(self, inner: Optional[CheckpointIO] = None, refuse_non_finite: bool = True) -> None:
        self.inner = inner if inner is not None else TorchCheckpointIO()
        self.refuse_non_finite = refuse_non_finite
        self.trainer: Any = None  # set by lightning_hbm.surgery.check_saves
        # set with it to lightning_hbm.surgery.pack_checkpoint: surgery sits above resume (tests/test_layering.py)
        self.pack: Optional[Callable[[Any, dict[str, Any]], None]] = None

    def _writes_atomically(self, path: Any, storage_options: Optional[Any]) -> bool:
        # a user's own IO (async, cloud, ...) keeps its own way of writing
        plain = type(self.inner).save_checkpoint is TorchCheckpointIO.save_checkpoint
        return plain and storage_options is None and _is_local(path)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        if self.trainer is not None and META_KEY not in checkpoint:
            # save_weights_only=True: Lightning calls no save hook, so the lightning_hbm part is packed here
            plugin = self.trainer.strategy.precision_plugin
            if getattr(plugin, "runs_surgery", False):
                plugin.on_save_checkpoint(checkpoint)
            elif self.pack is not None:
                self.pack(self.trainer, checkpoint)
        if self.refuse_non_finite:
            self._refuse_non_finite(checkpoint, path)
        seal(checkpoint)
        if self._writes_atomically(path, storage_options):
            atomic_save(checkpoint, path)
        else:
            self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def _refuse_non_finite(self, checkpoint: dict[str, Any], path: Any) -> None:
        module = getattr(self.trainer, "lightning_module", None)
        weights = {**checkpoint.get("state_dict", {}), **checkpoint.get(META_KEY, {}).get("state_dict", {})}
        if module is not None:  # the trained tensors (a frozen base may hold inf on purpose, e.g. masks)
            trained = {n for n, p in module.named_parameters() if p.requires_grad}
            weights = {k: v for k, v in weights.items() if k in trained}
        bad = [
            k for k, v in weights.items()
            if _plain(v) and v.is_floating_point() and not is_placeholder(v) and not torch.isfinite(v).all()
        ]
        if bad:
            kept = "the previous checkpoint there is kept" if Path(str(path)).exists() else "nothing was written"
            raise ValueError(
                f"Refusing to save checkpoint {path}: {len(bad)} trained tensor(s) hold NaN or inf ({bad[:5]}); {kept}. "
                "The loss diverged: lower the learning rate, clip gradients (Trainer(gradient_clip_val=1.0)) or check "
                "the data, and resume from the last good checkpoint. To save such tensors anyway, pass "
                "Trainer(plugins=[lightning_hbm.CheckedCheckpointIO(refuse_non_finite=False)])."
            )

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        check_file(path)
        try:
            checkpoint = self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        except OSError:
            raise  # a missing file, no permission, a remote store: as the IO says
        except Exception as err:  # flipped bytes reach torch's unpickler as any of a dozen exception types
            raise _unreadable(path, err) from err
        module = getattr(self.trainer, "lightning_module", None)
        if isinstance(checkpoint, dict):
            check_layout(checkpoint, path, module.state_dict().keys() if module is not None else ())
            verify(checkpoint, path)  # before Lightning loads anything from it
        state = getattr(self.trainer, "state", None)
        fitting = getattr(state, "fn", None) == "fit" and getattr(self.trainer.strategy, "lightning_restore_optimizer", True)
        check_contents(checkpoint, path, module, fitting)
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
