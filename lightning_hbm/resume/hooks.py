"""The load hooks that read a lightning_hbm checkpoint into the model when a Trainer resumes it.

Everything they need comes from this package: the checkpoint and its verified lightning_hbm part from
:mod:`lightning_hbm.resume.pending` (as for every other reader), the settings check from
:func:`~lightning_hbm.resume.restore.check_resume` (with the run's settings the surgery registered there), and
whether the surgery already changed the model from the model's record. A hook holds no function of a level above, so
a model holding it stays picklable.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.record import applied_transforms
from lightning_hbm.resume.keys import KeyMap
from lightning_hbm.resume.pending import opened, pending
from lightning_hbm.resume.restore import check_resume


def has_resume_hook(module: nn.Module) -> bool:
    """Whether :func:`add_resume_hooks` registered its hooks on ``module``."""
    return any(isinstance(h, _ResumeHook) for h in torch_compat.load_state_dict_pre_hooks(module))


def add_resume_hooks(module: nn.Module) -> None:
    """Register (once per model) the load hooks that read lightning_hbm checkpoints; inert for other checkpoints.

    Args:
        module: the model a Trainer may restore a checkpoint into.
    """
    if has_resume_hook(module):
        return
    hook = _ResumeHook()
    module.register_load_state_dict_pre_hook(hook)
    module.register_load_state_dict_post_hook(hook.forgive)


def _changed(module: nn.Module) -> bool:
    """Whether a surgery already changed ``module`` (then the changed tensors load right away)."""
    return bool(applied_transforms(module))


class _ResumeHook:
    """Loading a lightning_hbm checkpoint (from the Trainer resuming it) into the model.

    Before the load: every tensor's CRC is verified and the placeholders are taken out. Into the
    model as built, the changed tensors are loaded after the surgery (``surgery.run_surgery``); into a
    model already changed (``trainer.test(ckpt_path=...)`` after ``fit``) they are loaded right here.
    After the load: the keys the checkpoint says it left out are forgiven; every other missing key
    stays Lightning's strict error.
    """

    def __init__(self) -> None:
        self.omitted: list[str] = []
        self.placeholders: set[str] = set()

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        self.omitted, self.placeholders = [], set()
        trainer = lightning_compat.attached_trainer(module)
        loaded = pending(trainer)
        if trainer is None or loaded is None or prefix:
            return  # not Lightning restoring a checkpoint: nothing to check
        meta = opened(loaded, trainer.ckpt_path)  # verified by the checked IO that read it (or here, if another did)
        if trainer.state.fn == "fit" and not _changed(module):
            # settings and frozen base, before Lightning copies a single tensor into the model as built
            check_resume(trainer, module, meta, trainer.ckpt_path)
        if meta is None:
            return  # not a lightning_hbm checkpoint: Lightning's rules, unchanged
        self.placeholders = set(meta.get("placeholders", []))
        for key in self.placeholders:
            state_dict.pop(key, None)
        if _changed(module):
            state_dict.update(meta.get("state_dict", {}))
        self.omitted = list(meta.get("omitted", []))
        strict = bool(args[1]) if len(args) > 1 else True  # (local_metadata, strict, ...): Lightning's strict_loading
        if strict and trainer.state.fn == "fit" and not _changed(module):
            self._check_nothing_absent(module, state_dict, trainer.ckpt_path)

    def _check_nothing_absent(self, module: nn.Module, state_dict: dict[str, Any], path: Any) -> None:
        """A ``ValueError`` before a single tensor is copied when the model has tensors the checkpoint neither holds
        nor left out (a model with more layers than the one that saved it). Was Lightning's strict error, raised by
        torch after the tensors the checkpoint does hold had been copied in: ``RuntimeError: Error(s) in loading
        state_dict ... Missing key(s)``, with no word of what to do."""
        keys = KeyMap(module)
        absent = [k for k in module.state_dict() if k not in state_dict and k not in self.placeholders
                  and not keys.covered(k, self.omitted)]
        if absent:
            raise ValueError(
                f"Checkpoint {path} holds nothing for {len(absent)} tensor(s) of this model (first: {absent[:5]}): "
                "neither saved nor left out as a frozen base of the run that saved it, so that run's model had no such "
                "layers. Build the model of the run that saved it (the same architecture and config); nothing was loaded."
            )

    def forgive(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        keys = KeyMap(module)
        missing[:] = [k for k in missing if k not in self.placeholders and not keys.covered(k, self.omitted)]
