"""Ranks that built different frozen bases, refused before the first change."""

from __future__ import annotations

from typing import Any, Optional

from torch import nn

from lightning_hbm.surgery.record import _RECORD_ATTR


def check_ranks(module: nn.Module, meta: Optional[dict[str, Any]], restoring: bool) -> None:
    """Refuse, before the first change, ranks that built different frozen bases (a collective: every rank calls it).

    DDP broadcasts rank 0's parameters and buffers, but bitsandbytes' quantization constants are neither, and
    FSDP broadcasts nothing: ranks that built different weights would train on different frozen bases without a
    word. Compared: the as-built fingerprints of the tensors no checkpoint restores (with a lightning_hbm
    checkpoint, the base it left out; with a plain one, nothing; without one, every tensor).
    """
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return
    prints: dict[str, Optional[str]] = getattr(module, _RECORD_ATTR)["fingerprints"]
    if restoring:
        keys = set((meta or {}).get("omitted", []))
        prints = {k: v for k, v in prints.items() if k in keys}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, prints)
    for rank, other in enumerate(gathered[1:], start=1):
        differ = [k for k in gathered[0] if k in other and gathered[0][k] != other[k]]
        if differ:
            raise ValueError(
                f"Rank {rank} built another model than rank 0: {len(differ)} tensor(s) differ, first {differ[0]!r}. "
                "Every rank must build the same frozen base (its quantization constants are not synchronised, so "
                "the ranks would train on different bases): seed before building the model on every rank "
                "(lightning.seed_everything(0) or torch.manual_seed(0), not a per-rank seed) or load the same "
                "pretrained weights on every rank."
            )
