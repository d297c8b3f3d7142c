"""The two-part form of a checkpoint (see :mod:`lightning_hbm.resume`): what fits the model as built, placeholders,
and the lightning_hbm part with the changed tensors, the omitted keys and their fingerprints, and the settings."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from lightning_hbm.layers.correction import KEY_MARK as CORRECTION_MARK
from lightning_hbm.resume.keys import KeyMap

# 2: every tensor checksummed, the lightning_hbm part sealed by a digest, stronger fingerprints; 3: every value too
FORMAT_VERSION = 3
META_KEY = "lightning_hbm"


def _fits(schema: dict[str, tuple[tuple[int, ...], bool]], key: str, value: Any) -> bool:
    return isinstance(value, torch.Tensor) and schema.get(key) == (tuple(value.shape), value.is_floating_point())


def _placeholder(shape: tuple[int, ...]) -> torch.Tensor:
    return torch.full((), float("nan")).expand(shape)


def is_placeholder(tensor: Any) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


def pack(
    module: nn.Module,
    checkpoint: dict[str, Any],
    record: dict[str, Any],
    configs: dict[str, Any],
    trainable_only: bool,
) -> None:
    """Rewrite ``checkpoint`` in place into the two-part form described in :mod:`lightning_hbm.resume`."""
    schema = record["schema"]
    full: dict[str, Any] = checkpoint.get("state_dict", {})
    if trainable_only:
        # the adapters and modules_to_save, and the buffers the model had as built (BatchNorm
        # statistics change while training; a 4-bit layer's constants are not buffers)
        keep = {n for n, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        keep |= {n for n, b in module.named_buffers(remove_duplicate=False) if _fits(schema, n, b)}
        # a quantized layer's calibrated correction: frozen, but measured on the probe, not rebuilt from the base
        # (stored, so a resume takes it back bit for bit: lightning_hbm.precision.correction)
        keep |= {n for n in full if CORRECTION_MARK in n}
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
