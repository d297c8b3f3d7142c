"""Tracing one training step on fake tensors: what a candidate holds, per phase, without allocating the model.

The model is built under torch's ``FakeTensorMode`` (a fake tensor has shape, dtype and device but no
data), the candidate is applied by the same surgery a Trainer runs (:func:`run_surgery`: checks, the
precision plugin, the ``SurgeryCallback`` transforms in stage order, as the Trainer runs it; then the user's unchanged
``configure_optimizers`` and each transform's ``transform_optimizers``), the gradients and optimizer
states a first step leaves are created (zero gradients, one optimizer step), and one steady-state step
is traced as Lightning runs it: forward, zero_grad, backward, optimizer step. lightning_hbm's
:class:`~lightning_hbm.memory.tracker.LiveStorageTracker` follows every live storage; each phase's
peak is classified by the profiler's own peak classifier (:func:`~lightning_hbm.memory.categories.classify_records`):
parameters, ``.grad``, ``optimizer.state``, buffers by owner; what the forward created is activations, the rest
other.

Quantized layers are built by each precision mode's own fake-tensor construction
(:meth:`lightning_hbm.precision.QuantFormat.for_fake_tensors`). Data-dependent Python reads real values
from small real twins (:mod:`lightning_hbm.planner.realvalues`). ``from_pretrained`` inside a factory
builds the model from its saved config without reading a weight (:mod:`lightning_hbm.planner.building`).
Hugging Face models are kept on their eager code paths, which they leave for fake tensors
(:func:`_eager_transformers`).

This module is the trace itself (the model set up, the first step's state, the steady step); its parts, one job
each: :mod:`~lightning_hbm.planner.trace_result` (:class:`Trace`, what a step held, and the lines through cut
models), :mod:`~lightning_hbm.planner.peaks` (where each phase peaks), :mod:`~lightning_hbm.planner.block_cuts`
(the list of blocks cut to the few traced), :mod:`~lightning_hbm.planner.fallbacks` (modules that cannot run on
fake tensors, run for real on zeros), :mod:`~lightning_hbm.planner.host_offload` (the offload hooks as planned).
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections.abc import Collection, Iterator
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode, unset_fake_temporarily

from lightning_hbm import record
from lightning_hbm._compat import _configure_optimizers, _configure_schedulers_automatic_opt
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations import ActivationCheckpointing
from lightning_hbm.activations.token_chunks import ChunkedForward
from lightning_hbm.layers import readers
from lightning_hbm.memory import (
    LiveStorageTracker,
    owned_storages,
    parameter_bytes,
    parameter_count,
    quantization_tensors,
    scope_term_bytes,
    tensor_bytes,
    tensor_storage_key,
    unique_bytes,
)
from lightning_hbm.memory.categories import buffer_tensors, classify_records, optimizer_state_tensors, parameter_tensors
from lightning_hbm.planner.block_cuts import _block_list as _block_list  # its former home (api, tests)
from lightning_hbm.planner.block_cuts import _blocks, _blocks_cut, _cut_blocks, _cut_list
from lightning_hbm.planner.building import (
    ModelLike,
    Template,
    _adopt_foreign_fakes,
    _build,
    _fake_batch_like,
    _fake_mode,
    _forget_conversions,
    _quiet_logs,
    build_template,
)
from lightning_hbm.planner.candidates import Candidate
from lightning_hbm.planner.fallbacks import MAX_REAL_RUN_BYTES as MAX_REAL_RUN_BYTES  # its former home
from lightning_hbm.planner.fallbacks import UntraceableModule, _name_untraceable, _run_for_real
from lightning_hbm.planner.host_offload import _HostOffload, _offload_first, _offload_to_host
from lightning_hbm.planner.peaks import END_OF_BACKWARD, _PeakPoints, _peaks_apart
from lightning_hbm.planner.realvalues import RealValues
from lightning_hbm.planner.routed import Routed, modules_run, routed_away
from lightning_hbm.planner.trace_result import PHASES, Trace
from lightning_hbm.precision import QuantizedPrecision
from lightning_hbm.running import RunningModules
from lightning_hbm.strategies.fsdp_qlora import inner_units, remainder_units
from lightning_hbm.surgery import SurgeryCallback, applied_transforms, run_surgery, transform_optimizers
from lightning_hbm.surgery.probe_step import SharedProbe


@dataclass
class Decided:
    """What the structure-deciding forward on a probe batch found, kept to trace the same model at other lengths.

    That forward (:func:`_gradient_receivers`) costs as much as the traced step's own forward and decides the same at
    every length when it runs on the same probe batch (``max_context`` plans one model at a dozen lengths): which
    parameters the loss reaches, and each token-chunked layer's verdict (:class:`ChunkedForward`), both by name, per
    number of blocks kept. Reused, the plan is equal to the byte (``tests/planner/test_context.py``).

    Also kept for one prediction (the same batch: a partial offload traces one cut model with two offload counts) and, in
    :func:`~lightning_hbm.planner.api.plan`, for the next candidate that differs only by its optimizer (the same model
    set up: only the optimizers are made again, :func:`_remade_optimizers`). Equal to the byte
    (``tests/planner/test_set_up_reuse_s34.py``).
    """

    by_depth: dict[Optional[int], tuple[Optional[frozenset[str]], dict[str, Optional[str]]]] = field(default_factory=dict)
    #: per number of blocks kept: the experts' parameters the probe step did not route to, by name, and their containers
    routed: dict[Optional[int], tuple[frozenset[str], dict[str, str]]] = field(default_factory=dict)
    #: the model set up at each depth (:class:`_Built`), stepped again at the next length
    built: dict[Optional[int], _Built] = field(default_factory=dict)
    #: what the surgery's probe step saw on a model set up alike (:class:`_SharedProbe`); :func:`~lightning_hbm.planner.api.plan`
    #: hands one dict to the set-ups of all its candidates (another precision or checkpointing, the same cut model)
    probes: dict[tuple, tuple[Any, readers.Observation, list[str], dict[str, str]]] = field(default_factory=dict)

    def forget(self, keep_blocks: Optional[int]) -> None:
        """Decide again at ``keep_blocks`` (a module found untraceable there now runs for real)."""
        self.by_depth.pop(keep_blocks, None)
        self.built.pop(keep_blocks, None)
        self.routed.pop(keep_blocks, None)

    def keep(self, module: nn.Module, keep_blocks: Optional[int], reached: Optional[set[int]], routed: Routed) -> None:
        names = None if reached is None else frozenset(n for n, p in module.named_parameters() if id(p) in reached)
        verdicts = {name: forward.fake_verdict for name, forward in _chunked_forwards(module)}
        self.by_depth[keep_blocks] = (names, verdicts)
        away = frozenset(n for n, p in module.named_parameters() if id(p) in routed.ids)
        self.routed[keep_blocks] = (away, dict(routed.containers))

    def restore(self, module: nn.Module, keep_blocks: Optional[int]) -> tuple[Optional[set[int]], Routed]:
        """Set the kept verdicts on ``module``'s chunked layers; the ids of the parameters the loss reaches, and the
        experts' the probe step did not route to."""
        names, verdicts = self.by_depth[keep_blocks]
        for name, forward in _chunked_forwards(module):
            forward.fake_verdict = verdicts.get(name)
        away, containers = self.routed.get(keep_blocks, (frozenset(), {}))
        routed = Routed({id(p) for n, p in module.named_parameters() if n in away}, dict(containers))
        return None if names is None else {id(p) for n, p in module.named_parameters() if n in names}, routed


