"""Cutting a model's largest list of repeated blocks to the few the planner traces.

The planner traces a deep model cut to 3 and 4 blocks and extends the line (:mod:`lightning_hbm.planner.api`): only a
list whose blocks are alike from :data:`_ALIKE_FROM` on can be cut so (:func:`_block_list`); it is cut in place
(:func:`_cut_blocks`) or inside a context (:func:`_blocks_cut`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Optional, cast

from torch import nn

from lightning_hbm._compat.torch import child_items, set_child_items
from lightning_hbm.layers.blocks import find_blocks


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
    # blocks held as plain children (timm RegNet's RegStage: b1..bN) cannot be sliced off: traced whole
    lists = {path: items for path, items in lists.items() if isinstance(_list_at(module, path), (nn.ModuleList, nn.Sequential))}
    alike = {path: len(items) for path, items in lists.items() if len({_signature(b) for b in items[_ALIKE_FROM:]}) <= 1
             and _one_run(_list_at(module, path), items)}
    return max(alike.items(), key=lambda item: item[1]) if alike else ("", 0)


def _positions(blocks: nn.Module, items: list[nn.Module]) -> list[int]:
    """Where the blocks ``items`` are among the items of the list ``blocks``."""
    at = {id(child): i for i, child in enumerate(child for _, child in child_items(blocks))}
    return [at[id(block)] for block in items]


def _one_run(blocks: nn.Module, items: list[nn.Module]) -> bool:
    """Whether the blocks ``items`` of the list ``blocks`` from :data:`_ALIKE_FROM` on are one run of its items, nothing
    between them, so that a cut removes blocks only.

    A Sequential whose blocks lie between other layers (diffusers AutoencoderTiny: a strided convolution, blocks, a
    strided convolution, ...) adds each further block at another resolution: no line through two cuts is the model's,
    traced whole at once (it was cut, the line refused, then traced whole: three traces for one). One whose run of
    blocks is followed by other layers (a head) is cut inside the run, its head kept (session 39: its items were cut,
    the head with them, to 2 and 3 blocks)."""
    run = _positions(blocks, items)[_ALIKE_FROM:]
    return not run or run == list(range(run[0], run[0] + len(run)))


def _cut_items(blocks: nn.Module, items: list[nn.Module], keep: int) -> list[tuple[str, nn.Module]]:
    """Remove the blocks ``items`` after the ``keep``-th from the list ``blocks``, not the layers after them (one run:
    :func:`_one_run`); returns its items as they were. A Sequential keeps its items' names (a head's is looked up by
    name: ``layer_modes``, ``ignore_modules``); a ModuleList, all blocks, is cut at its end."""
    before = child_items(blocks)
    at = _positions(blocks, items)
    if keep < len(at):
        if isinstance(blocks, nn.Sequential):
            set_child_items(blocks, before[: at[keep]] + before[at[-1] + 1:])
        else:
            del cast(nn.ModuleList, blocks)[at[keep]: at[-1] + 1]
    return before


def _cut_blocks(module: nn.Module, keep: Optional[int], path: Optional[str] = None) -> tuple[str, int]:
    """Cut the largest list of repeated blocks to ``keep`` (in place); returns its path and full length (0: none).

    ``path``: the list the template was already cut at (:func:`_blocks_cut`): only that one is cut here (blocks
    configure_model added). Chosen again on the cut model, the largest list is another one: timm RepVGG's 4-block
    stage once its 14-block stage is cut to 3, cut to 3 in the trace of 3 and not in the trace of 4, and the line
    through them planned 15 % over the model (session 38)."""
    # the blocks at ``path``, not the list's length: a Sequential holds other layers between its blocks (diffusers'
    # AutoencoderTiny: 2 blocks in 5 layers, cut to 3 it lost its encoder's last layers; session 38)
    parent, depth = _block_list(module) if path is None else (path, len(_cut_list(module, path)))
    if keep is not None and depth > keep:
        _cut_items(_list_at(module, parent), _cut_list(module, parent), keep)
    return parent, depth


def _list_at(module: nn.Module, path: str) -> nn.ModuleList:
    return cast(nn.ModuleList, module.get_submodule(path) if path else module)  # a ModuleList or Sequential


@contextmanager
def _blocks_cut(module: nn.Module, keep: Optional[int]) -> Iterator[tuple[str, int]]:
    """The largest list of repeated blocks cut to ``keep`` inside the context, restored after; yields its path and
    length."""
    parent, depth = _block_list(module)
    if keep is None or depth <= keep:
        yield parent, depth
        return
    blocks = _list_at(module, parent)
    before = _cut_items(blocks, _cut_list(module, parent), keep)
    try:
        yield parent, depth
    finally:
        set_child_items(blocks, before)


def _cut_list(module: nn.Module, path: Optional[str] = None) -> list[nn.Module]:
    """The blocks of the list the planner cuts (:func:`_block_list`; ``path``: the one it cut), as the traced model
    holds them."""
    if path is not None:  # none there: the surgery renamed the path (a ConvNext's stages under LoRA), chosen again
        return [block for name, block in _blocks(module) if name.rpartition(".")[0] == path] or _cut_list(module)
    parent = _block_list(module)[0]
    return [block for name, block in _blocks(module) if name.rpartition(".")[0] == parent]
