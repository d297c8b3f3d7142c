"""The one place where lightning_hbm changes the user's model: the package's face.

* :mod:`~lightning_hbm.surgery.engine`: the engine (:func:`run_surgery`, in a fixed stage order, every check before
  the first change) and its Trainer adapter (:class:`SurgeryCallback`, :func:`install`, the plugin's convert/connect
  path). Why it runs where it runs, and how resume fits in, is that module's docstring.
* :mod:`~lightning_hbm.surgery.probe_step`: the probe step (the user's step run once on the model as built, to see
  which layers its code reads directly) and the guards on the paths it did not take.
* :mod:`~lightning_hbm.surgery.protocol`: what the engine asks a precision plugin (:class:`SurgeryPlugin`).
* :mod:`~lightning_hbm.surgery.record`: what the surgery knows of a model (kept in :mod:`lightning_hbm.record`,
  nothing set on the model).
* :mod:`~lightning_hbm.surgery.ranks`: ranks that built different bases.
* :mod:`~lightning_hbm.surgery.optimizers`: what whoever replaces an optimizer must do (:func:`repoint_lr_schedulers`).
"""

from __future__ import annotations

from lightning_hbm.surgery.engine import (
    PluginAttach,
    Stage,
    SurgeryCallback,
    apply_transforms,
    check_saves,
    install,
    pack_checkpoint,
    pending_checkpoint,
    plugin_callbacks,
    plugin_config,
    plugin_trainer,
    prune_frozen_parameters,
    resume_configs,
    run_settings,
    run_surgery,
    surgery_callbacks,
    trainer_optimizers,
    trainer_surgery,
    transform_optimizers,
)
from lightning_hbm.surgery.optimizers import repoint_lr_schedulers
from lightning_hbm.surgery.record import applied_transforms, mark_applied

__all__ = [
    "PluginAttach",
    "Stage",
    "SurgeryCallback",
    "applied_transforms",
    "apply_transforms",
    "check_saves",
    "install",
    "mark_applied",
    "pack_checkpoint",
    "pending_checkpoint",
    "plugin_callbacks",
    "plugin_config",
    "plugin_trainer",
    "prune_frozen_parameters",
    "repoint_lr_schedulers",
    "resume_configs",
    "run_settings",
    "run_surgery",
    "surgery_callbacks",
    "trainer_optimizers",
    "trainer_surgery",
    "transform_optimizers",
]
