"""Which modules' ``forward`` is running right now: one stack, kept by forward hooks.

Several parts of the package ask "which module is running?" while a model runs: the layer-weight probe
(``layers.readers``: who reads a layer's weight), the memory tracker's module attribution (``memory.tracker``: who
allocated a storage) and the attention-caller recorder (``activations.attention.blocked``: who calls attention). They
share this one stack instead of three copies of the same hooks.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional, TypeVar

from torch import nn
from torch.utils.hooks import RemovableHandle

_Hook = TypeVar("_Hook", bound=Callable[..., Any])
#: the functions marked by :func:`observing` (a weak set, not an attribute stamped on them: tests/test_record.py)
_OBSERVING: weakref.WeakSet[Any] = weakref.WeakSet()


def observing(hook: _Hook) -> _Hook:
    """Mark a forward hook as one that only observes (it changes no value and nothing the model reads): code that takes
    another path for a module with hooks ignores it (:func:`changing_hooks`), so that watching a step (the profiler's
    module attribution and its step recorder) does not change what the step runs."""
    _OBSERVING.add(getattr(hook, "__func__", hook))
    return hook


def changing_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has a forward (pre-)hook of its own that is not :func:`observing` (process-wide hooks are not
    looked at). A bound method is marked through its function."""
    hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
    return any(getattr(hook, "__func__", hook) not in _OBSERVING for hook in hooks)


class RunningModules:
    """A context manager keeping :attr:`stack`: the modules whose ``forward`` is running, innermost last.

    ``root``: hooks on each of ``root.modules()``, so only those are seen; ``None``: process-wide module hooks, every
    module's forward is seen (modules made or swapped in during the run too). Hooks are installed on entry and
    removed on exit, which also empties the stack; the same object can be entered again afterwards.

    The leaving hook is ``always_call``: a forward that raises leaves the stack too, so a model that catches an
    exception itself leaves no stale entry. It pops only when the module is on top: a leave without its enter (a
    pre-hook registered earlier raised before ours ran) cannot pop the parent.
    """

    def __init__(self, root: Optional[nn.Module] = None) -> None:
        self.root = root
        self.stack: list[nn.Module] = []
        self._handles: list[RemovableHandle] = []

    def __enter__(self) -> RunningModules:
        if self._handles:
            raise RuntimeError("RunningModules is already entered: its hooks would push every module twice")
        if self.root is None:
            self._handles = [
                nn.modules.module.register_module_forward_pre_hook(self._enter),
                nn.modules.module.register_module_forward_hook(self._leave, always_call=True),
            ]
        else:
            for module in self.root.modules():
                self._handles.append(module.register_forward_pre_hook(self._enter))
                self._handles.append(module.register_forward_hook(self._leave, always_call=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.stack.clear()

    @observing
    def _enter(self, module: nn.Module, args: Any) -> None:
        self.stack.append(module)

    @observing
    def _leave(self, module: nn.Module, args: Any, output: Any) -> None:
        if self.stack and self.stack[-1] is module:
            self.stack.pop()


__all__ = ["RunningModules", "changing_hooks", "observing"]
