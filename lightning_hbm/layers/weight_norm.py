"""A layer's ``weight_norm`` as the model built it: where its factors live and how they make the weight.

torch has two: the parametrization (``torch.nn.utils.parametrizations.weight_norm``, transformers' Wav2Vec2 / HuBERT
positional convolution: ``parametrizations.weight.original0`` = ``g``, ``original1`` = ``v``) and the older hook
(``torch.nn.utils.weight_norm``: ``weight_g``, ``weight_v``). Both compute ``weight = g * v / ||v||``, the norm taken
over every dimension but ``dim``. A quantized convolution folds the weight into one stored tensor
(:mod:`lightning_hbm.layers.conv`) and keeps the :class:`WeightNorm` it came from, so resume maps the storage to
``v`` and ``LoRA.merge`` writes a merged weight back as the factors the model as built loads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, cast

import torch
from torch import nn

from lightning_hbm._compat import torch as torch_compat


@dataclass(frozen=True)
class WeightNorm:
    """The as-built keys (local to the layer) of a weight_norm's factors and the dimension its norm keeps."""

    g: str  #: the norm, e.g. ``parametrizations.weight.original0``
    v: str  #: the direction, e.g. ``parametrizations.weight.original1``
    dim: int  #: torch's own: ``-1`` for ``dim=None`` (one norm over the whole weight)

    def weight(self, g: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The weight the factors compute, by torch's own kernel (bit-exact with the layer's forward)."""
        return torch_compat.weight_norm(v, g, self.dim)

    def factors(self, weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """``weight`` as factors the weight_norm computes back (``v`` = the weight, ``g`` = its norm: torch's own
        ``right_inverse``, what ``weight_norm`` sets when it is applied)."""
        return {self.g: torch.norm_except_dim(weight, 2, self.dim), self.v: weight}


def weight_norm_of(layer: nn.Module) -> Optional[WeightNorm]:
    """The weight_norm that computes ``layer.weight`` (the only parametrization of it, or the hook), else ``None``."""
    if torch.nn.utils.parametrize.is_parametrized(layer):
        listed = cast(nn.ModuleDict, layer.parametrizations)
        chain: list[Any] = list(cast(nn.ModuleList, listed["weight"])) if "weight" in listed else []
        if list(listed.keys()) != ["weight"] or len(chain) != 1 or type(chain[0]).__name__ != "_WeightNorm":
            return None  # another parametrization (spectral_norm, orthogonal), or a chain: no factors g and v
        return WeightNorm("parametrizations.weight.original0", "parametrizations.weight.original1", int(chain[0].dim))
    hooks: list[Any] = list(layer._forward_pre_hooks.values())
    hook = next((h for h in hooks if type(h).__name__ == "WeightNorm" and h.name == "weight"), None)
    return None if hook is None else WeightNorm("weight_g", "weight_v", int(hook.dim))


def floating_weight(layer: nn.Module) -> bool:
    """Whether ``layer``'s weight is floating point, told without computing a parametrized one: spectral_norm's
    computation in training mode advances its power iteration (buffers ``_u``, ``_v``) in place, so each such check
    at fit start moved it, and a resumed run was not the one it continued (the factors' dtypes tell)."""
    if torch.nn.utils.parametrize.is_parametrized(layer, "weight"):
        listed = cast(nn.ModuleDict, layer.parametrizations)["weight"]
        return all(t.is_floating_point() for t in (*listed.parameters(recurse=False), *listed.buffers(recurse=False)))
    return cast(torch.Tensor, layer.weight).is_floating_point()


__all__ = ["WeightNorm", "floating_weight", "weight_norm_of"]
