"""RunningModules: the stack of modules whose forward is running, per root or process-wide."""

from __future__ import annotations

from typing import Any, Optional

import pytest
import torch
from torch import nn

from lightning_hbm.running import RunningModules


class Probe(nn.Module):
    """Records a copy of the running stack each time its forward runs; raises if ``fail``."""

    def __init__(self, running: list[RunningModules], fail: bool = False) -> None:
        super().__init__()
        self.running, self.fail = running, fail
        self.seen: list[list[nn.Module]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append(list(self.running[0].stack))
        if self.fail:
            raise ValueError("inside the forward")
        return x + 1


class Outer(nn.Module):
    def __init__(self, running: list[RunningModules], fail: bool = False, catch: bool = False) -> None:
        super().__init__()
        self.inner = nn.Sequential(Probe(running, fail))
        self.after = Probe(running)
        self.catch = catch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        try:
            x = self.inner(x)
        except ValueError:
            if not self.catch:
                raise
        return self.after(x)


def _model(root: bool, fail: bool = False, catch: bool = False) -> tuple[Outer, RunningModules]:
    holder: list[RunningModules] = []
    model = Outer(holder, fail, catch)
    holder.append(RunningModules(model if root else None))
    return model, holder[0]


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


@pytest.mark.parametrize("root", [True, False], ids=["root", "process-wide"])
def test_nested_forwards_innermost_last(root: bool) -> None:
    model, running = _model(root)
    with running:
        model(torch.zeros(1))
        assert running.stack == []
    probe, after = model.inner[0], model.after
    assert probe.seen == [[model, model.inner, probe]]
    assert after.seen == [[model, after]]


def test_a_root_sees_only_its_own_modules() -> None:
    model, running = _model(root=True)
    stranger = nn.Linear(1, 1)
    seen: list[list[nn.Module]] = []
    model.after.register_forward_pre_hook(lambda m, a: seen.append(list(running.stack)))
    with running:
        stranger(torch.zeros(1))
        assert running.stack == []
        model(torch.zeros(1))
    assert seen == [[model]]  # our pre-hook on ``after`` runs after this one


def test_process_wide_sees_modules_made_during_the_run() -> None:
    running = RunningModules()
    made: list[Optional[list[nn.Module]]] = [None]

    class Maker(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            fresh = nn.Identity()
            # a pre-hook of its own: process-wide pre-hooks run first, so it is already on the stack
            fresh.register_forward_pre_hook(lambda m, a: made.__setitem__(0, list(running.stack)))
            return fresh(x)

    maker = Maker()
    with running:
        maker(torch.zeros(1))
    assert made[0] is not None and made[0][0] is maker and isinstance(made[0][1], nn.Identity)


@pytest.mark.parametrize("root", [True, False], ids=["root", "process-wide"])
def test_a_forward_that_raises_leaves_the_stack(root: bool) -> None:
    model, running = _model(root, fail=True)
    with running:
        with pytest.raises(ValueError):
            model(torch.zeros(1))
        assert running.stack == []  # popped on the way out, before the exit clears anything


@pytest.mark.parametrize("root", [True, False], ids=["root", "process-wide"])
def test_an_exception_the_model_catches_leaves_no_stale_entry(root: bool) -> None:
    model, running = _model(root, fail=True, catch=True)
    with running:
        model(torch.zeros(1))
    assert model.after.seen == [[model, model.after]]


@pytest.mark.parametrize("root", [True, False], ids=["root", "process-wide"])
def test_hooks_removed_and_stack_emptied_on_exit(root: bool) -> None:
    model, running = _model(root)
    before = _hooks(model)
    globals_before = _global_hooks()
    with pytest.raises(RuntimeError), running:  # running exits first, on the error
        running.stack.append(model)  # whatever is left at the exit
        raise RuntimeError("the step failed")
    assert running.stack == []
    assert _hooks(model) == before and _global_hooks() == globals_before
    model(torch.zeros(1))
    assert model.after.seen == [[]]  # nothing pushes after the exit


def _global_hooks() -> tuple[int, int]:
    module = nn.modules.module
    return len(module._global_forward_pre_hooks), len(module._global_forward_hooks)


def test_entered_again_after_exit_but_not_while_entered() -> None:
    model, running = _model(root=True)
    for _ in range(2):
        with running:
            model(torch.zeros(1))
    assert model.after.seen == [[model, model.after]] * 2
    with running:
        with pytest.raises(RuntimeError, match="already entered"):
            running.__enter__()
        assert _hooks(model) == 2 * len(list(model.modules()))  # the failed entry added none


@pytest.mark.parametrize("root", [True, False], ids=["root", "process-wide"])
def test_a_module_reused_and_recursing(root: bool) -> None:
    holder: list[RunningModules] = []
    probe = Probe(holder)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.probe = probe

        def forward(self, x: torch.Tensor, depth: int = 1) -> torch.Tensor:
            x = self.probe(self.probe(x))
            return self(x, depth - 1) if depth > 0 else x

    model = Twice()
    holder.append(RunningModules(model if root else None))
    with holder[0] as running:
        model(torch.zeros(1))
        assert running.stack == []
    assert probe.seen == [[model, probe]] * 2 + [[model, model, probe]] * 2


def test_a_leave_without_its_enter_does_not_pop_the_parent() -> None:
    model, running = _model(root=True)

    def refuse(module: nn.Module, args: Any) -> None:
        raise KeyError("refused")

    # registered before the entry, so they run before ours: a pre-hook of ``after`` that raises (ours never pushes
    # it, but its leave still runs), and a leaving hook of the model that looks at the stack
    model.after.register_forward_pre_hook(refuse)
    parent_seen: list[list[nn.Module]] = []
    model.register_forward_hook(lambda m, a, o: parent_seen.append(list(running.stack)), always_call=True)
    with running:
        with pytest.raises(KeyError):
            model(torch.zeros(1))
        assert running.stack == []
    # when the model's own leaving hooks run, ``after``'s leave popped nothing: the model is still on top
    assert parent_seen == [[model]]
