"""Who reads a layer's weight, decided by running the model: the probe forward, and the guard for paths it did not run.

A layer whose weight an enclosing module's code reads directly (``F.linear(x, self.qkv.weight)`` in torchvision's
Swin, ``x @ self.c.weight.T``) instead of calling the layer can be neither quantized (the reader would get the packed
integer weight) nor adapted (the adapter is never called). Reading the model's source cannot tell a read on the path
that trains from one on a path that never runs: Bloom reads ``self.dense.weight`` only under ``slow_but_exact``,
diffusers' ``Attention.fuse_projections`` (a utility never called in training) reads ``to_q.weight.data``, transformers'
Mamba reads ``x_proj.weight`` only in its CUDA kernel branch. So:

* :func:`observe` runs one step of the model as the user built it (the LightningModule's ``training_step`` on the
  first training batch, else ``forward``) under a ``__torch_function__`` mode and records every op that touches a
  layer's weight while that layer is not the one running. Fake tensors first (no arithmetic, nothing allocated, the
  model's values untouched), one real sample when the model's code needs values (``.item()``, data-dependent
  control flow). What it saw decides (:func:`observed_readers`).
* :func:`guard_unobserved` covers what it did not see: where the model's source reads a layer's weight (the scan of
  :func:`lightning_hbm.layers.base.source_readers`, now only a hint) but the probe did not, and the layer was then
  quantized or adapted, the reading module gets a guard that raises a clear error naming the module and the fix if
  that path ever runs. Never wrong numbers from a packed weight.

A plain ``nn.Linear`` whose weight the probe saw only read (``F.linear``, a matmul, any op that does not write to it)
is no reader's problem once quantized: it is stored as a :class:`~lightning_hbm.layers.read_weight.ReadableLinear`,
whose weight computes from its storage (and runs its LoRA adapter), so it is quantized and adapted like any other
layer (:func:`observed_readers` leaves it out). Where that cannot work is said in that module.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, Callable, Iterator, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # as planner/building.py: no public home
from torch.nn.parameter import is_lazy
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map_only

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._compat.torch import preserved_rngs  # re-exported: its home before the probe batches used it too
from lightning_hbm.layers import read_weight
from lightning_hbm.layers.fake_leftovers import dropping_fake_leftovers, holds_tensor
from lightning_hbm.memory.storage import quantized_format
from lightning_hbm.probe import quiet_logging
from lightning_hbm.running import RunningModules

# Reading these of a weight is harmless once the layer is quantized or adapted; "metadata" reads no value either: the
# guard answers it for a packed quantized weight as the layer computes (see_as), and it is harmless for an adapter
# (peft's layer shows its base's weight); anything else is a use.
# Introspection (memory trackers, hooks, printing) counts as harmless too: it computes nothing with the values.
HARMLESS = frozenset({
    "device", "requires_grad", "is_cuda", "is_meta", "is_sparse", "layout", "grad", "is_leaf", "names", "__hash__",
    "untyped_storage", "_typed_storage", "data_ptr", "storage_offset", "is_contiguous", "_base", "_is_view", "grad_fn",
    "_version", "is_nested", "is_quantized", "is_mkldnn", "__repr__", "__format__", "_cdata", "register_hook",
    "register_post_accumulate_grad_hook", "_backward_hooks", "_post_accumulate_grad_hooks",
})
METADATA = frozenset({"dtype", "shape", "size", "ndim", "dim", "numel", "element_size", "nbytes", "itemsize", "is_floating_point", "is_complex", "stride", "__len__"})
# Modules of these libraries read the layers they made themselves (peft's LoRA layers, bitsandbytes' kernels), or
# are converted before quantization (torch's nn.MultiheadAttention reads out_proj.weight: prepare_model)
KNOWN = ("torch.", "peft.", "bitsandbytes.", "lightning_hbm.", "lightning.", "transformers.modeling_utils")


@dataclass(frozen=True)
class Read:
    """One layer's weight read outside the layer on the probe step."""

    reader: str  # "Class.method" of the innermost module that ran it: BloomAttention.forward, Wrapped.training_step
    op: str  # what touched the weight: linear, matmul, data, ...
    metadata: bool  # only dtype/shape-like reads


