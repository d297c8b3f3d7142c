"""Probe a model on one batch and compare its outputs: shared by ``QuantizationQuality`` and the precision plugin.

It sits below ``precision`` and ``callbacks`` (see ``tests/test_layering.py``) so that the quantization
choices (sensitivity plan, smoothing, GPTQ) and the callback that reports their cost measure with the
same code; those of one quantization are handed a :class:`Probe` (the model and its batch, built once) and run their
forwards through it. ``lightning_hbm.quality`` re-exports every name. The probe batch is drawn by :mod:`lightning_hbm.probe_batch`
(:func:`first_batch`, :func:`first_batches`, re-exported here); what a forward did (its module calls and its
data-dependent selections, recorded and followed) by :mod:`lightning_hbm.probe_record` (re-exported here).
"""

from __future__ import annotations

import ast
import dis
import inspect
import sys
import textwrap
import warnings
from collections import defaultdict
from collections.abc import Collection, Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from types import FrameType, ModuleType
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torchmetrics import CosineSimilarity, RelativeSquaredError

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.naming import under
from lightning_hbm.probe_batch import first_batch, first_batches, per_sample_images  # the first two public here too (drawn by probe_batch)
from lightning_hbm.probe_record import (  # public here too (recorded by probe_record)
    INDEXED,
    MASKING,
    POOLED,
    SELECTING,
    Call,
    Followed,
    Selection,
    agreeing_calls,
    call_values,
    diverging,
    following,
    recording_calls,
    recording_selections,
)

PREFIX = "quant/"


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a ``forward`` (a LightningModule need not: ``training_step`` may compute without one)."""
    return "forward" in vars(module) or type(module).forward not in (nn.Module.forward, pl.LightningModule.forward)


def check_forward(module: nn.Module, who: str) -> None:
    """``TypeError`` naming the fix when ``module`` has no ``forward`` for the probe batch to go through.

    Without this, the probe fails inside torch: ``_forward_unimplemented() got an unexpected keyword argument
    'input_ids'``, which names neither the module nor what to add.
    """
    if has_forward(module):
        return
    name = type(module).__name__
    raise TypeError(
        f"{who} runs a probe batch through {name}.forward (module(x), module(inputs) of an (inputs, targets) pair, or "
        f"module(**batch) of a dict), but {name} defines no forward (Lightning trains through training_step, which "
        f"may compute without one). Define {name}.forward returning the output tensor or an object with .logits, e.g. "
        f"`def forward(self, **batch): return self.model(**batch)` for a dict batch or `def forward(self, x): return "
        f"self.model(x)`."
    )


@contextmanager
def quiet_logging(module: nn.Module) -> Generator[None, None, None]:
    """``self.log``/``self.log_dict`` as no-ops while a probe runs the user's step (they need the fit loop's result
    collection, which does not exist yet at the surgery point): instance attributes, removed after; a user's own
    instance attribute of that name is put back as it was (issue 55).

    A manual-optimization module's step gets stand-ins for what needs the optimizers, which do not exist before the
    model is changed: ``self.optimizers()`` gives one optimizer whose ``zero_grad``/``step`` do nothing (``step`` runs
    its closure, as an optimizer does), ``manual_backward``, ``toggle_optimizer``, ``clip_gradients`` and the like do
    nothing, ``lr_schedulers()`` gives one scheduler whose ``step`` does nothing (``self.lr_schedulers().step()``, as
    Lightning documents manual optimization; ``None`` failed that step, session 37 h10). Its step ran three times and
    failed each time ("'list' object has no attribute 'zero_grad'"), the user's code seen three times more, and which
    layers it reads fell back to its source (session 37). Several optimizers (a GAN's ``opt_g, opt_d =
    self.optimizers()``) get as many stand-ins (:class:`_Several`, session 38)."""
    stand_ins: dict[str, Callable[..., Any]] = {name: _nothing for name in ("log", "log_dict") if callable(getattr(module, name, None))}
    if isinstance(module, pl.LightningModule) and not module.automatic_optimization:
        stand_ins.update(_stand_ins(module))
    missing = object()
    own = {name: module.__dict__.get(name, missing) for name in stand_ins}
    for name, stand_in in stand_ins.items():
        module.__dict__[name] = stand_in  # an instance attribute over the class's method
    try:
        with _lent_optimizers(module):
            yield
    finally:
        for name in stand_ins:
            if own[name] is missing:
                del module.__dict__[name]
            else:
                module.__dict__[name] = own[name]


@contextmanager
def _lent_optimizers(module: nn.Module) -> Generator[None, None, None]:
    """``self.trainer.optimizers`` as the stand-ins (:class:`_NoStep`) while a probe step runs, Lightning's own (empty
    list) put back after: it is empty before the model is changed, and a step reading ``self.trainer.optimizers[0]``
    (its lr, for logging) failed with IndexError, the step left un-probed (s38 h8)."""
    if not isinstance(module, pl.LightningModule):
        yield
        return
    lent = _lent(module)
    with lightning_compat.optimizers_lent(module, lambda: list(lent())):
        yield


#: a manual-optimization module's methods that need the fit loop's optimizers or schedulers: no-ops in a probe step
_MANUAL_HOOKS = ("manual_backward", "toggle_optimizer", "untoggle_optimizer", "clip_gradients")


def _nothing(*args: Any, **kwargs: Any) -> None:
    return None


class _NoStep:
    """The optimizer ``self.optimizers()`` gives in a probe step: nothing is stepped (``step`` runs its closure), no
    gradient is zeroed.

    What a step commonly reads is there (s38 h8: AttributeError, the step left un-probed): ``optimizer`` (Lightning's
    ``LightningOptimizer`` wraps one: itself) and one ``param_groups`` group, the module's trainable parameters with
    ``lr`` 0.0: the lr ``configure_optimizers`` sets is not knowable without calling it (the user's code, run once more:
    issue 55), and 0.0 is the lr of a step that changes nothing, which is what a probe step is. As a torch optimizer
    (s39 h5; were AttributeError or KeyError, the step left un-probed): ``state`` (empty, a ``defaultdict`` as torch's:
    ``opt.state[p].get(...)``), ``state_dict()`` in torch's layout, and the group's other keys (``momentum``,
    ``betas``, ``weight_decay``) as the defaults of the optimizer class ``configure_optimizers``' source builds
    (:func:`_optimizer_defaults`, read, never called). Not a ``torch.optim.Optimizer`` of its own: its ``step`` would
    run the user's global optimizer hooks (``register_optimizer_step_pre_hook``), a step the user sees; :func:`_like`
    makes it one of the class ``configure_optimizers`` builds without initialising that class, ``step`` this one's.
    ``groups``: its param groups (:func:`_optimizer_groups`), else one of ``params``."""

    def __init__(
        self, params: Sequence[Tensor] = (), defaults: Optional[Mapping[str, Any]] = None, groups: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        self.defaults: dict[str, Any] = dict(defaults or {"lr": 0.0})
        self.param_groups: list[dict[str, Any]] = []
        self.state: defaultdict[Tensor, dict[str, Any]] = defaultdict(dict)
        for group in groups or [{"params": list(params)}]:
            self.add_param_group(group)

    def add_param_group(self, param_group: Mapping[str, Any]) -> None:
        self.param_groups.append({**self.defaults, **param_group, "params": list(param_group["params"])})

    def __getattr__(self, name: str) -> Any:
        """What the optimizer's ``__init__`` would have set (SAM's ``base_optimizer``) is not there: said as such (was
        "'SAM' object has no attribute 'base_optimizer'", as if the user's optimizer lacked it; s40 h1)."""
        mine = [k for k in type(self).__mro__ if not k.__module__.startswith(("lightning_hbm.", "builtins"))]
        what = mine[0].__qualname__ if mine else "the optimizer"
        raise AttributeError(
            f"the probe step's stand-in for {what} has no attribute {name!r}: the probe step runs before the optimizers "
            f"are built, so what {what}.__init__ sets is not there (nor what Lightning's LightningOptimizer adds beyond "
            "optimizer, toggle_model, step, zero_grad)"
        )

    def toggle_model(self, sync_grad: bool = True) -> AbstractContextManager[None]:
        """As ``LightningOptimizer.toggle_model`` (Lightning's manual optimization with several optimizers): nothing."""
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """As torch's ``Optimizer.state_dict()``: no state, each group's keys with its parameters as indices."""
        groups, start = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": list(range(start, start + count))})
            start += count
        return {"state": {}, "param_groups": groups}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        return None

    @property
    def optimizer(self) -> "_NoStep":
        return self

    def zero_grad(self, *args: Any, **kwargs: Any) -> None:
        return None

    def step(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        return closure() if closure is not None else None


class _NoSchedule:
    """The scheduler ``self.lr_schedulers()`` gives in a probe step: ``step`` (with a metric or not) does nothing; what
    a step reads of a scheduler is there (s39 h5: ``optimizer``, ``last_epoch``, ``base_lrs``, ``state_dict()``)."""

    def __init__(self) -> None:
        self.optimizer = _NoStep()
        self.last_epoch, self.base_lrs = 0, [0.0]

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return [0.0]  # the stand-in optimizer's lr (see _NoStep)

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs), "_last_lr": self.get_last_lr()}

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        return None


