"""The one place where lightning_hbm changes the user's model.

Quantization, adapters, activation checkpointing and attention kernels all rewrite the user's
``nn.Module``. They must run

* after ``LightningModule.configure_model`` (models built lazily exist),
* before ``configure_optimizers`` (the user's unchanged optimizer sees the final trainable
  parameters: changing the model in ``on_fit_start`` makes ``fit`` "succeed" while training
  nothing),
* in a fixed order: observe -> quantize -> adapters -> checkpointing -> kernels,
* with or without a lightning_hbm precision plugin (LoRA under Lightning's ``bf16-true`` too).

Lightning calls ``strategy.precision_plugin.convert_module(model)`` exactly there, in every
strategy (single device, DDP, FSDP, DeepSpeed). DDP ignores its return value, so every transform
works in place. :func:`install` wraps the *active* plugin's ``convert_module`` once per Trainer:

    wrapped(module):
        1. transforms with stage <  QUANTIZE   (e.g. QuantizationQuality keeps fp references)
        2. the plugin's own convert_module     (QuantizedPrecision quantizes; bf16-true casts)
        3. transforms with stage >  QUANTIZE   sorted by stage: ADAPTERS, CHECKPOINTING, KERNELS
        4. re-apply checkpoint weights stashed by the resume hooks (see below)

and the plugin's ``connect`` (called right after the user's ``configure_optimizers``, before
``on_fit_start`` and before optimizer states are restored): once the model was changed, frozen
parameters are pruned from the param groups, then each transform's ``transform_optimizers``
runs in stage order (e.g. ``MemoryEfficientOptimizer`` swaps in an 8-bit optimizer).

A transform is any Trainer callback that subclasses :class:`SurgeryCallback`. Each one is applied
at most once per module (``module._lightning_hbm_applied`` records what ran, in order), so
``trainer.validate`` after ``trainer.fit`` does not apply it twice.

Resume. Lightning restores ``checkpoint["state_dict"]`` *before* ``strategy.setup``, i.e. into
the model as the user built it, not the transformed one: keys such as ``weight.absmax`` or
``lora_A.weight`` do not exist yet, and adapter-only checkpoints miss the frozen base. While the
spine is installed (from ``Callback.setup`` until the surgery), two ``load_state_dict`` hooks on
the LightningModule move every key that does not fit the untransformed model into a stash, and
forgive the keys the checkpoint does not hold. After the surgery the stash is loaded into the
transformed model; a key that fits nowhere, or a trainable parameter the checkpoint lacks, is an
error before training starts.

The spine is installed by every :class:`SurgeryCallback`, and by :class:`ModelSurgery`, which
Lightning adds to every Trainer through the ``lightning.pytorch.callbacks_factory`` entry point
(pyproject.toml), so a run that only uses ``QuantizedPrecision`` can resume too.
"""

from __future__ import annotations

import logging
from enum import IntEnum
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

log = logging.getLogger(__name__)

_APPLIED_ATTR = "_lightning_hbm_applied"
_STATE_ATTR = "_lightning_hbm_spine"
_APPLIERS_ATTR = "_lightning_hbm_appliers"  # transform name -> id() of the instance that applied it last


class Stage(IntEnum):
    """Fixed order of the model changes. Lower runs first."""

    OBSERVE = 0  # read-only look at the model as the user built it
    QUANTIZE = 10  # the precision plugin's convert_module
    ADAPTERS = 20
    CHECKPOINTING = 30
    KERNELS = 40
    OPTIMIZER = 50  # only transform_optimizers: replaces the optimizers (e.g. 8-bit states)


