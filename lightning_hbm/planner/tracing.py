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
"""

from __future__ import annotations

import itertools
import sys
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch import nn
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensorMode,
    UnsupportedOperatorException,
    unset_fake_temporarily,
)
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map_only, tree_unflatten

from lightning_hbm._compat import _configure_optimizers, _configure_schedulers_automatic_opt, _disable_current_modes
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations import ActivationCheckpointing, OffloadSavedTensors, host_footprint
from lightning_hbm.activations.checkpointing import check_offload_blocks
from lightning_hbm.activations.token_chunks import ChunkedForward
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.memory import CATEGORIES, LiveStorageTracker, owned_storages, parameter_bytes, parameter_count, scope_term_bytes
from lightning_hbm.memory.categories import buffer_tensors, classify_records, optimizer_state_tensors, parameter_tensors
from lightning_hbm.planner.building import (
    ModelLike,
    Template,
    _adopt_foreign_fakes,
    _build,
    _fake_like,
    _fake_mode,
    _forget_conversions,
    _quiet_logs,
    build_template,
)
from lightning_hbm.planner.candidates import Candidate, format_bytes
from lightning_hbm.planner.realvalues import RealValues
from lightning_hbm.precision import QuantizedPrecision
from lightning_hbm.record import checkpoint_plan
from lightning_hbm.running import RunningModules
from lightning_hbm.surgery import SurgeryCallback, run_surgery, transform_optimizers

PHASES = ("forward", "backward", "step")


@dataclass
class Decided:
    """What the structure-deciding forward on a probe batch found, kept to trace the same model at other lengths.

    That forward (:func:`_gradient_receivers`) costs as much as the traced step's own forward and decides the same at
    every length when it runs on the same probe batch (``max_context`` plans one model at a dozen lengths): which
    parameters the loss reaches, and each token-chunked layer's verdict (:class:`ChunkedForward`), both by name, per
    number of blocks kept. Reused, the plan is equal to the byte (``tests/planner/test_context.py``).
    """

    by_depth: dict[Optional[int], tuple[Optional[frozenset[str]], dict[str, Optional[str]]]] = field(default_factory=dict)
    #: the model set up at each depth (:class:`_Built`), stepped again at the next length
    built: dict[Optional[int], _Built] = field(default_factory=dict)

    def forget(self, keep_blocks: Optional[int]) -> None:
        """Decide again at ``keep_blocks`` (a module found untraceable there now runs for real)."""
        self.by_depth.pop(keep_blocks, None)
        self.built.pop(keep_blocks, None)

    def keep(self, module: nn.Module, keep_blocks: Optional[int], reached: Optional[set[int]]) -> None:
        names = None if reached is None else frozenset(n for n, p in module.named_parameters() if id(p) in reached)
        verdicts = {name: forward.fake_verdict for name, forward in _chunked_forwards(module)}
        self.by_depth[keep_blocks] = (names, verdicts)

    def restore(self, module: nn.Module, keep_blocks: Optional[int]) -> Optional[set[int]]:
        """Set the kept verdicts on ``module``'s chunked layers; the ids of the parameters the loss reaches."""
        names, verdicts = self.by_depth[keep_blocks]
        for name, forward in _chunked_forwards(module):
            forward.fake_verdict = verdicts.get(name)
        return None if names is None else {id(p) for n, p in module.named_parameters() if n in names}


def _chunked_forwards(module: nn.Module) -> Iterator[tuple[str, ChunkedForward]]:
    for name, layer in module.named_modules():
        forward = torch_compat.forward_override(layer)
        if isinstance(forward, ChunkedForward):
            yield name, forward