def _chunked_forwards(module: nn.Module) -> Iterator[tuple[str, ChunkedForward]]:
    for name, layer in module.named_modules():
        forward = torch_compat.forward_override(layer)
        if isinstance(forward, ChunkedForward):
            yield name, forward


def trace(
    model: Union[ModelLike, Template],
    batch: Any,
    candidate: Candidate,
    device: str,
    keep_blocks: Optional[int],
    real_types: Optional[dict[str, str]] = None,
    probe_batch: Any = None,
    decided: Optional[Decided] = None,
    offload: Optional[int] = None,
) -> Trace:
    """Trace one steady-state training step of ``model`` under ``candidate`` (repeated blocks cut to ``keep_blocks``).

    ``offload``: with ``ActivationCheckpointing(offload=...)``, how many of the checkpointed blocks (the first ones)
    offload their inputs in this step; None: every one. The surgery gives every checkpointed block the offload hooks
    whatever the configured count (a cut model has fewer blocks than it names), and the count is set per step: one
    model set up serves each pattern the line through cut models needs (:func:`~lightning_hbm.planner.api.predict`).

    ``real_types``: {module class name: reason}; modules of those classes run for real on zeros
    (:func:`~lightning_hbm.planner.fallbacks._run_for_real`), named in :attr:`Trace.fallbacks`. ``probe_batch``: a shorter batch of the same
    structure for the forwards that decide structure only (the surgery's probe step, which parameters the loss
    reaches): at a long sequence they cost as much as the traced step and decide the same (``max_context``).
    """
    tracker = LiveStorageTracker(track_peak=True)
    built = decided.built.get(keep_blocks) if decided is not None else None
    with _dropped_if_failed(decided, keep_blocks), ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # self.log without a Trainer, peft/bnb notices: noise during a dry run
        stack.enter_context(_quiet_logs())  # the callbacks' "applied to N blocks" lines, once per trace
        stack.enter_context(torch.random.fork_rng(devices=[]))  # twins draw random numbers: not the user's
        if built is None:
            built = _set_up(stack, model, candidate, device, keep_blocks, real_types, batch, probe_batch, decided)
        else:  # the same model at another length: only the batch is new (what the last step left is a step's state)
            fake_batch = torch_compat.map_tensors(lambda t: _fake_batch_like(t, built.fake_mode, built.values), batch)
            built.enter(stack)
            built.fake_batch = built.plugin.convert_input(fake_batch)
            built.reached, built.routed = cast(Decided, decided).restore(built.module, keep_blocks)
            if built.optimizer != candidate.optimizer:  # the next candidate of a plan: another optimizer, the same model
                built.optimizers, built.optimizer = _remade_optimizers(built.module, candidate, device), candidate.optimizer
        module, optimizers, values = built.module, built.optimizers, built.values
        values.guessed, values.selections = list(built.guessed), dict(built.selections)
        stack.enter_context(tracker)
        tracker.phase = "setup"
        tracker.seed(itertools.chain(parameter_tensors(module), buffer_tensors(module), torch_compat.tensor_leaves(built.fake_batch)), "setup")
        _first_step_state(optimizers, built.reached, built.routed.ids)
        # states created outside the dispatch (e.g. bitsandbytes' real quantization maps)
        tracker.seed(optimizer_state_tensors(optimizers), "setup")
        # 0-dim states (Adam's step): whole on every FSDP2 rank, not sharded with the others
        replicated_states = unique_bytes(t for t in optimizer_state_tensors(optimizers) if t.dim() == 0)
        for hooks in built.offloads:
            hooks.reset_counts()
        offloaded, boundary = _offload_first(module, offload)
        phases, scopes, where, regions, held = _steady_step(module, built.fake_batch, built.plugin, optimizers, tracker,
                                                            boundary, remade_unit(candidate), built.cut_path)
        built.fake_batch = None  # the next length's batch is new: this one need not stay alive
        host = sum(hooks.host_bytes for hooks in built.offloads)
        host_sizes = tuple(sorted(size for hooks in built.offloads for size in cast(_HostOffload, hooks).sizes))
        trainable = parameter_count(module, trainable=True)
        total = parameter_count(module)
        blocks = [block for _, block in _blocks(module)]
        block_bytes, block_gradients = _block_unit_bytes(blocks)
        replicated = _replicated_bytes(module)
        remainder, apart, inner = _remainder_unit_bytes(module, blocks)
        remainder_gradients, apart_gradients, _ = _remainder_unit_bytes(module, blocks, trainable=True)
        rooted = bool(blocks) and not held
    depth, fallbacks = built.depth, built.fallbacks
    kept = min(depth, keep_blocks) if keep_blocks is not None else depth
    guessed = len(values.guessed) + (len(model.values.guessed) if isinstance(model, Template) else 0)  # + the build's
    return Trace(phases, trainable, total, depth, kept, block_bytes, guessed, scopes, fallbacks, host, values.selections,
                 host_sizes, offloaded, where, regions, replicated, remainder, unchecked_blocks(module), apart, rooted,
                 dict(built.routed.containers), block_gradients, replicated_states,
                 {name: size for name, size in apart_gradients.items() if size}, inner, remainder_gradients)