class SurgeryCallback(Callback):
    """Base class of every lightning_hbm callback that changes the user's model.

    Subclasses set :attr:`stage` and implement :meth:`transform_model`, which must change the
    module in place (DDP ignores a returned replacement). Subclasses that override ``setup`` call
    ``super().setup(...)``.
    """

    stage: Stage = Stage.KERNELS
    # True for transforms that are idempotent and keep per-instance settings (which blocks are
    # checkpointed, which kernel runs): a new instance re-applies itself to a module that an earlier
    # instance already changed (fit with one Trainer, then test with another). Transforms that add
    # parameters (LoRA) leave it False: their parameters must not be re-created.
    reapply: bool = False

    def transform_model(self, module: pl.LightningModule) -> None:
        """Change ``module`` in place. Called once, at the surgery point. Default: no change."""

    def check_model(self, module: pl.LightningModule) -> None:
        """Raise ``ValueError``/``TypeError`` if ``module`` cannot take this transform. Default: accept.

        Called by the spine for every pending transform before the first change (quantization
        included), so a bad argument leaves the user's model untouched. Must not change ``module``.
        """

    def transform_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any]) -> list[Optimizer]:
        """Return the optimizers to train with (called once they exist, before states are restored).

        Runs inside the precision plugin's ``connect``, right after the user's unchanged
        ``configure_optimizers`` and before ``on_fit_start``/optimizer-state restore. A transform
        that replaces an optimizer must re-point the LR schedulers in ``lr_scheduler_configs``.
        """
        return optimizers

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        install(trainer)