@dataclass
class Trace:
    """What one traced step held: per phase (forward, backward, step), the categories at that phase's peak."""

    phases: dict[str, dict[str, int]]
    trainable: int
    total: int
    depth: int  # number of repeated blocks of the full model (0: none found)
    kept: int  # blocks traced
    block_bytes: int = 0  # parameter bytes of the largest repeated block (what FSDP gathers at once)
    guessed: int = 0  # values read without a real twin (answered 0 / False)
    # per phase: each scope term's bytes at its peak (loss: what FusedLoss allocated; inside the categories)
    scopes: dict[str, dict[str, int]] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)  # module name -> why it ran on real zeros
    host: int = 0  # bytes ActivationCheckpointing(offload=True) moved to host memory (device="cuda"), pinned footprint
    # selections by a mask without values in the LightningModule's own code, planned at their largest: op -> what
    selections: dict[str, str] = field(default_factory=dict)
    host_sizes: tuple[int, ...] = ()  # bytes of each tensor in ``host`` before the pinned rounding, ascending
    offloaded: int = 0  # checkpointed blocks whose inputs went through the offload hooks
    # per phase: where its peak was reached, relative to the cut list of blocks (:class:`_PeakPoints`)
    where: dict[str, str] = field(default_factory=dict)
    regions: dict[str, dict[str, int]] = field(default_factory=dict)  # per phase: each region's peak bytes

    def peak_phase(self) -> str:
        return max(self.phases, key=lambda phase: sum(self.phases[phase].values()))

    def peak_categories(self) -> dict[str, int]:
        return self.phases[self.peak_phase()]

    def extrapolate(self, deeper: Trace, depth: int) -> Trace:
        """Extend linearly from ``self`` (k blocks) and ``deeper`` (k+1 blocks) to ``depth`` blocks."""
        return self.combine([(deeper, depth - self.kept)], depth)

    def combine(self, steps: Sequence[tuple[Trace, int]], depth: int) -> Trace:
        """``self`` plus, for each ``(other, n)`` of ``steps``, ``n`` times what ``other`` adds to it (one block more of
        its kind: a block that keeps its input, or one that offloads it), every figure line by line, at ``depth``."""

        def line(value: Callable[[Trace], int]) -> int:
            base = value(self)
            return max(0, base + sum(n * (value(other) - base) for other, n in steps))

        others = [other for other, _ in steps]
        phases: dict[str, dict[str, int]] = {
            phase: {c: line(_phase_value(phase, c)) for c in CATEGORIES}
            for phase in self.phases
            if all(phase in other.phases for other in others)
        }
        scopes = {phase: {name: line(_scope_value(phase, name)) for name in _scope_names(phase, [self, *others])}
                  for phase in phases}
        fallbacks: dict[str, str] = {}
        selections: dict[str, str] = {}
        for each in (self, *others):
            fallbacks.update(each.fallbacks)
            selections.update(each.selections)
        # the tensors one more block moved, once per block added
        sizes = Counter(self.host_sizes)
        for other, n in steps:
            sizes.update({size: count * n for size, count in (Counter(other.host_sizes) - Counter(self.host_sizes)).items()})
        return Trace(phases, line(_field("trainable")), line(_field("total")), depth, depth, self.block_bytes,
                     max(t.guessed for t in (self, *others)), scopes, fallbacks, line(_field("host")), selections,
                     tuple(sorted(sizes.elements())), line(_field("offloaded")))

    def peaks_apart(self, deeper: Trace, depth: int) -> list[str]:
        """Why the line from ``self`` (k blocks) and ``deeper`` (k+1) to ``depth`` blocks is not the model's, per phase
        (empty: it holds): the two peak at points that do not correspond (one before the blocks, the other after the
        last), or another region of the step, extended to ``depth`` as the peak is, holds more than the peak's.

        A line through two peaks extends one point of the step only when both are that point and stay the largest: a
        peak that moves is the max of two lines, under its real value beyond the cut (session 20: 11.16 GiB planned by
        the line, 6.17 the model's). Regions: :class:`_PeakPoints`; those of one cut only are not compared."""
        return self.lines_apart([(deeper, depth - self.kept)], depth)

    def lines_apart(self, steps: Sequence[tuple[Trace, int]], depth: int, offloading: bool = False) -> list[str]:
        """:meth:`peaks_apart` for the combination :meth:`combine` draws (``self`` plus ``n`` times what each ``other``
        adds): every trace must peak, phase by phase, in the same region, and no region of all of them, combined as the
        peak is, may hold more at ``depth`` than the peak's. ``offloading``: name each trace with its offloading blocks
        (a partial offload's traces have the same lengths)."""

        def name(trace: Trace, first: bool) -> str:
            return f"{trace.kept}{' blocks' if first else ''}{f' ({trace.offloaded} offloading)' if offloading else ''}"

        traces = [self, *(other for other, _ in steps)]
        apart = []
        for phase, point in self.where.items():
            moved = [f"{other.where[phase]} with {name(other, False)}" for other in traces[1:]
                     if other.where.get(phase, point) != point]
            if moved:
                apart.append(f"{phase}: {point} with {name(self, True)}, {', '.join(moved)}")
                continue
            regions = [trace.regions.get(phase, {}) for trace in traces]
            mine = regions[0]
            lines = {r: mine[r] + sum(n * (theirs[r] - mine[r]) for theirs, (_, n) in zip(regions[1:], steps))
                     for r in mine if all(r in theirs for theirs in regions[1:])}
            over = max(lines, key=lambda r: lines[r], default=point)
            if point in lines and lines[over] > lines[point]:
                cuts = [name(trace, False) for trace in traces]
                apart.append(f"{phase}: {point} with {', '.join(cuts[:-1])} and {cuts[-1]} blocks, but {over} extended to "
                             f"{depth} blocks holds {format_bytes(lines[over])} against {format_bytes(lines[point])}")
        return apart

    def peak_scopes(self) -> dict[str, int]:
        """Each scope term's bytes at the peak phase (the registry's scope terms, :func:`~lightning_hbm.memory.terms.scope_terms`)."""
        return dict(self.scopes.get(self.peak_phase(), {}))