class _Several:
    """What ``self.optimizers()`` (``self.lr_schedulers()``) gives in a probe step: one stand-in, that reads as the list
    of them Lightning gives for several too: ``opt_g, opt_d = self.optimizers()`` (a GAN; Lightning's documented
    manual optimization) gets as many as it unpacks (the unpacking's own count: :func:`_unpacked`), ``[i]`` one, and a
    loop or ``len`` as many as ``configure_optimizers`` returns (:func:`_configured`, read from its source).

    ``configure_optimizers`` is never called for the count: it is the user's code, run once more (issue 55: the probe
    step must change nothing the user sees), and it may read ``self.trainer.estimated_stepping_batches``, which loads
    the train dataloader (opened twice, another of issue 55's cases); the real optimizers are built after the change,
    on the parameters it leaves. Was: one stand-in, and a step unpacking two failed each of the probe's three attempts
    ("cannot unpack non-iterable"), said as "could not run one step", the layers it reads left to its source (s38)."""

    #: the ``index``-th of them
    one: Callable[[int], Any]

    def __init__(self, count: int) -> None:
        self.count = count

    def __iter__(self) -> Iterator[Any]:
        unpacked = _unpacked(sys._getframe(1))
        return iter([self.one(i) for i in range(self.count if unpacked is None else unpacked)])

    def __getitem__(self, index: int) -> Any:
        return self.one(index)

    def __len__(self) -> int:
        return self.count


