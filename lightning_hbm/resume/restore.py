"""The checkpoint against this run: its settings, adapter sizes and frozen base before the first change
(:func:`check_settings`; :func:`check_resume` for a Trainer's run, with the settings the surgery registered), and its
changed tensors loaded into the changed model after the surgery (:func:`load_changed`)."""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable, Optional

import torch
from torch import nn

from lightning_hbm.record import as_built, set_as_built
from lightning_hbm.resume.fingerprints import as_built_record
from lightning_hbm.resume.keys import KeyMap, _canonical

log = logging.getLogger(__name__)


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
                    lines.append(f"{name}.{key}: checkpoint {_shown(saved[name], key)}, this run {_shown(current[name], key)}")
    return lines


#: what a setting left out of a run's settings means (saved only when it differs from what runs did before it existed)
_UNRECORDED = {"quantize_embeddings": "False (not recorded: the embeddings kept wide)"}


def _shown(settings: dict[str, Any], key: str) -> str:
    # was "checkpoint None" for a setting a run does not record at its old value (session 31): None was never set
    return repr(settings[key]) if key in settings else _UNRECORDED.get(key, "not recorded (the run's default then)")


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


# QuantizedPrecision alone: Lightning gives a precision plugin no hook before it loads the checkpoint into the model
LOADED_ALREADY = (
    "Note: Lightning had already loaded this file into your model before QuantizedPrecision could check it (a "
    "precision plugin gets no hook before that load), so its weights now hold the checkpoint's tensors and NaN "
    "placeholders: rebuild the model before using it again. With any lightning_hbm callback in the Trainer (e.g. "
    "LoRA) the file is checked before it is loaded."
)