def _phase_value(phase: str, category: str) -> Callable[[Trace], int]:
    return lambda trace: trace.phases[phase][category]


def _scope_value(phase: str, name: str) -> Callable[[Trace], int]:
    return lambda trace: trace.scopes.get(phase, {}).get(name, 0)


def _scope_names(phase: str, traces: Sequence[Trace]) -> dict[str, None]:
    return {name: None for trace in traces for name in trace.scopes.get(phase, {})}


def _field(name: str) -> Callable[[Trace], int]:
    return lambda trace: int(getattr(trace, name))


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
    (:func:`_run_for_real`), named in :attr:`Trace.fallbacks`. ``probe_batch``: a shorter batch of the same
    structure for the forwards that decide structure only (the surgery's probe step, which parameters the loss
    reaches): at a long sequence they cost as much as the traced step and decide the same (``max_context``).
    """
    tracker = LiveStorageTracker(track_peak=True)
    built = decided.built.get(keep_blocks) if decided is not None else None
    with ExitStack() as stack:
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # self.log without a Trainer, peft/bnb notices: noise during a dry run
        stack.enter_context(_quiet_logs())  # the callbacks' "applied to N blocks" lines, once per trace
        stack.enter_context(torch.random.fork_rng(devices=[]))  # twins draw random numbers: not the user's
        if built is None:
            built = _set_up(stack, model, candidate, device, keep_blocks, real_types, batch, probe_batch, decided)
        else:  # the same model at another length: only the batch is new (what the last step left is a step's state)
            fake_batch = torch_compat.map_tensors(lambda t: _fake_like(t, built.fake_mode, built.values), batch)
            built.enter(stack)
            built.fake_batch = built.plugin.convert_input(fake_batch)
            built.reached = cast(Decided, decided).restore(built.module, keep_blocks)
        module, optimizers, values = built.module, built.optimizers, built.values
        values.guessed, values.selections = list(built.guessed), dict(built.selections)
        stack.enter_context(tracker)
        tracker.phase = "setup"
        tracker.seed(itertools.chain(parameter_tensors(module), buffer_tensors(module), torch_compat.tensor_leaves(built.fake_batch)), "setup")
        _first_step_state(optimizers, built.reached)
        # states created outside the dispatch (e.g. bitsandbytes' real quantization maps)
        tracker.seed(optimizer_state_tensors(optimizers), "setup")
        for hooks in built.offloads:
            hooks.reset_counts()
        offloaded, boundary = _offload_first(module, offload)
        phases, scopes, where, regions = _steady_step(module, built.fake_batch, built.plugin, optimizers, tracker, boundary,
                                                      remade_unit(candidate))
        built.fake_batch = None  # the next length's batch is new: this one need not stay alive
        host = sum(hooks.host_bytes for hooks in built.offloads)
        host_sizes = tuple(sorted(size for hooks in built.offloads for size in cast(_HostOffload, hooks).sizes))
        trainable = parameter_count(module, trainable=True)
        total = parameter_count(module)
        block_bytes = max((parameter_bytes(block) for _, block in _blocks(module)), default=0)
    depth, fallbacks = built.depth, built.fallbacks
    kept = min(depth, keep_blocks) if keep_blocks is not None else depth
    guessed = len(values.guessed) + (len(model.values.guessed) if isinstance(model, Template) else 0)  # + the build's
    return Trace(phases, trainable, total, depth, kept, block_bytes, guessed, scopes, fallbacks, host, values.selections,
                 host_sizes, offloaded, where, regions)


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
    guessed: list[str] = field(default_factory=list)  # what the setup read without values (each step adds its own)
    selections: dict[str, str] = field(default_factory=dict)

    def enter(self, stack: ExitStack) -> None:
        """Enter the modes a step of this model runs under."""
        stack.enter_context(_eager_transformers())  # after the build: the model's import brings transformers in
        stack.enter_context(self.fake_mode)
        stack.enter_context(self.values)
        stack.enter_context(torch_compat.FakeGroupedMM())  # transformers' MoE experts in float32
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
    with _blocks_cut(model.module, keep_blocks) if isinstance(model, Template) else nullcontext(0) as depth:
        module = _build(model, fake_mode, values)
    fake_batch = torch_compat.map_tensors(lambda t: _fake_like(t, fake_mode, values), batch)
    fake_probe = fake_batch if probe_batch is None else torch_compat.map_tensors(
        lambda t: _fake_like(t, fake_mode, values), probe_batch)
    built = _Built(module, plugin, fake_mode, values, [], [], depth, fallbacks, None, fake_batch)
    built.enter(stack)
    with plugin.tensor_init_context():
        module.configure_model()
    _adopt_foreign_fakes(module, fake_mode)
    _forget_conversions(fake_mode)
    built.depth = max(depth, _cut_blocks(module, keep_blocks))  # blocks built lazily exist only now
    for name, submodule in list(module.named_modules()):
        if type(submodule).__name__ in (real_types or {}):
            _run_for_real(submodule, fallbacks, cast(dict[str, str], real_types)[type(submodule).__name__], name)
    built.optimizers = apply_candidate(module, candidate, plugin, device, batch=fake_probe, offload_every=True)
    built.offloads = _offload_to_host(module) if device == "cuda" else []
    built.fake_batch = plugin.convert_input(fake_batch)
    fake_probe = built.fake_batch if probe_batch is None else plugin.convert_input(fake_probe)
    if decided is not None and keep_blocks in decided.by_depth:
        built.reached = decided.restore(module, keep_blocks)
    else:
        built.reached = _gradient_receivers(module, fake_probe, plugin)  # before the tracker: its storages are gone after
        if decided is not None:
            decided.keep(module, keep_blocks, built.reached)
    built.guessed, built.selections = list(values.guessed), dict(values.selections)
    if decided is not None:
        decided.built[keep_blocks] = built
    return built


def _part_of(submodule: nn.Module, model: nn.Module) -> bool:
    """Whether ``submodule`` is one of ``model``'s modules (asked only when a selection has no values: rare)."""
    return any(m is submodule for m in model.modules())


