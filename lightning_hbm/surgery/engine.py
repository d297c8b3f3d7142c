"""The one place where lightning_hbm changes the user's model.

Quantization, adapters, activation checkpointing and attention kernels all rewrite the user's
``nn.Module``. They must run

* after ``LightningModule.configure_model`` (models built lazily exist),
* before ``configure_optimizers`` (the user's unchanged optimizer sees the final trainable
  parameters: changing the model in ``on_fit_start`` makes ``fit`` "succeed" while training
  nothing),
* in a fixed order: observe -> quantize -> adapters -> checkpointing -> kernels,
* with every check before the first change, so bad input leaves the model untouched.

:func:`run_surgery` is that engine. It takes its context as arguments (the precision plugin, the
transforms, the target device, the checkpoint being resumed), so the Trainer and the planner run
the same code.

In a Trainer, Lightning calls ``strategy.precision_plugin.convert_module(model)`` exactly at that
point, in every strategy (single device, DDP, FSDP, DeepSpeed), and ``precision_plugin.connect``
right after the user's ``configure_optimizers``. DDP ignores ``convert_module``'s return value, so
every transform works in place.

* :class:`~lightning_hbm.QuantizedPrecision` (a :class:`~lightning_hbm.surgery.protocol.SurgeryPlugin`: what the
  engine asks a plugin is declared there) calls the engine from its own ``convert_module`` and ``connect``.
* Any other plugin (Lightning's ``bf16-true``, ...) is given the engine by the first
  :class:`SurgeryCallback` of the Trainer, in ``Callback.setup``: :func:`install` sets picklable
  wrapper objects (:class:`_SpineConvert`, :class:`_SpineConnect`) on that plugin instance.

A Trainer that uses no lightning_hbm plugin, strategy or callback is left exactly as Lightning
made it: same callbacks, same plugin objects, same (strict) loading rules.

Resume (see :mod:`lightning_hbm.resume` for the checkpoint format). Lightning restores
``checkpoint["state_dict"]`` *before* the surgery, into the model as built. A lightning_hbm
checkpoint keeps there only what fits the model as built; the changed tensors travel in
``checkpoint["lightning_hbm"]`` and are loaded right after the surgery. With a
:class:`SurgeryCallback` in the Trainer, two load hooks (registered in ``Callback.setup``) check
every tensor's CRC before anything is loaded, keep the placeholders out of the model and forgive
exactly the keys the checkpoint says it left out; any other missing key is Lightning's usual strict
error. With ``QuantizedPrecision`` alone, Lightning loads the placeholders, and the engine loads the
real tensors right after quantizing. Resume owns the file: it reads and verifies the checkpoint once
(:mod:`lightning_hbm.resume.pending`) and hands this engine, the hooks and the plugin its verified part; once the
model is changed, this engine hands resume what the run's checkpoints are packed with (:func:`_hand_saves`). The
resume checks outside the surgery are resume's too (:func:`lightning_hbm.resume.check_resume`): this engine only
registers how a Trainer run's settings are read (:func:`run_settings`).

The package: this module is the engine, the settings of a run that a resume compares and the Trainer adapter (one
import cycle by design: ``SurgeryCallback.setup`` installs the engine, which finds the ``SurgeryCallback`` s);
``record`` (a face over :mod:`lightning_hbm.record`, where what the surgery knows of a model is kept: nothing is set
on the model), ``ranks`` (ranks that built different bases), ``probe_step`` (the probe step and its guards) are the parts
that need none of it. The resume checks themselves, the load hooks and the file format live in
:mod:`lightning_hbm.resume`; this module tells them the settings of the Trainer's plugin and transforms.
"""

from __future__ import annotations

import functools
import weakref
from enum import IntEnum
from typing import Any, Callable, Optional, Sequence, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from torch.utils.weak import WeakIdKeyDictionary
from typing_extensions import override

