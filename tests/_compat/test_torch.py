"""lightning_hbm._compat.torch against the installed torch: each test fails when torch changes the internal."""

from __future__ import annotations

import inspect
import warnings

import pytest
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


def test_private_base_classes_cover_every_kind() -> None:
    for conv in (nn.Conv1d(1, 1, 1), nn.Conv2d(1, 1, 1), nn.Conv3d(1, 1, 1), nn.ConvTranspose2d(1, 1, 1)):
        assert isinstance(conv, compat.ConvNd)
    for norm in (nn.BatchNorm1d(2), nn.BatchNorm2d(2), nn.SyncBatchNorm(2)):
        assert isinstance(norm, compat.BatchNormBase)
    assert not isinstance(nn.LayerNorm(2), compat.BatchNormBase) and not isinstance(nn.Linear(1, 1), compat.ConvNd)


def test_foreach_norm_is_each_tensors_2_norm() -> None:
    tensors = [torch.ones(3, 4), torch.zeros(5), torch.full((2,), 3.0)]
    assert [float(n) for n in compat.foreach_norm(tensors)] == [pytest.approx(12**0.5), 0.0, pytest.approx(18**0.5)]


def test_int_mm_multiplies_int8_into_int32() -> None:
    a = torch.randint(-128, 127, (32, 64), dtype=torch.int8)
    b = torch.randint(-128, 127, (64, 32), dtype=torch.int8)
    out = compat.int_mm(a, b)
    assert out.dtype == torch.int32
    torch.testing.assert_close(out, (a.long() @ b.long()).int())


class _Shell(torch.Tensor):
    """A wrapper subclass that owns no memory (as FusedLoss's LazyLogits)."""

    @staticmethod
    def __new__(cls) -> "_Shell":
        return compat.make_wrapper_subclass(cls, (3, 5), dtype=torch.float16, device="cpu", requires_grad=False)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        with compat.disable_torch_function_subclass():
            return func(*args, **(kwargs or {}))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{func} reached dispatch: the torch-function passthrough did not hold")


def test_wrapper_subclass_and_torch_function_passthrough() -> None:
    shell = _Shell()
    assert shell.shape == (3, 5) and shell.dtype == torch.float16 and isinstance(shell, _Shell)
    assert type(shell.size()) is torch.Size  # the metadata call ran as on a plain tensor, no recursion
    assert compat.parse_to("cpu", torch.float16) == (torch.device("cpu"), torch.float16, False, None)
    assert compat.parse_to(dtype=torch.bfloat16)[1] == torch.bfloat16


def test_child_schedulers_and_packed_qkv() -> None:
    optimizer = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    first, second = torch.optim.lr_scheduler.ConstantLR(optimizer), torch.optim.lr_scheduler.ExponentialLR(optimizer, 0.9)
    assert compat.child_schedulers(torch.optim.lr_scheduler.SequentialLR(optimizer, [first, second], milestones=[1])) == [first, second]
    assert compat.child_schedulers(first) == []
    assert compat.packed_qkv(nn.MultiheadAttention(8, 2)) is True
    assert compat.packed_qkv(nn.MultiheadAttention(8, 2, kdim=4, vdim=4)) is False


@pytest.mark.parametrize("tracked", [True, False])
def test_track_step_called_is_what_lr_schedulers_check(tracked: bool) -> None:
    """A scheduler moved onto a new optimizer warns "lr_scheduler.step() before optimizer.step()" unless tracked."""
    params = list(nn.Linear(2, 2).parameters())
    scheduler = torch.optim.lr_scheduler.ExponentialLR(torch.optim.SGD(params, lr=0.1), 0.9)
    new = torch.optim.SGD(params, lr=0.1)
    scheduler.optimizer = new
    if tracked:
        compat.track_step_called(new)
    new.step()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scheduler.step()
    order = [w for w in caught if "optimizer.step()" in str(w.message)]
    assert bool(order) is not tracked, [str(w.message) for w in caught]


def test_is_fake_tells_a_fake_tensor_from_a_real_one() -> None:
    with FakeTensorMode():
        fake = torch.empty(2, 3)
    assert compat.is_fake(fake) and not compat.is_fake(torch.empty(2, 3))


def test_grouped_mm_meta_refuses_float32_and_the_shim_gives_the_cpu_kernel_shapes() -> None:
    """torch's meta kernel of ``_grouped_mm`` wants bf16 where its CPU kernel takes float32 (torch 2.13): when torch
    fixes it, ``FakeGroupedMM`` can go."""
    a, w = torch.randn(10, 8), torch.randn(3, 8, 4)
    offs = torch.tensor([3, 7, 10], dtype=torch.int32)
    real = torch._grouped_mm(a, w, offs=offs)
    batched = torch._grouped_mm(torch.randn(3, 5, 8), w)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fa, fw, foffs = mode.from_tensor(a), mode.from_tensor(w), mode.from_tensor(offs)
        with pytest.raises(RuntimeError, match="BF16"):
            torch._grouped_mm(fa, fw, offs=foffs)
        with compat.FakeGroupedMM():
            fake = torch._grouped_mm(fa, fw, offs=foffs)
            fake_batched = torch._grouped_mm(mode.from_tensor(torch.randn(3, 5, 8)), fw)
    assert isinstance(fake, FakeTensor) and fake.shape == real.shape and fake.dtype == real.dtype
    assert fake_batched.shape == batched.shape


