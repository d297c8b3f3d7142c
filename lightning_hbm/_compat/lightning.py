"""Lightning's internals that lightning_hbm relies on (Lightning 2.6; ``tests/_compat/test_lightning.py`` checks each)."""

from __future__ import annotations

import sys
from contextlib import contextmanager
from types import FrameType
from typing import Any, Callable, Iterator, Optional

from lightning.fabric.connector import _PRECISION_INPUT_STR  # the Trainer's precision values (cli)
from lightning.fabric.utilities.init import _materialize_distributed_module  # QuantizedFSDPStrategy
from lightning.fabric.utilities.optimizer import _optimizers_to_device  # QuantizedFSDPStrategy
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.core.optimizer import (  # planner
    LightningOptimizer,
    _configure_optimizers,
    _configure_schedulers_automatic_opt,
)
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.trainer.connectors.callback_connector import _CallbackConnector  # trainer_being_built
from lightning.pytorch.trainer.connectors.data_connector import _request_dataloader  # stage_dataloader
from lightning.pytorch.trainer.states import RunningStage  # loader_as_trained
from lightning.pytorch.utilities.combined_loader import CombinedLoader  # stage_dataloaders
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table  # display
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature  # takes_batch_idx
from torchmetrics import Metric  # Lightning's own dependency (its _ResultMetric is one): logged_values

from lightning_hbm._compat import torch as torch_compat


def attached_trainer(module: Any) -> Optional[Any]:
    """The Trainer ``module`` is attached to, or ``None`` (a plain ``nn.Module``, or a LightningModule outside a Trainer).

    ``LightningModule.trainer`` raises when the module is not attached; its backing field ``_trainer`` does not.
    """
    return getattr(module, "_trainer", None)


def loaded_checkpoint(trainer: Optional[Any]) -> Optional[dict[str, Any]]:
    """The checkpoint Lightning is resuming from, between its weight restore and the end of setup (else ``None``).

    No public accessor: ``on_load_checkpoint`` hooks see the dict but run after the model's weights are
    restored and before nothing else lightning_hbm needs, ``CheckpointIO.load_checkpoint`` is bypassed by
    strategies that load their own (sharded) files, and the point where Lightning drops the dict
    (``_CheckpointConnector.resume_end``) has no hook common to fit, validate, test and predict.
    """
    connector = getattr(trainer, "_checkpoint_connector", None)
    return getattr(connector, "_loaded_checkpoint", None) or None


def batches_that_stepped(trainer: Any) -> int:
    """The step Lightning's own ``self.log`` passes to the loggers (``trainer.global_step`` counts optimizer steps)."""
    return trainer.fit_loop.epoch_loop._batches_that_stepped


def format_summary_table(
    total_parameters: int, trainable_parameters: int, model_size: float, modes: dict[str, int], columns: list[Any]
) -> str:
    """Lightning's text model summary (``ModelSummary.summarize`` formats it inline), without its "Total Flops" line."""
    lines = _format_summary_table(total_parameters, trainable_parameters, model_size, modes, 0, *columns).splitlines()
    return "\n".join(lines[:-1] if lines and lines[-1].endswith("Total Flops") else lines)


def trainer_being_built() -> Optional[Any]:
    """The Trainer whose ``__init__`` is calling the ``lightning.pytorch.callbacks_factory`` entry points, or ``None``.

    Lightning calls those factories without arguments (``_CallbackConnector.on_trainer_init`` ->
    ``_load_external_callbacks``), after the accelerator connector has set the strategy and its precision plugin:
    the connector on the call stack is the only way to see which Trainer asks.
    """
    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, _CallbackConnector):
            return candidate.trainer
        frame = frame.f_back
    return None