def _block_unit_bytes(blocks: list[nn.Module]) -> tuple[int, int]:
    """What FSDP2 gathers for the largest block: its parameters, not its quantization constants (whole on every rank,
    in ``replicated``; before session 33 counted here too: +3,328 B a block on the 2-rank nanoGPT); and the gradient
    bytes the largest block's backward makes (its trainable parameters'), reduce-scattered to shards by FSDP2."""
    gathered = max((parameter_bytes(block) - _replicated_bytes(block) for block in blocks), default=0)
    gradients = max((tensor_bytes(p for p in block.parameters() if p.requires_grad) for block in blocks), default=0)
    return gathered, gradients


def _remainder_unit_bytes(module: nn.Module, blocks: list[nn.Module], trainable: bool = False
                          ) -> tuple[int, dict[str, int], dict[str, int]]:
    """What ``QuantizedFSDPStrategy``'s units outside the blocks gather (parameters outside the blocks, quantization
    constants excluded): the unit around the blocks (a causal LM's ``model``; 0 without one), less its inner units; by
    name each unit apart from it (a head or an embedding side by side with the backbone: :func:`remainder_units`); and
    by name each unit inside it that is no block (:func:`inner_units`: ConvNext's downsampling members), each less the
    inner units inside it. ``trainable``: the gradient bytes of each instead (its trainable parameters')."""
    inside = {id(p) for block in blocks for p in block.parameters()}
    holder = _model_holding(module, blocks)

    def outside(unit: nn.Module) -> int:
        return tensor_bytes(p for p in unit.parameters() if id(p) not in inside and (p.requires_grad or not trainable))

    apart = {name: outside(unit) for name, unit in remainder_units(module, blocks) if unit is not holder}
    inner: dict[str, int] = {}
    for name, unit in sorted(inner_units(module, blocks, holder), key=lambda item: -item[0].count(".")):
        inner[name] = outside(unit)  # innermost first: what an inner unit holds is not its parent's
        inside |= {id(p) for p in unit.parameters()}
    return (outside(holder) if holder is not None else 0), apart, inner