from lightning_hbm import resume
from lightning_hbm._compat import bitsandbytes as bnb_compat
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.data import MidEpochResumeCheck, check_resume_loader, check_resume_processes
from lightning_hbm.display import adopt_display
from lightning_hbm.probe_batch import say_streams_drawn_anew
from lightning_hbm.quiet import quieted
from lightning_hbm.record import appliers, as_built, set_as_built, set_modules_to_save
from lightning_hbm.resume.io import gather_from_ranks
from lightning_hbm.surgery.probe_step import PROBE_PATIENCE_S as PROBE_PATIENCE_S  # its former home
from lightning_hbm.surgery.probe_step import PROBE_SWITCH as PROBE_SWITCH  # its former home
from lightning_hbm.surgery.probe_step import _guard, _observe, _tell_unrun, probe_step_on
from lightning_hbm.surgery.protocol import SurgeryPlugin
from lightning_hbm.surgery.ranks import check_ranks
from lightning_hbm.surgery.record import applied_transforms, mark_applied


class Stage(IntEnum):
    """Fixed order of the model changes. Lower runs first."""

    OBSERVE = 0  # read-only look at the model as the user built it
    QUANTIZE = 10  # the precision plugin's conversion
    ADAPTERS = 20
    CHECKPOINTING = 30
    KERNELS = 40
    OPTIMIZER = 50  # only transform_optimizers: replaces the optimizers (e.g. 8-bit states)


class SurgeryCallback(Callback):
    """Base class of every lightning_hbm callback that changes the user's model.

    Subclasses set :attr:`stage` and implement :meth:`check_model` (raise before anything changes),
    :meth:`transform_model` (change the module in place: DDP ignores a returned replacement) and/or
    :meth:`transform_optimizers`. Subclasses that override ``setup`` or ``on_save_checkpoint`` call
    ``super()``.
    """

    stage: Stage = Stage.KERNELS
    # True for transforms that are idempotent and keep per-instance settings (which blocks are
    # checkpointed, which kernel runs): a new instance re-applies itself to a module that an earlier
    # instance already changed (fit with one Trainer, then test with another). Transforms that add
    # parameters (LoRA) leave it False: their parameters must not be re-created.
    reapply: bool = False
    # True for transforms that ask which layers the model's code reads directly (``weight_readers``: LoRA leaves them
    # out): the probe step runs the user's step once before the surgery for them. A run whose transforms do not ask,
    # under a plugin that replaces no layer, skips it (issue 55: the user's step runs only for the loop's steps).
    reads_layers: bool = False

    def transform_model(self, module: nn.Module) -> None:
        """Change ``module`` in place. Called once, at the surgery point. Default: no change."""

    def check_model(self, module: nn.Module) -> None:
        """Raise ``ValueError``/``TypeError`` if ``module`` cannot take this transform. Default: accept.

        Called for every pending transform before the first change (quantization included), on the
        model as the user built it, so a bad argument leaves it untouched. Must not change ``module``.
        """

    def transform_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any]) -> list[Optimizer]:
        """Return the optimizers to train with (called once they exist, before states are restored).

        Runs inside the precision plugin's ``connect``, right after the user's unchanged
        ``configure_optimizers`` and before ``on_fit_start``/optimizer-state restore. A transform
        that replaces an optimizer must re-point the LR schedulers in ``lr_scheduler_configs``.
        """
        return optimizers

    def resume_config(self) -> Optional[dict[str, Any]]:
        """Settings that must be equal when a checkpoint of this run is resumed (None: not compared).

        Saved in every checkpoint; a resume whose settings differ is an error naming the difference.
        """
        return None

    def saves_frozen_weights(self) -> bool:
        """False if checkpoints should hold only the trainable weights (and the as-built buffers)."""
        return True

    def allows_base_change(self) -> bool:
        """True to accept, on resume, a frozen base other than the one the checkpoint was trained on."""
        return False

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        install(trainer)

    @override
    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        pack_checkpoint(trainer, checkpoint)


def _transform_name(transform: object) -> str:
    return type(transform).__qualname__


def surgery_callbacks(trainer: pl.Trainer) -> list[SurgeryCallback]:
    """The Trainer's transforms, in stage order (the user's order within a stage)."""
    callbacks = [cb for cb in trainer.callbacks if isinstance(cb, SurgeryCallback)]  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
    return sorted(callbacks, key=lambda cb: int(cb.stage))  # sorted() is stable


