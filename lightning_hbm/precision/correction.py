"""The calibrated low-rank correction of each quantized layer (``QuantizedPrecision(correction_rank=r)``).

What it shrinks: nothing; it buys quality back for ``2 x r x (in + out)`` bytes per layer (bf16), +0.09 bytes per
weight at r = 16 on SmolLM2-135M. A 4-bit layer computes ``Q x`` instead of ``W x``. The loss sees the *output*
error ``(W - Q) X`` on the data, not the weight error, so the rank-``r`` term ``L`` that minimises
``||(W - Q - L) X^T||`` on the probe batch is fitted (as CLoQ, Deng et al. 2025, computes it; EoRA's compensation is
the same fit): with the input Gram ``H = X^T X / n`` (the one GPTQ rounding measures, 1 % of its mean diagonal added
as damping) and its Cholesky factor ``H = C C^T``, ``L = svd_r((W - Q) C) C^-1``, in float64. ``L = B A`` is stored
frozen in the compute dtype beside the layer
(:func:`~lightning_hbm.layers.correction.storage_dtype`) (:mod:`lightning_hbm.layers.correction`) and added to its output; LoRA
adapters train on top of it as usual (``B = 0`` at the start).

Why frozen beside the adapters rather than the adapters' start: measured on the real SmolLM2-135M (benchmarks/README.md,
"A calibrated low-rank correction"), starting the rank-16 adapters on ``L`` gave +4.29 % held-out loss above 16-bit
LoRA after 48 steps; the frozen term beside fresh adapters +2.34 % (``nf4-dq``), and with ``nf4-dq-b32`` + GPTQ
+0.79 / +0.62 % at 150 steps (two seeds).

With ``rounding="gptq"`` the correction is fitted to the GPTQ-rounded weight and shares its input statistics (one
probe forward for both). It is fitted on the layers the probe reached, one at a time while the model is quantized
(the original weight is needed and is dropped right after). A convolution is corrected as the Linear it is over its
input's patches (the statistics are the patches' Gram, as GPTQ's): ``B A`` of its ``[out, in x kernel]`` matrix, added
to the weight it dequantizes (:mod:`lightning_hbm.precision.conv_correction`; grouped, depthwise and transposed ones get
none). The experts of a mixture of experts (``LinearExperts``, made after the probe forward) are fitted each on the
inputs of the tokens its router sent it on the probe, recorded on the model as built
(:mod:`lightning_hbm.precision.expert_inputs`); an expert the probe reached with fewer tokens than the rank gets none
(named in the one warning, with the count: a larger probe reaches it). On a trained tiny Qwen3-MoE the experts' factors
closed a further share of the 4-bit loss gap (``benchmarks/moe_correction.py``, benchmarks/README.md). The projections
of an ``nn.MultiheadAttention`` get none (said in one warning). A quantized input embedding is fitted on the probe's
token counts, each row's error weighted by how often the probe read it (smoothed: unread tokens get the plain low-rank
fit of their error), and a head tied to it computes with the corrected table
(:mod:`lightning_hbm.precision.embedding_correction`; a table stored in 8 bits or more gets none: no gain measured,
said). A rank above ``min(in, out)`` of a layer is capped there (said),
and a probe with fewer input rows (tokens) than the rank is an error before anything changes.

Resume: the factors are saved with every checkpoint (with the changed tensors, :data:`~lightning_hbm.layers.correction.KEY_MARK`)
and a resume with the same settings takes them back from the file instead of fitting again: bit for bit, whatever the
probe. On fake tensors (the planner) each layer gets zero factors of the shapes it would have: the bytes, no fit.

Ranks (DDP, ``QuantizedFSDPStrategy``): every rank fits from the statistics of all ranks' probe batches together
(:func:`~lightning_hbm.precision.gptq.pooled_across_ranks`, in the probe forward), so the factors (sharded like the weight under FSDP) are the ones a single process fits
on the same samples (tests/strategies/test_fsdp_correction.py: 2 CPU ranks, losses equal to 1e-5).

Cost: one probe forward (shared with GPTQ), then per layer a Cholesky of ``[in, in]`` and an SVD of ``[out, in]`` in
float64, logged at the surgery with seconds per billion weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor

from lightning_hbm.layers.correction import attach_correction, attach_weight_correction, correction_of, saved_factors, storage_dtype
from lightning_hbm.naming import name_list
from lightning_hbm.precision.embedding_correction import fit_row_factors
from lightning_hbm.precision.gptq import pooled_across_ranks
from lightning_hbm.precision.registry import format_of

log = logging.getLogger(__name__)

#: damping added to ``diag(H)`` as a fraction of its mean (the measured benchmark arm's)
DAMP = 0.01


def fit_factors(error: Tensor, hessian: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """``(A [r, in], B [out, r])`` in float64 with ``B A = svd_r(error C) C^-1``, ``C C^T`` = damped ``hessian``.

    Args:
        error: ``W - Q``, ``[out, in]``.
        hessian: a multiple of ``X^T X`` of the layer's inputs (any positive scale: the fit does not depend on it).
        rank: ``r <= min(out, in)``.
    """
    h = hessian.to(torch.float64).clone()
    dead = h.diagonal() == 0  # an input always zero on the probe: no information, the weight error decides
    h[dead, dead] = 1
    h.diagonal().add_(DAMP * h.diagonal().mean())
    chol = torch.linalg.cholesky(h)
    u, s, vh = torch.linalg.svd(error.to(torch.float64) @ chol, full_matrices=False)
    right = torch.linalg.solve_triangular(chol, vh[:rank], upper=False, left=False)  # vh_r C^-1
    return right, u[:, :rank] * s[:rank]


@dataclass
class CorrectionReport:
    """What one surgery's correction did (logged; ``QuantizationQuality`` reads the figures)."""

    rank: int
    corrected: dict[str, int] = field(default_factory=dict)  # layer -> rank
    capped: dict[str, int] = field(default_factory=dict)  # layer -> the rank it took (below ``rank``)
    without: dict[str, str] = field(default_factory=dict)  # quantized layer -> why it got no correction
    weights: int = 0  # weights of the corrected layers
    bytes: int = 0  # bytes of the factors
    seconds: float = 0.0  # fitting time (the probe forward not included)
    resumed: bool = False

    def summary(self) -> str:
        per_billion = self.seconds / max(self.weights, 1) * 1e9
        how = "taken from the checkpoint being resumed" if self.resumed else (
            f"fitted on the probe batch in {self.seconds:.1f} s ({per_billion:,.0f} s per billion weights)")
        return (
            f"rank-{self.rank} calibrated correction of {len(self.corrected)} quantized layers ({self.weights:,} weights), "
            f"{how}; {self.bytes / 2**20:.2f} MiB, +{self.bytes / max(self.weights, 1):.3f} bytes per weight"
        )