@contextmanager
def _dropped_if_failed(decided: Optional[Decided], keep_blocks: Optional[int]) -> Iterator[None]:
    """A trace that failed half-way leaves its model set up in a state no later trace may step again: forgotten."""
    try:
        yield
    except BaseException:
        if decided is not None:
            decided.built.pop(keep_blocks, None)
        raise


def _remade_optimizers(module: pl.LightningModule, candidate: Candidate, device: str) -> list[torch.optim.Optimizer]:
    """The optimizers of ``candidate`` for ``module``, set up (and stepped) for a candidate that differs from it only by
    its optimizer (:func:`~lightning_hbm.planner.api.plan`): the model is the same, the optimizers are made as
    :func:`apply_candidate` makes them, after the checks of the transforms the model has not seen (the optimizer's)."""
    transforms: list[SurgeryCallback] = candidate.callbacks()
    applied = set(applied_transforms(module))
    for transform in transforms:
        if type(transform).__qualname__ not in applied:
            transform.check_model(module)
    for param in module.parameters():  # what the last trace's step left: each trace's first step makes its own
        param.grad = None
    return _optimizers(module, transforms, device)


def unchecked_blocks(module: nn.Module) -> dict[str, str]:
    """The blocks ``ActivationCheckpointing`` chose but runs without checkpoint (their forward changes a list or dict it
    is given, decided on their first training forward: the planner's steps run the same code), and what they change."""
    found = {}
    for name, block in module.named_modules():
        changes = getattr(record.checkpoint_setup(block), "mutates", None)
        if changes:
            found[name] = changes
    return found