class _HostOffload(OffloadSavedTensors):
    """``OffloadSavedTensors`` planned for a CUDA device: the host copies are fake tensors on the meta device, which
    the tracker does not count as device memory; their host bytes are what the run's pinned pieces take (:func:`host_footprint`). Everything the
    hooks keep on the device (the tensor in flight, the restored and prefetched inputs) is traced as it runs."""

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")

    def __init__(self, device: Union[str, torch.device]) -> None:
        super().__init__(device)
        self.sizes: list[int] = []  # bytes of each tensor moved, before the pinned rounding (max_context's host fit)

    def reset_counts(self) -> None:
        super().reset_counts()
        self.sizes = []

    def _footprint(self, tensor: torch.Tensor) -> int:
        self.sizes.append(tensor.numel() * tensor.element_size())
        return host_footprint(tensor)


def _offload_to_host(module: nn.Module) -> list[OffloadSavedTensors]:
    """Replace the offload hooks of every checkpointed block whose target is host memory by :class:`_HostOffload`
    (one per original hooks object, shared as the original was); returns them."""
    replaced: dict[int, OffloadSavedTensors] = {}
    for block in module.modules():
        plan = getattr(torch_compat.forward_override(block), "plan", None)
        offload = getattr(plan, "offload", None)
        if isinstance(offload, OffloadSavedTensors) and offload.device.type == "cpu":
            if id(offload) not in replaced:
                replaced[id(offload)] = _HostOffload(offload.device)
            plan.offload = replaced[id(offload)]  # type: ignore[union-attr]  # a _BlockPlan, found by its offload
    return list(replaced.values())


def _offload_first(module: nn.Module, count: Optional[int]) -> tuple[int, Optional[tuple[nn.Module, nn.Module]]]:
    """Make the first ``count`` checkpointed blocks with offload hooks offload their inputs, the rest keep them (None:
    every one). Returns how many offload, and (the last that offloads, the first that keeps) when both kinds run.
    Raises ``ValueError`` (the callback's own) for more than there are."""
    blocks = [(block, plan) for block in module.modules() for plan in [checkpoint_plan(block)]
              if plan is not None and getattr(plan, "offload", None) is not None]
    check_offload_blocks(count, len(blocks))
    moved = len(blocks) if count is None else count
    for index, (_, plan) in enumerate(blocks):
        plan.moves = index < moved
    return moved, (blocks[moved - 1][0], blocks[moved][0]) if 0 < moved < len(blocks) else None