class CalibratedCorrection:
    """The correction of one ``Quantization`` (``QuantizedPrecision(correction_rank=r)``).

    In the checks: :attr:`saved` (the checkpoint's factors, when resuming with the same settings:
    :func:`~lightning_hbm.layers.correction.saved_factors`), else
    :meth:`measured` (the input statistics of one probe forward, checked against the rank); during the quantization
    :meth:`fit` per layer; after it :meth:`finish`.

    Args:
        rank: the requested rank (>= 1).
        dtype: the compute dtype (the factors are stored in its :func:`~lightning_hbm.layers.correction.storage_dtype`).
    """

    def __init__(self, rank: int, dtype: torch.dtype) -> None:
        #: ``dtype``: the factors' storage dtype (the compute dtype)
        self.rank, self.dtype = rank, storage_dtype(dtype)
        #: ``{layer: H}`` of the surgery under way (freed by :meth:`finish`)
        self.hessians: Optional[dict[str, Tensor]] = None
        #: ``{layer: (A, B)}`` from the checkpoint being resumed (``None``: fit)
        self.saved: Optional[dict[str, tuple[Tensor, Tensor]]] = None
        #: the layers the statistics were measured for (the targets before any change; ``None``: not measured). A layer
        #: a kind's ``prepare`` made after the measure (the Linears of ``LinearExperts``) gets no statistics, so no
        #: correction: the planner's fake model, which has none, leaves it out the same way (was: planned with zero
        #: factors, +7.4 % over the measured step on Qwen3-MoE at rank 8, tests/planner/test_families_s38.py)
        self.measurable: Optional[set[str]] = None
        #: ``{expert's Linear: probe tokens routed to it}`` of the surgery under way (:meth:`measured`)
        self.routed: dict[str, int] = {}
        #: ``{input embedding: how often the probe read each row}`` of the surgery under way (:meth:`measured`;
        #: :class:`~lightning_hbm.precision.embedding_correction.TokenCounts`): its statistics, fitted row-weighted
        self.counts: dict[str, Tensor] = {}
        #: what the last surgery did
        self.report: Optional[CorrectionReport] = None
        self._current: Optional[CorrectionReport] = None

    @staticmethod
    def check_rank(rank: Any) -> int:
        """``correction_rank`` as an int (0: off).

        Raises:
            ValueError: a negative rank.
        """
        value = 0 if rank is None else int(rank)
        if value < 0:
            raise ValueError(
                f"QuantizedPrecision(correction_rank={rank!r}): the rank of the calibrated correction must be >= 0 "
                "(0 or None: no correction; 16 is the measured choice)."
            )
        return value

    # ------------------------------------------------------------------ the checks

    def take_saved(self, meta: dict[str, Any]) -> bool:
        """Keep the factors of the checkpoint part ``meta`` (already verified,
        :func:`~lightning_hbm.layers.correction.saved_factors`); whether it held any."""
        self.saved = saved_factors(meta.get("state_dict") or {})
        return self.saved is not None

    def measured(
        self, hessians: dict[str, Tensor], rows: dict[str, int], experts: Optional[set[str]] = None, counts: Optional[dict[str, Tensor]] = None
    ) -> None:
        """Keep the input statistics of the probe forward (:func:`~lightning_hbm.precision.gptq.input_statistics`,
        pooled across ranks there: every rank decides on the same figures); refuse a probe too small for the rank
        (nothing changed yet). ``experts``: the names of the experts' Linears, whose rows are the tokens the router
        sent them: one reached by fewer than the rank gets no correction (named at :meth:`finish`), never an error.
        ``counts``: the input embeddings' token counts (never too few: the row weights are smoothed,
        :mod:`lightning_hbm.precision.embedding_correction`).

        Raises:
            ValueError: a layer saw fewer input rows (tokens) than the rank.
        """
        self.routed = {name: rows.get(name, 0) for name in experts or ()}
        # the rank a layer takes is at most its inputs (capped in fit): a narrow layer needs no more rows than that
        need = {name: min(self.rank, hessians[name].shape[0]) for name in rows if name in hessians and name not in self.routed}
        short = {name: (rows[name], n) for name, n in need.items() if rows[name] < n}
        if short:
            name, (n, needed) = max(short.items(), key=lambda item: item[1][1] - item[1][0])
            raise ValueError(
                f"QuantizedPrecision(correction_rank={self.rank}): the probe batch gives {name} only {n} input rows "
                f"(tokens), fewer than the rank: a rank-{needed} correction needs at least {needed} tokens per layer "
                f"(more fit better: the measured runs used 512-2048). Pass a larger probe_batch (at least {needed} "
                "tokens) or a smaller correction_rank; nothing has been changed."
            )
        self.hessians = dict(hessians)
        self.counts = dict(counts or {})

    # ------------------------------------------------------------------ during the quantization

    def start(self) -> None:
        """A new quantization: a fresh report."""
        self._current = CorrectionReport(self.rank, resumed=self.saved is not None)

    def fit(self, name: str, layer: nn.Module, weight: Tensor, holder: Optional[nn.Module] = None) -> None:
        """Give the quantized ``layer`` (built from ``weight``) its correction, or record why it gets none.

        Args:
            name: the target's name (the key of its statistics and of a resumed checkpoint's factors).
            layer: the mode's quantized layer holding ``weight`` as an ``[out, in]`` matrix.
            weight: the original weight, as that matrix.
            holder: the module that carries the factors, when it is not ``layer`` itself: a quantized convolution,
                which adds them to the weight it dequantizes (:func:`~lightning_hbm.layers.correction.attach_weight_correction`);
                ``None``: ``layer``, with the forward hook that adds the term to its output.
        """
        report = self._current if self._current is not None else CorrectionReport(self.rank)
        self._current = report
        out_features, in_features = weight.shape
        rank = min(self.rank, out_features, in_features)
        fake = isinstance(weight, FakeTensor) or weight.is_meta
        if fake and self.measurable is not None and name not in self.measurable:
            report.without[name] = "the probe batch did not reach it (or it was converted before quantizing)"
            return
        if fake:  # the planner: the shapes and bytes, nothing fitted
            right, left = weight.new_zeros((rank, in_features), dtype=self.dtype), weight.new_zeros((out_features, rank), dtype=self.dtype)
        elif self.saved is not None:
            if name not in self.saved:
                report.without[name] = "the checkpoint being resumed holds no correction for it"
                return
            # as saved, dtype included: bit for bit, also a checkpoint of a version that stored them in fp32
            right, left = (t.to(weight.device) for t in self.saved[name])
            rank = right.shape[0]
        else:
            fitted = self._fitted(name, layer, weight, rank, report)
            if fitted is None:
                return
            right, left = fitted
        if rank < self.rank:
            report.capped[name] = rank
        if holder is None:
            attach_correction(layer, right.contiguous(), left.contiguous())
        else:
            attach_weight_correction(holder, right.contiguous(), left.contiguous())
        report.corrected[name] = rank
        report.weights += weight.numel()
        report.bytes += right.numel() * right.element_size() + left.numel() * left.element_size()

    def _fitted(self, name: str, layer: nn.Module, weight: Tensor, rank: int, report: CorrectionReport) -> Optional[tuple[Tensor, Tensor]]:
        """The factors ``(right, left)`` of ``layer`` fitted on the probe's statistics, in the storage dtype; ``None``:
        it gets none, why recorded in ``report``."""
        hessian = (self.hessians or {}).get(name)
        counts = self.counts.get(name)  # an input embedding's statistics: its rows' counts
        fmt = format_of(layer)
        routed = self.routed.get(name)
        if routed is not None and routed < rank:  # an expert the router (nearly) never chose on the probe
            report.without[name] = ("an expert the probe batch routed no token to" if routed == 0 else
                                    f"an expert the probe batch routed fewer tokens to than the rank ({rank})")
            report.without[name] += ": a larger probe_batch reaches it"
            return None
        if hessian is None and counts is None:
            report.without[name] = "the probe batch did not reach it (or it was converted before quantizing)"
            return None
        if fmt is None:
            report.without[name] = "its format cannot be read back (no dequantize)"
            return None
        start = time.perf_counter()
        error = weight.detach().to(torch.float64) - fmt.dequantize(layer, torch.float32).to(weight.device, torch.float64)
        if counts is not None:
            a, b = fit_row_factors(error, counts.to(weight.device), rank)
        else:
            a, b = fit_factors(error, cast(Tensor, hessian).to(weight.device), rank)
        report.seconds += time.perf_counter() - start
        return a.to(self.dtype), b.to(self.dtype)

    def skip(self, name: str, why: str) -> None:
        """A quantized layer that gets no correction, and why."""
        if self._current is None:
            self.start()
        assert self._current is not None
        self._current.without[name] = why

    def finish(self, module: nn.Module) -> CorrectionReport:
        """After the quantization: free the statistics, log what was done, warn about capped and uncorrected layers."""
        report = self._current if self._current is not None else CorrectionReport(self.rank)
        self.report, self._current, self.hessians, self.routed, self.counts = report, None, None, {}, {}
        log.info("lightning_hbm: %s", report.summary())
        if report.capped:
            rank_zero_warn(
                f"QuantizedPrecision(correction_rank={self.rank}): {len(report.capped)} layer(s) allow a smaller rank "
                f"(at most min(in, out) of the layer) and take it: {dict(list(report.capped.items())[:6])}. Pass "
                f"correction_rank <= {min(report.capped.values())} to have one rank everywhere."
            )
        if report.without:
            reasons: dict[str, list[str]] = {}
            for name, why in report.without.items():
                reasons.setdefault(why, []).append(name)
            rank_zero_warn(
                f"QuantizedPrecision(correction_rank={self.rank}): {len(report.without)} quantized layer(s) get no "
                "calibrated correction and keep their plain quantization error: "
                + "; ".join(f"{name_list(names)}: {why}" for why, names in reasons.items())
                + ". Keep them in full precision with ignore_modules if their error matters."
            )
        return report


def corrected_layers(module: nn.Module) -> list[str]:
    """Names of the layers of ``module`` that carry a correction."""
    return [name for name, sub in module.named_modules() if correction_of(sub) is not None]


__all__ = ["DAMP", "CalibratedCorrection", "CorrectionReport", "corrected_layers", "fit_factors", "pooled_across_ranks"]
