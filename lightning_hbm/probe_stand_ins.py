"""What a probe step lends the user's ``training_step`` so that running it changes nothing: ``self.log`` as a no-op,
and, for manual optimization, stand-ins for the optimizers and schedulers that do not exist yet at the surgery point.

The stand-ins are read from ``configure_optimizers``' source (:func:`source_tree`), never built by running it: their
classes, param groups, literal settings and count, so that ``isinstance(self.optimizers(), list)``, ``opt.param_groups[1]``
or a GAN's two optimizers answer as Lightning's would (issue 55). Their ``step`` runs the closure and changes nothing.
Split out of :mod:`lightning_hbm.probe` (running a model on a batch, which re-exports :func:`quiet_logging` and
:func:`source_tree`) in session 40: one job per module (issue 54).
"""

from __future__ import annotations

import ast
import dis
import inspect
import sys
import textwrap
from collections import defaultdict
from collections.abc import Generator, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from types import FrameType, ModuleType
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

from lightning_hbm._compat import lightning as lightning_compat


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

__all__ = ["quiet_logging", "source_tree"]