class ModelSurgery(Callback):
    """Installs the spine in every Trainer (added by Lightning through the entry point).

    It changes nothing by itself: with no lightning_hbm transform and no lightning_hbm
    precision plugin, the wrapped ``convert_module`` only calls the original one.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        install(trainer)


def callbacks_factory() -> list[Callback]:
    """Entry point ``lightning.pytorch.callbacks_factory``: Lightning adds these to every Trainer."""
    return [ModelSurgery()]


def applied_transforms(module: nn.Module) -> list[str]:
    """Names of the transforms applied to ``module``, in the order they ran."""
    return list(getattr(module, _APPLIED_ATTR, []))


def mark_applied(module: nn.Module, name: str) -> None:
    """Record that ``name`` changed ``module`` (used by the spine and the precision plugin)."""
    applied = getattr(module, _APPLIED_ATTR, None)
    if applied is None:
        applied = []
        # object.__setattr__: a plain list must not become an nn.Module attribute lookup problem
        object.__setattr__(module, _APPLIED_ATTR, applied)
    applied.append(name)


def _transform_name(transform: object) -> str:
    return type(transform).__qualname__


def _surgery_callbacks(trainer: pl.Trainer) -> list[SurgeryCallback]:
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, SurgeryCallback)]
    # sorted() is stable: callbacks of one stage keep the user's order
    return sorted(callbacks, key=lambda cb: int(cb.stage))


def apply_transforms(module: pl.LightningModule, transforms: list[SurgeryCallback]) -> None:
    """Apply each transform once, in stage order (also usable without a Trainer, e.g. planner)."""
    done = set(applied_transforms(module))
    appliers: dict[str, int] = getattr(module, _APPLIERS_ATTR, None) or {}
    object.__setattr__(module, _APPLIERS_ATTR, appliers)
    for transform in sorted(transforms, key=lambda t: int(t.stage)):
        name = _transform_name(transform)
        if name in done and not (transform.reapply and appliers.get(name) != id(transform)):
            continue
        transform.transform_model(module)
        appliers[name] = id(transform)
        if name not in done:
            mark_applied(module, name)


class _SpineState:
    """What the spine keeps per precision plugin: its Trainer, the stash of checkpoint keys, hook handles."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self.stash: dict[str, torch.Tensor] = {}
        self.loaded_keys: set[str] = set()
        self.forgiven_missing: list[str] = []
        self.handles: list[Any] = []

    def remove_hooks(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def install(trainer: pl.Trainer) -> None:
    """Wrap the active precision plugin's ``convert_module`` and ``connect`` with the surgery (idempotent).

    A plugin instance reused by a second Trainer is wrapped once and follows the latest Trainer.
    """
    plugin = trainer.strategy.precision_plugin
    state: _SpineState | None = getattr(plugin, _STATE_ATTR, None)
    if state is None:
        state = _SpineState(trainer)
        object.__setattr__(plugin, _STATE_ATTR, state)
        _wrap_plugin(plugin, state)
    state.trainer = trainer
    pl_module = trainer.lightning_module
    if pl_module is not None and not applied_transforms(pl_module) and not state.handles:
        _register_resume_hooks(pl_module, state)


def _wrap_plugin(plugin: Any, state: _SpineState) -> None:
    original_convert = plugin.convert_module
    original_connect = plugin.connect

    def convert_module(module: nn.Module) -> nn.Module:
        state.remove_hooks()
        transforms = _surgery_callbacks(state.trainer)
        done = set(applied_transforms(module))
        for transform in transforms:  # every check before the first change: nothing half-applied
            if _transform_name(transform) not in done:
                transform.check_model(module)
        apply_transforms(module, [t for t in transforms if t.stage < Stage.QUANTIZE])
        # Tell our own plugin where the model will live, so it can quantize on the target device.
        if hasattr(plugin, "target_device"):
            plugin.target_device = state.trainer.strategy.root_device
        # Lightning's plugins return the module itself (HalfPrecision: module.to(dtype)); DDP ignores
        # the return value, so every transform works in place.
        module = original_convert(module)
        apply_transforms(module, [t for t in transforms if t.stage > Stage.QUANTIZE])
        _restore_stash(module, state)
        return module

    def connect(model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> tuple:
        if applied_transforms(state.trainer.lightning_module):
            prune_frozen_parameters(optimizers)
        for transform in _surgery_callbacks(state.trainer):
            optimizers = transform.transform_optimizers(optimizers, lr_schedulers)
        return original_connect(model, optimizers, lr_schedulers)

    # instance attributes: only this plugin object is changed
    plugin.convert_module = convert_module
    plugin.connect = connect


def prune_frozen_parameters(optimizers: list[Optimizer]) -> None:
    """Drop parameters that do not require grad from the optimizers' param groups, in place.

    The user's ``configure_optimizers`` usually passes ``self.parameters()``, so frozen (e.g.
    quantized) base weights sit in the param groups. They never get state, but they make the
    optimizer's view of "what is trained" wrong and cost every ``step`` a loop over them.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p.requires_grad]


def _register_resume_hooks(pl_module: nn.Module, state: _SpineState) -> None:
    def pre_hook(
        module: nn.Module,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        # (shape, is floating point): an int8 weight has the float weight's shape but must not be
        # loaded into it (it would be cast to float and then quantized a second time)
        current = {
            k: (v.shape, v.is_floating_point()) for k, v in module.state_dict().items() if isinstance(v, torch.Tensor)
        }
        for key in list(state_dict):
            value = state_dict[key]
            fits = isinstance(value, torch.Tensor) and current.get(key) == (value.shape, value.is_floating_point())
            if not fits:
                state.stash[key] = state_dict.pop(key)
        state.loaded_keys.update(state_dict)

    def post_hook(module: nn.Module, incompatible_keys: Any) -> None:
        # The checkpoint came from a transformed model (adapter-only, quantized base): the keys it
        # lacks are checked after the surgery instead, against the transformed model.
        state.forgiven_missing.extend(incompatible_keys.missing_keys)
        incompatible_keys.missing_keys.clear()

    state.handles.append(pl_module.register_load_state_dict_pre_hook(pre_hook))
    state.handles.append(pl_module.register_load_state_dict_post_hook(post_hook))


def _restore_stash(module: nn.Module, state: _SpineState) -> None:
    if not state.stash and not state.forgiven_missing:
        state.loaded_keys = set()
        return  # nothing was loaded, or the checkpoint fitted the model as built
    stash, state.stash = state.stash, {}
    state.forgiven_missing = []
    if stash:
        advice = (
            "Resume with the same precision mode and the same LoRA/checkpointing callbacks as the run that saved it."
        )
        try:
            result = module.load_state_dict(stash, strict=False)
        except RuntimeError as err:  # shape mismatches raise even with strict=False
            raise ValueError(f"The checkpoint does not fit the model after lightning_hbm's changes. {advice}\n{err}") from err
        if result.unexpected_keys:
            raise ValueError(
                "The checkpoint holds weights that fit neither the model as built nor the model after "
                f"lightning_hbm's changes: {sorted(result.unexpected_keys)[:10]}. {advice}"
            )
    restored = state.loaded_keys | set(stash)
    lacking = [n for n, p in module.named_parameters() if p.requires_grad and n not in restored]
    state.loaded_keys = set()
    if lacking:
        raise ValueError(
            "The checkpoint does not hold these trainable parameters of the model after lightning_hbm's "
            f"changes: {lacking[:10]}. Resume with the same precision mode and LoRA settings as the run "
            "that saved it (or train from scratch without ckpt_path)."
        )
    log.info("lightning_hbm: restored %d checkpoint tensors after model surgery", len(stash))
