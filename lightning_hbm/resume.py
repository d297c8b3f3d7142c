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
  plugin and of every transform (``configs``), and a CRC32 of every saved tensor (``checksums``).

On resume, before the first change: every tensor is checked against its CRC (``torch.load`` does
not verify the zip CRC of tensor data, so flipped bytes would load silently), the configurations
must be equal, and the omitted base must have the fingerprint of the base the adapters were trained
on. After the surgery the changed tensors are loaded and every key of the changed model must come
from the checkpoint or from an omitted (fingerprinted) base weight.
"""

from __future__ import annotations

import hashlib
import zlib
from pathlib import Path
from typing import Any, Iterable, Optional

import torch
from lightning.fabric.plugins import CheckpointIO
from torch import nn

FORMAT_VERSION = 1
META_KEY = "lightning_hbm"
_SAMPLES = 64  # elements sampled per tensor for its fingerprint: cheap on an 8B model, enough to tell two bases apart


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


def fingerprint(tensor: torch.Tensor) -> Optional[str]:
    """A hash of the shape and of 64 fixed, evenly spread elements (None for meta tensors)."""
    if tensor.is_meta or not isinstance(tensor, torch.Tensor) or type(tensor) not in (torch.Tensor, nn.Parameter):
        return None
    flat = tensor.detach().reshape(-1)
    if flat.numel() == 0:
        values = torch.zeros(0, dtype=torch.float64)
    else:
        index = spread_indices(flat.numel(), _SAMPLES, flat.device)
        values = flat[index].to(torch.float64).cpu()
    digest = hashlib.sha1(repr(tuple(tensor.shape)).encode() + values.numpy().tobytes())
    return digest.hexdigest()[:16]


def as_built_record(module: nn.Module) -> dict[str, Any]:
    """Schema ``{key: (shape, is_floating_point)}`` and fingerprints of the model as the user built it."""
    schema: dict[str, tuple[tuple[int, ...], bool]] = {}
    prints: dict[str, Optional[str]] = {}
    for key, value in module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):
            schema[key] = (tuple(value.shape), value.is_floating_point())
            prints[key] = fingerprint(value)
    return {"schema": schema, "fingerprints": prints}


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
        from lightning_hbm.layers import converted_keys

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
    keys = KeyMap(module)
    forms = [keys.as_built(k) for k in changed]
    for key, (shape, floating) in schema.items():
        if key in fitting:
            continue
        # a full checkpoint saved every tensor in some changed form (even one renamed by a layer-kind
        # conversion, e.g. in_proj_weight -> q_proj/k_proj/v_proj); an adapter-only one left the base out
        if floating and (not trainable_only or any(keys._form_of(k, key) for k in forms)):
            placeholders.append(key)
        else:
            omitted.append(key)
    sums = {k: checksum(v) for k, v in {**fitting, **changed}.items() if isinstance(v, torch.Tensor)}
    state_dict = dict(fitting)
    state_dict.update({k: _placeholder(schema[k][0]) for k in placeholders})
    checkpoint["state_dict"] = state_dict
    checkpoint[META_KEY] = {
        "version": FORMAT_VERSION,
        "state_dict": changed,
        "placeholders": placeholders,
        "omitted": omitted,
        "fingerprints": {k: record["fingerprints"].get(k) for k in omitted},
        "checksums": {k: v for k, v in sums.items() if v is not None},
        "configs": configs,
    }


# ------------------------------------------------------------------------------------------- resume


def verify_checksums(meta: dict[str, Any], state_dict: dict[str, Any], path: Any) -> None:
    """Raise if a tensor of ``state_dict`` or of the changed part differs from the CRC saved with it."""
    sums = meta.get("checksums", {})
    for part in (state_dict, meta.get("state_dict", {})):
        for key, value in part.items():
            expected = sums.get(key)
            if expected is None or not isinstance(value, torch.Tensor) or is_placeholder(value):
                continue
            if checksum(value) != expected:
                raise ValueError(
                    f"Checkpoint {path} is damaged: tensor {key!r} does not match the checksum written with it "
                    "(flipped bytes on disk or in transfer). Resume from another checkpoint (e.g. the previous "
                    "'last.ckpt' or a top-k one) instead; nothing was loaded."
                )


def check_file(path: Any) -> None:
    """A clear error for a checkpoint file that is empty or cut short (torch says EOFError / Errno 22)."""
    if path is None:
        return
    try:
        file = Path(path)
        size = file.stat().st_size
    except (OSError, TypeError, ValueError):
        return  # a remote URL or an unusual path: leave it to Lightning's own loader
    if size == 0:
        raise ValueError(f"Checkpoint {path} is empty (0 bytes): the save was interrupted. Resume from another checkpoint.")
    import zipfile

    if not zipfile.is_zipfile(file):
        raise ValueError(
            f"Checkpoint {path} is not a complete torch checkpoint ({size} bytes; its zip directory is missing): the "
            "file was cut short, e.g. by a kill during save or a full disk. Resume from another checkpoint."
        )


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
    now = record["fingerprints"]
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


class CheckedCheckpointIO(CheckpointIO):
    """The strategy's checkpoint IO, with a clear error for an empty or cut-short file before loading it."""

    def __init__(self, inner: CheckpointIO) -> None:
        self.inner = inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None) -> None:
        self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None) -> dict[str, Any]:
        check_file(path)
        return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)

    def remove_checkpoint(self, path: Any) -> None:
        self.inner.remove_checkpoint(path)

    def teardown(self) -> None:
        self.inner.teardown()