def has_train_dataloader(trainer: Any) -> bool:
    """Whether the Trainer's fit loop has a train dataloader to request: a datamodule's, one passed to ``fit``, or the
    LightningModule's own ``train_dataloader`` (Lightning's ``_DataConnector`` attached it; nothing is requested)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    return source is not None and source.is_defined()


def train_dataloader(trainer: Any) -> Any:
    """The train dataloader Lightning will use (module's, datamodule's or ``fit``'s), before the fit loop loads it.

    Requested and handed over as :func:`stage_dataloader` does (the user's hook runs once per fit: issue 55, AutoFit
    called it once more); a loader read once (``torch_compat.passes_once``) has its first batch drawn and kept for
    the loop, so a caller's ``next(iter(loader))`` gets that batch and reads nothing more.
    """
    source = trainer.fit_loop._data_source
    loaders = _request_dataloader(source)
    handed = source.dataloader = _HandOver(source, loaders, trainer)
    loader = _first_loader(loaders)
    state = pending_loader_state(trainer)  # read before the loader is: the draw hands nothing back up here
    if loader is not None and torch_compat.passes_once(loader):
        kept = torch_compat.draw_keeping_the_pass(loader, state)
        if kept is not None and kept[1] is not loader:  # the loop gets what gives that batch back first
            handed.loaders, loader = _replaced(loaders, loader, kept[1]), kept[1]
    return loader


def pending_loader_state(trainer: Any, loader: Any = None) -> Optional[Any]:
    """The state the fit loop will restore its first train dataloader (or ``loader``, one of its train dataloaders) to
    (if stateful) before it iterates: of the resumed checkpoint's ``combined_loader`` states
    (``_FitLoop._load_combined_loader_states`` hands them to the stateful loaders in order), the one of that loader,
    the checkpoint's own object; ``None`` outside a resumed fit."""
    if str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return None
    loops = (loaded_checkpoint(trainer) or {}).get("loops") or {}
    states = ((loops.get("fit_loop") or {}).get("state_dict") or {}).get("combined_loader") or []
    index = 0
    if loader is not None:  # its place among the stateful loaders of the request handed to the fit loop
        handed = _handed_to_fit(trainer)
        stateful = [each for each in _flat(loader if handed is None else handed) if _is_stateful(each)]
        index = next((i for i, each in enumerate(stateful) if each is loader), 0)
    return states[index] if isinstance(states, list) and len(states) > index else None


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


def stage_dataloaders(trainer: Any) -> Optional[tuple[list[Any], Callable[[list[Any]], Any]]]:
    """Where the fit loop trains on several loaders together (a dict or list of them, a ``CombinedLoader`` not
    ``"sequential"``), after :func:`stage_dataloader` handed them over: those loaders, and what puts one batch of each
    together as the loop gives ``training_step`` its batch (the same dict or list); ``None`` otherwise (one loader,
    another stage: its step gets one loader's batch at a time)."""
    if str(getattr(trainer.state.fn, "value", trainer.state.fn)) != "fit":
        return None
    loaders = _handed_to_fit(trainer)
    combined = loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders, "max_size_cycle")
    if len(combined.flattened) < 2 or combined._mode == "sequential":
        return None

    def together(batches: list[Any]) -> Any:
        one_each = CombinedLoader(combined.iterables, "max_size_cycle")
        one_each.flattened = [[batch] for batch in batches]
        return next(iter(one_each))[0]  # (batch, batch_idx, dataloader_idx)

    return list(combined.flattened), together


def _handed_to_fit(trainer: Any) -> Any:
    """What :func:`stage_dataloader` or :func:`train_dataloader` handed to the fit loop in this run (``None``: nothing)."""
    source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
    handed = vars(source).get("dataloader") if source is not None else None
    return handed.loaders if isinstance(handed, _HandOver) else None


def _flat(loaders: Any) -> list[Any]:
    """The loaders of a request, in the order the fit loop's ``CombinedLoader`` flattens them."""
    return list((loaders if isinstance(loaders, CombinedLoader) else CombinedLoader(loaders)).flattened)


_STAGE_LOOPS = {"fit": "fit_loop", "validate": "validate_loop", "test": "test_loop", "predict": "predict_loop"}
_STAGE_LIMITS = {"fit": "limit_train_batches", "validate": "limit_val_batches", "test": "limit_test_batches", "predict": "limit_predict_batches"}