def adapter_misfits(meta: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """LoRA pairs of the checkpoint whose (in, out) sizes differ from the as-built weight they adapt."""
    saved = meta.get("state_dict", {})
    misfits = []
    for key, lora_a in saved.items():
        found = re.fullmatch(r"(.*?)(?:\.base_layer)?\.lora_A\.([^.]+)\.weight", key)
        lora_b = saved.get(key.replace(".lora_A.", ".lora_B."))
        base = schema.get(f"{found.group(1)}.weight") if found else None
        if found is None or base is None or lora_b is None or len(base[0]) != 2 or not isinstance(lora_a, torch.Tensor):
            continue
        if sorted((lora_a.shape[-1], lora_b.shape[0])) != sorted(base[0]):
            misfits.append(f"{found.group(1)}: adapters for {lora_a.shape[-1]} -> {lora_b.shape[0]}, layer {tuple(base[0])}")
    return misfits


def load_changed(module: nn.Module, meta: dict[str, Any], checkpoint: dict[str, Any], path: Any) -> None:
    """Load the changed tensors of ``checkpoint`` into the model after the surgery, and check that every tensor of the
    changed model came from the file or from an omitted (fingerprinted) base weight.

    Raises:
        ValueError: naming the file, for tensors that do not fit the changed model or that the file lacks.
    """
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
    lacking = unrestored_keys(module, restored, meta.get("omitted", []))
    if lacking:
        # the settings were compared before the first change (check_settings) and are equal: do not blame them
        raise ValueError(
            f"Checkpoint {path} does not hold these tensors of the model after lightning_hbm's changes: {lacking[:10]}. "
            "Its lightning_hbm settings equal this run's, so the file was edited, the model differs from the one that saved it (another "
            "architecture or config: build the same model), or a converted layer kind does not map these tensors to "
            "the model as built (LayerKind.as_built_keys; please report it). LoRA(full_checkpoint=True) checkpoints "
            "hold every tensor."
        )
    log.info("lightning_hbm: restored %d changed tensors after model surgery", len(changed))


def check_settings(
    meta: Optional[dict[str, Any]], current: dict[str, Any], record: Optional[dict[str, Any]], allows_base_change: bool, path: Any
) -> None:
    """Before the first change: the checkpoint's lightning_hbm settings against this run's, its adapters against the
    layers, and its frozen base against the model's.

    Args:
        meta: the checkpoint's lightning_hbm part (None: a checkpoint saved without lightning_hbm's changes).
        current: this run's settings, by plugin or transform name (``surgery.resume_configs``).
        record: the model as built (:func:`~lightning_hbm.resume.as_built_record`); read only when ``meta`` is given.
        allows_base_change: a transform accepts adapters trained on another frozen base (``LoRA(allow_base_change=True)``).
        path: the checkpoint's path, for the messages.

    Raises:
        ValueError: for settings that differ, adapters that do not fit, or a changed base; nothing was loaded.
    """
    if meta is None:
        if current:
            raise ValueError(
                f"Checkpoint {path} was saved without lightning_hbm's changes, but this run applies "
                f"{sorted(current)}: its optimizer states and weights belong to the unchanged model. To start a new "
                "run from its weights, load them into your model first (model.load_state_dict(torch.load(path)"
                "['state_dict'])) and call fit without ckpt_path."
            )
        return
    differences = config_differences(meta.get("configs", {}), current)
    if differences:
        raise ValueError(
            f"Checkpoint {path} was saved with other lightning_hbm settings than this run has:\n  - "
            + "\n  - ".join(differences)
            + "\nResume with the settings of the run that saved it (or train from scratch without ckpt_path)."
        )
    assert record is not None, "the model's as-built record is taken before its first resume check"
    changed = fingerprint_differences(meta, record)
    misfits = adapter_misfits(meta, record["schema"])
    if misfits:  # even with allow_base_change: adapters of another shape cannot sit on this base
        raise ValueError(
            f"Checkpoint {path} holds adapters that do not fit this model's layers: {misfits[:3]}. A base change "
            "(allow_base_change=True) keeps the layer sizes; build the model with the sizes of the run that saved it."
        )
    if changed and not allows_base_change:
        raise ValueError(
            f"Checkpoint {path} holds adapters trained on another frozen base: {len(changed)} base tensor(s) of the "
            f"model differ from the ones it was trained on ({changed[:5]}). Build the model with the same seed or "
            "pretrained weights as the run that saved it; to put these adapters on a different base on purpose, "
            "pass LoRA(allow_base_change=True)."
        )


#: ``settings(trainer) -> (configs, allows_base_change)``: the settings of a Trainer's run that a checkpoint it resumes
#: must share (by plugin or transform name), and whether a transform accepts another frozen base
RunSettings = Callable[[Any], tuple[dict[str, Any], bool]]
_RUN_SETTINGS: list[RunSettings] = []


def register_run_settings(settings: RunSettings) -> None:
    """Read a Trainer run's settings with ``settings`` (the surgery, which knows the plugin and the transforms,
    registers it once at import, as the precision level registers its meta checks). Read when a resume is checked,
    not before: the plugin's part depends on the checkpoint being resumed (its saved plan)."""
    _RUN_SETTINGS[:] = [settings]


def check_resume(trainer: Any, module: nn.Module, meta: Optional[dict[str, Any]], path: Any) -> None:
    """:func:`check_settings` with the settings of ``trainer``'s run, for the load paths outside the surgery:
    Lightning's weight restore (the load hook, before the surgery) and a strategy that restores after its setup (FSDP).

    Raises:
        ValueError: for settings that differ, adapters that do not fit, or a changed base; nothing was loaded.
    """
    if as_built(module) is None:  # before the surgery: the model is as the user built it
        set_as_built(module, as_built_record(module))
    # no surgery imported (no lightning_hbm plugin, callback or strategy in the run): nothing applied, nothing shared
    configs, allows_base_change = _RUN_SETTINGS[0](trainer) if _RUN_SETTINGS else ({}, False)
    check_settings(meta, configs, as_built(module), allows_base_change, path)