def _pending(module: nn.Module, transforms: Sequence[SurgeryCallback]) -> list[SurgeryCallback]:
    done = set(applied_transforms(module))
    last = appliers(module)
    return [
        t
        for t in sorted(transforms, key=lambda t: int(t.stage))
        if _transform_name(t) not in done or (t.reapply and last.get(_transform_name(t)) != id(t))
    ]


def apply_transforms(module: nn.Module, transforms: Sequence[SurgeryCallback]) -> None:
    """Apply each pending transform once, in stage order (no checks: :func:`run_surgery` checks first)."""
    pending = _pending(module, transforms)
    last = appliers(module)  # the record's own map: updated in place
    done = set(applied_transforms(module))
    for transform in pending:
        name = _transform_name(transform)
        try:
            transform.transform_model(module)
        except Exception as err:
            _note_half_applied(err, name, applied_transforms(module))
            raise
        last[name] = id(transform)
        if name not in done:
            mark_applied(module, name)


def _note_half_applied(err: Exception, failed: str, applied: list[str]) -> None:
    """Say on ``err`` what the model now holds: a change that fails after the checks (a user's transform, an error of
    a library) leaves the ones before it in place (quantization cannot be undone without a copy of the weights as
    built; was: the error alone, the model changed without a word, session 31)."""
    add_note = getattr(err, "add_note", None)  # Python >= 3.11
    if not applied or add_note is None:
        return
    add_note(
        f"lightning_hbm: {failed} failed while changing the model, after {', '.join(applied)} changed it: the model "
        "keeps those changes (a new fit of it goes on from them, without applying them again). Rebuild the model (or "
        "reload its weights) to start from the model as built."
    )


def _check_distinct(transforms: Sequence[SurgeryCallback]) -> None:
    seen: dict[str, int] = {}
    for transform in transforms:
        seen[_transform_name(transform)] = seen.get(_transform_name(transform), 0) + 1
    twice = sorted(name for name, count in seen.items() if count > 1)
    if twice:
        raise ValueError(
            f"The Trainer has {seen[twice[0]]} {twice[0]} callbacks ({', '.join(twice)} given more than once). "
            "Each lightning_hbm transform changes the model once: keep one instance and put all its settings "
            "there (e.g. one LoRA(target_modules=[...]) listing every target)."
        )


def plugin_config(plugin: Any) -> dict[str, Any]:
    """The precision plugin's part of the resume configuration (a :class:`SurgeryPlugin`'s; Lightning's have none)."""
    return {type(plugin).__qualname__: plugin.resume_config()} if isinstance(plugin, SurgeryPlugin) else {}


def resume_configs(plugin: Any, transforms: Sequence[SurgeryCallback]) -> dict[str, Any]:
    configs = plugin_config(plugin)
    for transform in transforms:
        config = transform.resume_config()
        if config is not None:
            configs[_transform_name(transform)] = config
    return configs