def _gradient_receivers(module: pl.LightningModule, batch: Any, plugin: Precision) -> Optional[set[int]]:
    """``id``s of the parameters the traced step's loss reaches (they get a gradient), from one forward's graph.

    A trainable parameter the loss never reaches (LLaVA's last vision layer and its adapters under
    ``vision_feature_layer=-2``) gets no gradient, and an optimizer keeps no state for it: counting one for every
    trainable parameter overshot LLaVA's peak by 8 %. ``None`` (count every trainable parameter) when a reentrant
    checkpoint hides the parameters of its blocks from the graph (they do get gradients).
    """
    with plugin.forward_context(), _name_untraceable(module):
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
            return None
        variable = getattr(node, "variable", None)  # an AccumulateGrad node: the leaf it fills
        if variable is not None:
            found.add(id(variable))
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return found


def _first_step_state(optimizers: list[torch.optim.Optimizer], reached: Optional[set[int]] = None) -> None:
    """The state a first step leaves behind, without tracing its backward: a gradient for every trained parameter
    the loss reaches (``reached``: ids, see :func:`_gradient_receivers`; ``None``: every one), and the optimizer
    states a step with those gradients creates."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and (reached is None or id(param) in reached):
                    param.grad = torch.zeros_like(param)
        optimizer.step()


def _steady_step(
    module: pl.LightningModule, batch: Any, plugin: Precision, optimizers: list, tracker: LiveStorageTracker,
    boundary: Optional[tuple[nn.Module, nn.Module]] = None, unit: int = 1,
) -> tuple[dict[str, dict[str, int]], dict[str, dict[str, int]], dict[str, str], dict[str, dict[str, int]]]:
    """Forward, zero_grad, backward, optimizer step, as Lightning runs them; each phase's peak by category, each
    scope term at it (:func:`~lightning_hbm.memory.scope_term_bytes`; ``loss``: what ``FusedLoss`` allocated), and
    where it was reached with each region's peak (:class:`_PeakPoints`).

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
        blocks = _cut_list(module)
        kept_from = next((i for i, block in enumerate(blocks) if boundary is not None and block is boundary[1]), None)
        stack.enter_context(points.watching(blocks, kept_from, unit))
        if boundary is not None:
            stack.enter_context(_peaks_apart(boundary, close))
        for phase in PHASES:
            tracker.phase = phase
            tracker.reset_peak()
            points.restart({"forward": "before the blocks", "backward": "after block -1"}.get(phase, phase))
            if phase == "forward":
                with plugin.forward_context(), _name_untraceable(module):
                    loss, _kept = _closure_loss(module.training_step(batch, 1))
            elif phase == "backward":
                for optimizer in optimizers:  # Lightning zeroes gradients after the forward, before backward
                    optimizer.zero_grad(set_to_none=True)
                loss.backward()
                loss = None
            else:
                for optimizer in optimizers:
                    optimizer.step()
            close(phase if phase != "backward" or boundary is None else f"{phase} (offloaded blocks)")
    return phases, scopes, points.where, points.peaks


def remade_unit(candidate: Candidate) -> int:
    """The blocks of one unit of ``ActivationCheckpointing(regenerate=n)`` (``every * n``: one block keeping its input,
    the rest remaking theirs); 1 without remade inputs."""
    configured = candidate.configured[1] if candidate.configured is not None else ()
    return next((c.every * c.regenerate for c in configured if isinstance(c, ActivationCheckpointing) and c.regenerate > 1),
                1)


def _cut_list(module: nn.Module) -> list[nn.Module]:
    """The blocks of the list the planner cuts (:func:`_block_list`), as the traced model holds them."""
    parent, _ = _block_list(module)
    return [block for name, block in _blocks(module) if name.rpartition(".")[0] == parent]


