"""The quantized base an adapter exported with its corrections fits, recorded beside it and checked before loading.

``LoRA.save_adapter(with_correction=True)`` folds each layer's calibrated correction (fitted to ``W - Q`` on the probe
batch, ``Q`` the run's quantized weight) into the adapter: it computes the run's outputs only on a base whose quantized
weights are ``Q`` bit for bit. Session 38 measured the cost of another ``Q``: reloaded onto a GPTQ base rounded from
another probe, the logits differed by 0.078; onto bitsandbytes' own nearest rounding, by 0.091 (logits of scale 0.6).
The export writes :data:`BASE_RECORD` into the folder (the manifest lists it; peft ignores it): per quantized layer of
the exported model, its mode and rounding (as ``QuantizedPrecision`` built it, ``null`` where another library did), the
rank of the correction folded in, the shapes and dtypes of its storage and a fingerprint of that storage.

Why a fingerprint of the quantized storage (the packed codes and the quantization constants), not of the probe batch:
it is what the correction was fitted to, so it is sound for every way a base can differ (another probe, another
rounding, another block size or double quantization, GPTQ run on another device, other pretrained weights), and it can
be taken of any base, one quantized by bitsandbytes or Hugging Face too, which records no probe. It is cheap: one
:func:`lightning_hbm.resume.fingerprint` per storage tensor (exact CRC32 up to 16 MiB, exact row and column sums
where the tensor lives above), about half a byte per weight read once.

:func:`check_quantized_base` compares a base against the record before anything is loaded and refuses one that
differs, naming the first differing layer, what differs and the fix.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from lightning_hbm import record, resume
from lightning_hbm.adapters.lora.base import full_tensor
from lightning_hbm.adapters.lora.folder import check_adapter_folder
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.precision.registry import format_of

#: the record of the quantized base, written by ``save_adapter(with_correction=True)`` (listed in the manifest)
BASE_RECORD = "lightning_hbm_quantized_base.json"
_VERSION = 1


def _storage(layer: nn.Module) -> list[torch.Tensor]:
    """The tensors that make ``layer``'s quantized weight, each once: its weight (the packed codes; neither its bias,
    which LoRA may train, nor the correction's or an adapter's factors) and its format's constants (absmax, code book,
    nested absmax). A weight of a tensor subclass (torchao's ``NF4Tensor``) counts as its dequantized values."""
    fmt = format_of(layer)
    weight = getattr(layer, "weight", None)
    tensors: list[torch.Tensor] = []
    if isinstance(weight, torch.Tensor):
        plain = full_tensor(weight.detach())  # FSDP2's shard: the whole packed weight (every rank gathers)
        if type(plain) is not torch.Tensor and fmt is not None:
            plain = fmt.dequantize(layer, torch.float32)
        tensors.append(plain)
    seen = {id(t) for t in tensors}
    for tensor in fmt.constants(layer) if fmt is not None else []:
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors.append(tensor.detach())
    return tensors


def _describe(layer: nn.Module) -> dict[str, Any]:
    """What the base must hold at one quantized layer: mode, rounding, layout and fingerprint of its storage (a
    constant held twice, as a copied bitsandbytes layer holds its ``QuantState`` on the weight and on the layer, once)."""
    mode, rounding = record.quantized_as(layer) or (None, None)
    fmt = format_of(layer)
    prints: dict[str, str] = {}
    for tensor in _storage(layer):
        prints.setdefault(str(resume.fingerprint(tensor.as_subclass(torch.Tensor))), f"{str(tensor.dtype).removeprefix('torch.')}{list(tensor.shape)}")
    return {
        "mode": mode,
        "format": fmt.name if fmt is not None else type(layer).__name__,
        "rounding": rounding,
        "layout": list(prints.values()),
        "storage": hashlib.sha1("".join(prints).encode()).hexdigest()[:16],
    }


def _quantized_layers(model: nn.Module) -> dict[str, nn.Module]:
    """``{name: mode's layer}`` of ``model``'s quantized layers, named as in the plain model (peft's ``base_layer``
    segments left out)."""
    return {
        ".".join(part for part in name.split(".") if part != "base_layer"): sub
        for name, sub in model.named_modules()
        if name and format_of(sub) is not None
    }


def base_record(model: nn.Module) -> dict[str, Any]:
    """The record of the quantized base of ``model`` (the exported Hugging Face model): :data:`BASE_RECORD`'s content."""
    layers = {}
    for name, layer in _quantized_layers(model).items():
        correction = correction_of(layer)
        layers[name] = {**_describe(layer), "correction_rank": correction.rank if correction is not None else 0}
    ranks = {entry["correction_rank"] for entry in layers.values()} - {0}
    return {
        "version": _VERSION,
        "what": "the quantized base this adapter (LoRA.save_adapter(with_correction=True)) fits: "
        "LoRA.check_quantized_base(base, folder) checks a base against it before loading",
        "correction_rank": max(ranks, default=0),
        "layers": layers,
    }


def _find(layers: dict[str, nn.Module], name: str) -> Optional[nn.Module]:
    """The layer recorded as ``name`` in a base whose names may carry a prefix (a LightningModule's ``model.``, a
    PeftModel's ``base_model.model.``): the exact name, else the shortest name ending in ``.name``."""
    if name in layers:
        return layers[name]
    found = sorted((n for n in layers if n.endswith("." + name)), key=len)
    return layers[found[0]] if found else None


def _difference(name: str, want: dict[str, Any], layer: Optional[nn.Module]) -> Optional[str]:
    """What differs at the recorded layer ``name`` (``None``: nothing)."""
    if layer is None:
        return f"{name}: not quantized in this base (the adapter needs it stored as {_how(want)})"
    have = _describe(layer)
    if have["storage"] == want["storage"]:
        return None
    if have["layout"] != want["layout"]:
        return (f"{name}: stored as {_how(have)} ({', '.join(have['layout'])}), the adapter needs {_how(want)} "
                f"({', '.join(want['layout'])})")
    if have["rounding"] is not None and want["rounding"] is not None and have["rounding"] != want["rounding"]:
        return f"{name}: rounded {have['rounding']!r} in this base, the adapter needs rounding={want['rounding']!r}"
    if want["rounding"] == "gptq":
        why = ("GPTQ-rounded from another probe batch (or on another device)" if have["rounding"] == "gptq" else
               "not the run's GPTQ rounding (bitsandbytes' own nearest rounding, another probe batch, other weights)")
    else:
        why = "other quantized values (another rounding, or other pretrained weights)"
    return f"{name}: its quantized weight differs from the run's ({why}: storage {have['storage']}, the run's {want['storage']})"


def _how(entry: dict[str, Any]) -> str:
    mode = entry["mode"] or entry["format"]
    return f"{mode!r}" + (f" rounded {entry['rounding']!r}" if entry["rounding"] else "")


def _fix(wanted: dict[str, Any]) -> str:
    """The ``QuantizedPrecision`` call that builds the recorded base again."""
    modes = Counter(str(e["mode"] or e["format"]) for e in wanted.values())
    args = repr(modes.most_common(1)[0][0]) if modes else "mode"
    args += ", rounding='gptq', probe_batch=<the run's probe batch>" if any(e["rounding"] == "gptq" for e in wanted.values()) else ""
    others = f" and the run's other settings (its layer modes: {', '.join(f'{m} {n}' for m, n in modes.most_common())})" if len(modes) > 1 else ""
    return (
        f"quantize the base exactly as the run did (QuantizedPrecision({args}){others}, without correction_rank: the "
        "adapter holds the corrections), or save the adapter for the full-precision base (LoRA.save_adapter without "
        "with_correction) and load it onto the unquantized base"
    )


def check_quantized_base(model: nn.Module, path: Union[str, Path]) -> Path:
    """Refuse a base the adapter in ``path`` (``LoRA.save_adapter(with_correction=True)``) does not fit, before loading.

    The folder is checked complete first (:func:`check_adapter_folder`). Each quantized layer recorded in its
    :data:`BASE_RECORD` must be in ``model`` (a Hugging Face model, the LightningModule holding it, or a ``PeftModel``)
    and hold the same quantized storage (fingerprint) as the run's: same mode, block size and rounding, GPTQ from the
    same probe batch. A folder without the record (saved without ``with_correction``, or by a lightning_hbm before
    session 39) cannot be checked: said in a warning. A model sharded by FSDP2 (``QuantizedFSDPStrategy``) is read
    whole, each rank gathering its packed weights: call it on every rank. Returns ``path``.

    Raises:
        ValueError: a layer differs (the first named, with what differs and the fix; nothing was loaded), or the record
            cannot be read.
    """
    folder = check_adapter_folder(path)
    file = folder / BASE_RECORD
    if not file.is_file():
        rank_zero_warn(
            f"LoRA.check_quantized_base: {folder} has no {BASE_RECORD}, so which quantized base its adapter fits cannot be "
            "checked: it was saved without with_correction=True (the adapter for the full-precision base: load it onto "
            "that base) or by a lightning_hbm older than the record (session 39). Save it again from the run with "
            "LoRA.save_adapter(model, path, with_correction=True) to have the base checked."
        )
        return folder
    try:
        wanted = json.loads(file.read_text())["layers"]
        wanted = {str(name): dict(entry) for name, entry in wanted.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as err:
        raise ValueError(f"{file} cannot be read ({type(err).__name__}: {err}): save the adapter again.") from None
    layers = _quantized_layers(model)
    differ = [d for name, entry in wanted.items() if (d := _difference(name, entry, _find(layers, name))) is not None]
    if differ:
        others = f"; {len(differ) - 1} more layer(s) differ" if len(differ) > 1 else ""
        raise ValueError(
            f"LoRA.check_quantized_base: {type(model).__name__} is not the quantized base the adapter in {folder} was "
            "exported for (save_adapter(with_correction=True): its folded corrections fit the run's quantized weights "
            f"only; on another quantization it computes other outputs). First differing layer: {differ[0]}{others}. "
            f"Fix: {_fix(wanted)}. Nothing was loaded."
        )
    return folder


__all__ = ["BASE_RECORD", "base_record", "check_quantized_base"]