def _parametrization_state(module: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer a training forward changes with a copy of its value, to put back once the surgery is done.

    A parametrized weight is computed at each read, and spectral_norm's computation in training mode advances its
    power iteration (its buffers ``_u``, ``_v``) in place: the surgery's reads of ``layer.weight`` (the checks, the
    fingerprints, peft's dispatch) advanced it some sixty steps, a number that depends on lightning_hbm's internals,
    and again after a resume had restored them (a resumed run was not the run it continued). The probe step on fake
    tensors counted one batch in each BatchNorm's ``num_batches_tracked``."""
    return [(buffer, buffer.detach().clone()) for buffer in torch_compat.buffers_changed_in_training(module)]


def _keeps_parametrization_state(surgery: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """``surgery`` (its first argument the model), putting back the parametrizations' buffers after it
    (:func:`_parametrization_state`), and the global RNGs (Python's, NumPy's, torch's CPU and CUDA) as they were before
    it: peft's adapter init, the probe step and calibration draw from them in the strategy's setup, before the fit
    loop's shuffled DataLoader draws its order there (issue 55: with LoRA, ``seed_everything(0)`` trained on other
    batches than without). The adapters stay what the seed gives: they draw from the state the surgery began with."""

    @functools.wraps(surgery)
    def run(module: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        kept = _parametrization_state(module)
        try:
            with torch_compat.preserved_rngs():  # the user's draws as they were (_keeps_parametrization_state)
                return surgery(module, *args, **kwargs)
        finally:
            with torch.no_grad():
                for buffer, value in kept:
                    buffer.copy_(value)

    return run


@_keeps_parametrization_state
def run_surgery(
    module: nn.Module,
    plugin: Any,
    transforms: Sequence[SurgeryCallback],
    device: Optional[torch.device] = None,
    checkpoint: Optional[dict[str, Any]] = None,
    checkpoint_path: Any = None,
    convert: Optional[Callable[[nn.Module], nn.Module]] = None,
    batch: Any = None,
    step: str = "training_step",
) -> nn.Module:
    """Check, then change ``module`` in place: observe -> the plugin's conversion -> adapters -> ... .

    Args:
        module: the model as built (or as an earlier surgery left it: applied transforms are skipped).
        plugin: the precision plugin (``QuantizedPrecision``, a Lightning plugin, or None).
        transforms: the :class:`SurgeryCallback` s to apply.
        device: where the model will live (a ``QuantizedPrecision`` quantizes there).
        checkpoint: the checkpoint being resumed, if any: its configuration and frozen-base
            fingerprints are compared before the first change, its changed tensors loaded after.
        convert: the plugin's conversion (default: ``plugin.convert_base`` or ``plugin.convert_module``).
        batch: a training batch (or a function returning one), run once through the model as built before any
            check, to see which layers its code reads directly (:mod:`lightning_hbm.layers.readers`); ``None``: the
            model's source decides instead.
        step: the LightningModule method that ``batch`` is run through (the stage's own: ``validation_step`` for
            ``trainer.validate``; ``training_step`` by default).
    """
    _check_distinct(transforms)
    # the modules LoRA trains in full: a QuantizedPrecision leaves them unquantized, with or without a Trainer (planner)
    # (LoRA finds a model's task heads on the model as built: resolve_modules_to_save, before any check)
    saved = [getattr(t, "resolve_modules_to_save", lambda m: getattr(t, "modules_to_save", None))(module) for t in transforms]  # noqa: B023 - called at once
    set_modules_to_save(module, [n for names in saved for n in names or ()])
    pending = _pending(module, transforms)
    if batch is not None and _asks_readers(plugin, pending, convert) and not applied_transforms(module):
        _observe(module, batch, step)
    if isinstance(plugin, SurgeryPlugin):
        plugin.check_model(module)
    for transform in pending:  # every check before the first change: nothing half-applied
        transform.check_model(module)
    if as_built(module) is None:
        set_as_built(module, resume.as_built_record(module))
    meta = (checkpoint or {}).get(resume.META_KEY)
    if checkpoint is not None:
        _check_checkpoint(module, plugin, transforms, checkpoint, checkpoint_path)
    apply_transforms(module, [t for t in pending if t.stage < Stage.QUANTIZE])
    if device is not None and isinstance(plugin, SurgeryPlugin):
        plugin.place_on(device)
    if convert is None and plugin is not None:
        convert = plugin.convert_base if isinstance(plugin, SurgeryPlugin) else plugin.convert_module
    if convert is not None:
        module = convert(module)
    apply_transforms(module, [t for t in pending if t.stage > Stage.QUANTIZE])
    _mend_bitsandbytes_layers(module)
    if meta is not None:
        resume.load_changed(module, meta, cast(dict[str, Any], checkpoint), checkpoint_path)  # not None: meta came from it
    if applied_transforms(module):
        resume.add_resume_hooks(module)  # later loads into the changed model (trainer.test(ckpt_path=...))
        _guard(module)
        _tell_unrun(module)  # adapters the training step never runs: said at fit start
    return module


def _mend_bitsandbytes_layers(module: nn.Module) -> None:
    """bitsandbytes layers, whoever quantized them (lightning_hbm, transformers, the user)."""
    # 4-bit: on an AVX512-BF16 CPU their first no-grad eval forward would repack them for a kernel that bypasses
    # autograd (no gradient upstream)
    bnb_compat.disable_cpu_repacks(module)
    # int8: bitsandbytes keeps each one's input outside autograd's saved tensors, so activation checkpointing could
    # not free it
    bnb_compat.drop_kept_inputs(module)


def _check_checkpoint(module: nn.Module, plugin: Any, transforms: Sequence[SurgeryCallback],
                      checkpoint: dict[str, Any], checkpoint_path: Any) -> None:
    """The checkpoint's settings against this run's, before the first change, on its part as resume hands it over
    (verified by resume: by the checked IO that read it, or on this first sight of it)."""
    try:
        meta = resume.opened(checkpoint, checkpoint_path)
        _check_resume(module, plugin, transforms, meta, checkpoint_path)
    except ValueError as err:
        if resume.has_resume_hook(module):
            raise  # checked before Lightning's load (resume.add_resume_hooks): the model is as it was
        # no load hook ran (QuantizedPrecision alone): Lightning already copied the file into the model
        raise ValueError(f"{str(err).replace('; nothing was loaded', '')}\n{resume.LOADED_ALREADY}") from None


def _asks_readers(plugin: Any, pending: Sequence[SurgeryCallback], convert: Optional[Callable[[nn.Module], nn.Module]]) -> bool:
    """Whether this surgery asks which layers the model's code reads directly (the probe step's answer): a pending
    transform that says so (:attr:`SurgeryCallback.reads_layers`: LoRA), lightning_hbm's plugin (it quantizes), or any
    other conversion that may replace layers (its quantized layers get the probe's guards). Lightning's plugins that
    only cast the model (``32-true``, ``bf16-true``, ``16-mixed``, ...) with checkpointing, kernels or an optimizer do
    not: the probe step is skipped and the user's step runs only for the loop's steps (issue 55)."""
    if any(t.reads_layers for t in pending) or isinstance(plugin, SurgeryPlugin):
        return True
    if plugin is None:
        return convert is not None
    return not lightning_compat.casts_only(plugin)


def run_settings(trainer: pl.Trainer) -> tuple[dict[str, Any], bool]:
    """The settings of ``trainer``'s run that a checkpoint it resumes must share, and whether a transform accepts
    another frozen base: what :func:`lightning_hbm.resume.check_resume` checks a resume with, outside
    :func:`run_surgery` (Lightning's weight restore before the surgery, a strategy that restores after its setup).
    Registered with resume below; read when a resume is checked (the plugin's part depends on the checkpoint)."""
    transforms = surgery_callbacks(trainer)
    return resume_configs(trainer.strategy.precision_plugin, transforms), any(t.allows_base_change() for t in transforms)


resume.register_run_settings(run_settings)


def _check_resume(
    module: nn.Module, plugin: Any, transforms: Sequence[SurgeryCallback], meta: Optional[dict[str, Any]], path: Any
) -> None:
    """:func:`lightning_hbm.resume.check_settings` with the settings of this plugin and these transforms."""
    allows_base_change = any(t.allows_base_change() for t in transforms)
    resume.check_settings(meta, resume_configs(plugin, transforms), as_built(module), allows_base_change, path)


def prune_frozen_parameters(optimizers: list[Optimizer]) -> None:
    """Drop parameters that do not require grad from the optimizers' param groups, in place.

    The user's ``configure_optimizers`` usually passes ``self.parameters()``, so frozen (e.g.
    quantized) base weights sit in the param groups. They never get state, but they make the
    optimizer's view of "what is trained" wrong and cost every ``step`` a loop over them.
    """
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if p.requires_grad]


def transform_optimizers(
    module: Optional[nn.Module], transforms: Sequence[SurgeryCallback], optimizers: list[Optimizer], lr_schedulers: list[Any]
) -> list[Optimizer]:
    """Prune frozen parameters (once the model was changed), then each transform's optimizer step."""
    if module is not None and applied_transforms(module):
        prune_frozen_parameters(optimizers)
    for transform in transforms:
        optimizers = transform.transform_optimizers(optimizers, lr_schedulers)
    return optimizers


# ------------------------------------------------------------------------------ the Trainer adapter


class _SpineState:
    """What the spine keeps per precision plugin: the Trainer it serves (a plugin can be reused).

    Weakly: the Trainer holds the plugin, so a strong reference here kept the plugin key of :data:`_STATES` alive,
    and with it the Trainer and its model, after every fit (issue 55: 200 fits, 200 models alive).
    """

    def __init__(self, trainer: pl.Trainer) -> None:
        self._trainer = weakref.ref(trainer)

    @property
    def trainer(self) -> Optional[pl.Trainer]:
        return self._trainer()

    @trainer.setter
    def trainer(self, trainer: pl.Trainer) -> None:
        self._trainer = weakref.ref(trainer)


# plugin -> its _SpineState; weak and by identity: nothing is set on the plugin, a copy of it starts without one
_STATES: WeakIdKeyDictionary = WeakIdKeyDictionary()


def _state(plugin: Any, trainer: pl.Trainer) -> _SpineState:
    state: Optional[_SpineState] = _STATES.get(plugin)
    if state is None:
        state = _STATES[plugin] = _SpineState(trainer)
    state.trainer = trainer
    return state


def plugin_trainer(plugin: Any) -> Optional[pl.Trainer]:
    """The Trainer the spine last ran ``plugin`` for (``None`` before its first surgery)."""
    state: Optional[_SpineState] = _STATES.get(plugin)
    return state.trainer if state is not None else None


def pending_checkpoint(trainer: Optional[pl.Trainer]) -> Optional[dict[str, Any]]:
    """The checkpoint Lightning is resuming from, between its weight restore and the end of setup.

    Kept by :func:`lightning_hbm.resume.pending` (which verifies it once and hands its parts out).
    """
    return resume.pending(trainer)


def trainer_surgery(module: nn.Module, plugin: Any, convert: Callable[[nn.Module], nn.Module]) -> nn.Module:
    """:func:`run_surgery` with the context of the Trainer that ``module`` is attached to."""
    trainer = lightning_compat.attached_trainer(module)
    state: Optional[_SpineState] = _STATES.get(plugin)
    if trainer is None and state is not None:
        trainer = state.trainer
    if trainer is None:  # not attached to a Trainer (a plain call): the plugin's change alone
        return run_surgery(module, plugin, [], convert=convert)
    _state(plugin, trainer)
    lightning_compat.drop_handed_over(trainer)  # a loader the probe of an earlier run handed over and no loop took
    probe_step_on()  # a switch value it does not know: refused before any check or change
    check_saves(trainer)
    checkpoint = pending_checkpoint(trainer)
    fitting = trainer.state.fn == "fit"
    if fitting:
        resume.check_checkpoint_dirs(trainer)  # a read-only checkpoint folder: said now, not after the first steps
        check_resume_processes(trainer, checkpoint)  # a loader state of another number of processes: before any change
        check_resume_loader(  # or other settings, on every rank: the loader as the loop will iterate it
            trainer, checkpoint, lambda: lightning_compat.loader_as_trained(trainer, lightning_compat.stage_dataloader(trainer)),
            lambda mine: gather_from_ranks(trainer, mine),
        )
    if as_built(module) is None and not applied_transforms(module):
        set_as_built(module, resume.as_built_record(module))
    if fitting and not applied_transforms(module):
        check_ranks(module)  # every rank gets rank 0's model as built (before quantizing), then they are compared
    try:
        with quieted():  # the libraries' noise while lightning_hbm works, and only then (lightning_hbm.quiet)
            module = _trainer_run_surgery(module, plugin, trainer, checkpoint, fitting, convert)
    finally:
        say_streams_drawn_anew()  # a stream's batch drawn in a pass the loop does not get: said (issue 55)
    _hand_saves(trainer)
    return module


def _trainer_run_surgery(
    module: nn.Module, plugin: Any, trainer: pl.Trainer, checkpoint: Optional[dict[str, Any]], fitting: bool, convert: Callable[[nn.Module], nn.Module]
) -> nn.Module:
    return run_surgery(
        module,
        plugin,
        surgery_callbacks(trainer),
        device=trainer.strategy.root_device,
        checkpoint=checkpoint if fitting or (checkpoint or {}).get(resume.META_KEY) else None,
        checkpoint_path=trainer.ckpt_path,
        convert=convert,
        batch=lambda: _stage_batch(trainer),
        step=_STAGE_STEPS.get(str(getattr(trainer.state.fn, "value", trainer.state.fn)), "training_step"),
    )


# the LightningModule method each stage runs: its probe step runs that one (never training_step for validate/predict)
_STAGE_STEPS = {"fit": "training_step", "validate": "validation_step", "test": "test_step", "predict": "predict_step"}


def _stage_batch(trainer: pl.Trainer) -> Any:
    """The first batch of the stage's dataloader, drawn without touching the global RNG (``None``: none); where the fit
    loop trains several loaders together, one of each put together as ``training_step`` gets them (was: the first
    loader's alone, and a step reading ``batch["b"]`` failed in the probe)."""
    loader = lightning_compat.stage_dataloader(trainer)
    several = lightning_compat.stage_dataloaders(trainer) if loader is not None else None
    if several is None:
        return _first_batch(trainer, loader)
    batches = [_first_batch(trainer, each) for each in several[0]]
    return None if any(batch is None for batch in batches) else several[1](batches)


def _first_batch(trainer: pl.Trainer, loader: Any) -> Any:
    if loader is None:
        return None
    if torch_compat.passes_once(loader):  # a stream, an iterator: the batch drawn here is the loop's first (issue 55)
        if isinstance(loader, DataLoader) and lightning_compat.rebuilds_its_dataloader(trainer):
            return None  # its loop reads a rebuilt copy, from the stream again: a batch drawn here would be lost
        return _first_of_the_pass(trainer, loader)
    # a map-style loader: a new pass, left as it was (its generators draw epoch 0's order: issue 55)
    return next(iter(torch_compat.leading_batches(loader, lambda batches: True)), None)


def _first_of_the_pass(trainer: pl.Trainer, loader: Any) -> Any:
    """The first batch of a loader read once (:func:`torch_compat.passes_once`), given back to its loop in front of
    the rest of the same pass: no sample lost, no stream opened twice. The probe step gets its own copy (a step
    that changes its batch in place must not change the batch the loop trains)."""
    kept = torch_compat.draw_keeping_the_pass(loader, lightning_compat.pending_loader_state(trainer, loader))  # resumed: from there
    if kept is None:
        return None
    first, loop_loader = kept
    if loop_loader is not loader:
        lightning_compat.hand_over_instead(trainer, loader, loop_loader)
    return torch_compat.map_tensors(torch.Tensor.clone, first)


def trainer_optimizers(plugin: Any, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> list[Optimizer]:
    state: Optional[_SpineState] = _STATES.get(plugin)
    trainer = state.trainer if state is not None else None
    if trainer is None:
        return optimizers
    return transform_optimizers(trainer.lightning_module, surgery_callbacks(trainer), optimizers, lr_schedulers)


class _SpineConvert:
    """Picklable ``convert_module`` for a plugin that is not lightning_hbm's: the engine around the original."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def __call__(self, module: nn.Module) -> nn.Module:
        original = type(self.plugin).convert_module
        return trainer_surgery(module, self.plugin, lambda m: original(self.plugin, m))


class _SpineConnect:
    """Picklable ``connect``: the optimizer transforms, then the plugin's own ``connect``."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def __call__(self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]) -> Any:
        optimizers = trainer_optimizers(self.plugin, optimizers, lr_schedulers)
        return type(self.plugin).connect(self.plugin, model, optimizers, lr_schedulers)


def install(trainer: pl.Trainer) -> None:
    """Give the Trainer's precision plugin the engine, and the model the resume hooks (idempotent).

    Called by every :class:`SurgeryCallback` (and ``AutoFit``) in ``Callback.setup``, which runs
    before Lightning restores weights. A plugin instance reused by a second Trainer follows the latest
    Trainer. The strategy's checkpoint IO is wrapped (:func:`check_saves`): atomic saves, clear load errors.
    Lightning's stock progress bar and model summary become lightning_hbm's (:func:`~lightning_hbm.display.adopt_display`:
    4-bit weights counted unpacked, the right totals under ``max_steps``); they print after ``setup``.
    """
    adopt_display(trainer)
    plugin = trainer.strategy.precision_plugin
    _state(plugin, trainer)
    if not isinstance(plugin, SurgeryPlugin) and not isinstance(lightning_compat.plugin_hook_override(plugin, "convert_module"), _SpineConvert):
        # a plugin that is not lightning_hbm's gets the engine wrapped around its hooks; instance attributes: only
        # this plugin object is changed, and it stays picklable
        lightning_compat.override_plugin_hooks(plugin, _SpineConvert(plugin), _SpineConnect(plugin))
    check_saves(trainer)
    if trainer.lightning_module is not None:
        resume.add_resume_hooks(trainer.lightning_module)


class PluginAttach(Callback):
    """What a Trainer whose precision plugin is lightning_hbm's gets when it has no lightning_hbm callback.

    Lightning restores a checkpoint into the model before it calls the precision plugin for the first time
    (``convert_module``), so a plugin alone cannot check a file before the model holds its tensors. This callback
    (added by :func:`plugin_callbacks`, lightning_hbm's ``lightning.pytorch.callbacks_factory`` entry point) installs
    the checks in ``setup``, as every :class:`SurgeryCallback` does: the checked checkpoint IO and the load hooks. It
    changes nothing else; Trainers with any other plugin never get it.
    """

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        install(trainer)


def plugin_callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: ``[PluginAttach()]`` for a Trainer being built with a
    lightning_hbm precision plugin and no lightning_hbm callback, ``[]`` for every other Trainer."""
    trainer = lightning_compat.trainer_being_built()
    if trainer is None:
        return []
    plugin = trainer.strategy.precision_plugin
    if not isinstance(plugin, SurgeryPlugin) or any(isinstance(cb, (SurgeryCallback, PluginAttach)) for cb in trainer.callbacks):
        return []
    return [PluginAttach()]


def check_saves(trainer: pl.Trainer) -> resume.CheckedCheckpointIO:
    """Wrap the strategy's checkpoint IO (once) in :class:`~lightning_hbm.resume.CheckedCheckpointIO`: atomic saves,
    clear errors for damaged files. Called by :func:`install` and by every surgery in a Trainer, so a run with
    ``QuantizedPrecision`` alone, Lightning's plugins or lightning_hbm's strategies all get it."""
    io = trainer.strategy.checkpoint_io
    if not isinstance(io, resume.CheckedCheckpointIO):
        io = resume.CheckedCheckpointIO(io)
        trainer.strategy.checkpoint_io = io
    io.trainer = trainer  # the IO packs with what the surgery handed resume (_hand_saves), nothing called back up
    if not any(isinstance(c, MidEpochResumeCheck) for c in trainer.callbacks):  # type: ignore[attr-defined]  # undeclared on Trainer (Lightning's CallbackConnector sets it)
        trainer.callbacks.append(MidEpochResumeCheck())  # type: ignore[attr-defined]  # undeclared on Trainer (CallbackConnector sets it); a mid-epoch resume with a loader Lightning restarts: warn
    return io


def _hand_saves(trainer: pl.Trainer) -> None:
    """Hand resume what this run's checkpoints are packed with, once the surgery changed the model: the settings a
    resume must share, whether the frozen base is left out, and the precision plugin's own entries (its GPTQ CRC and
    smoothing exponents, fixed by the quantization). Every save then packs from this data, never calling back here."""
    plugin = trainer.strategy.precision_plugin
    transforms = surgery_callbacks(trainer)
    extras: dict[str, Any] = {}
    if isinstance(plugin, SurgeryPlugin):
        plugin.add_checkpoint_metadata(extras)
    trainable_only = not all(t.saves_frozen_weights() for t in transforms)
    resume.expect_saves(trainer, resume.Saves(resume_configs(plugin, transforms), trainable_only, extras))


def pack_checkpoint(trainer: pl.Trainer, checkpoint: dict[str, Any]) -> None:
    """Write ``checkpoint`` in lightning_hbm's two-part form (once per checkpoint; see :func:`lightning_hbm.resume.pack_for`).

    The first save hook that runs packs (the plugin's, a :class:`SurgeryCallback`'s, or the checked IO for
    ``save_weights_only``); the later ones find the lightning_hbm part there and return.
    """
    resume.pack_for(trainer, checkpoint)