class _PeakPoints:
    """Where each phase's peak is reached, relative to the list of blocks the planner cuts, and the peak of each
    region of the step (decided by running: the tracker's peak is read and restarted at each region's end).

    Regions: ``before the blocks``, ``block i`` (its forward; in the backward, from its output's gradient on),
    ``after block i`` (the forward between it and the next block, or the head and loss after the last), each block
    named from the start below :data:`_ALIKE_FROM` and from the end from there on (``block -1``: the last kept), so
    that a region of a cut to 3 blocks is one of a cut to 4 (:meth:`Trace.peaks_apart`). The optimizer step is one
    region. A phase's peak is its regions' largest (the first reached on a tie, as one peak over the phase had it)."""

    def __init__(self, tracker: LiveStorageTracker) -> None:
        self.tracker = tracker
        self.where: dict[str, str] = {}  # per closed phase: the region of its peak
        self.peaks: dict[str, dict[str, int]] = {}  # per closed phase: each region's peak bytes
        self.region = ""
        self.restart()

    def restart(self, region: Optional[str] = None) -> None:
        """A new phase starts here (``tracker.reset_peak`` ran), in ``region`` (None: the current one)."""
        self.region = self.region if region is None else region
        self.regions: dict[str, int] = {}
        self.best, self.found, self.records = -1, self.region, self.tracker.peak_records

    def mark(self, region: str) -> None:
        """The current region ends (its peak kept, the phase's if larger), ``region`` starts."""
        tracker = self.tracker
        tracker.finish_peak()
        self.regions[self.region] = max(self.regions.get(self.region, 0), tracker.peak_bytes)
        if tracker.peak_bytes > self.best:  # the tracker rebinds its records at each peak: this dict stays as it is
            self.best, self.found, self.records = tracker.peak_bytes, self.region, tracker.peak_records
        tracker.reset_peak()
        self.region = region

    def close(self, name: str) -> dict:
        """The phase ``name`` ends: its peak's live records (the tracker's ``peak_records`` over the phase)."""
        self.mark(self.region)
        self.where[name], self.peaks[name] = self.found, self.regions
        return self.records

    @contextmanager
    def watching(self, blocks: Sequence[nn.Module], kept_from: Optional[int] = None, unit: int = 1) -> Iterator[None]:
        """Mark the regions as ``blocks`` run forward (hooks) and their outputs' gradients arrive (tensor hooks).

        ``kept_from``: under a partial offload, the index of the first block of the part that keeps its inputs; the
        blocks before it from :data:`_ALIKE_FROM` on are named from the end of the offloading part (``offloading -1``:
        the last), as the cuts that draw its line add blocks in the middle of each part (``Trace.combine``).

        ``unit`` > 1 (``ActivationCheckpointing(regenerate=n)``, the cuts in units of ``n`` blocks): each block is named
        by its place in its unit and the unit's number (``block 1 of unit -1``), the units below :data:`_ALIKE_FROM`
        from the start, the others from the end. Every unit then holds the same at the same place once nothing
        accumulates, and the phase's peak, the first reached on a tie, is in the same named region of each cut (by
        blocks, block 3 of a cut to 6 was ``-3``, of a cut to 8 ``-5``: the 8B plans were refused and traced whole)."""
        tracker, handles = self.tracker, []
        for index, block in enumerate(blocks):
            name = str(index) if index < _ALIKE_FROM else str(index - len(blocks))
            if kept_from is not None and _ALIKE_FROM <= index < kept_from:
                name = f"offloading {index - kept_from}"
            elif unit > 1:
                number = index // unit
                name = f"{index % unit} of unit {number if number < _ALIKE_FROM else number - -(-len(blocks) // unit)}"

            def enter(module: nn.Module, args: Any, name: str = name) -> None:
                if tracker.phase == "forward":  # not a checkpoint's recomputation in the backward
                    self.mark(f"block {name}")

            def leave(module: nn.Module, args: Any, output: Any, name: str = name) -> None:
                if tracker.phase != "forward":
                    return
                self.mark(f"after block {name}")
                out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
                if out is not None:
                    out.register_hook(lambda grad: self.mark(f"block {name}"))

            handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()


