"""The two-part form of a checkpoint (see :mod:`lightning_hbm.resume`): what fits the model as built, placeholders,
and the lightning_hbm part with the changed tensors, the omitted keys and their fingerprints, and the settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from lightning_hbm.layers.correction import KEY_MARK as CORRECTION_MARK
from lightning_hbm.record import as_built
from lightning_hbm.resume.keys import KeyMap, _canonical

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
        # an as-built buffer of a layer peft wrapped (spectral_norm's power-iteration u and v, which change while
        # training, under ...base_layer...): kept under its as-built name, restored before the surgery as the others
        # (was: dropped, so a resume restarted the power iteration from the model as built)
        renamed = {n: _canonical(n) for n, b in module.named_buffers(remove_duplicate=False) if n not in keep and _fits(schema, _canonical(n), b)}
        # a quantized layer's calibrated correction: frozen, but measured on the probe, not rebuilt from the base
        # (stored, so a resume takes it back bit for bit: lightning_hbm.precision.correction)
        keep |= {n for n in full if CORRECTION_MARK in n}
        full = {renamed.get(k, k): v for k, v in full.items() if k in keep or k in renamed}
    fitting = {k: v for k, v in full.items() if _fits(schema, k, v)}
    changed = {k: v for k, v in full.items() if k not in fitting}
    placeholders, omitted = [], []
    saved_in_changed_form = KeyMap(module).any_form_of(changed) if trainable_only else None
    for key, (_shape, floating) in schema.items():
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


@dataclass
class Saves:
    """What every checkpoint of one Trainer's run is packed with, handed down by the surgery once it ran.

    Data, not a callback: the checked IO (for ``save_weights_only``) and the save hooks pack with it without calling
    back up into the surgery or the plugin.

    Args:
        configs: the settings a resume must share, by plugin or transform name (``surgery.resume_configs``).
        trainable_only: the checkpoint keeps the trainable weights (and the as-built buffers) only.
        extras: the precision plugin's own entries (e.g. the GPTQ CRC, the smoothing exponents), added after the rest.
    """

    configs: dict[str, Any]
    trainable_only: bool
    extras: dict[str, Any] = field(default_factory=dict)


# Trainer -> its Saves; weak and by identity: nothing is set on the Trainer, and a finished run's entry goes with it
_SAVES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def expect_saves(trainer: Any, saves: Saves) -> None:
    """Pack ``trainer``'s checkpoints with ``saves`` from now on (the surgery calls it once the model is changed)."""
    _SAVES[trainer] = saves


def pack_for(trainer: Any, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` of ``trainer``'s run in the two-part form (once per checkpoint; see :func:`pack`).

    The first save hook that runs packs (the plugin's, a surgery callback's, or the checked IO for
    ``save_weights_only``); the later ones find the lightning_hbm part there and return. A run whose model the surgery
    did not change (no :func:`expect_saves`) is saved as Lightning saves it.
    """
    module = getattr(trainer, "lightning_module", None)
    saves: Optional[Saves] = _SAVES.get(trainer)
    record = as_built(module) if module is not None else None
    if META_KEY in checkpoint or module is None or saves is None or record is None or "state_dict" not in checkpoint:
        return
    pack(module, checkpoint, record, saves.configs, saves.trainable_only)
    checkpoint[META_KEY].update(saves.extras)
