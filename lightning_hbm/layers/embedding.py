"""Input embeddings (``nn.Embedding``) stored in the precision mode's format: ``QuantizedPrecision(quantize_embeddings=True)``.

What it shrinks: the **parameters** term. A language model's token embedding is ``vocabulary x hidden`` weights: 0.53 B
of Llama-3-8B's 8.03 B, 21 % of SmolLM2-135M. The weight, a ``[num_embeddings, embedding_dim]`` matrix, is stored by
the mode's own Linear layer (every mode, its constants, checkpoints, resume and the planner included, as a quantized
convolution's); a lookup unpacks only the rows it reads (:meth:`~lightning_hbm.precision.registry.QuantFormat.gather_rows`:
bitsandbytes 4-bit and int8 gather the packed rows and their scales; other formats dequantize the whole table first).

Only what is exactly ``nn.Embedding`` is converted: a subclass has a forward of its own (Gemma's scaled embedding
multiplies by ``sqrt(hidden)``) that a replacement would drop; it stays in the compute dtype with that reason. An
embedding whose weight is tied to the output head stays too (the head would need the same quantized copy). The
layers are not LoRA targets. A layer of this kind exists only once quantized: a plain embedding is counted with the
other parameters (embeddings, norms) in the coverage table.
"""

from __future__ import annotations

from typing import Any, Optional, cast

import torch
from torch import nn

from lightning_hbm.layers.base import LayerKind, no_names, register_kind
from lightning_hbm.memory.storage import quantized_format


class QuantizedEmbedding(nn.Embedding):
    """An ``nn.Embedding`` whose frozen weight a precision mode stores (module docstring); built by :meth:`from_quantized`."""

    compute_dtype: torch.dtype

    def storage(self) -> nn.Module:
        """The mode's layer holding the table as a ``[num_embeddings, embedding_dim]`` matrix."""
        return cast(nn.Module, self._modules["quantized"])

    @property
    def weight(self) -> torch.Tensor:  # type: ignore[override]
        # the table as a lookup reads it, dequantized on each read, never stored: for code that reads its shape,
        # dtype or device (a whole-table transient, which the lookup itself never makes)
        storage = self.storage()
        with torch.no_grad():
            return cast(Any, quantized_format(storage)).dequantize(storage, self.compute_dtype)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        storage = self.storage()
        rows = cast(Any, quantized_format(storage)).gather_rows(storage, input.reshape(-1), self.compute_dtype)
        return rows.view(*input.shape, self.embedding_dim)

    @classmethod
    def from_quantized(cls, embedding: nn.Embedding, quantized: nn.Module, dequantize: Any, dtype: torch.dtype) -> QuantizedEmbedding:
        """``embedding``'s replacement around ``quantized`` (the mode's layer built from :func:`_as_linear`)."""
        new = cls.__new__(cls)
        nn.Module.__init__(new)  # not nn.Embedding's: it would allocate a weight the storage holds
        for attribute in ("num_embeddings", "embedding_dim", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse"):
            setattr(new, attribute, getattr(embedding, attribute))
        new.quantized = quantized
        new.compute_dtype = dtype
        return new


def convertible(name: str, embedding: nn.Module, owners: dict[int, int]) -> Optional[str]:
    """Why the input embedding ``embedding`` cannot be stored quantized (``None``: it can).

    Args:
        name: its module name (for the reason).
        embedding: an ``nn.Embedding`` (or subclass) with a floating weight.
        owners: how many modules hold each parameter (``id`` -> count): a tied weight is held twice.
    """
    if type(embedding) is not nn.Embedding:
        return f"{type(embedding).__name__} has a forward of its own (not a plain nn.Embedding): kept in the compute dtype"
    if owners.get(id(embedding.weight), 0) > 1:
        return "weight tied to the output head: kept in the compute dtype (quantize_head=True without a tied head quantizes both)"
    if embedding.max_norm is not None:
        return "nn.Embedding(max_norm=...) renormalises its rows in place at each lookup: kept in the compute dtype"
    return None


def is_plain_embedding(module: nn.Module) -> bool:
    """Whether ``module`` is an embedding a precision mode could store (a floating table, not quantized yet)."""
    return isinstance(module, nn.Embedding) and not isinstance(module, QuantizedEmbedding) and module.weight.is_floating_point()


def _as_linear(embedding: nn.Module) -> nn.Linear:
    weight = cast(torch.Tensor, embedding.weight).detach()  # [num_embeddings, embedding_dim]: out x in, as a Linear's
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    linear.weight = nn.Parameter(weight, requires_grad=False)
    return linear


def _stored_in(layer: nn.Module) -> Optional[nn.Module]:
    return layer.storage() if isinstance(layer, QuantizedEmbedding) else None


EMBEDDING = register_kind(
    LayerKind(
        name="Embedding",
        matches=lambda module: isinstance(module, QuantizedEmbedding),
        to_linear=_as_linear,
        quantized_as="the table as its [vocabulary, hidden] matrix in the mode's Linear layer; a lookup unpacks only "
        "the rows it reads (QuantizedPrecision(quantize_embeddings=True))",
        adapted_as="not adapted (frozen; LoRA adapts the Linear-like layers)",
        option="QuantizedPrecision(quantize_embeddings=True) stores them quantized",
        modules="`nn.Embedding` (with `quantize_embeddings=True`)",
        found_in="every language model's token embedding",
        planned_as="the mode's layer built from the fake table's matrix",
        adaptable_names=no_names,
        features=lambda layer: (cast(int, layer.embedding_dim), cast(int, layer.num_embeddings)),
        as_built_keys=lambda layer: {"quantized.weight": "weight"} if _stored_in(layer) is not None else {},
        wrap=QuantizedEmbedding.from_quantized,
        stored_in=_stored_in,
    )
)

__all__ = ["EMBEDDING", "QuantizedEmbedding", "convertible", "is_plain_embedding"]