def stage_dataloader(trainer: Any) -> Any:
    """The dataloader of the stage the Trainer runs (fit: the train dataloader; validate/test/predict: theirs), before
    its loop loads it; ``None`` if the stage has none or reads no batch. A list or dict of dataloaders gives its first.

    Requested as the loop requests it (``_request_dataloader``: the user's ``*_dataloader()`` hook, its arguments
    recorded for a later re-instantiation with a distributed sampler), and handed to that loop: its next request gets
    the same object, so the user's hook runs once per run as without lightning_hbm (issue 55: ``train_dataloader()``
    was called twice, a stream opened twice).
    """
    stage = str(getattr(trainer.state.fn, "value", trainer.state.fn))
    loop = getattr(trainer, _STAGE_LOOPS.get(stage, ""), None)
    source = getattr(loop, "_data_source", None)
    if source is None or not source.is_defined() or getattr(trainer, _STAGE_LIMITS[stage]) == 0:
        return None  # a loop that reads no batch does not call the hook either
    loaders = _request_dataloader(source)  # a loader already handed over in this run (AutoFit's) is given again
    source.dataloader = _HandOver(source, loaders, trainer)  # an instance attribute over the dataclass's method
    return _first_loader(loaders)


def stage_step_index(trainer: Any) -> tuple[int, ...]:
    """The ``dataloader_idx`` the stage's loop passes its step with the batch :func:`stage_dataloader` gave (its first
    loader's: ``(0,)``), where it passes one: validate/test over several loaders one after another, predict over several
    (Lightning's ``_build_kwargs``, positional); ``()`` otherwise (fit, one loader). Was: ``validation_step(batch, 0)``
    for a step that takes ``dataloader_idx``, a TypeError, the step left un-probed (s38 h8)."""
    fn = getattr(getattr(trainer, "state", None), "fn", None)
    stage = str(getattr(fn, "value", fn))
    loop = getattr(trainer, _STAGE_LOOPS[stage], None) if stage in _STAGE_LOOPS and stage != "fit" else None
    source = getattr(loop, "_data_source", None)
    handed = vars(source).get("dataloader") if source is not None else None
    if not isinstance(handed, _HandOver):
        return ()
    combined = handed.loaders if isinstance(handed.loaders, CombinedLoader) else CombinedLoader(handed.loaders, "sequential")
    return (0,) if len(combined.flattened) > 1 and (stage == "predict" or combined._mode == "sequential") else ()


def loader_as_trained(trainer: Any, loader: Any) -> Any:
    """``loader`` as the fit loop will iterate it: on several processes Lightning rebuilds a ``DataLoader`` with a
    ``DistributedSampler`` (``_DataConnector._prepare_dataloader``, ``use_distributed_sampler``); else ``loader`` itself.
    A loader Lightning cannot rebuild is given as it is (the loop raises its own error later)."""
    connector = getattr(trainer, "_data_connector", None)
    if connector is None or int(getattr(trainer, "world_size", 1) or 1) < 2:
        return loader
    try:
        return connector._prepare_dataloader(loader, shuffle=True, mode=RunningStage.TRAINING)
    except Exception:  # noqa: BLE001 - any failure to rebuild: the loop's own, later
        return loader


def _first_loader(loaders: Any) -> Any:
    loader = loaders.flattened if isinstance(loaders, CombinedLoader) else loaders  # fit(CombinedLoader(...)): its first
    if isinstance(loader, dict):
        loader = next(iter(loader.values()), None)
    if isinstance(loader, (list, tuple)):
        loader = loader[0] if loader else None
    return loader


def rebuilds_its_dataloader(trainer: Any) -> bool:
    """Whether the loop of the stage the Trainer runs iterates a rebuilt copy of a ``DataLoader`` it is given, not that
    object: the predict loop always does (``_DataConnector._prepare_dataloader``: ``_update_dataloader`` with an
    index-recording sampler; training rebuilds only to inject a distributed sampler, never for an iterable dataset)."""
    return str(getattr(trainer.state.fn, "value", trainer.state.fn)) == "predict"


def hand_over_instead(trainer: Any, old: Any, new: Any) -> None:
    """The loop of the stage the Trainer runs gets ``new`` where :func:`stage_dataloader` handed it ``old`` (a one-pass
    iterator the probe drew its first batch from, given back with that batch in front)."""
    loop = getattr(trainer, _STAGE_LOOPS.get(str(getattr(trainer.state.fn, "value", trainer.state.fn)), ""), None)
    handed = vars(getattr(loop, "_data_source", None) or object()).get("dataloader") if loop is not None else None
    if isinstance(handed, _HandOver):
        handed.loaders = _replaced(handed.loaders, old, new)