@contextmanager
def _peaks_apart(boundary: tuple[nn.Module, nn.Module], close: Callable[[str], None]) -> Iterator[None]:
    """Close the forward's first peak when the first block that keeps its input starts, and the backward's first
    peak when the gradient reaches the last block that offloads its input (a hook on its output)."""
    last, first = boundary

    def reached(module: nn.Module, args: Any, output: Any) -> None:
        grad_out = next((t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if grad_out is not None:
            grad_out.register_hook(lambda grad: close("backward"))

    handles = [first.register_forward_pre_hook(lambda module, args: close("forward (offloaded blocks)")),
               last.register_forward_hook(reached)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


#: What FakeTensorMode raises when an op needs values (or a kernel) a fake tensor does not have.
_FAKE_FAILURES = (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException)


class UntraceableModule(RuntimeError):
    """A submodule's forward cannot run on fake tensors; :attr:`module_name` names the innermost one.

    ``module_name`` ``"training_step"``: the LightningModule's own code (its ``training_step`` or ``forward``), which no
    fallback runs for real (that would be the whole model): :attr:`runs_for_real` is False.
    """

    def __init__(self, module_name: str, module_type: str, error: Exception) -> None:
        self.module_name, self.module_type = module_name, module_type
        self.runs_for_real = module_name != "training_step"
        where = f"the forward of {module_name} ({module_type})" if self.runs_for_real else f"{module_type}.training_step"
        super().__init__(
            f"{where} cannot run on fake tensors: {type(error).__name__}: {error}. "
            "Its Python reads values of a tensor too large for a real twin (more than "
            "lightning_hbm.planner.realvalues.MAX_TWIN_ELEMENTS elements) or calls an op with no fake kernel. Fix: "
            "write the branch without reading values (torch.where instead of `if tensor...:`, masks instead of "
            "nonzero/boolean indexing), or measure this configuration with a real step "
            "(lightning_hbm.planner.reference.memtracker_peak)."
        )


@contextmanager
def _name_untraceable(model: nn.Module) -> Iterator[None]:
    """Turn a fake-tensor failure inside a submodule's forward into :class:`UntraceableModule` naming it.

    Global forward hooks keep the stack of forwards in progress; a forward that raises never pops
    itself, so at the failure the top of the stack is the innermost module whose forward raised. Not
    :class:`lightning_hbm.running.RunningModules` on purpose: its leaving hook also runs when a forward raises,
    which would empty the stack before the failure is named.
    """
    names = {id(m): name for name, m in model.named_modules() if m is not model}
    stack: list[nn.Module] = []

    def push(module: nn.Module, args: Any) -> None:
        stack.append(module)

    def pop(module: nn.Module, args: Any, output: Any) -> None:
        while stack and stack.pop() is not module:
            pass  # entries left by an exception the model caught itself

    pre = nn.modules.module.register_module_forward_pre_hook(push)
    post = nn.modules.module.register_module_forward_hook(pop)
    try:
        yield
    except _FAKE_FAILURES as err:
        inner = next((m for m in reversed(stack) if id(m) in names), None)
        if inner is None:  # the LightningModule's own code: no module to run for real but the whole model
            raise UntraceableModule("training_step", type(model).__name__, err) from err
        raise UntraceableModule(names[id(inner)], type(inner).__name__, err) from err
    finally:
        pre.remove()
        post.remove()


class _RealRun(torch.autograd.Function):
    """A fake stand-in for a forward that ran for real: fake outputs of the real shapes, ``saved`` bytes held
    for backward (what the real run saved, as one fake buffer), zero gradients for every input."""

    @staticmethod
    def forward(ctx: Any, shapes: list, saved: int, *inputs: torch.Tensor) -> Any:
        ctx.save_for_backward(torch.empty(saved, dtype=torch.uint8))
        ctx.inputs = [(t.shape, t.dtype) for t in inputs]
        return tuple(torch.empty(shape, dtype=dtype) for shape, dtype in shapes)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        needed = ctx.needs_input_grad[2:]
        return (None, None, *(torch.zeros(s, dtype=d) if n else None for (s, d), n in zip(ctx.inputs, needed)))


#: Values besides tensors a forward that ran for real may return (they are the zeros' values, kept as they are).
_PLAIN_VALUES = (bool, int, float, str, type(None))


#: Most host memory the zeros of a module run for real may take (inputs and weights); beyond, the plan stops with the
#: fix instead: a submodule that is most of a large model (a VLM's language model) would take the model's size for real.
MAX_REAL_RUN_BYTES = 2 * 2**30


def _check_real_run(name: str, module: nn.Module, reason: str, tensors: tuple[torch.Tensor, ...]) -> None:
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes > MAX_REAL_RUN_BYTES:
        raise RuntimeError(
            f"the forward of {name} ({type(module).__name__}) cannot run on fake tensors ({reason}), and running it for "
            f"real on zeros would take {format_bytes(nbytes)} of host memory (inputs and weights; more than "
            f"lightning_hbm.planner.tracing.MAX_REAL_RUN_BYTES = {format_bytes(MAX_REAL_RUN_BYTES)}). Fix: write the "
            "branch without reading values (torch.where instead of `if tensor...:`, masks instead of nonzero/boolean "
            "indexing), or measure this configuration with a real step (lightning_hbm.planner.reference.memtracker_peak)."
        )


def _run_for_real(module: nn.Module, fallbacks: dict[str, str], reason: str, name: str) -> None:
    """Replace ``module``'s forward (in place) by a real run on zeros of the fake inputs' shapes, traced as
    :class:`_RealRun`; ``fallbacks[name]`` says so once it ran."""
    fake_forward = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        fakes = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        weights = dict(itertools.chain(module.named_parameters(), module.named_buffers()))
        _check_real_run(name, module, reason, (*fakes, *weights.values()))
        with _disable_current_modes(), torch.enable_grad():
            real = {id(t): torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad) for t in fakes}
            real_weights = {k: torch.zeros(t.shape, dtype=t.dtype).requires_grad_(t.requires_grad) for k, t in weights.items()}
            saved: dict[int, int] = {}

            # storages told apart by their data pointer (every one here is alive until the sum below): the id() of
            # ``untyped_storage()``, a new Python object at each call, could be reused by the next one, so the sum
            # depended on the heap and a checkpointed block's recompute could count other bytes than its forward
            # (torch's CheckpointError "different metadata", seen once in the full suite)
            def pack(t: torch.Tensor) -> torch.Tensor:
                saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            torch_compat.override_forward(module, fake_forward)  # the module's own forward, on real tensors
            try:
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    out = torch.func.functional_call(
                        module, real_weights, *tree_map_only(torch.Tensor, lambda t: real[id(t)], (args, kwargs))
                    )
            finally:
                torch_compat.override_forward(module, forward)
            # lists and dicts too: torchvision's RPN returns (a list of boxes per image, a dict of losses)
            leaves, spec = tree_flatten(out)
            other = next((t for t in leaves if not isinstance(t, (torch.Tensor, *_PLAIN_VALUES))), None)
            if other is not None:
                raise TypeError(f"{name} returns {type(out).__name__} holding {type(other).__name__}: the real-tensor "
                                "fallback handles tensors, numbers and strings in tuples, lists and dicts")
            outs = [t for t in leaves if isinstance(t, torch.Tensor)]
            # inputs, weights and outputs are in the trace already: only what the forward saved besides them
            known = {t.untyped_storage().data_ptr() for t in (*real.values(), *real_weights.values(), *outs)}
            saved_bytes = sum(n for key, n in saved.items() if key not in known)
            shapes = [(t.shape, t.dtype) for t in outs]
        result = iter(_RealRun.apply(shapes, saved_bytes, *fakes, *weights.values()))
        fallbacks[name] = reason
        return tree_unflatten([next(result) if isinstance(t, torch.Tensor) else t for t in leaves], spec)

    torch_compat.override_forward(module, forward)


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


def _blocks(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks as ``ActivationCheckpointing`` finds them (children of a ModuleList of one class)."""
    return find_blocks(module)


#: The planner cuts a list of blocks to 3 and to 4 (api.py): from the third block on (index 2, the last one a cut to 3
#: keeps) every block must be alike, else the cut model computes other shapes than the real one.
_ALIKE_FROM = 2


def _signature(block: nn.Module) -> tuple:
    """What makes two blocks alike for the cut: the module tree as printed (classes, widths, strides, kernels) and every
    parameter's and buffer's name, shape and dtype (Parameters a repr does not show)."""
    tensors = itertools.chain(block.named_parameters(), block.named_buffers())
    return repr(block), tuple((name, tuple(t.shape), t.dtype) for name, t in tensors)


def _block_list(module: nn.Module) -> tuple[str, int]:
    """(path, length) of the largest list of repeated blocks that can be cut and extended; ("", 0) when there is none.

    Only a list whose blocks are alike from index 2 on (:data:`_ALIKE_FROM`): cut to 3 or 4, the model still runs
    with the shapes of the full one (timm EfficientNet's stages change channel counts: cut after stage 3, its head
    got 16 channels instead of 80), and the line from 3 to 4 blocks is what each further block adds. A list of
    unlike blocks is traced whole.
    """
    lists: dict[str, list[nn.Module]] = {}
    for name, block in _blocks(module):
        lists.setdefault(name.rpartition(".")[0], []).append(block)
    alike = {path: len(items) for path, items in lists.items() if len({_signature(b) for b in items[_ALIKE_FROM:]}) <= 1}
    return max(alike.items(), key=lambda item: item[1]) if alike else ("", 0)


def _cut_blocks(module: nn.Module, keep: Optional[int]) -> int:
    """Cut the largest list of repeated blocks to ``keep`` (in place); returns its full length (0: none)."""
    parent, depth = _block_list(module)
    if keep is not None and depth > keep:
        del cast(nn.ModuleList, module.get_submodule(parent) if parent else module)[keep:]  # a ModuleList or Sequential
    return depth


@contextmanager
def _blocks_cut(module: nn.Module, keep: Optional[int]) -> Iterator[int]:
    """The largest list of repeated blocks cut to ``keep`` inside the context, restored after; yields its length."""
    parent, depth = _block_list(module)
    if keep is None or depth <= keep:
        yield depth
        return
    blocks = cast(nn.ModuleList, module.get_submodule(parent) if parent else module)  # a ModuleList or Sequential
    removed = list(blocks)[keep:]
    del blocks[keep:]
    try:
        yield depth
    finally:
        blocks.extend(removed)


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