class _NoSteps(_NoStep, _Several):
    def __init__(
        self, count: int, params: Sequence[Tensor] = (), defaults: Optional[Mapping[str, Any]] = None, groups: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        _NoStep.__init__(self, params, defaults, groups)
        _Several.__init__(self, count)
        self.one = lambda index: _NoStep(params, defaults, groups)


class _NoSchedules(_NoSchedule, _Several):
    def __init__(self, count: int) -> None:
        _NoSchedule.__init__(self)
        _Several.__init__(self, count)
        self.one = lambda index: _NoSchedule()

    @staticmethod
    def lent(count: int) -> Any:
        """What ``self.lr_schedulers()`` gives in a probe step: a ``list`` for several, as Lightning (s40 h1)."""
        if count == 0:  # none configured: ``None``, as Lightning (was a stand-in: ``if sch is None`` read otherwise)
            return None
        return [_NoSchedule() for _ in range(count)] if count > 1 else _NoSchedules(count)


def _unpacked(frame: Optional[FrameType]) -> Optional[int]:
    """How many values the instruction ``frame`` runs unpacks (``a, b = ...``: 2; ``a, *rest = ...``: 1), ``None`` for
    any other (a loop, ``list(...)``)."""
    if frame is None:
        return None
    for instruction in dis.get_instructions(frame.f_code):
        if instruction.offset == frame.f_lasti:
            if instruction.opname == "UNPACK_SEQUENCE":
                return int(instruction.arg or 0)
            if instruction.opname == "UNPACK_EX":
                return int(instruction.arg or 0) % 256 + int(instruction.arg or 0) // 256
            return None
    return None


def source_tree(obj: Any) -> Optional[ast.Module]:
    """The parsed source of a class or function (dedented: a method's), ``None`` where there is none (built in a
    REPL, compiled, a builtin): what the readings from source share (``configure_optimizers``' count here, a stage's
    order in :mod:`lightning_hbm.layers.blocks`, the weight reads in :mod:`lightning_hbm.layers.source_scan`)."""
    try:
        return ast.parse(textwrap.dedent(inspect.getsource(obj)))
    except (OSError, TypeError, SyntaxError):
        return None


def _configured(
    module: pl.LightningModule, method: str = "configure_optimizers", depth: int = 0, returned: Optional[list[int]] = None
) -> tuple[int, int]:
    """How many optimizers and schedulers ``configure_optimizers`` returns, read from its source's ``return``s (a list
    or tuple of them, ``[optimizers], [schedulers]``, or dicts: a list of ``{"optimizer": ..., "lr_scheduler": ...}``
    counts its schedulers); ``(1, 1)`` where the source does not say. A name returned (``return opts, scheds``) is read
    where the method assigns it a list or tuple, and ``return self._build()`` in the method it calls (s39 h5: a
    helper's two optimizers, or a list of two dicts' two schedulers, were counted one: a loop over them ran once).
    ``returned`` gets each ``return``'s own count of optimizers (1 for one it does not count)."""
    tree = source_tree(getattr(type(module), method, None))
    if tree is None:
        return 1, 1
    assigned = {
        node.targets[0].id: node.value for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }  # fmt: skip
    counts = [(1, 1)]
    for node in ast.walk(tree):
        value = _listed(node.value, assigned) if isinstance(node, ast.Return) else None
        helper = _own_method(value)
        if helper is not None and depth < 3:
            counts.append(_configured(module, helper, depth + 1, returned))
        if not isinstance(value, (ast.List, ast.Tuple)) or not value.elts:
            if isinstance(node, ast.Return) and node.value is not None and helper is None and returned is not None:
                returned.append(1)
            continue
        first, second = (_listed(e, assigned) for e in (value.elts + value.elts)[:2])
        if len(value.elts) == 2 and isinstance(first, (ast.List, ast.Tuple)):
            counts.append((len(first.elts), len(second.elts) if isinstance(second, (ast.List, ast.Tuple)) else 1))
        else:
            scheduled = [e for e in value.elts if isinstance(e, ast.Dict) and any(isinstance(k, ast.Constant) and k.value == "lr_scheduler" for k in e.keys)]
            counts.append((len(value.elts), max(1, len(scheduled))))
        if returned is not None:
            returned.append(counts[-1][0])
    return max(c for c, _ in counts), max(c for _, c in counts)


def _listed(node: Optional[ast.expr], assigned: Mapping[str, ast.expr]) -> Optional[ast.expr]:
    """``node``, or where it is a name the method assigns a list or tuple, that list or tuple."""
    if isinstance(node, ast.Name) and isinstance(assigned.get(node.id), (ast.List, ast.Tuple)):
        return assigned[node.id]
    return node


def _own_method(node: Optional[ast.expr]) -> Optional[str]:
    """The name of the method ``node`` calls on ``self`` (``self._build(...)``), ``None`` for anything else."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and isinstance(node.func.value, ast.Name) and node.func.value.id == "self":
        return node.func.attr
    return None


#: an optimizer class ``configure_optimizers`` builds, its call there, and the names that method assigns
_Built = tuple[type, ast.Call, dict[str, ast.expr]]


def _optimizers_built(module: pl.LightningModule, method: str = "configure_optimizers", depth: int = 0) -> list[_Built]:
    """The ``torch.optim.Optimizer`` classes ``configure_optimizers`` builds, in its source's order (a helper it calls
    on ``self``, ``self._build()``, read where it is called): the calls of a class reached from its module's names
    (``torch.optim.AdamW(...)``, ``SGD(...)``, a user's ``SAM(...)``), neither class nor method called (issue 55)."""
    function = getattr(type(module), method, None)
    tree, names = source_tree(function), getattr(function, "__globals__", {})
    if tree is None:
        return []
    assigned = {
        node.targets[0].id: node.value for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }  # fmt: skip
    found: list[_Built] = []
    for node in sorted((n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)):
        called, helper = _resolved(node.func, names), _own_method(node)
        if isinstance(called, type) and issubclass(called, torch.optim.Optimizer):
            found.append((called, node, assigned))
        elif helper is not None and depth < 3 and not hasattr(pl.LightningModule, helper):  # the user's own method
            found += _optimizers_built(module, helper, depth + 1)
    return found


def _optimizer_groups(module: pl.LightningModule, built: Optional[_Built]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The defaults and param groups of the stand-in for the optimizer ``built`` (see :class:`_NoStep`): each group the call's
    source lists (``AdamW([{"params": ..., "weight_decay": 0.01}, {...}])``, or builds over a literal tuple:
    ``opt.param_groups[1]`` was IndexError, s40 h1), its keys the class's keyword defaults (read from its signature), then the literal values the call and the
    group pass (``betas=(0.5, 0.999)``), ``lr`` 0.0; its parameters those the source names (``self.g.parameters()``:
    :func:`_parameters_named`), else the module's trainable ones."""
    trainable = [p for p in module.parameters() if p.requires_grad]
    if built is None:
        return {"lr": 0.0}, [{"params": trainable}]
    optimizer, call, assigned = built
    defaults = {**_optimizer_defaults(optimizer), **_literals({k.arg: k.value for k in call.keywords if k.arg is not None}), "lr": 0.0}
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "params"), None)
    listed = _listed(first, assigned)
    if isinstance(listed, ast.ListComp) and isinstance(listed.elt, ast.Dict) and len(listed.generators) == 1:
        over = _listed(listed.generators[0].iter, assigned)  # [{"params": m.parameters()} for m in (self.a, self.b)]
        listed = ast.List(elts=[listed.elt] * len(over.elts)) if isinstance(over, (ast.List, ast.Tuple)) else listed
    if isinstance(listed, (ast.List, ast.Tuple)) and listed.elts and all(isinstance(e, ast.Dict) for e in listed.elts):
        groups = []
        for group in listed.elts:
            keys = {k.value: v for k, v in zip(group.keys, group.values) if isinstance(k, ast.Constant) and isinstance(k.value, str)}  # type: ignore[attr-defined]
            params = _parameters_named(module, keys.get("params"), assigned)
            groups.append({**_literals(keys), "lr": 0.0, "params": trainable if params is None else params})
        return defaults, groups
    params = _parameters_named(module, first, assigned)
    return defaults, [{"params": trainable if params is None else params}]