@dataclass
class Observation:
    """What :func:`observe` saw: ``reads`` by layer name; ``ran``: how the step ran (for messages)."""

    reads: dict[str, Read] = field(default_factory=dict)
    ran: str = ""
    # layers among ``reads`` whose weight, stored quantized, computes for these reads (read_weight.ReadableLinear)
    served: frozenset[str] = frozenset()
    # layers the step never ran (:func:`unrun_layers`), and the stage's method it ran (``training_step`` for fit)
    unrun: frozenset[str] = frozenset()
    step: str = "training_step"
    told: bool = False  # the unrun layers said (once per model: a later stage's surgery does not say them again)


# held here, not stamped on the user's modules: what the probe saw, and the models whose guards are installed
_OBSERVED: "weakref.WeakKeyDictionary[nn.Module, Observation]" = weakref.WeakKeyDictionary()
_GUARDED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()


def observed_readers(module: nn.Module, uses_only: bool = False) -> Optional[dict[str, str]]:
    """``{layer name: "Class.method"}`` the probe saw reading the layer's weight, or ``None`` if ``module`` was never
    observed. ``uses_only``: leave out metadata reads (``.dtype``/``.shape``: harmless for an adapter).

    Reads a quantized layer serves (``Observation.served``) do not keep it out: left out once it serves them (it is a
    ``ReadableLinear``), and, while the model is being changed, from the quantization's question (not ``uses_only``).
    For an adapter (``uses_only``), and once the surgery is done, a layer still as built is read without its adapter:
    LoRA alone leaves it out, and the coverage table names the read."""
    seen = _OBSERVED.get(module)
    if seen is None:
        return None
    return {
        name: read.reader for name, read in seen.reads.items()
        if not (uses_only and read.metadata) and not _served_now(module, seen, name, uses_only)
    }


def _served_now(module: nn.Module, seen: Observation, name: str, uses_only: bool) -> bool:
    if name not in seen.served:
        return False
    try:
        layer = module.get_submodule(name)
    except AttributeError:
        return False
    if isinstance(getattr(layer, "base_layer", layer), read_weight.ReadableLinear):
        return True
    return not uses_only and module not in _GUARDED  # the quantization will store it so (guarded: the surgery is done)


def observation(module: nn.Module) -> Optional[Observation]:
    return _OBSERVED.get(module)


def _descriptor_name(func: Any) -> str:
    # Tensor properties (.shape, .data, .T) reach __torch_function__ as their descriptor's __get__
    name = getattr(func, "__name__", str(func))
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _weights_in(args: tuple, kwargs: dict, watched: dict[int, Any]) -> Iterator[Any]:
    # one level into lists/tuples is enough (torch.cat([q.weight, k.weight]), F.linear(x, w, b)); a full pytree
    # flatten of every op's arguments would cost more than the guard should
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor):
            if id(arg) in watched:
                yield watched[id(arg)]
        elif isinstance(arg, (list, tuple)):
            for item in arg:
                if isinstance(item, torch.Tensor) and id(item) in watched:
                    yield watched[id(item)]


class _Watch:
    """The layers whose weights are followed, and which modules are running (forward hooks, removed afterwards)."""

    def __init__(self, module: nn.Module, layers: dict[str, nn.Module]) -> None:
        self.root = module
        self.running = RunningModules(module)  # entered around each attempt of the step
        holders: dict[int, set[int]] = {}  # a tied weight is its own in every module that holds it
        for sub in module.modules():
            for param in sub.parameters(recurse=False):
                holders.setdefault(id(param), set()).add(id(sub))
        self.weights: dict[int, tuple[str, set[int]]] = {}
        # held while watched: a weight computed at each read (a weight_norm's, a parametrization's) is a temporary,
        # and a freed tensor's id is reused by the next one made (was: HuBERT's pos_conv_embed.conv, now and then,
        # "read directly by HubertFeatureEncoder.forward" when one of its tensors got that id, and left unquantized)
        self.alive: list[torch.Tensor] = []
        # each watched layer and its parent module by name (the root under ""): whose forward the step calls
        self.calls: dict[str, nn.Module] = dict(layers)
        for name in layers:
            parent = name.rpartition(".")[0]
            with suppress(AttributeError):  # a name get_submodule cannot follow: its parent not watched
                self.calls.setdefault(parent, module.get_submodule(parent))
        for name, layer in layers.items():
            weight = getattr(layer, "weight", None)
            if isinstance(weight, torch.Tensor):
                self.alive.append(weight)
                self.weights[id(weight)] = (name, holders.get(id(weight), {id(layer)}) | {id(layer)})

    def follow(self, alias: torch.Tensor, weight: torch.Tensor) -> None:
        """Follow ``alias`` (``weight.data``, ``weight.detach()``) as the weight itself: what is done to it is done to the weight."""
        self.alive.append(alias)
        self.weights[id(alias)] = self.weights[id(weight)]

    def reader(self, holders: set[int], step: str) -> Optional[str]:
        """The module reading a weight outside its holders, or ``None`` (a holder is running, or a known library)."""
        stack = self.running.stack
        if any(id(m) in holders for m in stack):
            return None
        inner = stack[-1] if stack else self.root
        if type(inner).__module__.startswith(KNOWN) and inner is not self.root:
            return None
        return f"{type(inner).__qualname__}.{'forward' if stack else step}"


