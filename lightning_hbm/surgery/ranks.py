"""Every rank starts from rank 0's model as built, as DDP does; then the ranks are asserted equal.

Plain DDP broadcasts rank 0's parameters and buffers when it wraps the module, so a model built without a seed
trains the same on every rank. lightning_hbm quantizes before that wrap, and bitsandbytes' quantization constants
are neither parameters nor buffers (DDP's broadcast would not reach them); FSDP2 broadcasts nothing. So the surgery
sends rank 0's model as built to every rank *before* quantizing (DDP and FSDP alike): quantization is deterministic
given equal inputs, so the ranks then agree by construction.
"""

from __future__ import annotations

import logging
from typing import Any, Iterator, Optional, cast

import torch
from torch import nn

from lightning_hbm import resume
from lightning_hbm.record import as_built, set_as_built

log = logging.getLogger(__name__)


def check_ranks(module: nn.Module) -> None:
    """Give every rank rank 0's model as built, then assert the ranks agree (a collective: every rank calls it).

    Sent: every parameter and buffer (and the quantization constants of a layer quantized before the surgery),
    byte for byte, from rank 0. Cost: the bytes of the model as built go once to every rank, before quantization
    shrinks them (4 bytes a parameter in fp32: 540 MB for a 135M model, 28 GB for a 7B one; DDP's own broadcast
    then sends the quantized model again). Ranks whose parameters or buffers differ in name, shape or dtype are
    refused before anything is sent. The broadcast comes before the surgery's checks, so every rank checks the
    same model (and all raise the same error together, instead of one rank raising while another waits).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    tensors = list(_tensors(module))
    _check_structure(tensors)
    changed = _broadcast(tensors)
    # rank 0's record (schema, as-built fingerprints) is now every rank's: its checkpoints name rank 0's base
    record: list[Optional[dict[str, Any]]] = [as_built(module)]
    dist.broadcast_object_list(record, src=0)
    set_as_built(module, record[0])
    _assert_equal(tensors, changed)


def _tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters, buffers (persistent or not: DDP sends both), and quantization constants already on the model."""
    for name, param in module.named_parameters():
        yield name, param
        state, prefix = getattr(param, "quant_state", None), f"{name}.quant_state"  # bnb 4-bit: absmax, code, state2
        while state is not None:
            for attr, value in sorted(vars(state).items()):
                if isinstance(value, torch.Tensor):
                    yield f"{prefix}.{attr}", value
            state, prefix = getattr(state, "state2", None), f"{prefix}.state2"
        if isinstance(getattr(param, "SCB", None), torch.Tensor):  # bitsandbytes int8: row scales
            yield f"{name}.SCB", cast(Any, param).SCB  # bitsandbytes Int8Params
    yield from module.named_buffers()


def _sendable(tensor: torch.Tensor) -> bool:
    # meta and fake tensors have no data, wrapper subclasses (DTensor, NF4Tensor) their own layout: not sent.
    # Parameter subclasses without a dispatch of their own (bitsandbytes' Params4bit, Int8Params) hold plain data.
    return (
        not tensor.is_meta and tensor.numel() > 0 and type(tensor).__torch_dispatch__ is torch.Tensor.__torch_dispatch__
    )