def _literals(values: Mapping[str, ast.expr]) -> dict[str, Any]:
    """The values of ``values`` that are literals in the source (``0.9``, ``(0.5, 0.999)``), never ``params``."""
    found = {}
    for key, value in values.items():
        try:
            found[key] = ast.literal_eval(value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            continue
    found.pop("params", None)
    return found


def _parameters_named(module: nn.Module, node: Optional[ast.expr], assigned: Mapping[str, ast.expr], depth: int = 0) -> Optional[list[Tensor]]:
    """The parameters the source ``node`` names, read without running it: ``self.g.parameters()`` (a submodule's, by
    :func:`_submodule_named`), a comprehension or ``filter`` over it (its condition not run: every one), ``list``,
    ``tuple`` or ``itertools.chain`` of such, a name assigned one; ``None`` for anything else."""
    if depth > 5 or node is None:
        return None
    if isinstance(node, ast.Name):
        return _parameters_named(module, assigned.get(node.id), assigned, depth + 1)
    if isinstance(node, (ast.ListComp, ast.GeneratorExp)) and len(node.generators) == 1:
        return _parameters_named(module, node.generators[0].iter, assigned, depth + 1)
    if not isinstance(node, ast.Call):
        return None
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in ("parameters", "named_parameters") and not node.args:
        sub = _submodule_named(module, func.value)
        return None if sub is None else list(sub.parameters())
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    if name not in ("list", "tuple", "filter", "chain") or node.keywords:
        return None
    parts = [_parameters_named(module, arg, assigned, depth + 1) for arg in (node.args[1:] if name == "filter" else node.args)]
    return None if not parts or any(part is None for part in parts) else [p for part in parts for p in part or ()]


def _submodule_named(module: nn.Module, node: ast.expr) -> Optional[nn.Module]:
    """The submodule the source ``node`` names on ``self`` (``self``, ``self.g``, ``self.body[0]``, ``self.heads["a"]``),
    read from the modules' ``_modules`` (no attribute of the user's runs); ``None`` for anything else."""
    if isinstance(node, ast.Name):
        return module if node.id == "self" else None
    if not isinstance(node, (ast.Attribute, ast.Subscript)):
        return None
    parent = _submodule_named(module, node.value)
    if parent is None:
        return None
    if isinstance(node, ast.Attribute):
        return parent._modules.get(node.attr)
    key = node.slice.value if isinstance(node.slice, ast.Constant) else None
    if isinstance(key, int) and isinstance(parent, (nn.Sequential, nn.ModuleList)) and -len(parent) <= key < len(parent):
        return list(parent._modules.values())[key]
    return parent._modules.get(key) if isinstance(key, str) and isinstance(parent, nn.ModuleDict) else None


def _no_schedulers(module: pl.LightningModule) -> bool:
    """Whether ``configure_optimizers``' source returns no LR scheduler on every path: each ``return`` gives an
    optimizer built there (a call of a ``torch.optim.Optimizer`` class, or a name assigned one), a list or tuple of
    such, ``[optimizers], []``, or a dict without ``"lr_scheduler"``. ``self.lr_schedulers()`` is ``None`` then."""
    function = type(module).configure_optimizers
    tree, names = source_tree(function), getattr(function, "__globals__", {})
    if tree is None:
        return False
    assigned = {
        node.targets[0].id: node.value for node in ast.walk(tree)
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
    }  # fmt: skip

    def built(node: Optional[ast.expr]) -> bool:
        node = assigned.get(node.id) if isinstance(node, ast.Name) else node
        found = _resolved(node.func, names) if isinstance(node, ast.Call) else None
        return isinstance(found, type) and issubclass(found, torch.optim.Optimizer)

    def unscheduled(value: Optional[ast.expr]) -> bool:
        value = _listed(value, assigned)
        if isinstance(value, ast.Dict):
            return not any(isinstance(k, ast.Constant) and k.value == "lr_scheduler" for k in value.keys)
        if isinstance(value, (ast.List, ast.Tuple)) and len(value.elts) == 2 and isinstance(value.elts[1], (ast.List, ast.Tuple)):
            return not value.elts[1].elts and unscheduled(value.elts[0])
        if isinstance(value, (ast.List, ast.Tuple)):
            return bool(value.elts) and all(built(e) or (isinstance(e, ast.Dict) and unscheduled(e)) for e in value.elts)
        return built(value)

    returns = [node.value for node in ast.walk(tree) if isinstance(node, ast.Return)]
    return bool(returns) and all(unscheduled(value) for value in returns)


def _optimizer_defaults(optimizer: Optional[type]) -> dict[str, Any]:
    """The param group keys of ``optimizer`` (a class), as its keyword defaults, and ``lr`` 0.0 (see :class:`_NoStep`),
    read from the class's signature, never called; ``{"lr": 0.0}`` for ``None`` or where the signature does not say."""
    try:
        parameters = list(inspect.signature(optimizer).parameters.values()) if optimizer is not None else []
    except (TypeError, ValueError):
        parameters = []
    plain = (int, float, bool, str, tuple, type(None))
    return {**{p.name: p.default for p in parameters[1:] if isinstance(p.default, plain)}, "lr": 0.0}


def _resolved(node: ast.expr, names: Mapping[str, Any]) -> Any:
    """What the name or dotted name ``node`` is in ``names`` (a function's globals), following modules' attributes
    only (no user object's property runs); ``None`` for anything else."""
    if isinstance(node, ast.Name):
        return names.get(node.id)
    if isinstance(node, ast.Attribute):
        base = _resolved(node.value, names)
        return getattr(base, node.attr, None) if isinstance(base, ModuleType) else None
    return None


def _stand_ins(module: pl.LightningModule) -> dict[str, Callable[..., Any]]:
    """A manual-optimization module's stand-ins for what needs the optimizers (see :func:`quiet_logging`)."""
    schedulers = 0 if _no_schedulers(module) else _configured(module)[1]
    stand_ins: dict[str, Callable[..., Any]] = {name: _nothing for name in _MANUAL_HOOKS if callable(getattr(module, name, None))}
    lent = _lent(module)
    stand_ins.update(optimizers=lambda *a, **k: lent(), lr_schedulers=lambda *a, **k: _NoSchedules.lent(schedulers))
    stand_ins["toggled_optimizer"] = _toggled
    return stand_ins


def _lent(module: pl.LightningModule) -> Callable[[], Any]:
    """What ``self.optimizers()`` gives in a probe step, as Lightning gives it (s40 h1): for several optimizers
    ``configure_optimizers``' source returns on every path, a ``list`` of stand-ins (``isinstance(opts, list)``; was one stand-in
    reading as a list, a step normalising ``opts if isinstance(opts, list) else [opts]`` stepped one); else one that
    unpacks as :class:`_Several` says. The ``i``-th is of the ``i``-th optimizer class the source builds
    (:func:`_optimizers_built`, :func:`_like`): its groups and their keys (Adam's ``betas``, SGD's ``momentum``; were the
    first class's on each: :func:`_optimizer_groups`), and ``isinstance`` of that class."""
    returned: list[int] = []
    count, built = _configured(module, returned=returned)[0], _optimizers_built(module)
    several = count > 1 and len(set(returned)) == 1  # every return gives as many: a list (else one that unpacks)
    # more classes built than returned: branches (``Adam(...) if ... else SGD(...)``), which one runs is unknowable
    # unrun: of none of them (``isinstance`` False, no user method), the groups of the one in its place in the source
    branches = len(built) > count and len({optimizer for optimizer, _, _ in built}) > 1

    def one(index: int, base: type = _NoStep, *args: Any) -> Any:
        chosen = built[min(index, len(built) - 1)] if built else None
        stand_in = _like(base, chosen[0] if chosen and not branches else None)(*args, (), *_optimizer_groups(module, chosen))
        if isinstance(stand_in, _Several):
            stand_in.one = one
        return stand_in

    return lambda: [one(i) for i in range(count)] if several else one(0, _NoSteps, count)


#: what a user's optimizer class may not define for a stand-in to be of it: each runs the class's code as the
#: stand-in is built or read (a subclass made, an attribute set or missed)
_RUNS_ON_ACCESS = ("__new__", "__init_subclass__", "__getattr__", "__getattribute__", "__setattr__", "__delattr__", "__del__", "__slots__")


def _like(base: type, optimizer: Optional[type]) -> type:
    """``base`` (a stand-in class) also of ``optimizer``'s class (``isinstance(opt, SAM)``: as Lightning's
    ``LightningOptimizer``, a subclass of the optimizer's class), with ``base``'s methods first and the methods a user's
    class adds (SAM's ``first_step`` / ``second_step``, davda54's ``sam.py``) doing nothing: the user's optimizer code
    never runs on the real parameters (was AttributeError, "could not run one step", s40 h1). Neither class is
    initialised (torch's ``Optimizer.__init__`` would hook ``step``: a probe step counted as a step). ``base`` alone
    where ``optimizer`` is unknown or has a metaclass or one of :data:`_RUNS_ON_ACCESS` outside torch."""
    if optimizer is None or type(optimizer) is not type:
        return base
    users = [k for k in optimizer.__mro__ if k is not object and not k.__module__.startswith("torch.")]
    if any(name in vars(k) for k in users for name in _RUNS_ON_ACCESS):
        return base
    methods = {
        name for k in users for name, value in vars(k).items()
        if not name.startswith("__") and (inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod))) and not hasattr(base, name)
    }  # fmt: skip
    return type(optimizer.__name__, (base, optimizer), {"__qualname__": optimizer.__qualname__, **{name: _nothing for name in methods}})