def test_loader_as_it_was_shuts_down_the_persistent_pass_torch_keeps_in_iterator() -> None:
    """torch keeps a persistent-workers pass in ``DataLoader._iterator`` and resets it at the next ``iter``."""
    from torch.utils.data import DataLoader

    loader = DataLoader(list(range(4)), batch_size=2, num_workers=1, persistent_workers=True)
    with compat.loader_as_it_was(loader):
        assert next(iter(loader)).tolist() == [0, 1]
        started = loader._iterator
        assert started is not None and iter(loader) is started  # reused, only reset: what the context undoes
    assert loader._iterator is None and not started._workers_status[0]  # its worker told to stop
    assert next(iter(loader)).tolist() == [0, 1]
    with compat.loader_as_it_was(iter([1, 2])):  # no attributes (a generator): nothing to put back
        pass


def test_a_kept_pass_is_what_the_loaders_next_iter_returns_and_persistent_workers_reset_it() -> None:
    """``draw_keeping_the_pass`` relies on ``DataLoader.__iter__`` calling ``self._get_iterator()`` (an instance
    attribute shadows it) and, with persistent workers, on ``_iterator`` being ``None`` for a new pass and reset after."""
    from torch.utils.data import DataLoader, IterableDataset

    class Numbers(IterableDataset):
        def __iter__(self):  # type: ignore[no-untyped-def]
            return iter(range(3))

    for workers in (0, 1):
        loader = DataLoader(Numbers(), batch_size=None, num_workers=workers, persistent_workers=workers > 0)
        first, given = compat.draw_keeping_the_pass(loader)  # type: ignore[misc]
        assert given is loader and int(first) == 0 and loader._iterator is None
        assert [int(x) for x in loader] == [0, 1, 2] and "_get_iterator" not in vars(loader)
        assert [int(x) for x in loader] == [0, 1, 2]  # the next epoch: a new pass (or the persistent one reset)


def test_buffers_changed_in_training_are_the_ones_a_training_forward_changes() -> None:
    """BatchNorm's tracked statistics and spectral_norm's ``_u``/``_v`` (kept below its ParametrizationList)."""
    model = nn.Sequential(
        nn.utils.parametrizations.spectral_norm(nn.Linear(4, 4)), nn.BatchNorm1d(4), nn.BatchNorm1d(4, track_running_stats=False),
        nn.LayerNorm(4),
    )  # fmt: skip
    found = compat.buffers_changed_in_training(model)
    values = {id(b): b.clone() for b in model.buffers()}  # by value: BatchNorm's kernel does not bump _version
    model.train()(torch.randn(3, 4))
    changed = {id(b) for b in model.buffers() if not torch.equal(b, values[id(b)])}
    assert {id(b) for b in found} == changed and len(found) == 5  # u, v; running_mean, running_var, num_batches_tracked


def test_accumulates_into_tells_a_plain_backward_from_autograd_grad_and_inputs() -> None:
    # torch._C._will_engine_execute_node has no public name: this fails when torch renames or changes it
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    seen: list[tuple[bool, bool]] = []

    class _Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            seen.append((compat.accumulates_into([a]), compat.accumulates_into([a, b])))
            return grad

    def loss() -> torch.Tensor:
        return _Probe.apply(a * b).sum()

    loss().backward()
    torch.autograd.grad(loss(), [a])
    loss().backward(inputs=[a])
    assert seen == [(True, True), (False, False), (True, False)]