class _Recorder(TorchFunctionMode):
    def __init__(self, watch: _Watch, step: str) -> None:
        super().__init__()
        self.watch, self.step = watch, step
        self.reads: dict[str, Read] = {}
        self.ops: dict[str, set[str]] = {}  # every op each read layer's weight went through
        self.called: set[str] = set()  # the watched layers and their parents whose forward this attempt called

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = _descriptor_name(func)
        if op not in HARMLESS:
            for name, holders in _weights_in(args, kwargs, self.watch.weights):
                reader = self.watch.reader(holders, self.step)
                if reader is not None and op in METADATA and _in_dtype_lookup():
                    continue
                if reader is not None:
                    self.ops.setdefault(name, set()).add(op)
                    earlier = self.reads.get(name)
                    if earlier is None or earlier.metadata and op not in METADATA:  # a real use wins
                        self.reads[name] = Read(reader, op, op in METADATA)
        result = func(*args, **kwargs)
        if op in _ALIASES and isinstance(result, torch.Tensor) and args and id(args[0]) in self.watch.weights:
            self.watch.follow(result, args[0])
        return result


#: ops whose result shares the weight's storage with no autograd link: a write to it is a write to the weight (Gemma
#: 3n's ``self.prediction_coefs.weight.data.clamp_(...)`` in training; was served as a computed weight, then the
#: first step stopped on "clamp_ would write to a weight stored quantized")
_ALIASES = frozenset({"data", "detach"})


def _in_dtype_lookup() -> bool:
    """Is transformers' ``PreTrainedModel.dtype`` the caller? It returns the dtype of the first parameter for which
    ``is_floating_point()`` is true: a packed quantized weight answers False and is skipped, so it is no read of the
    weight (issue 53: a VLM's patch-embedding conv was kept for ``pixel_values.type(self.visual.dtype)``)."""
    frame: Optional[FrameType] = sys._getframe(2)
    for _ in range(6):  # the property, its generator expression, then the torch dispatch frames
        if frame is None:
            return False
        if frame.f_code.co_name in ("dtype", "<genexpr>") and frame.f_code.co_filename.endswith(("transformers/modeling_utils.py", "transformers\\modeling_utils.py")):
            return True
        frame = frame.f_back
    return False


# ----------------------------------------------------------------------------------- running one step


def _first_sample(batch: Any) -> Any:
    """One sample of the batch (the real-tensor probe's cost is one sample's forward, whatever the batch size)."""
    leaves = [t for t in _leaves(batch) if t.dim() > 0]
    rows = leaves[0].shape[0] if leaves else 0
    if rows <= 1 or any(t.shape[0] != rows for t in leaves):
        return batch  # no common batch dimension: as it is
    return tree_map_only(torch.Tensor, lambda t: t[:1] if t.dim() > 0 else t, batch)


