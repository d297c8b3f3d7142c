"""The calibrated correction of a quantized input embedding (``QuantizedPrecision(correction_rank=r)``, issue 52).

A lookup's output for token ``i`` is row ``i`` of the table, so the output error of a table ``E`` stored as ``Q`` on
the probe batch is ``sum_i c_i ||E_i - Q_i - (L R)_i||^2``, ``c_i`` the times the probe reads token ``i``: a row-weighted
low-rank fit, solved exactly by one SVD. With the weights ``w_i = c_i + lambda`` and ``D = diag(sqrt(w))``,
``D L R = svd_r(D (E - Q))``, so ``R = V_r^T`` (the top right singular vectors) and ``L = (E - Q) V_r``: every row's
error is projected on the same ``r`` directions, so no row's error grows, and a token the probe never read gets the
plain low-rank fit of its error (``lambda``: :data:`SMOOTHING` times the mean count; why that value: its docstring).
``L`` ``[vocab, r]`` and ``R`` ``[r, hidden]`` (the factors ``left`` and ``right`` of the table as the
``[vocab, hidden]`` matrix its mode stores) are stored frozen on the :class:`~lightning_hbm.layers.embedding.QuantizedEmbedding`
in :func:`~lightning_hbm.layers.correction.storage_dtype` and added to each row a lookup reads; a head tied to it
(:class:`~lightning_hbm.layers.embedding.TiedHead`) multiplies with ``Q + L R`` a vocabulary slice at a time. Bytes,
planner, checkpoints and resume are the Linear's correction's.

The counts are taken in the probe forward that measures the Linears' statistics (:class:`TokenCounts`: no forward
more), summed across ranks as the Linears' statistics are. An embedding the probe never called (a model fed
``inputs_embeds``) gets none, named in the correction's one warning; so does a table stored in 8 bits or more
(:data:`MIN_BITS`: an int8 table's correction measured as noise).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Optional, Protocol, cast

import torch
from torch import Tensor, nn

from lightning_hbm.layers.embedding import QuantizedEmbedding
from lightning_hbm.memory.storage import parameter_bytes
from lightning_hbm.precision.gptq import pooled_across_ranks

#: ``lambda`` of the row weights ``c_i + lambda``, as a multiple of the probe's mean count per vocabulary entry
#: (``tokens / vocab``). Measured on the real SmolLM2-135M (nf4-dq table and tied head, rank 16, probe 4 x 128 tokens,
#: held-out 16 x 128, two seeds; benchmarks/README.md, "The correction on a quantized embedding"): held-out loss
#: -1.26 / -0.46 % at 0.01 x the mean, -2.16 / -0.64 % at 1 x, -3.13 / -3.00 % at 10 x, -3.25 / -3.36 % at 100 x,
#: -3.20 / -3.52 % with uniform weights (the data-free fit). The held-out text reads many tokens the probe never did, so
#: a fit that follows the probe's counts closely serves them worse (the mean, the issue's first guess, kept two thirds
#: of the gain on seed 0, a fifth on seed 1); 100 x (about one count per token at 512 probe tokens) and uniform weights are within 0.16
#: points, each ahead on one seed: 100 x is kept as it still leans towards the tokens the data reads.
SMOOTHING = 100.0
#: tables stored in this many bits per value or more get no correction (:func:`correct_embedding`)
MIN_BITS = 8


def fit_row_factors(error: Tensor, counts: Tensor, rank: int, smoothing: float = SMOOTHING) -> tuple[Tensor, Tensor]:
    """``(right [r, dim], left [vocab, r])`` in float64 minimising ``sum_i w_i ||error_i - (left @ right)_i||^2``,
    ``w_i = counts_i + smoothing x mean(counts)`` (module docstring).

    Args:
        error: ``E - Q``, ``[vocab, dim]``.
        counts: how often the probe read each row, ``[vocab]`` (any positive scale: the fit does not depend on it).
        rank: ``r <= min(vocab, dim)``.
        smoothing: ``lambda`` as a multiple of the mean count (> 0).
    """
    error, counts = error.to(torch.float64), counts.to(torch.float64)
    weights = counts + smoothing * counts.mean()
    _, _, vh = torch.linalg.svd(error * weights.sqrt()[:, None], full_matrices=False)
    right = vh[:rank]
    return right, error @ right.t()


class TokenCounts(AbstractContextManager["TokenCounts"]):
    """How often the probe forward run inside reads each row of each of ``names`` (input embeddings of ``module``):
    :attr:`counts` ``{name: float64 [vocab]}`` and :attr:`tokens` ``{name: ids read}`` once closed, summed across ranks.

    Args:
        module: the model as built.
        names: its plain ``nn.Embedding`` targets.
    """

    def __init__(self, module: nn.Module, names: list[str]) -> None:
        self.counts: dict[str, Tensor] = {}
        self.tokens: dict[str, int] = {}
        self._layers = {name: module.get_submodule(name) for name in names}
        self._handles: list[Any] = []

    def __enter__(self) -> TokenCounts:
        for name, layer in self._layers.items():
            self._handles.append(layer.register_forward_pre_hook(self._hook(name, cast(int, layer.num_embeddings))))
        return self

    def _hook(self, name: str, vocab: int) -> Any:
        def count(_layer: nn.Module, args: tuple) -> None:
            ids = args[0].detach().reshape(-1).to("cpu", torch.int64)
            found = torch.bincount(ids, minlength=vocab).to(torch.float64)
            self.counts[name] = self.counts[name] + found if name in self.counts else found
            self.tokens[name] = self.tokens.get(name, 0) + ids.numel()

        return count

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc[0] is not None:
            return
        # every rank's probe together (a collective: every rank has the same embeddings); pooled as frequencies
        shares = {name: self.counts.get(name, torch.zeros(cast(int, layer.num_embeddings), dtype=torch.float64)) / max(self.tokens.get(name, 0), 1)
                  for name, layer in self._layers.items()}  # fmt: skip
        tokens = pooled_across_ranks(shares, {name: self.tokens.get(name, 0) for name in self._layers})
        self.counts = {name: shares[name] * tokens[name] for name in self._layers if tokens[name] > 0}
        self.tokens = {name: n for name, n in tokens.items() if n > 0}


class Correct(Protocol):
    """What :func:`correct_embedding` calls (:class:`~lightning_hbm.precision.correction.CalibratedCorrection`)."""

    def fit(self, name: str, layer: nn.Module, weight: Tensor, holder: Optional[nn.Module] = None) -> None: ...

    def skip(self, name: str, why: str) -> None: ...


def stored_bits(embedding: QuantizedEmbedding) -> float:
    """Bits per value of the table as its mode stores it (constants included)."""
    return 8 * parameter_bytes(embedding.storage()) / (cast(int, embedding.num_embeddings) * cast(int, embedding.embedding_dim))


def correct_embedding(correct: Correct, name: str, embedding: QuantizedEmbedding, weight: Tensor) -> None:
    """Give the quantized ``embedding`` (built from ``weight``, its ``[vocab, dim]`` table) its correction, or record
    why it gets none (module docstring). A table stored in :data:`MIN_BITS` bits per value or more gets none: on the
    real SmolLM2-135M the int8 table's correction moved the held-out loss by noise only (between -0.06 % and +0.03 %,
    two seeds) for +1.5 MiB, where the 4-bit table's took -3.2 % (benchmarks/README.md, "The correction on a quantized
    embedding"); the default ``quantize_embeddings="auto"`` stores int8, so a default run's table keeps none, said."""
    bits = stored_bits(embedding)
    if bits >= MIN_BITS:
        correct.skip(name, f"an input embedding stored in {bits:.1f} bits per value: corrected under {MIN_BITS} bits only "
                           "(an int8 table's correction measured as noise, benchmarks/README.md); quantize_embeddings=True "
                           "stores it in the run's mode")  # fmt: skip
        return
    correct.fit(name, embedding.storage(), weight, holder=embedding)


__all__ = ["MIN_BITS", "SMOOTHING", "TokenCounts", "correct_embedding", "fit_row_factors", "stored_bits"]