def _replicated_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s quantization constants (absmax, code books, row scales), which FSDP2 keeps whole on every
    rank; not the rows a bitsandbytes int8 layer's state points at after a forward (``state.CB``: the weight's own
    storage, sharded)."""
    seen = {key for key in map(tensor_storage_key, module.parameters()) if key is not None}
    return unique_bytes((t for m in module.modules() for t in quantization_tensors(m)), seen)


@dataclass
class _Built:
    """A model set up for tracing (built on fake tensors, configured, surgery applied, optimizers made): stepped at
    one length, and kept in :class:`Decided` to step again at the next (the setup is a quarter of a trace)."""

    module: pl.LightningModule
    plugin: Precision
    fake_mode: FakeTensorMode
    values: RealValues
    optimizers: list
    offloads: list
    depth: int
    fallbacks: dict[str, str]
    reached: Optional[set[int]]
    fake_batch: Any
    routed: Routed = field(default_factory=Routed)  # the experts' parameters the probe step did not route to
    guessed: list[str] = field(default_factory=list)  # what the setup read without values (each step adds its own)
    selections: dict[str, str] = field(default_factory=dict)
    optimizer: str = "user"  # the candidate's optimizer (Candidate.optimizer) its optimizers were made for
    cut_path: Optional[str] = None  # the list of blocks cut (block_cuts._cut_blocks)

    def enter(self, stack: ExitStack) -> None:
        """Enter the modes a step of this model runs under."""
        stack.enter_context(_eager_transformers())  # after the build: the model's import brings transformers in
        stack.enter_context(self.fake_mode)
        stack.enter_context(self.values)
        stack.enter_context(torch_compat.FakeGroupedMM())  # transformers' MoE experts in float32
        stack.enter_context(torch_compat.fake_parameters_as_real_ones())  # a quantized router cast by its model
        running = stack.enter_context(RunningModules())
        module = self.module
        # a selection by a mask without values in the LightningModule's own code (its loss) is planned at its largest
        # size; inside a submodule it fails, and the module runs for real (real_types) as named by _name_untraceable
        self.values.bound_selections = lambda: not any(m is not module and _part_of(m, module) for m in running.stack)


def _set_up(
    stack: ExitStack, model: Union[ModelLike, Template], candidate: Candidate, device: str, keep_blocks: Optional[int],
    real_types: Optional[dict[str, str]], batch: Any, probe_batch: Any, decided: Optional[Decided],
) -> _Built:
    """Build ``model`` on fake tensors, run the surgery of ``candidate`` and make its optimizers; the modes entered
    on ``stack``. Kept in ``decided`` (when given) for the same model at other lengths."""
    fallbacks: dict[str, str] = {}
    plugin = _planning_plugin(candidate)
    fake_mode = _fake_mode()
    values = RealValues(fake_mode)
    # a template is copied with its blocks already cut: copying 32 layers of fakes to trace 3 costs seconds
    with _blocks_cut(model.module, keep_blocks) if isinstance(model, Template) else nullcontext(("", 0)) as (path, depth):
        module = _build(model, fake_mode, values)
    fake_batch = torch_compat.map_tensors(lambda t: _fake_batch_like(t, fake_mode, values), batch)
    fake_probe = fake_batch if probe_batch is None else torch_compat.map_tensors(
        lambda t: _fake_batch_like(t, fake_mode, values), probe_batch)
    built = _Built(module, plugin, fake_mode, values, [], [], depth, fallbacks, None, fake_batch)
    built.enter(stack)
    with plugin.tensor_init_context():
        module.configure_model()
    _adopt_foreign_fakes(module, fake_mode)
    _forget_conversions(fake_mode)
    # blocks built lazily exist only now; the template's cut list, not the largest of the cut model (block_cuts)
    built.cut_path, full = _cut_blocks(module, keep_blocks, path if depth else None)
    built.depth = max(depth, full)
    for name, submodule in list(module.named_modules()):
        if type(submodule).__name__ in (real_types or {}):
            _run_for_real(submodule, fallbacks, cast(dict[str, str], real_types)[type(submodule).__name__], name)
    shared = _SharedProbe(fake_probe, decided, (keep_blocks, tuple(sorted((real_types or {}).items()))),
                          batch if probe_batch is None else probe_batch, values) if decided is not None else fake_probe
    built.optimizers = apply_candidate(module, candidate, plugin, device, batch=shared, offload_every=True)
    built.optimizer = candidate.optimizer
    built.offloads = _offload_to_host(module) if device == "cuda" else []
    built.fake_batch = plugin.convert_input(fake_batch)
    fake_probe = built.fake_batch if probe_batch is None else plugin.convert_input(fake_probe)
    if decided is not None and keep_blocks in decided.by_depth:
        built.reached, built.routed = decided.restore(module, keep_blocks)
    else:
        # before the tracker: its storages are gone after
        built.reached, built.routed = _gradient_receivers(module, fake_probe, plugin)
        if decided is not None:
            decided.keep(module, keep_blocks, built.reached, built.routed)
    built.guessed, built.selections = list(values.guessed), dict(values.selections)
    if decided is not None:
        decided.built[keep_blocks] = built
    return built


class _SharedProbe(SharedProbe):
    """The surgery's probe step (who reads which layer's weight, :mod:`lightning_hbm.layers.readers`), run once for every
    set-up of one cut model in a plan: its answer depends on the model as built (classes, names, dtypes, shapes: the
    candidates' precisions build it in their own dtype), the layers asked about, ``modules_to_save``, the modules run
    for real, and the batch, all in the key; the reads it made without values (:class:`RealValues`) are replayed, so
    each prediction is the one a set-up of its own makes (``tests/planner/test_set_up_reuse_s35.py``)."""

    def __init__(self, batch: Any, decided: Decided, key: tuple, raw: Any, values: RealValues) -> None:
        super().__init__(batch)
        self.decided, self.key, self.raw, self.values = decided, key, raw, values

    def observe(self, module: nn.Module, batch: Any, layers: dict[str, nn.Module], step: str) -> Optional[readers.Observation]:
        key = (*self.key, step, tuple((name, type(layer)) for name, layer in layers.items()),
               tuple(record.modules_to_save(module)), _as_built_signature(module))
        kept = self.decided.probes.get(key)
        if kept is not None and kept[0] is self.raw:
            _, seen, guessed, selections = kept
            readers.adopt(module, seen, layers)
            self.values.guessed.extend(guessed)
            self.values.selections.update(selections)
            return seen
        count, before = len(self.values.guessed), dict(self.values.selections)
        found = readers.observe(module, batch, layers, step)
        if found is not None:
            made = {op: why for op, why in self.values.selections.items() if before.get(op) != why}
            self.decided.probes[key] = (self.raw, found, self.values.guessed[count:], made)
        return found


def _as_built_signature(module: nn.Module) -> tuple:
    """Each module's class and each parameter's and buffer's dtype, shape and ``requires_grad``, by name."""
    return (tuple((name, type(sub)) for name, sub in module.named_modules()),
            tuple((name, t.dtype, tuple(t.shape), t.requires_grad)
                  for name, t in itertools.chain(module.named_parameters(), module.named_buffers())))


def _part_of(submodule: nn.Module, model: nn.Module) -> bool:
    """Whether ``submodule`` is one of ``model``'s modules (asked only when a selection has no values: rare)."""
    return any(m is submodule for m in model.modules())


def _gradient_receivers(module: pl.LightningModule, batch: Any, plugin: Precision) -> tuple[Optional[set[int]], Routed]:
    """``id``s of the parameters the traced step's loss reaches (they get a gradient), from one forward's graph; and the
    trainable parameters of the experts that forward did not route to (:mod:`~lightning_hbm.planner.routed`).

    A trainable parameter the loss never reaches (LLaVA's last vision layer and its adapters under
    ``vision_feature_layer=-2``) gets no gradient, and an optimizer keeps no state for it: counting one for every
    trainable parameter overshot LLaVA's peak by 8 %. ``None`` (count every trainable parameter) when a reentrant
    checkpoint hides the parameters of its blocks from the graph (they do get gradients). An expert a long run routes
    to keeps its optimizer states in every later step, routed to or not: the experts this forward skipped get states.

    It is also the first training forward of the model set up, so the step :func:`_steady_step` traces is a second one,
    as training's steps are from the second on: not to be replaced by the traced step's own graph (a block given a dict
    runs its first forward unchecked, a cache made on the first forward, chunk verdicts; measured in
    ``benchmarks/planner_gradient_receivers.py``, pinned by ``tests/planner/test_warm_up_forward_s37.py``).
    """
    with plugin.forward_context(), _name_untraceable(module), modules_run() as ran:
        loss, _kept = _closure_loss(module.training_step(batch, 1))
    found: set[int] = set()
    seen: set[int] = set()
    nodes = [loss.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if type(node).__name__ == "CheckpointFunctionBackward":  # reentrant: its forward ran without a graph
            return None, Routed()
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it fills
        if variable is not None:
            found.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found, routed_away(module, ran, found)


def _first_step_state(optimizers: list[torch.optim.Optimizer], reached: Optional[set[int]] = None,
                      routed: Collection[int] = ()) -> None:
    """The state the steps before a steady one leave behind, without tracing their backward: a gradient for every
    trained parameter the loss reaches (``reached``: ids, see :func:`_gradient_receivers`; ``None``: every one), and
    the optimizer states a step with those gradients creates; states, but no gradient, for the experts' parameters
    the step did not route to (``routed``: an earlier step of a long run did)."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and (reached is None or id(param) in reached or id(param) in routed):
                    param.grad = torch.zeros_like(param)
        optimizer.step()
        for group in optimizer.param_groups:
            for param in group["params"]:
                if id(param) in routed and (reached is None or id(param) not in reached):
                    param.grad = None  # the gradients alive at the next step's start are one step's


def _steady_step(
    module: pl.LightningModule, batch: Any, plugin: Precision, optimizers: list, tracker: LiveStorageTracker,
    boundary: Optional[tuple[nn.Module, nn.Module]] = None, unit: int = 1, cut_path: Optional[str] = None,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], dict[str, str], dict[str, dict[str, int]], bool]:
    """Forward, zero_grad, backward, optimizer step, as Lightning runs them; each phase's peak by category, each
    scope term at it (:func:`~lightning_hbm.memory.scope_term_bytes`; ``loss``: what ``FusedLoss`` allocated),
    where it was reached with each region's peak (:class:`~lightning_hbm.planner.peaks._PeakPoints`), and whether a
    child of the LightningModule holding the blocks ran its forward around them (:func:`_model_holding`; else each block
    is an FSDP2 root of its own: an ``nn.Sequential`` of blocks the LightningModule iterates, session 35).

    ``boundary``: (the last block that offloads its input, the first that keeps it) under a partial offload. The
    forward and the backward then each have two peaks, recorded apart (``"forward (offloaded blocks)"``, ``"backward
    (offloaded blocks)"``): one grows with the blocks that keep their inputs, the other with those that offload them,
    and the line through cut models extends each peak, not their maximum (which moves from one to the other).
    ``unit``: the regions are named by units of that many blocks (:meth:`_PeakPoints.watching`)."""
    phases: dict[str, dict[str, int]] = {}
    scopes: dict[str, dict[str, int]] = {}
    points = _PeakPoints(tracker)

    def close(name: str) -> None:
        records = points.close(name)
        # classified now, while what the phase's peak held is still owned (the previous step's
        # gradients, alive during the forward, are gone once backward starts)
        owned = owned_storages(module, optimizers)
        phases[name] = classify_records(records, owned)
        scopes[name] = scope_term_bytes(records, owned)
        tracker.reset_peak()
        points.restart()

    loss: Any = None
    with ExitStack() as stack:
        blocks = _cut_list(module, cut_path)
        kept_from = next((i for i, block in enumerate(blocks) if boundary is not None and block is boundary[1]), None)
        model = _model_holding(module, blocks)
        apart = [(name, unit) for name, unit in remainder_units(module, blocks) if unit is not model]
        # the blocks of the other lists (ConvNext's later stages), each in a region of its own name, and the units
        # inside the one around the blocks (its downsampling members): FSDP2 gathers each alone (Prediction.per_rank)
        others = [(name, block) for name, block in _blocks(module) if not any(block is b for b in blocks)]
        apart += inner_units(module, [block for _, block in _blocks(module)], model)
        stack.enter_context(points.watching(blocks, kept_from, unit, model, apart, others))
        if boundary is not None:
            stack.enter_context(_peaks_apart(boundary, close))
        for phase in PHASES:
            tracker.phase = phase
            tracker.reset_peak()
            first = {"forward": "before the blocks", "backward": "after the model" if model is not None else "after block -1"}
            points.restart(first.get(phase, phase))
            if phase == "forward":
                with plugin.forward_context(), _name_untraceable(module):
                    loss, _kept = _closure_loss(module.training_step(batch, 1))
            elif phase == "backward":
                for optimizer in optimizers:  # Lightning zeroes gradients after the forward, before backward
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                # the unit around the blocks reduce-scatters its gradients; under a partial offload too (session 37:
                # unmarked there, a trained embedding inside the backbone planned 14.4 % under on 2 gloo ranks)
                if model is not None:
                    points.mark(END_OF_BACKWARD)  # the loss alive, as Lightning's closure keeps it
                loss = None
            else:
                for optimizer in optimizers:
                    optimizer.step()
            close(phase if phase != "backward" or boundary is None else f"{phase} (offloaded blocks)")
    return phases, scopes, points.where, points.peaks, points.model_ran


def _model_holding(module: nn.Module, blocks: list[nn.Module]) -> Optional[nn.Module]:
    """The child of the LightningModule holding the blocks (a causal LM's ``model``; None: the blocks or their list
    are its children, or there are none): ``QuantizedFSDPStrategy``'s unit around the blocks."""
    if not blocks:
        return None
    return next((child for child in module.children()
                 if child is not blocks[0] and not isinstance(child, (nn.ModuleList, nn.ModuleDict))
                 and any(sub is blocks[0] for sub in child.modules())), None)


def remade_unit(candidate: Candidate) -> int:
    """The blocks of one unit of ``ActivationCheckpointing(regenerate=n)`` (``every * n``: one block keeping its input,
    the rest remaking theirs); 1 without remade inputs."""
    configured = candidate.configured[1] if candidate.configured is not None else ()
    return next((c.every * c.regenerate for c in configured if isinstance(c, ActivationCheckpointing) and c.regenerate > 1),
                1)


def _planning_plugin(candidate: Candidate) -> Precision:
    """The candidate's precision plugin, its quantized layers built by the mode's fake-tensor construction."""
    plugin = candidate.precision_plugin("cpu")
    if isinstance(plugin, QuantizedPrecision):
        plugin.mode = plugin.mode.for_fake_tensors()
    return plugin


def apply_candidate(
    module: pl.LightningModule, candidate: Candidate, plugin: Precision, device: str, batch: Any = None,
    offload_every: bool = False,
) -> list[torch.optim.Optimizer]:
    """The surgery a Trainer runs after ``configure_model`` (its probe step on ``batch`` included), then the
    optimizers it builds and transforms. ``offload_every``: an ``ActivationCheckpointing(offload=k)`` gives every
    checkpointed block the offload hooks (the trace sets how many offload per step: :func:`trace`)."""
    transforms: list[SurgeryCallback] = candidate.callbacks()
    for transform in transforms if offload_every else ():
        if isinstance(transform, ActivationCheckpointing):
            transform.offload_blocks = None
    run_surgery(module, plugin, transforms, batch=batch)
    module.train()
    return _optimizers(module, transforms, device)


def _optimizers(module: pl.LightningModule, transforms: list[SurgeryCallback], device: str) -> list[torch.optim.Optimizer]:
    """The optimizers ``configure_optimizers`` returns for the changed ``module``, transformed by ``transforms``."""
    optimizers, schedulers, monitor = _configure_optimizers(module.configure_optimizers())  # type: ignore[arg-type]  # Lightning's helper is typed narrower than the hook
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    # Outside the fake mode: bitsandbytes' 8-bit optimizers build their quantization maps from Python
    # floats when constructed. The maps are real (2 KiB, shared) and mix with fake states as they would
    # with real ones.
    with unset_fake_temporarily():
        optimizers = transform_optimizers(module, sorted(transforms, key=lambda t: int(t.stage)), optimizers, configs)
    if device == "cuda":
        # torch's optimizers default to their foreach implementation on CUDA (single-tensor on CPU,
        # where the trace runs): its temporaries (AdamW: one copy of the trained parameters) count.
        for optimizer in optimizers:
            for group in optimizer.param_groups:
                if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                    group["foreach"] = True
    return optimizers


@contextmanager
def _eager_transformers() -> Iterator[None]:
    """Make Hugging Face models take their eager code paths on fake tensors.

    transformers treats a fake tensor as "tracing" (``is_tracing``) and then materializes the causal mask
    and repeats the key/value heads instead of letting SDPA handle causality and GQA: B*H*T*T bytes per
    layer that the real eager run never allocates. During the planner's trace, fake tensors say nothing
    about tracing, so the model runs as it will in training (its mask checks read the real twins of the
    batch, :mod:`lightning_hbm.planner.realvalues`).
    """
    masking: Any = sys.modules.get("transformers.masking_utils")
    if masking is None or not hasattr(masking, "is_tracing") or not hasattr(masking, "find_packed_sequence_indices"):
        yield
        return
    originals = masking.is_tracing, masking.find_packed_sequence_indices
    masking.is_tracing = lambda tensor=None: originals[0](None)
    # Packed-sequence detection reads position ids; the planner assumes one sequence per row (which is
    # what the model's own position ids say when the batch holds none).
    masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking.is_tracing, masking.find_packed_sequence_indices = originals


def _loss_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    raise ValueError(
        f"training_step returned {type(output).__name__}; the planner traces automatic optimization and needs "
        "the loss tensor (or a dict with 'loss')."
    )


def _closure_loss(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The loss Lightning's automatic optimization backpropagates, and the detached copy it keeps for the step.

    Lightning's ``ClosureResult`` divides the loss by ``accumulate_grad_batches`` (a new tensor even for 1) and
    clones it detached; both live through backward. Two scalars, but they decided the peak phase of a step whose
    forward and backward peaks were otherwise equal to the byte (NanoGPT nf4-dq + LoRA, tests/test_planner.py).
    """
    loss = _loss_of(output) / 1
    return loss, loss.detach().clone()


__all__ = ["PHASES", "Template", "Trace", "UntraceableModule", "apply_candidate", "build_template", "trace"]