def _leaves(batch: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    tree_map_only(torch.Tensor, found.append, batch)
    return found


def _step(module: nn.Module, batch: Any, step: str = "training_step") -> tuple[Callable[[], Any], str]:
    """The step the stage runs (``training_step`` for fit; ``validation_step``, ``test_step``, ``predict_step`` for
    the others: validate/predict never call the user's ``training_step``): the LightningModule's own when it has
    one, else ``forward``."""
    if isinstance(module, pl.LightningModule) and getattr(type(module), step, None) is not getattr(pl.LightningModule, step, None):
        method, index = getattr(module, step), lightning_compat.stage_step_index(module._trainer)  # dataloader_idx: s38 h8
        first = (batch, 0) if lightning_compat.takes_batch_idx(method) else (batch,)  # as Lightning's loops call it (s39)
        return (lambda: method(*first, *index)), step
    return (lambda: _call(module, batch)), "forward"


def _call(module: nn.Module, batch: Any) -> Any:
    # as probe_output calls a model (a tensor, an (inputs, targets) pair, keyword inputs), whatever it returns
    if isinstance(batch, torch.Tensor):
        return module(batch)
    if isinstance(batch, (tuple, list)):
        return module(batch[0])
    return module(**batch)


def _run(module: nn.Module, batch: Any, watch: _Watch, step_name: str = "training_step") -> tuple[_Recorder, str]:
    """Run the step under the recorder: fake tensors first, one real sample if the model's code needs values."""
    fake_already = any(_is_fake_or_meta(p) for p in module.parameters())
    attempts: list[tuple[str, Callable[[], Any]]] = []
    if fake_already:  # the planner's fake model: as it is
        attempts.append(("on the planner's fake tensors", lambda: dropping_fake_leftovers(module)))
    else:
        # buffers restored on fake tensors too: BatchNorm's num_batches_tracked.add_(1) reached the real buffer
        attempts.append(("on fake tensors", lambda: _fake_tensors(module)))
        attempts.append(("on one real sample", lambda: _real_values(module)))
        if _first_sample(batch) is not batch:  # a step that needs more than one sample (BatchNorm in training mode)
            attempts.append(("on the real batch", lambda: _real_values(module)))
    failure: Optional[BaseException] = None
    for how, context in attempts:
        sample = _first_sample(batch) if how == "on one real sample" else batch
        run, step = _step(module, sample, step_name)
        recorder = _Recorder(watch, step)
        try:
            with (
                preserved_rngs(), torch.no_grad(), quiet_logging(module), _counting_nothing(module), context(), watch.running,
                _calls(watch.calls, recorder.called), recorder,
            ):  # fmt: skip
                run()
        except Exception as err:  # noqa: BLE001 - any failure of the user's step: try the next way, then report
            failure = err  # leaving watch.running emptied its stack
            continue
        return recorder, f"{type(module).__qualname__}.{step} {how}"
    raise RuntimeError(f"{type(failure).__name__}: {failure}") from failure


@contextmanager
def _counting_nothing(module: nn.Module) -> Iterator[None]:
    # the user's torchmetrics metrics as they were: the probe's update was counted in the epoch's value (the first
    # batch twice), and on fake tensors left a fake state in the metric (session 32)
    restore = lightning_compat.logged_values(module)
    try:
        yield
    finally:
        restore()


@contextmanager
def _fake_tensors(module: nn.Module) -> Iterator[None]:
    # and nothing fake left cached in the model (BEiT's relative position index: fake gradients in the real fit)
    with dropping_fake_leftovers(module), _restoring_buffers(module), FakeTensorMode(allow_non_fake_inputs=True), torch_compat.FakeGroupedMM():
        yield


@contextmanager
def _real_values(module: nn.Module) -> Iterator[None]:
    # nothing cached either: a tensor the step keeps in a plain attribute (Mimi's codebook ``_embed``) was computed
    # in the dtype as built, and the cast to the compute dtype does not reach it (issue 53, session 33)
    with dropping_fake_leftovers(module, holds_tensor), _restoring_buffers(module):
        yield


def _is_fake_or_meta(tensor: torch.Tensor) -> bool:
    return tensor.is_meta or isinstance(tensor, FakeTensor)


@contextmanager
def _restoring_buffers(module: nn.Module) -> Iterator[None]:
    # training mode (the path that trains), but BatchNorm's running statistics must not move for the probe; and each
    # module's buffer slots as they were: a buffer the step creates (``self.mean = ...`` where None was registered, or
    # ``register_buffer`` on the first batch) or replaces (``self.steps = self.steps + 1``) was left in the model, a
    # FakeTensor after the fake-tensor attempt (session 30)
    slots = [(m, dict(m._buffers), set(m._non_persistent_buffers_set)) for m in module.modules()]
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        for owner, buffers, non_persistent in slots:
            owner._buffers.clear()
            owner._buffers.update(buffers)
            owner._non_persistent_buffers_set.clear()
            owner._non_persistent_buffers_set.update(non_persistent)
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


#: the batch a stage's step is probed on, named in the advice when it cannot run (session 38: a validate run was told
#: to fix its training_step)
_STAGE_BATCH = {"validation_step": "validation", "test_step": "test", "predict_step": "predict"}


def observe(module: nn.Module, batch: Any, layers: dict[str, nn.Module], step: str = "training_step") -> Optional[Observation]:
    """Run one step of ``module`` on ``batch`` and record who reads the weight of each of ``layers`` (by name).

    ``step``: the LightningModule method the stage runs (``training_step`` for fit, ``validation_step``, ...).
    Nothing of the model changes (its values, buffers, the global RNGs of Python, NumPy and torch). Returns ``None`` and warns if the step
    cannot run at all (the decision then falls back to the model's source, named in the warning), or if the model
    has lazy layers not built yet (their parameters would be built by the probe, fake on fake tensors: the model was
    left with a fake weight, every later forward failing; session 30).
    """
    lazy = [name for name, sub in module.named_modules() if any(map(is_lazy, [*sub.parameters(recurse=False), *sub.buffers(recurse=False)]))]
    if lazy:
        warnings.warn(
            f"lightning_hbm: {type(module).__qualname__} has lazy layers whose parameters are not built yet "
            f"({', '.join(lazy[:5])}{', ...' if len(lazy) > 5 else ''}): its step was not run before changing it, so which "
            "layers its code reads directly was read from its source code instead. Build them first: run one forward "
            "of the model on a batch before fit (torch's advice for lazy modules).",
            UserWarning,
            stacklevel=2,
        )
        return None
    watch = _Watch(module, layers)
    device = next((p.device for p in module.parameters()), torch.device("cpu"))
    if not any(_is_fake_or_meta(p) for p in module.parameters()):
        batch = tree_map_only(torch.Tensor, lambda t: t.to(device), batch)
    try:
        recorder, ran = _run(module, batch, watch, step)
    except RuntimeError as err:
        manual = isinstance(module, pl.LightningModule) and not module.automatic_optimization and step == "training_step"
        advice = (
            "Its training_step uses manual optimization, which needs the optimizers, and they do not exist before the "
            "model is changed: nothing to fix in your code."
            if manual
            else f"Make {step} (or forward) run on the first {_STAGE_BATCH.get(step, 'training')} batch."
        )
        warnings.warn(
            f"lightning_hbm: could not run one step of {type(module).__qualname__} before changing it ({err}), so which "
            "layers its code reads directly (and cannot be quantized or adapted) was read from its source code instead, "
            f"which also counts paths that never run. {advice}",
            UserWarning,
            stacklevel=2,
        )
        return None
    seen = Observation(recorder.reads, ran, _served(recorder, layers), unrun_layers(layers, recorder.called, recorder.reads), step)
    _OBSERVED[module] = seen
    return seen


@contextmanager
def _calls(modules: dict[str, nn.Module], called: set[str]) -> Iterator[None]:
    """Forward pre-hooks on ``modules`` (by name) while the step runs, adding to ``called`` the names of those called."""
    names: dict[int, list[str]] = {}
    for name, sub in modules.items():  # a module held under two names (shared) is called under both
        names.setdefault(id(sub), []).append(name)
    subs = {id(sub): sub for sub in modules.values()}
    handles = [sub.register_forward_pre_hook(lambda m, args: called.update(names[id(m)])) for sub in subs.values()]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def unrun_layers(layers: dict[str, nn.Module], called: set[str], reads: dict[str, Read]) -> frozenset[str]:
    """The ``layers`` the step never ran: neither called nor their weight used (a read of its dtype or shape only is
    no use), their parent module not called either, and no numbered sibling (the same name with another number:
    ``layers.1.x`` for ``layers.0.x``, ``experts.5.w1`` for ``experts.2.w1``, ``expert_3.wi`` for ``expert_0.wi``) run.

    A layer whose parent ran is on a branch of the parent's forward this batch did not take (transformers Longformer's
    ``query_global``; the first backward's adapter watch says it); a sibling run says the module is picked by the data
    (an expert no token of this batch was routed to, a layer LayerDrop dropped). What is left is a module the step's
    code does not call: Musicgen's decoder's cross-attention (``encoder_attn``) without encoder states, a head
    ``training_step`` does not use."""
    ran = called | {name for name, read in reads.items() if not read.metadata}
    siblings = {shape for name in ran for shape in _numbered(name)}
    return frozenset(
        name for name in layers
        if name not in ran and name.rpartition(".")[0] not in called and not siblings.intersection(_numbered(name))
    )  # fmt: skip


def _numbered(name: str) -> list[str]:
    """``name`` with each of its numbered parts, one at a time, numbered ``*`` (``a.*.b.3``, ``a.2.b.*`` for
    ``a.2.b.3``; ``experts.expert_*.wi`` for ``experts.expert_0.wi``: transformers SwitchTransformers' ``ModuleDict``)."""
    parts = name.split(".")
    return [".".join([*parts[:i], part.rstrip("0123456789") + "*", *parts[i + 1 :]]) for i, part in enumerate(parts) if part[-1:].isdigit()]


def adopt(module: nn.Module, seen: Observation, layers: dict[str, nn.Module]) -> None:
    """``seen``, what the probe step saw on a model set up as ``module`` is (the same classes, names, dtypes and shapes,
    the same ``layers`` by name, the same batch), as ``module``'s own: its served layers marked as :func:`observe` marks
    them. The planner's set-ups of one cut model for several candidates step it once."""
    for name in seen.served:
        read_weight.mark_served(layers[name], seen.reads[name].reader, name)
    _OBSERVED[module] = seen


def _served(recorder: _Recorder, layers: dict[str, nn.Module]) -> frozenset[str]:
    """The read layers whose weight, stored quantized, will compute for every read the probe saw (none writes to it,
    the layer is a plain ``nn.Linear``): marked for the formats' ``replace`` (``read_weight.readable``). A layer whose
    dtype or shape alone is read is left to what handles it today (T5's ``wo``, computed in fp32, shows an fp32
    weight; any other stays in the compute dtype, named)."""
    served = set()
    for name, read in recorder.reads.items():
        layer, ops = layers.get(name), recorder.ops.get(name, set())
        if layer is not None and not read.metadata and read_weight.servable(layer) and not any(read_weight.writes(op) for op in ops):
            read_weight.mark_served(layer, read.reader, name)
            served.add(name)
    return frozenset(served)


# ------------------------------------------------------------------------------ guarding unrun paths


class UnobservedRead(RuntimeError):
    """A module read a quantized or adapted layer's weight on a path the probe step did not run."""


class _Guard(TorchFunctionMode):
    def __init__(self, guarded: "GuardHook") -> None:
        super().__init__()
        self.guarded = guarded

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        op = _descriptor_name(func)
        if op in METADATA:  # .dtype, .shape, .size(): no value read; a quantized weight answers as the layer computes
            seen = self.guarded.seen_as.get(id(args[0])) if args and isinstance(args[0], torch.Tensor) else None
            return func(seen, *args[1:], **kwargs) if seen is not None and not self.guarded.inside else func(*args, **kwargs)
        if op not in HARMLESS and not self.guarded.inside:
            for name, quantized in _weights_in(args, kwargs, self.guarded.weights):
                self.guarded.refuse(name, op, quantized)
        return func(*args, **kwargs)


class GuardHook:
    """Forward hooks on a module whose source reads a changed layer's weight on a path the probe did not run."""

    def __init__(self, reader: str, ran: str) -> None:
        self.reader, self.ran = reader, ran
        # the weights themselves, not their ids: a copied model's hooks then follow the copy's weights; each with
        # what a metadata read of it answers (a quantized weight: see_as; None: as it is)
        self.tensors: list[tuple[torch.Tensor, str, Optional[torch.Tensor]]] = []
        self.weights: dict[int, tuple[str, bool]] = {}
        self.seen_as: dict[int, torch.Tensor] = {}
        self.inside = 0  # > 0 while one of the guarded layers itself runs (its own reads are its business)
        self._modes: list[_Guard] = []

    def enter(self, module: nn.Module, args: Any) -> None:
        self.weights = {id(tensor): (name, seen is not None) for tensor, name, seen in self.tensors}
        self.seen_as = {id(tensor): seen for tensor, _, seen in self.tensors if seen is not None}
        mode = _Guard(self)
        mode.__enter__()
        self._modes.append(mode)

    def exit(self, module: nn.Module, args: Any, output: Any) -> None:
        if self._modes:
            self._modes.pop().__exit__(None, None, None)

    def layer_in(self, module: nn.Module, args: Any) -> None:
        self.inside += 1

    def layer_out(self, module: nn.Module, args: Any, output: Any) -> None:
        self.inside -= 1

    def refuse(self, name: str, op: str, quantized: bool) -> None:
        # raised inside the mode's own __torch_function__: the forward hook (always_call) takes the mode off
        self.inside = 0
        state = "stored quantized" if quantized else "adapted by LoRA (its adapter would be skipped)"
        raise UnobservedRead(
            f"lightning_hbm: {self.reader} read the weight of {name!r} directly ({op}) on a path that the step run before "
            f"the model was changed ({self.ran}) did not take; {name!r} is {state}, so this path would compute with the "
            f"wrong weight. Keep it as built: QuantizedPrecision(ignore_modules=[{name!r}]) and/or "
            f"LoRA(exclude_modules=[{name!r}]), or make the run take the path the probe step took."
        )


def see_as(holder: nn.Module, weight: torch.Tensor) -> torch.Tensor:
    """What a metadata read (``.dtype``, ``.shape``, ``.size()``, ``.ndim``, ...) of ``weight``, stored quantized by
    ``holder`` (the mode's layer), answers under the guard: a storage-less meta tensor of the shape the layer
    multiplies as, in the dtype it computes in. Such a read is no use of the values, and the model's code asks it to
    cast its input (Switch Transformers: ``hidden_states.to(self.wo.weight.dtype)``, with a packed ``uint8`` weight
    otherwise); it was refused as an ``UnobservedRead`` in an expert the probe batch did not route to (issue 53)."""
    fmt = quantized_format(holder)
    shape = fmt.weight_shape(holder) if fmt is not None else weight.shape
    dtype = (fmt.compute_dtype(holder) if fmt is not None else None) or getattr(holder, "compute_dtype", None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        dtype = torch.get_default_dtype()  # computes in its input's dtype: the model's
    return torch.empty(shape, dtype=dtype, device="meta")


def guard_unobserved(
    module: nn.Module, hinted: list[tuple[str, str, str]], changed: dict[str, tuple[nn.Module, torch.Tensor, Optional[torch.Tensor]]]
) -> list[str]:
    """Guard each reader the source scan found but the probe did not see, for layers that were changed.

    Args:
        hinted: ``(reader module name, "Class.method", layer name)`` from the source scan.
        changed: ``{layer name: (the layer a parent calls, the weight a reader would get, what a metadata read of a
            quantized weight answers (:func:`see_as`); None: not quantized, only adapted)}`` for the layers now
            quantized or adapted. Whatever runs inside the layer a parent calls (peft's layer, its base layer, a
            quantized convolution dequantizing its storage) reads the weight as its own business. A metadata read
            (``.dtype``, ``.shape``) is never refused.
    Returns the guarded readers' names. First, each quantized layer serving its reads learns the LoRA layer around it
    (``read_weight.link_adapters``): a read of its weight then runs the adapter.
    """
    read_weight.link_adapters(module)
    seen = _OBSERVED.get(module)
    if seen is None or module in _GUARDED:
        return []
    _GUARDED.add(module)
    by_reader: dict[str, tuple[str, dict[str, tuple[nn.Module, torch.Tensor, Optional[torch.Tensor]]]]] = {}
    for reader_name, reader, layer_name in hinted:
        if layer_name in changed and layer_name not in seen.reads:
            by_reader.setdefault(reader_name, (reader, {}))[1][layer_name] = changed[layer_name]
    for reader_name, (reader, layers) in by_reader.items():
        hook = GuardHook(reader, seen.ran)
        for layer_name, (layer, weight, answer) in layers.items():
            hook.tensors.append((weight, layer_name, answer))
            layer.register_forward_pre_hook(hook.layer_in)
            layer.register_forward_hook(hook.layer_out, always_call=True)
        sub = module.get_submodule(reader_name) if reader_name else module
        sub.register_forward_pre_hook(hook.enter)
        sub.register_forward_hook(hook.exit, always_call=True)
    return sorted(by_reader)


__all__ = ["Observation", "Read", "UnobservedRead", "adopt", "guard_unobserved", "observation", "observe", "observed_readers", "preserved_rngs", "see_as"]