def _check_structure(tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Refuse, before anything is sent, ranks whose tensors differ in name, shape, dtype or kind."""
    import torch.distributed as dist

    mine = [(n, tuple(t.shape), str(t.dtype).replace("torch.", ""), _sendable(t)) for n, t in tensors]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    for rank, other in enumerate(gathered[1:], start=1):
        if other == gathered[0]:
            continue
        raise ValueError(
            f"Rank {rank} built another model than rank 0: {_first_difference(gathered[0], other)}. Every rank "
            "starts from rank 0's model as built (sent to the others before quantizing, as DDP does), which needs the "
            "same parameters and buffers, of the same shapes and dtypes, on every rank: build the same architecture "
            "on every rank (same configure_model)."
        )
    skipped = [n for n, t in tensors if not _sendable(t) and t.numel() > 0]  # (empty ones are equal anyway)
    if skipped and dist.get_rank() == 0:
        log.warning(
            "lightning_hbm: %d tensor(s) of the model as built are not sent from rank 0 (meta, fake or a tensor "
            "subclass), first %r: they must already be equal on every rank", len(skipped), skipped[0],
        )  # fmt: skip


def _first_difference(ours: list[tuple[Any, ...]], theirs: list[tuple[Any, ...]]) -> str:
    mine, other = {e[0]: e[1:] for e in ours}, {e[0]: e[1:] for e in theirs}
    for key in [*mine, *(k for k in other if k not in mine)]:
        if mine.get(key) != other.get(key):
            return f"tensor {key!r} is {_describe(other.get(key))} there, {_describe(mine.get(key))} on rank 0"
    return "the same tensors, in another order"  # sent in order: the order must be the same too


def _describe(entry: Optional[tuple[Any, ...]]) -> str:
    if entry is None:
        return "absent"
    shape, dtype, sendable = entry
    return f"{dtype} of shape {list(shape)}" + ("" if sendable else " (not sent: meta, fake, empty or a subclass)")


def _wire(tensor: torch.Tensor) -> torch.device:
    """Where ``tensor`` can travel: NCCL (and other accelerator-only backends) send device tensors only."""
    import torch.distributed as dist

    backend = str(dist.get_backend())
    if tensor.device.type != "cpu" or "gloo" in backend or "mpi" in backend:
        return tensor.device
    accelerator = torch.accelerator.current_accelerator()
    if accelerator is None:
        return tensor.device
    return torch.device(accelerator.type, torch.accelerator.current_device_index())


@torch.no_grad()
def _broadcast(tensors: list[tuple[str, torch.Tensor]]) -> list[str]:
    """Send each tensor's bytes from rank 0 (as uint8: any dtype, bool included); the names this rank had other."""
    import torch.distributed as dist

    changed, source = [], dist.get_rank() == 0
    for name, tensor in tensors:
        if not _sendable(tensor):
            continue
        data, wire = tensor.detach(), _wire(tensor)
        # one tensor at a time: at most one extra copy of the largest tensor lives while it travels
        if source:
            flat = data.reshape(-1).to(wire).contiguous()
        else:
            flat = torch.empty(data.numel(), dtype=data.dtype, device=wire)
        dist.broadcast(flat.view(torch.uint8), src=0)
        if source:
            continue
        if not torch.equal(flat.view(torch.uint8), data.reshape(-1).to(wire).contiguous().view(torch.uint8)):
            data.copy_(flat.view(data.shape))
            changed.append(name)
    return changed


def _assert_equal(tensors: list[tuple[str, torch.Tensor]], changed: list[str]) -> None:
    """After the broadcast every rank must hold rank 0's bytes: if not, it is a bug in lightning_hbm."""
    import torch.distributed as dist

    prints = {n: resume.fingerprint(t.detach()) for n, t in tensors if _sendable(t)}  # detach: a plain tensor
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (prints, len(changed), changed[:1]))
    for rank, (other, _, _) in enumerate(gathered[1:], start=1):
        differ = [k for k in gathered[0][0] if gathered[0][0][k] != other.get(k)]
        if differ:
            raise RuntimeError(
                f"lightning_hbm bug: after rank 0's model as built was sent to every rank, rank {rank} still differs "
                f"in {len(differ)} tensor(s), first {differ[0]!r}. Please report it with the model's class; until "
                "fixed, seed before building the model (the same seed on every rank) so that no tensor must be sent."
            )
    if dist.get_rank() == 0:
        sent = sum(t.numel() * t.element_size() for n, t in tensors if _sendable(t))
        others = [f"rank {r}: {count} (first {first[0]!r})" for r, (_, count, first) in enumerate(gathered) if count]
        log.info(
            "lightning_hbm: rank 0's model as built sent to every rank before quantizing, as DDP does (%d tensors, "
            "%.1f MiB)%s", len(prints), sent / 2**20,
            "; tensors that differed and now hold rank 0's values: " + ", ".join(others) if others else "",
        )  # fmt: skip