def _replaced(loaders: Any, old: Any, new: Any) -> Any:
    """``loaders`` (one, or a dict, list or tuple of them) with ``new`` where ``old`` was."""
    if loaders is old:
        return new
    if isinstance(loaders, CombinedLoader):  # the same object, its iterables replaced (the loop takes it as it is)
        loaders.flattened = [new if value is old else value for value in loaders.flattened]
        return loaders
    if isinstance(loaders, dict):
        return {key: new if value is old else value for key, value in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(new if value is old else value for value in loaders)
    return loaders


class _HandOver:
    """``source.dataloader`` for one call: what :func:`stage_dataloader` requested, given to the loop's own request
    (``setup_data``), after which the source's own method is back. Picklable (a module-level class)."""

    def __init__(self, source: Any, loaders: Any, trainer: Any) -> None:
        self.source, self.instance, self.loaders = source, source.instance, loaders
        self.trainer_data, self.run = getattr(trainer, "_data_connector", None), _run_of(trainer)

    def __call__(self) -> Any:
        vars(self.source).pop("dataloader", None)
        # the data was attached anew since, or this is another run (one that stopped before its loop handed it over,
        # and no lightning_hbm surgery ran in this one to drop it): the source's own loader
        if self.source.instance is not self.instance or getattr(self.trainer_data, "_datahook_selector", None) is not self.run:
            return self.source.dataloader()
        return self.loaders


def _run_of(trainer: Any) -> Any:
    """What tells one run of ``trainer`` from another: Lightning builds a new ``_DataHookSelector`` each time a
    ``fit``/``validate``/``test``/``predict`` attaches its data (``_DataConnector.attach_datamodule``)."""
    return getattr(getattr(trainer, "_data_connector", None), "_datahook_selector", None)


def drop_handed_over(trainer: Any) -> None:
    """Forget a loader :func:`stage_dataloader` handed to a loop of an earlier run that never asked for it (a run that
    stopped before its loop started): called before each run's probe, so no run gets another run's loader. A loader
    handed over earlier in this run (AutoFit's, at ``Callback.setup``) is kept for this run's probe and loop."""
    run = _run_of(trainer)
    for loop in (trainer.fit_loop, trainer.fit_loop.epoch_loop.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop):
        handed = vars(loop._data_source).get("dataloader")
        if isinstance(handed, _HandOver) and (handed.run is not run or run is None):
            del vars(loop._data_source)["dataloader"]


def unwrap_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (public property; kept here beside its callers' other needs)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def override_plugin_hooks(plugin: Any, convert_module: Callable[..., Any], connect: Callable[..., Any]) -> None:
    """Replace ``convert_module`` and ``connect`` on this precision plugin instance only.

    Every Lightning strategy calls ``precision_plugin.convert_module(model)`` in its ``setup`` after
    ``configure_model`` and before the optimizers exist, and ``precision_plugin.connect(...)`` once they do:
    the only points where a plugin that is not lightning_hbm's can be given the surgery. Instance attributes
    shadow the class's methods (callables must be picklable: the Trainer may be pickled after ``fit``).
    """
    plugin.convert_module = convert_module
    plugin.connect = connect


# Lightning's precision plugins that only cast the model or run it under autocast: none replaces a layer (exact types:
# a subclass may do more)
_CASTING_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def casts_only(plugin: Any) -> bool:
    """Whether ``plugin`` is one of Lightning's precision plugins that replace no layer (``32-true``, ``16-mixed``,
    ``bf16-mixed``, ``bf16-true``, ``16-true``, ``64-true``), not a subclass of one."""
    return type(plugin) in _CASTING_PLUGINS


def plugin_hook_override(plugin: Any, name: str) -> Optional[Callable[..., Any]]:
    """What :func:`override_plugin_hooks` put on ``plugin`` for hook ``name`` (``None``: the class's method)."""
    return vars(plugin).get(name)


@contextmanager
def detached(module: Any) -> Iterator[None]:
    """``module`` attached to no Trainer or Fabric inside the block (a deep copy then leaves them behind).

    Lightning keeps the links in the private fields ``_trainer`` / ``_fabric``; there is no public detach.
    """
    saved = {attr: module.__dict__.get(attr) for attr in ("_trainer", "_fabric")}
    for attr in saved:
        module.__dict__[attr] = None
    try:
        yield
    finally:
        module.__dict__.update(saved)


@contextmanager
def device_mesh_hidden(module: Any) -> Iterator[None]:
    """``module.device_mesh`` is ``None`` inside the block, and the mesh Lightning set is back after it.

    ``ModelParallelStrategy.setup_environment`` puts its mesh on the LightningModule by writing the private field
    behind the read-only ``LightningModule.device_mesh`` property (``lightning_module._device_mesh``); there is no
    public setter. ``QuantizedFSDPStrategy`` hides it during the surgery: peft 0.21 takes a module that has a
    ``_device_mesh`` for a tensor-parallel transformers model and reads its ``.config``.
    """
    mesh = module._device_mesh
    module._device_mesh = None
    try:
        yield
    finally:
        module._device_mesh = mesh


def logged_values(module: Any) -> Callable[[], None]:
    """What a step run that is then discarded may have counted, and the function that puts it back.

    ``self.log`` adds to the result collection of the Trainer's active loop (``trainer._results``: one
    ``_ResultMetric`` per key, a torchmetrics ``Metric`` holding the running sum and batch count), and the user's own
    torchmetrics metrics count every ``update``. The first step's rerun (``adapters/lora/input_grads.py``) discards a
    run of ``training_step``: without this its values reached the epoch's mean (the first batch counted twice).
    Keys the discarded run added are removed; the states of the others, and of every ``Metric`` among ``module``'s
    modules, are put back as they were.
    """
    results = getattr(attached_trainer(module), "_results", None)
    keys = set(results) if results is not None else set()
    metrics = [m for m in module.modules() if isinstance(m, Metric)]
    metrics += [m for m in (results.values() if results is not None else ()) if isinstance(m, Metric)]
    saved = [(m, m._copy_state_dict(), m._update_count, m._computed, m._forward_cache, vars(m).get("has_reset")) for m in metrics]

    def restore() -> None:
        for key in [key for key in (results or {}) if key not in keys]:
            del results[key]  # type: ignore[union-attr]  # results is not None here
        for metric, states, count, computed, cache, has_reset in saved:
            for name, value in states.items():
                setattr(metric, name, value)
            metric._update_count, metric._computed, metric._forward_cache = count, computed, cache
            if has_reset is not None:
                metric.has_reset = has_reset

    return restore


@contextmanager
def optimizers_lent(module: Any, make: Callable[[], list]) -> Iterator[None]:
    """``module.trainer.optimizers`` as ``make()`` gives them inside the context, where the trainer's strategy holds
    none yet (before the fit sets them up: the probe step's stand-ins, :func:`lightning_hbm.probe_stand_ins.quiet_logging`), the
    strategy's own list put back after, also when the step raises. Nothing without a trainer, or where it holds
    optimizers. Lightning's private ``LightningModule._trainer`` (``trainer`` raises when detached) and
    ``Strategy._optimizers`` (``trainer.optimizers`` reads it; its setter would wrap the stand-ins as
    ``LightningOptimizer`` s); ``tests/_compat/test_lightning.py`` checks both are still there."""
    strategy = getattr(getattr(module, "_trainer", None), "strategy", None)
    before = getattr(strategy, "_optimizers", None)
    if before is None or before:
        yield
        return
    strategy._optimizers = make()  # type: ignore[union-attr]
    try:
        yield
    finally:
        strategy._optimizers = before  # type: ignore[union-attr]


def takes_batch_idx(step: Callable[..., Any]) -> bool:
    """Whether Lightning's loops pass ``batch_idx`` to ``step`` (a ``*_step`` method): a parameter of that name, two
    after ``self``, or ``*args`` (``is_param_in_hook_signature(step, "batch_idx", min_args=2)``, as its training,
    evaluation and prediction loops ask). A ``validation_step(self, batch)`` gets the batch alone (s39 h5: the probe
    step passed it ``0``, a TypeError, the step left un-probed)."""
    return is_param_in_hook_signature(step, "batch_idx", min_args=2)