def test_fake_device_answers_the_device_queries_fake_tensors_send_through_every_mode() -> None:
    """torch's C++ asks a FakeTensor its device through the dispatch (``prim.device``), past every Python mode above the
    fake mode, at nearly every op: ``fake_device`` gives the fake mode's own answer, and None for anything else."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self, answer: bool) -> None:
            super().__init__()
            self.answer, self.queries, self.ops = answer, 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            device = compat.fake_device(func, args) if self.answer else None
            if device is not None:
                self.queries += 1
                return device
            self.ops += func is not compat.PRIM_DEVICE
            return func(*args, **(kwargs or {}))

    outputs = []
    for answer in (False, True):
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, Seen(answer) as seen:
            x = mode.from_tensor(torch.randn(4, 8)).requires_grad_()
            y = (torch.nn.functional.linear(x, torch.ones(3, 8)) * 2).sum()
            y.backward()
            outputs.append((y.shape, y.device, x.grad.shape, x.grad.device, x.grad.is_meta, seen.ops))
        assert not answer or seen.queries > seen.ops  # most calls a mode sees on fake tensors are the device's
    assert outputs[0] == outputs[1]  # the same ops reach the fake mode, with the same devices
    assert compat.fake_device(torch.ops.aten.add.Tensor, (x, x)) is None  # another op
    assert compat.fake_device(compat.PRIM_DEVICE, (torch.ones(1),)) is None  # a real tensor (never asked so)


def test_module_to_swaps_a_fake_parameter_and_the_shim_keeps_it_as_a_real_one_is_kept() -> None:
    """torch 2.13's ``Module._apply`` swaps a FakeTensor parameter (``torch.utils.swap_tensors``: its ``__dict__`` too)
    where it sets ``.data`` of a real one: the attributes a quantized weight carries (bitsandbytes' ``quant_state``)
    were lost at a model's own ``layer.to(float32)``. When torch keeps them, ``fake_parameters_as_real_ones`` can go."""
    from lightning_hbm.planner.building import _fake_mode  # the planner's (no memo: torch swaps no weakly held tensor)

    with _fake_mode():
        layer = nn.Linear(4, 4)
        layer.weight.requires_grad_(False)
        layer.weight.quant_state = "state"
        layer.to(torch.float32)
        assert not hasattr(layer.weight, "quant_state")  # torch's own behaviour
        layer.weight.quant_state = "state"
        with compat.fake_parameters_as_real_ones():
            kept = layer.weight
            layer.to(torch.float32)  # the same view: nothing swapped
            assert layer.weight is kept and layer.weight.quant_state == "state"
            other = nn.Linear(4, 4)
            other.weight.quant_state = "state"
            other.to(torch.float64)  # a new storage: swapped, the attribute set back
            assert other.weight.dtype == torch.float64 and other.weight.quant_state == "state"
    assert torch.utils.swap_tensors is not None and torch.utils.swap_tensors.__name__ == "swap_tensors"


def test_a_fake_scalar_formats_as_its_value_inside_the_shim_only() -> None:
    """``Tensor.__format__`` gives a 0-d tensor's value only when its type is exactly ``Tensor``."""
    assert f"expert_{torch.tensor(3)}" == "expert_3"
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = mode.from_tensor(torch.tensor(3))
        assert f"{fake}".startswith("FakeTensor")
    from lightning_hbm.planner.realvalues import RealValues

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    values = RealValues(mode)
    with mode, values:
        index = torch.tensor([5, 3])[1]  # a small tensor: its real twin has the value
        assert f"expert_{index}" == "expert_3" and f"{torch.ones(2)}".startswith("FakeTensor")
    assert "__format__" not in vars(FakeTensor)


def test_memtracker_without_module_hooks_still_counts_a_step() -> None:
    """``without_module_hooks`` swaps MemTracker's private ``_mod_tracker``; fails when torch renames it or asks its
    ModTracker for something ``_NoModuleHooks`` does not answer (planner/reference.py's ``module_hooks=False``)."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.distributed._tools.mod_tracker import ModTracker

    tracker = MemTracker()
    assert isinstance(tracker._mod_tracker, ModTracker)
    for name in ("parents", "is_bw", "register_user_hooks", "clear_user_hooks", "get_known_fqn"):
        assert hasattr(tracker._mod_tracker, name) and hasattr(compat._NoModuleHooks, name)
    compat.without_module_hooks(tracker)
    layer = torch.nn.Linear(64, 64)
    with tracker:
        layer(torch.ones(8, 64)).sum().backward()
    peaks = tracker.get_tracker_snapshot("peak")
    assert sum(snapshot["Total"] for snapshot in peaks.values()) > 64 * 64 * 4


def test_real_tensors_are_made_inside_a_fake_mode() -> None:
    """``real_tensors`` (torch's ``unset_fake_temporarily``): a tensor made in it under a FakeTensorMode is a real one,
    which bitsandbytes' ``Params4bit`` can wrap (``precision.sensitivity.weight_bytes`` under the planner's trace)."""
    with FakeTensorMode():
        assert isinstance(torch.zeros(2), FakeTensor)
        with compat.real_tensors():
            made = torch.zeros(2)
    assert not isinstance(made, FakeTensor) and made.sum().item() == 0


def test_child_items_lists_each_registration_and_set_child_items_keeps_names() -> None:
    block, head = nn.Linear(2, 2), nn.Linear(2, 1)
    seq = nn.Sequential(block, block, head)
    assert compat.child_items(seq) == [("0", block), ("1", block), ("2", head)]
    compat.set_child_items(seq, [("0", block), ("2", head)])
    assert [name for name, _ in seq.named_children()] == ["0", "2"]
    assert seq.get_submodule("2") is head and len(seq) == 2
    torch.testing.assert_close(seq(torch.ones(1, 2)), head(block(torch.ones(1, 2))))
