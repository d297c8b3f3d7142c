"""``activations/checkpointing.py`` split (issue 54, session 34): the callback a thin face over the mechanism.

The mechanism lives in ``block_forward`` (one block's checkpointed forward) and ``recompute`` (the blocks chosen and
wrapped, what the first step tells); ``checkpointing`` holds the ``ActivationCheckpointing`` callback only and keeps
every name imported from it before importable, including the classes a model pickled before the split names there.
"""

from __future__ import annotations

import ast
import pickle
from pathlib import Path

import torch

from lightning_hbm import ActivationCheckpointing, record
from lightning_hbm.activations import block_forward, recompute
from lightning_hbm.layers.blocks import find_blocks as moved_find_blocks
from tests.test_renamed_s33 import _llama, _loss_and_grads  # the same Llama and step, one definition

ROOT = Path(__file__).resolve().parents[2]


def test_the_callback_module_holds_the_callback_only() -> None:
    """No function, and no class but the callback, in ``checkpointing.py``: the mechanism is in its own modules."""
    tree = ast.parse((ROOT / "lightning_hbm" / "activations" / "checkpointing.py").read_text())
    defined = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    assert defined == ["ActivationCheckpointing"]


def test_the_names_imported_from_checkpointing_before_the_split_still_are() -> None:
    from lightning_hbm.activations.checkpointing import (  # noqa: F401  # every one of them, as tests and the planner did
        PIECE_BYTES,
        ActivationCheckpointing,
        OffloadSavedTensors,
        _BlockPlan,
        _BlockSetup,
        _CheckpointedForward,
        _Pieces,
        check_offload_blocks,
        find_blocks,
        host_footprint,
        mutated_arguments,
        pinned_footprint,
        pinned_pieces,
        report_chunks,
    )

    assert _BlockSetup is _BlockPlan is block_forward._BlockSetup
    assert _CheckpointedForward is block_forward._CheckpointedForward
    assert check_offload_blocks is recompute.check_offload_blocks and report_chunks is recompute.report_chunks
    assert mutated_arguments is block_forward.mutated_arguments and find_blocks is moved_find_blocks


def test_a_model_pickled_before_the_split_loads_and_its_blocks_still_checkpoint() -> None:
    """transformers' Llama, checkpointed, pickled now (its classes named under ``block_forward``) and as the code
    before the split pickled it (named under ``checkpointing``): both load, their blocks checkpointed, and a training
    step gives the loss and the gradients of the model they were pickled from."""
    model = _llama()
    callback = ActivationCheckpointing()
    callback.transform_model(model)
    data = pickle.dumps(model, protocol=0)  # protocol 0 spells each class path as text
    for name in (b"_BlockSetup", b"_CheckpointedForward"):
        assert data.count(b"clightning_hbm.activations.block_forward\n" + name + b"\n") == 1
    before = data.replace(b"clightning_hbm.activations.block_forward\n", b"clightning_hbm.activations.checkpointing\n")
    assert b"block_forward" not in before

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    loss, grads = _loss_and_grads(model, ids)
    for copy in (pickle.loads(data), pickle.loads(before)):
        assert record.checkpointed_blocks(copy) == callback.checkpointed == ["model.layers.0", "model.layers.1", "model.layers.2"]
        assert all(type(record.checkpoint_setup(b)) is block_forward._BlockSetup for b in copy.model.layers)
        assert all(type(b.forward) is block_forward._CheckpointedForward and b.forward.block is b for b in copy.model.layers)
        copy_loss, copy_grads = _loss_and_grads(copy, ids)
        assert torch.equal(loss, copy_loss) and len(grads) == len(copy_grads) > 0
        assert all(torch.equal(a, b) for a, b in zip(grads, copy_grads))
