"""Resume after the surgery: adapters that do not fit, and the changed tensors loaded into the changed model."""

from __future__ import annotations

import logging
import re
from typing import Any

import torch
from torch import nn

from lightning_hbm import resume

log = logging.getLogger(__name__)


# QuantizedPrecision alone: Lightning gives a precision plugin no hook before it loads the checkpoint into the model
_LOADED_ALREADY = (
    "Note: Lightning had already loaded this file into your model before QuantizedPrecision could check it (a "
    "precision plugin gets no hook before that load), so its weights now hold the checkpoint's tensors and NaN "
    "placeholders: rebuild the model before using it again. With any lightning_hbm callback in the Trainer (e.g. "
    "LoRA) the file is checked before it is loaded."
)


def _adapter_misfits(meta: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """LoRA pairs of the checkpoint whose (in, out) sizes differ from the as-built weight they adapt."""
    saved = meta.get("state_dict", {})
    misfits = []
    for key, lora_a in saved.items():
        found = re.fullmatch(r"(.*?)(?:\.base_layer)?\.lora_A\.([^.]+)\.weight", key)
        lora_b = saved.get(key.replace(".lora_A.", ".lora_B."))
        base = schema.get(f"{found.group(1)}.weight") if found else None
        if base is None or lora_b is None or len(base[0]) != 2 or not isinstance(lora_a, torch.Tensor):
            continue
        if sorted((lora_a.shape[-1], lora_b.shape[0])) != sorted(base[0]):
            misfits.append(f"{found.group(1)}: adapters for {lora_a.shape[-1]} -> {lora_b.shape[0]}, layer {tuple(base[0])}")
    return misfits


def _load_changed(module: nn.Module, meta: dict[str, Any], checkpoint: dict[str, Any], path: Any) -> None:
    changed: dict[str, Any] = meta.get("state_dict", {})
    advice = "Resume with the same precision mode and LoRA settings as the run that saved it."
    try:
        result = module.load_state_dict(changed, strict=False)
    except RuntimeError as err:  # shape mismatches raise even with strict=False
        raise ValueError(f"Checkpoint {path} does not fit the model after lightning_hbm's changes. {advice}\n{err}") from err
    if result.unexpected_keys:
        raise ValueError(
            f"Checkpoint {path} holds tensors that fit neither the model as built nor the model after lightning_hbm's "
            f"changes: {sorted(result.unexpected_keys)[:10]}. {advice}"
        )
    restored = set(changed) | {k for k in checkpoint.get("state_dict", {}) if k not in set(meta.get("placeholders", []))}
    lacking = resume.unrestored_keys(module, restored, meta.get("omitted", []))
    if lacking:
        # the settings were compared before the first change (_check_resume) and are equal: do not blame them
        raise ValueError(
            f"Checkpoint {path} does not hold these tensors of the model after lightning_hbm's changes: {lacking[:10]}. "
            "Its lightning_hbm settings equal this run's, so the file was edited, the model differs from the one that saved it (another "
            "architecture or config: build the same model), or a converted layer kind does not map these tensors to "
            "the model as built (LayerKind.as_built_keys; please report it). LoRA(full_checkpoint=True) checkpoints "
            "hold every tensor."
        )
    log.info("lightning_hbm: restored %d changed tensors after model surgery", len(changed))
