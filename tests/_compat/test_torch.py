"""lightning_hbm._compat.torch against the installed torch: each test fails when torch changes the internal."""

from __future__ import annotations

import inspect

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_hbm._compat import _disable_current_modes
from lightning_hbm._compat import torch as compat


def test_override_forward_keeps_hooks_and_restores_the_class_forward() -> None:
    torch.manual_seed(0)
    layer, x, hooked = nn.Linear(4, 3), torch.randn(2, 4), []
    layer.register_forward_hook(lambda m, args, out: hooked.append(out))
    expected = layer(x)
    assert compat.forward_override(layer) is None
    compat.override_forward(layer, lambda inp: torch.zeros(2, 3))
    assert compat.forward_override(layer) is not None
    torch.testing.assert_close(layer(x), torch.zeros(2, 3))  # __call__ finds the instance's forward
    assert len(hooked) == 2  # and still runs the module's hooks
    compat.override_forward(layer, None)
    assert compat.forward_override(layer) is None
    torch.testing.assert_close(layer(x), expected)


def test_load_state_dict_pre_hooks_lists_the_registered_callables() -> None:
    layer = nn.Linear(2, 2)

    def hook(*args: object) -> None:
        return None

    layer.register_load_state_dict_pre_hook(hook)
    assert compat.load_state_dict_pre_hooks(layer) == [hook]
    assert compat.load_state_dict_pre_hooks(nn.Linear(2, 2)) == []


def test_memory_history_functions_exist_with_their_arguments() -> None:
    """CUDA-only to call (untested here on a GPU); their names and keyword arguments are checked."""
    record = inspect.signature(torch.cuda.memory._record_memory_history).parameters
    assert {"enabled", "max_entries"} <= set(record)
    assert "filename" in inspect.signature(torch.cuda.memory._dump_snapshot).parameters
    # the wrappers pass by keyword / position exactly like the profiler's calls
    assert inspect.signature(compat.dump_memory_snapshot).parameters.keys() == {"path"}


def test_disable_current_modes_leaves_a_fake_mode() -> None:
    with FakeTensorMode():
        assert isinstance(torch.zeros(2), FakeTensor)
        with _disable_current_modes():
            real = torch.zeros(2)
    assert not isinstance(real, FakeTensor)