@contextmanager
def _toggled(*args: Any, **kwargs: Any) -> Generator[None, None, None]:
    yield


class Stepped:
    """A LightningModule without ``forward`` measured through the one direct submodule ``child`` holding every layer
    measured (issue 53), called on the probe batch as :func:`forward_on` takes a batch (a tensor, an (inputs, targets)
    pair, or a dict of keyword inputs).

    Whether ``child`` takes the raw probe batch is seen at its first call through :func:`forwarding` (the first
    measuring forward, the reference's in the default recipe): one that returns says yes. Only where that call raises
    is ``child`` run on the probe batch alone, as it was before every measurement until session 34 (one forward of the
    model more at every fit start of a LightningModule without ``forward``: 0.5 s of SmolLM2-135M's on a CPU), to tell
    a submodule that does not take the batch (then :attr:`takes_batch` is False: every measurement says "define
    forward") from a measurement that failed on its own (its error is raised as it was)."""

    def __init__(self, child: str, batch: Any = None, tried: bool = True) -> None:
        self.child = child
        #: whether ``child`` takes the raw probe batch (``None``: no call through it has returned or raised yet)
        self.takes_batch: Optional[bool] = True if tried else None
        self._batch = None if tried else batch

    def call(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``child``'s output on the arguments of ``module``'s forward (``TypeError`` naming the fix: see :meth:`_untaken`)."""
        child = module.get_submodule(self.child)
        if self.takes_batch:
            return child(*args, **kwargs)
        if self.takes_batch is None:
            try:
                output = child(*args, **kwargs)
            except Exception:
                if self._tried(child):
                    raise  # it takes the batch: the measurement's own error, as before session 34
            else:
                self.takes_batch, self._batch = True, None
                return output
        raise self._untaken(module)

    def _tried(self, child: nn.Module) -> bool:
        """Whether ``child`` takes the probe batch, run on it alone (no user code), as :func:`stepped_inputs` ran it."""
        batch, self._batch = self._batch, None
        try:
            with eval_no_grad(child), torch_compat.preserved_rngs():
                forward_on(child, batch)
        except Exception:  # noqa: BLE001 - a step that prepares the batch first (CLIP, DiT, SD3 in the s29 families)
            self.takes_batch = False
            return False
        self.takes_batch = True
        return True

    @staticmethod
    def _untaken(module: nn.Module) -> TypeError:
        name = type(module).__name__
        return TypeError(
            f"{name} defines no forward for the probe batch, and no one of its submodules holds every layer "
            f"measured; define {name}.forward"
        )


def stepped_inputs(module: nn.Module, batch: Any, names: Collection[str]) -> Optional[Stepped]:
    """The :class:`Stepped` of ``module`` on ``batch``: the one direct submodule holding every layer of ``names`` (a
    backbone, the wrapped model: ``training_step`` calls ``self.model(...)``), given the probe batch as a forward is.
    ``None`` where no one submodule holds them all (the measurements then say to define ``forward``).

    The user's ``training_step`` is not run for this: a second run of the user's code before the fit is a call the
    user sees (a counter, a service called, a stream read; issue 55: the probe step is the one run, said once and
    switched off by ``LIGHTNING_HBM_PROBE_STEP=0``). A step that transforms the batch before that call (a head of its
    own first) gives the submodule other inputs than here: the figure is then the submodule's on the raw batch, or,
    where it does not run on it, "not measured" with the fix (define ``forward``). Whether it runs on it is seen at
    the first measuring forward (:class:`Stepped`: no forward is run here)."""
    holders = [n for n, _ in module.named_children() if names and all(under(x, [n]) for x in names)]
    if len(holders) != 1:
        return None
    return Stepped(holders[0], batch, tried=False)


@contextmanager
def forwarding(module: nn.Module, stepped: Callable[[], Optional[Stepped]]) -> Generator[None, None, None]:
    """While measuring a LightningModule without ``forward``: its ``forward`` is the call of the submodule
    ``stepped()`` names (:func:`stepped_inputs`, drawn with the probe batch; an instance attribute, removed after),
    so the probes, the reference and the quantized output measure that submodule on the inputs the step gave it, the
    layer names as in the LightningModule. Nothing where ``module`` has a ``forward``; where ``stepped()`` finds none,
    or one that does not take the probe batch, a call is the ``TypeError`` the measurements say (with the fix: define
    ``forward``)."""
    if has_forward(module):
        yield
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        found = stepped()
        if found is None:
            raise Stepped._untaken(module)
        return found.call(module, args, kwargs)

    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        del module.__dict__["forward"]


def forward_on(module: nn.Module, batch: Any) -> Any:
    """``module``'s output on ``batch``, whatever it is: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets)
    pair (where that fails and the batch is per-sample images alone, :func:`~lightning_hbm.probe_batch.per_sample_images`:
    ``forward(images)``, session 37), or ``forward(**dict)``, on a copy of the batch: a forward that changes its input in place (``x /= 255``) ran
    on the user's batch once per probe forward, and the probe batch is the first batch training gets (a
    ``BatchEncoding``'s tensors too, :func:`~lightning_hbm._compat.torch.map_tensors`). Nothing cached by it is left
    in the model (:func:`caching_nothing`)."""
    with caching_nothing(module):
        if isinstance(batch, Tensor):
            return module(batch.clone())
        if isinstance(batch, (tuple, list)):
            images = per_sample_images(batch)
            try:
                return module(torch_compat.map_tensors(torch.clone, batch[0]))
            except Exception as error:
                if not images:
                    raise
                first_error = error
            # a batch that is per-sample images alone (collate_fn=tuple): forward(images), not forward(first image);
            # each a tensor (per_sample_images), so copied one by one. Where that fails too, the batch was no images
            # (a tuple of [B, L, D] tensors of B <= 4 reads as them): forward(inputs)'s own error is raised (h10)
            try:
                return module(type(batch)(image.clone() for image in batch))
            except Exception:
                raise first_error from None
        return module(**torch_compat.map_tensors(torch.clone, batch))


@contextmanager
def caching_nothing(module: nn.Module) -> Generator[None, None, None]:
    """Each module attribute a probe forward set to a tensor (or a list, tuple or dict of them) put back as it was, or
    removed: a model caching a tensor on its first forward (transformers' Mimi codebook: ``self._embed = ...``) kept the
    one computed by a probe on the model as built, in float32, and the cast to the compute dtype does not reach a plain
    attribute (the fit's first step: "expected scalar type Float but found BFloat16"; its resume not bit-exact; issue
    53, session 33). Parameters, buffers and submodules are not attributes here (their own dicts)."""
    before = [(vars(m), dict(vars(m))) for m in module.modules()]
    try:
        yield
    finally:
        put_back_attributes(before, _holds_tensor)


_MISSING = object()


def put_back_attributes(before: list[tuple[dict[str, Any], dict[str, Any]]], holds: Callable[[Any], bool]) -> None:
    """Each attribute dict of ``before`` (a module's ``vars`` and a copy of it taken earlier) with every key set since
    to a new value ``holds`` accepts put back as it was, or removed where it was not there. Shared with
    :func:`~lightning_hbm.layers.fake_leftovers.dropping_fake_leftovers` (a level above: it also restores the caches a
    step filled in place)."""
    for own, attributes in before:
        for key, value in list(own.items()):
            old = attributes.get(key, _MISSING)
            if old is not value and holds(value):
                if old is _MISSING:
                    del own[key]
                else:
                    own[key] = old


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(isinstance(item, Tensor) for item in items)


def probe_output(module: nn.Module, batch: Any) -> Tensor:
    """The module's output tensor for ``batch``: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets) pair, or
    ``forward(**dict)``. Of an output that is not one tensor: its floating ``logits``, else its first floating tensor
    that is not one of the batch's own handed back.

    No logits (a UNet's ``.sample``, an encoder's ``last_hidden_state``, a dict of features; as
    ``ModelOutput.to_tuple()[0]``): floating, because an integer tensor first (a prediction's ``argmax`` beside the
    logits) was measured, and the 4-bit conv plan widened layers to keep class indices equal; not the batch's, because
    a forward returning ``(x, features)`` was measured on its input, the same whatever the quantization (cosine 1.0:
    every convolution kept in the base mode); not a 0-dim one while there is another, because ``(loss, logits)`` was
    measured on the loss, whose cosine is 1.0 (the cosine of one value is its sign).

    One way, in this function: the forward on a copy of the batch, then the batch's own tensors, then the pick (a helper
    of this module called after the copy sent the quantization's walk back and forth between here and ``_compat.torch``).
    """
    check_forward(module, "lightning_hbm")  # QuantizationQuality checks at setup; the plugin's probes land here
    out = forward_on(module, batch)
    if isinstance(out, Tensor):
        logits: Any = out
    else:
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if not (isinstance(logits, Tensor) and logits.is_floating_point()):
            values = out.to_tuple() if hasattr(out, "to_tuple") else list(out.values()) if isinstance(out, Mapping) else out
            given = torch_compat.tensor_leaves(batch)

            def echoed(t: Tensor) -> bool:
                return any(t.shape == b.shape and t.dtype == b.dtype and t.device == b.device and torch.equal(t, b) for b in given)

            found = [t for t in tree_flatten(values)[0] if isinstance(t, Tensor) and t.is_floating_point() and not echoed(t)]
            logits = next((t for t in found if t.dim() > 0), found[0] if found else None)
    if not (isinstance(logits, Tensor) and logits.is_floating_point()):
        got = f"a {logits.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"QuantizationQuality needs the model's forward to return a floating tensor (or an object with a `logits` "
            f"tensor, or any floating tensor other than its input), got {got}. Make forward return the output tensor "
            "for the probe batch."
        )
    return logits


def input_absmax(module: nn.Module, layers: Mapping[str, nn.Module], batch: Any) -> tuple[dict[str, Tensor], Tensor]:
    """Per-channel ``max|x|`` (float32) of the input of each of ``layers`` over one forward of ``batch`` (all its
    calls), and the module's output (:func:`probe_output`, as float32). A layer the forward never calls is absent."""
    absmax: dict[str, Tensor] = {}

    def record(name: str) -> Any:
        def hook(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            seen = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

        return hook

    handles = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    try:
        output = probe_output(module, batch).float()
    finally:
        for handle in handles:
            handle.remove()
    return absmax, output


#: a value as built at most this (``-1e9``, ``-1e30``, ``torch.finfo(torch.float32).min``) is a mask (no probability
#: after a softmax), and so is a value computed at most :data:`MASK_AS_COMPUTED` (or the computing dtype's lowest, -inf)
#: where the model as built has one
MASK_VALUE = -1e9
#: :data:`MASK_VALUE` as a computing dtype may round it: bfloat16 (8 significant bits) gives ``-1e9`` as
#: ``-998,244,352``, above ``-1e9`` (was read as no mask, and the mask then dominated the figures: ~1.0 for a model
#: whose every other output was wrong, session 30); the 1 in 128 allowed is twice bfloat16's rounding
MASK_AS_COMPUTED = MASK_VALUE * (1 - 2**-7)


#: the fewest values a row of :func:`compare_outputs`' cosine holds outside a language model: an output whose last axis is
#: narrower (a feature map of 2x2, 4x4) is measured per sample, its every value one row
MIN_ROW = 8

#: the fewest values a sample's row holds for :func:`compare_outputs` to take a cosine per sample outside a language
#: model: a classifier's few logits (``[N, C]``, ``C`` under this) are measured over the whole batch, flattened and
#: centred on the reference's mean (issue 53, session 34: a 2-class head's rows of 2 logits read 0.993 on the probe,
#: dominated by the logits' common offset, while held out the quantized model measured 0.76 centred, 84 % top-1
#: agreement; planned on the batch's figure, 0.954 and 97 %; ``benchmarks/conv_few_classes.py``)
FEW_VALUES = 16


def compare_outputs(output: Tensor, reference: Tensor, lm: bool) -> dict[str, float]:
    """The metrics logged by :class:`QuantizationQuality` (and optimized by the sensitivity-aware plan).

    Cosine similarity per output row (per token for a language model, per sample otherwise: the last axis, or the
    sample's every value where the last axis holds fewer than :data:`MIN_ROW`; a sample of fewer than
    :data:`FEW_VALUES` values, a classifier's few logits: the whole batch as one row, centred on the reference's mean),
    root relative squared error over all outputs, and for a language model ``KL(p_fp || p_q)``.
    """
    limit = torch.finfo(output.dtype).max if output.is_floating_point() else float("inf")  # its dtype's range
    output, reference = output.float(), reference.float()
    width = reference.shape[-1] if reference.dim() >= 2 else reference.numel()
    # [N, C, 1, 1] (a pooled feature map): rows of one value were NaN where 0 (MobileNetV2); a feature map's last axis
    # narrower than MIN_ROW outside a language model: per sample (issue 53, session 33: MobileNetV2's [N, 1280, 2, 2]
    # at 64 px gave rows of 2 ReLU6 values, NaN where both are 0; the conv plan measured NaN and widened nothing)
    if reference.dim() >= 2 and (width == 1 or (not lm and width < MIN_ROW)):
        width = reference[0].numel()
    few = not lm and width < FEW_VALUES  # a few logits a sample: rows of 2-10 values, uncentred, read their offset
    if few:
        width = reference.numel()
    # an inf both give (a head that masks classes with -inf) agrees: left in, every row holding one measured NaN, and
    # the conv plan was chosen on NaN (planned 'to a probe output cosine of nan')
    same = ~reference.isfinite() & (output == reference)
    # a mask of torch.finfo(dtype).min both give (bfloat16 rounds float32's to -inf): its square overflows float32, every
    # row holding one measured NaN (identical outputs read cosine NaN); agrees like an inf both give
    huge = 2.0**63
    same |= (reference.abs() > huge) & (output.abs() > huge) & (reference.sign() == output.sign())
    # a mask (at most -1e9 as built) that the output gives as a mask in its own dtype (-1e9 as that dtype rounds it, or
    # that dtype's lowest: -inf, float16's -65504 from torch.finfo(dtype).min): the same mask; was cosine NaN, relative error inf
    # (session 29). Not an overflowing value of the output's own (-1e5 or +1e5 as built): those stay NaN and inf
    same |= (reference <= MASK_VALUE) & (output <= max(MASK_AS_COMPUTED, -limit))
    measured, wanted = (output.masked_fill(same, 0.0), reference.masked_fill(same, 0.0)) if bool(same.any()) else (output, reference)
    rows = ~same.reshape(-1, width).all(-1)  # a row both mask whole (-inf everywhere) has no direction: left out
    cosine = _centred if few else lambda got, want: float(CosineSimilarity(reduction="mean")(got, want))
    metrics = {
        PREFIX + "cosine_similarity": cosine(measured.reshape(-1, width)[rows], wanted.reshape(-1, width)[rows]),
        PREFIX + "relative_error": float(RelativeSquaredError(squared=False)(measured.flatten(), wanted.flatten())),
    }
    if lm:
        metrics[PREFIX + "kl_divergence"] = _kl_divergence(output.reshape(-1, width), reference.reshape(-1, width))
    return metrics


def _centred(got: Tensor, want: Tensor) -> float:
    """The cosine of a batch's few values a sample (:data:`FEW_VALUES`; one row), centred on ``want``'s mean: a constant
    offset of the logits does not count (uncentred, a 2-class head's rows read 0.99 whatever its outputs did). A constant
    ``want`` has no centred direction: uncentred then (NaN against all zeros: no figure)."""
    got, want = got.double().flatten(), want.double().flatten()
    if want.numel() and not bool((want == want[0]).all()):
        mean = want.mean()
        got, want = got - mean, want - mean
    return float(torch.nn.functional.cosine_similarity(got, want, dim=0)) if want.numel() else float("nan")


def _kl_divergence(output: Tensor, reference: Tensor) -> float:
    """Mean over rows of ``KL(p || q)``, ``p`` the softmax of ``reference`` (the full-precision model's logits), ``q``
    of ``output``: torchmetrics ``KLDivergence``'s figure, with masked entries handled.

    A token the reference gives no mass (``-inf`` logit: a masked vocabulary entry; or a probability that underflows to
    0 in float32: a mask of ``-1e9`` or ``torch.finfo(torch.float32).min``, which float16 or bfloat16 round to
    ``-inf``) adds 0, whatever ``output`` gives it (torchmetrics: ``0 * (-inf - x)`` = NaN, the whole figure NaN when both models mask the same entries). A token
    the reference gives mass to and ``output`` -inf adds inf: the quantized model rules out what the model as built
    predicts, and the figure says so (with a warning naming how many), not NaN; a row ``output`` masks whole (every
    entry -inf) rules out every token, inf. A row the reference masks whole (every entry -inf: a padded position
    masked entirely) has no distribution to compare with: it is left out of the mean, whatever ``output`` gives it,
    and a warning counts such rows (counting it 0 would lower the mean by the share of such rows; its softmax is NaN,
    which made the whole figure NaN). If every row is left out there is no figure: NaN, with that warning.
    """
    p_log, q_log = reference.float().log_softmax(-1), output.float().log_softmax(-1)
    empty, none_left = reference.eq(float("-inf")).all(-1), output.eq(float("-inf")).all(-1)
    q_log = q_log.masked_fill(none_left.unsqueeze(-1), float("-inf"))  # its softmax is NaN: no mass anywhere
    p_log, q_log = p_log[~empty], q_log[~empty]
    if bool(empty.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence leaves out {int(empty.sum())} of {empty.shape[0]} rows the full-precision "
            f"model masks whole (-inf for every entry: no next-token distribution to compare with; "
            f"{int((empty & none_left).sum())} of them the quantized model masks whole too): the figure is the mean "
            f"over the other {int((~empty).sum())} rows{' (none: NaN)' if bool(empty.all()) else ''}. Probe on rows "
            "the model predicts (no fully masked positions) for a figure over every row.",
            stacklevel=2,
        )
    masked = p_log.exp() == 0  # no mass in float32 (the figure's own p * (log p - log q) is 0 there)
    ruled_out = (q_log == float("-inf")) & ~masked
    terms = (p_log.exp() * (p_log - q_log)).masked_fill(masked, 0.0).masked_fill(ruled_out, float("inf"))
    if bool(ruled_out.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence is inf: the quantized model gives -inf (no probability) to "
            f"{int(ruled_out.sum())} token(s) the full-precision model gives probability to, in "
            f"{int(ruled_out.any(-1).sum())} of {ruled_out.shape[0]} rows (the quantized logits overflowed, or mask "
            f"differently): compare the two models' masks, or quantize fewer layers (skip=...).",
            stacklevel=2,
        )
    return float(terms.sum(-1).mean()) if terms.shape[0] else float("nan")


@contextmanager
def eval_no_grad(module: nn.Module) -> Generator[None, None, None]:
    # Dropout would make the probe outputs random; the same eval forward is used on both sides.
    # Each module's own flag is put back (not module.train(flag) on the root, which would also switch on the
    # submodules the user froze in eval mode, e.g. a frozen encoder whose BatchNorm statistics must not move).
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


@dataclass
class Probe:
    """A model and its probe batch, as the measurements of one quantization run them: built once by their owner
    (``Measures.measure_model``, ``choose_layer_modes``) and handed down, so that each measurement (the smoothing, its
    candidates' errors, the swapped-in outputs of the plans) asks it for a forward instead of taking the model and
    the batch apart again. Each method is the function of this module of the same name on :attr:`module` and
    :attr:`batch`."""

    module: nn.Module
    batch: Any

    def eval_no_grad(self) -> AbstractContextManager[None]:
        """:func:`eval_no_grad` of the model."""
        return eval_no_grad(self.module)

    def output(self) -> Tensor:
        """:func:`probe_output`: the model's output tensor on the batch."""
        return probe_output(self.module, self.batch)

    def forward(self) -> Any:
        """:func:`forward_on`: the model's output on (a copy of) the batch, as it returns it."""
        return forward_on(self.module, self.batch)

    def input_absmax(self, layers: Mapping[str, nn.Module]) -> tuple[dict[str, Tensor], Tensor]:
        """:func:`input_absmax` of ``layers`` over one forward, and the output."""
        return input_absmax(self.module, layers, self.batch)

    def recording_calls(self, names: Optional[Collection[str]] = None, keep: int = 0) -> AbstractContextManager[list["Call"]]:
        """:func:`recording_calls` of the model's submodules ``names``."""
        return recording_calls(self.module, names, keep)


def recorded_forward(
    module: nn.Module, args: tuple, kwargs: Mapping[str, Any], names: Optional[Collection[str]], keep: int, follow: Sequence[Selection] = (),
    stepped: Optional[Stepped] = None,
) -> tuple[Any, list[Call], Followed]:
    """``module(*args, **kwargs)`` in eval mode without grad (:func:`eval_no_grad`), with the calls of its submodules
    ``names`` (:func:`recording_calls`, ``keep`` values each) and its data-dependent selections
    (:func:`recording_selections`), following those of ``follow`` (:func:`following`; none: its own): the output, the
    calls, the selections, in one pass. A LightningModule without ``forward`` runs through the submodule ``stepped``
    names (:func:`forwarding`: as the model as built was recorded)."""
    with forwarding(module, lambda: stepped), eval_no_grad(module), recording_calls(module, names, keep) as calls, following(calls, follow) as followed:
        return module(*args, **kwargs), calls, followed


__all__ = ["FEW_VALUES", "INDEXED", "MASKING", "MASK_AS_COMPUTED", "MASK_VALUE", "MIN_ROW", "POOLED", "PREFIX", "SELECTING", "Call", "Stepped", "Followed", "Probe", "Selection", "agreeing_calls", "call_values", "check_forward", "compare_outputs", "diverging", "eval_no_grad", "first_batch", "first_batches", "following", "forward_on", "put_back_attributes",
           "has_forward", "input_absmax", "probe_output", "recorded_forward", "quiet_logging", "recording_calls", "recording_selections", "stepped_inputs", "forwarding"]
