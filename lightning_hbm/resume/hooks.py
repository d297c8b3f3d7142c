"""The load hooks that read a lightning_hbm checkpoint into the model when a Trainer resumes it.

The hooks need two answers only the surgery engine (a level above) has: whether the surgery already changed the
model, and the resume checks with the Trainer's plugin and transforms. The engine hands them in
(:func:`add_resume_hooks`): module-level functions, so a model holding the hooks stays picklable. The checkpoint and
its verified lightning_hbm part come from :mod:`lightning_hbm.resume.pending`, as for every other reader.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import nn

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.resume.keys import KeyMap
from lightning_hbm.resume.pending import opened, pending

#: ``check(trainer, module, meta, path)``: the settings and frozen base of a checkpoint against the run resuming it,
#: before Lightning copies a tensor into the model as built (``surgery.check_resume``)
ResumeCheck = Callable[[Any, nn.Module, Optional[dict[str, Any]], Any], None]
#: ``changed(module)``: whether a surgery already changed ``module`` (then the changed tensors load right away)
ChangedCheck = Callable[[nn.Module], bool]


def has_resume_hook(module: nn.Module) -> bool:
    """Whether :func:`add_resume_hooks` registered its hooks on ``module``."""
    return any(isinstance(h, _ResumeHook) for h in torch_compat.load_state_dict_pre_hooks(module))


def add_resume_hooks(module: nn.Module, check: ResumeCheck, changed: ChangedCheck) -> None:
    """Register (once per model) the load hooks that read lightning_hbm checkpoints; inert for other checkpoints.

    Args:
        module: the model a Trainer may restore a checkpoint into.
        check: the resume checks of the surgery engine (see :data:`ResumeCheck`).
        changed: whether the surgery already changed a model (see :data:`ChangedCheck`).
    """
    if has_resume_hook(module):
        return
    hook = _ResumeHook(check, changed)
    module.register_load_state_dict_pre_hook(hook)
    module.register_load_state_dict_post_hook(hook.forgive)


class _ResumeHook:
    """Loading a lightning_hbm checkpoint (from the Trainer resuming it) into the model.

    Before the load: every tensor's CRC is verified and the placeholders are taken out. Into the
    model as built, the changed tensors are loaded after the surgery (``surgery.run_surgery``); into a
    model already changed (``trainer.test(ckpt_path=...)`` after ``fit``) they are loaded right here.
    After the load: the keys the checkpoint says it left out are forgiven; every other missing key
    stays Lightning's strict error.
    """

    def __init__(self, check: ResumeCheck, changed: ChangedCheck) -> None:
        self.check, self.changed = check, changed
        self.omitted: list[str] = []
        self.placeholders: set[str] = set()

    def __call__(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        self.omitted, self.placeholders = [], set()
        trainer = lightning_compat.attached_trainer(module)
        loaded = pending(trainer)
        if trainer is None or loaded is None or prefix:
            return  # not Lightning restoring a checkpoint: nothing to check
        meta = opened(loaded, trainer.ckpt_path)  # verified by the checked IO that read it (or here, if another did)
        if trainer.state.fn == "fit" and not self.changed(module):
            # settings and frozen base, before Lightning copies a single tensor into the model as built
            self.check(trainer, module, meta, trainer.ckpt_path)
        if meta is None:
            return  # not a lightning_hbm checkpoint: Lightning's rules, unchanged
        self.placeholders = set(meta.get("placeholders", []))
        for key in self.placeholders:
            state_dict.pop(key, None)
        if self.changed(module):
            state_dict.update(meta.get("state_dict", {}))
        self.omitted = list(meta.get("omitted", []))

    def forgive(self, module: nn.Module, incompatible_keys: Any) -> None:
        missing = incompatible_keys.missing_keys
        keys = KeyMap(module)
        missing[:] = [k for k in missing if k not in self.placeholders and not keys.covered(k, self.omitted)]
