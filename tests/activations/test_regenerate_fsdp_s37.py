"""The link ``ActivationCheckpointing(regenerate=n)`` makes through FSDP2's pre-forward function (session 37, issue 51).

FSDP2 hands each unit its input through ``RegisterPostBackwardFunction`` (its post-backward hook), which returns the
tensor it is given as another tensor of the same data. ``Record.gave`` links through it (the block fed remakes its
input) only where that function's node takes the very output the block returned, the data is the same, and the block
run again is a unit of its own (``remake`` gathers it); otherwise the input is kept, as before. The 2-rank fits are in
``tests/strategies/test_fsdp_sequential_blocks_s35.py``; this is the link alone, in one process (no process group:
the function's forward only passes its inputs on).
"""

from __future__ import annotations

import gc
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp._fully_shard._fsdp_param_group import RegisterPostBackwardFunction

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.regenerate import Record


def _record(block: nn.Module, x: torch.Tensor) -> tuple[Record, torch.Tensor]:
    from lightning_hbm.activations.replay import ForwardState

    record = Record(block, block.forward, (x,), {}, ForwardState(block), lambda t: t)
    out = block(x)
    record.returned(out)
    return record, out


def test_fsdp_function_output_is_linked_to_the_block_output() -> None:
    x = torch.randn(2, 8, requires_grad=True)
    block = nn.Linear(8, 8)
    record, out = _record(block, x)
    handed = RegisterPostBackwardFunction.apply(None, out)[0]
    assert handed is not out and handed.data_ptr() == out.data_ptr()
    assert torch_compat.passed_through_fsdp(handed, out)
    other = out * 1  # the same values, computed again: another tensor
    assert not torch_compat.passed_through_fsdp(RegisterPostBackwardFunction.apply(None, other)[0], out)
    assert not torch_compat.passed_through_fsdp(out.view(2, 8), out)  # a view is no FSDP2 hand-over
    assert not torch_compat.passed_through_fsdp(RegisterPostBackwardFunction.apply(None, out[:1])[0], out)  # other data
    # the block is no FSDP2 unit of its own (nothing would gather it for the remake): its output is not linked through
    assert record.gave(out) and not record.gave(handed)


def test_gathered_leaves_a_module_that_is_no_unit_alone() -> None:
    block = nn.Linear(4, 4)
    weight = block.weight
    with torch_compat.fsdp_gathered(block):
        assert block.weight is weight
    assert not torch_compat.is_fsdp_unit(block)


def test_a_real_fsdp2_unit_hands_its_input_over_linked(tmp_path: Any) -> None:
    """One gloo rank, two ``fully_shard`` units in an ``nn.Sequential``: the tensor the second unit's forward gets is
    FSDP2's hand-over of the first unit's output (linked), each block is a unit, and ``fsdp_gathered`` runs a unit's
    forward outside its ``__call__`` with its parameters gathered, leaving it sharded as it found it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    seen: list[torch.Tensor] = []
    outputs: list[torch.Tensor] = []
    try:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
        for block in model:
            fully_shard(block)
        fully_shard(model)
        model[1].register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        model[0].register_forward_hook(lambda _m, _a, out: outputs.append(out))
        model(torch.randn(2, 8, requires_grad=True)).sum().backward()
        assert all(torch_compat.is_fsdp_unit(block) for block in model)
        assert seen[0] is not outputs[0] and torch_compat.passed_through_fsdp(seen[0], outputs[0])
        from lightning_hbm.activations.replay import ForwardState

        record = Record(model[0], model[0].forward, (None,), {}, ForwardState(model[0]), lambda t: t)
        record.returned(outputs[0])
        assert record.gave(seen[0])  # a unit of its own: linked through FSDP2's hand-over
        outputs[0].mul_(2)  # changed in place since the block returned it: not what a remake makes
        assert not record.gave(seen[0]) and not record.gave(outputs[0])
        sharded = type(model[0].weight)
        with torch_compat.fsdp_gathered(model[0]):
            assert type(model[0].weight) is not sharded  # gathered: a plain tensor, the forward runs outside __call__
            again = type(model[0]).forward(model[0], torch.ones(1, 8))
        assert type(model[0].weight) is sharded and again.shape == (1, 8)
    finally:
        seen.clear()  # the hooks' lists hold the outputs, whose nodes hold the record, which holds the model: a cycle
        outputs.clear()
        dist.destroy_process_group()
        gc.collect()


def test_unit_boundaries_that_cut_the_chains(tmp_path: Any) -> None:
    """Which checkpointed blocks keep their input under FSDP2, known once the units exist (session 38): one gloo rank,
    eight blocks held as four two-block ``Pair`` units (a user's ``shard_modules``): the first block of pairs 1 to 3
    is fed across a unit boundary by a block that is no unit of its own, so it starts a new chain; every block a unit
    of its own, or one unit around them all: none. Then the inputs kept: 4 of 8 with ``regenerate=3`` (3 linked)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from lightning_hbm.activations.regenerate import kept_inputs, unit_crossings

    def pairs() -> nn.Module:
        return nn.Sequential(*(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(4)))

    names = [f"{p}.{b}" for p in range(4) for b in range(2)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        in_pairs = pairs()
        for pair in in_pairs:
            fully_shard(pair)
        crossings = unit_crossings(in_pairs, names)
        assert [(c.name, c.before, c.source_unit, c.entered) for c in crossings] == [
            ("1.0", "0.1", "0", ["1"]), ("2.0", "1.1", "1", ["2"]), ("3.0", "2.1", "2", ["3"])]
        each = pairs()
        for name in names:
            fully_shard(each.get_submodule(name))
        fully_shard(each)  # a unit around units of their own: each block's input is handed over once, linked
        assert unit_crossings(each, names) == []
        around = pairs()
        fully_shard(around)  # one unit around them all: the blocks feed each other directly
        assert unit_crossings(around, names) == [] and unit_crossings(pairs(), names) == []  # no FSDP2: none
        # the class name the fix offers is the user's, not FSDP2's generated FSDP<Name> (session 38)
        assert type(in_pairs[0]).__name__ == "FSDPSequential" and torch_compat.own_class_name(in_pairs[0]) == "Sequential"
        assert torch_compat.own_class_name(nn.Linear(2, 2)) == "Linear"
    finally:
        dist.destroy_process_group()
    assert kept_inputs(8, 3, [2, 4, 6]) == 4 and kept_inputs(8, 3) == 3
    assert kept_inputs(8, 2, [2, 4, 6]) == kept_inputs(8, 2) == 4  # the pairs' first blocks keep theirs anyway
    assert kept_inputs(8, 1) == 8 and kept_inputs(7, 4, [2]) == 3 and kept_inputs(7, 4, [3]) == kept_inputs(7, 4) == 2
