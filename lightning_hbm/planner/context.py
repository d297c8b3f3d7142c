"""``max_context``: the longest sequence a configuration trains within a memory budget, planned, not bisected.

What it answers: "how long a context can I fine-tune on my 24 GiB card". The user fixes what changes the result
(the precision plugin: quantization mode; the callbacks: LoRA and its rank, the optimizer); ``max_context`` sets only
what trades step time for memory, and reports each choice (:attr:`ContextResult.choices`):

* ``ActivationCheckpointing(policy="full")``: each block keeps only its input;
* ``offload=True`` on ``device="cuda"``: those inputs go to pinned host memory (the ``host_activations`` term),
  unless a ``host_budget`` is too small for them and the length without offload is as long;
* ``mlp_chunks``: each block's MLP recomputed in token chunks (a power of two near 4x its widening, at most 32);
* ``FusedLoss``: the loss chunk by chunk; its chunk is the automatic one (``FusedLoss.chunk_size=None``, reported);
* ``regenerate``: with ``max_regenerate > 1`` and a ``host_budget`` the offloaded inputs overflow, only every n-th
  block keeps its input, the others remade in the backward (:mod:`lightning_hbm.activations.regenerate`; the smallest
  n that fits the host, at most ``max_regenerate``: ``(n-1)/2`` more block forwards per block).

How, fast: the peak of a step is affine plus quadratic in the sequence length (attention may be quadratic where no
fused kernel saves only a log-sum-exp), so :func:`plan` runs at up to three lengths (2k, 32k, 128k tokens, shortest
first, stopping at the first one over the budget: a short answer plans no 128k step); each budget, shortest first, is
solved on the quadratic through the three planned points nearest it (a line through two), and the answer is
confirmed by one plan at that length
(a miss is corrected from the confirmed points and planned again, up to :data:`_CONFIRMS` times). What only decides
structure (which parameters the loss reaches, which layers run in token chunks) is decided once, on a short batch, for
every length, and the model is built and its surgery run once, then stepped at each length
(:class:`~lightning_hbm.planner.tracing.Decided`; half the time of a fresh plan). The answer is a multiple of
``multiple_of`` whose predicted total (peak + the CUDA context :func:`plan` adds) fits, at most :data:`_SLACK` (0.1 %)
short of the longest that does; these are predictions, not measurements. Seven budgets of the 8B shape: 11 plans
(all three first lengths fit under 8 GiB or bracket it: as before). A small Llama's answers of 512 to 6,912 tokens
(tests/planner/test_context_plans_s32.py): 6 plans, 7 before (the same answers); a host budget with regenerate
(tests/planner/test_remade_inputs.py): 12, 14 before (131k tokens planned for nothing, once per configuration).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union

from torch import nn

from lightning_hbm.activations import ActivationCheckpointing, FusedLoss, pinned_footprint
from lightning_hbm.activations.loss.cost import chunk_tokens
from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers import experts
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.memory import CATEGORIES, host_terms
from lightning_hbm.planner.api import HOST_ACTIVATIONS, Prediction, predict
from lightning_hbm.planner.building import ModelLike, Template, build_template
from lightning_hbm.planner.candidates import Candidate, format_bytes, parse_bytes
from lightning_hbm.planner.realvalues import MAX_TWIN_ELEMENTS
from lightning_hbm.planner.tracing import Decided

_log = logging.getLogger(__name__)

#: Plans per budget after the fit at most: the confirmation, and corrections from confirmed points when it missed.
_CONFIRMS = 4
#: An answer may stop this much (a fraction of its tokens) short of the longest length that fits: each plan costs
#: seconds, and chasing the last tokens took two or three more plans per budget (0.1 %: 223 tokens at 24 GiB on 8B).
_SLACK = 1e-3
#: Most token chunks of an MLP recompute max_context chooses (1 % of step time each, stated in candidates.py).
_MAX_MLP_CHUNKS = 32
#: The lengths planned first, shortest first up to the first one over the budget (:meth:`_Lengths.points`): where
#: long contexts live (each budget is then solved from the three planned lengths nearest it).
_FIRST_LENGTHS = (2048, 32768, 131072)
#: Tokens of the batch the structure-deciding forwards run on (the surgery's probe, which parameters get gradients).
_PROBE_TOKENS = 256


@dataclass(frozen=True)
class ContextResult:
    """The longest context for one budget.

    Attributes:
        budget: bytes the total (peak + CUDA context) must fit in.
        tokens: the longest sequence length per sample that fits (0: not even ``multiple_of`` tokens).
        prediction: the plan at ``tokens`` (host terms included: :attr:`host`); at ``multiple_of`` when nothing fits.
        choices: what max_context set: ``checkpointing``, ``offload``, ``mlp_chunks``, ``loss_chunk_tokens``,
            ``regenerate``.
        limit: why not longer: the largest device term at ``tokens``; when nothing fits, the term that alone is over.
        expert_load: on a model with mixture-of-experts layers (``LinearExperts``), the bytes the planner's worst routing
            load adds to the device total at ``tokens`` over a balanced router (both planned; :meth:`notes` says it);
            ``None`` on other models, and where nothing fits.
    """

    budget: int
    tokens: int
    prediction: Prediction
    choices: dict[str, Any] = field(default_factory=dict)
    limit: str = ""
    expert_load: Optional[int] = None

    @property
    def host(self) -> int:
        """Host memory the run needs (pinned block inputs, offloaded optimizer states)."""
        return self.prediction.host

    def __str__(self) -> str:
        return (f"{format_bytes(self.budget)}: {self.tokens:,} tokens (device {format_bytes(self.prediction.total)}, "
                f"host {format_bytes(self.host)}; {self.limit})")

    def notes(self) -> list[str]:
        """What the answer assumes and its numbers do not show: on a MoE model, the worst routing load, with its cost.

        The planner traces on fake tensors, which hold no values, so no router runs: each experts layer is planned with
        its first and last expert given every token of a chunk (``LinearExperts._worst_load``; exact under that load,
        tests/planner/test_moe_chunks_s40.py). A trained router may do that; a balanced one needs less.
        """
        if self.expert_load is None:
            return []
        total = self.prediction.total
        return [
            f"{format_bytes(self.budget)}: the MoE experts are planned at the worst routing load (the first and last "
            f"expert of each layer take every token), {format_bytes(self.expert_load)} "
            f"({100 * self.expert_load / max(total, 1):.1f} % of the device total) over a balanced router at "
            f"{self.tokens:,} tokens: a run whose router spreads its tokens evenly needs that much less, so "
            f"{self.tokens:,} may be short of its longest context; one that sends a chunk's tokens to one expert needs all of it"
        ]


def max_context(
    model: Union[ModelLike, Template],
    budget: Union[str, int, Sequence[Union[str, int]]],
    *,
    plugin: Optional[Any] = None,
    callbacks: Optional[Sequence[Any]] = None,
    strategy: Any = None,
    batch_size: int = 1,
    device: Literal["cpu", "cuda"] = "cuda",
    batch_fn: Optional[Callable[[int], Any]] = None,
    multiple_of: int = 1,
    host_budget: Union[str, int, None] = None,
    max_regenerate: int = 1,
) -> Union[ContextResult, list[ContextResult]]:
    """The longest sequence length per sample that trains within ``budget`` (one size, or a list: one result each).

    Args:
        model: the LightningModule or a factory (built fake, as :func:`plan` does).
        budget: device memory, ``"24GiB"`` or bytes (:func:`~lightning_hbm.planner.parse_bytes`), or a list of them.
        plugin, callbacks, strategy: the Trainer's, as for :func:`plan`. Their ``ActivationCheckpointing`` and
            ``FusedLoss`` are replaced by max_context's choices (the blocks and heads they name are kept).
        batch_size: samples per step.
        device: where training runs; ``"cuda"`` offloads the checkpointed inputs and counts the CUDA context.
        batch_fn: ``batch_fn(length)`` -> one training batch at that sequence length, for models that do not take
            ``(tokens, targets)`` (the default: ``synthetic_batch(batch_size, length, vocab_size)``, the vocabulary
            read from the model's ``vocab_size`` hyperparameter or its first ``nn.Embedding``).
        multiple_of: the answer is a multiple of this (e.g. 64); 1 by default.
        host_budget: host RAM the run may take (``"64GiB"``), or None (no limit). The offloaded block inputs are
            pinned in power-of-two pieces (:func:`~lightning_hbm.activations.pinned_footprint`); over this budget, the answer is the longer
            of the longest offloaded length that fits it and the longest without offload (both planned).
        max_regenerate: with a ``host_budget`` the offloaded inputs overflow, ``ActivationCheckpointing(regenerate=n)``
            for the smallest ``n`` up to this whose kept inputs fit it (each other block remakes its input in the
            backward: ``(n-1)/2`` more block forwards per block); the answer is the longer of that and the one without.
            ``1`` (the default): every block keeps its input.

    Step time: the ``mlp_chunks`` it chooses (16 for a Llama whose MLP widens 3.5x, the 8B and 70B) costs time where the
    chunks are short: each chunk runs the MLP's base matmuls again, dequantizing their 4-bit weights each time. Measured
    on a 2-core CPU (bf16 QLoRA Llama of the 8B's proportions, ``benchmarks/mlp_chunks_time.py``, benchmarks/README.md):
    16 chunks took 1.31x the step of 1 at 2,048 tokens (128 per chunk) and 1.07x at 4,096; 4 chunks 1.07x and 1.00x.
    The lengths it answers for the 8B are 30k-900k tokens (thousands per chunk); not measured on GPU. To buy the time
    back at a short context, train with fewer chunks (``ActivationCheckpointing(mlp_chunks=4)``) and :func:`plan` it.

    Returns:
        A :class:`ContextResult`, or a list of them in the order of ``budget``.

    Raises:
        ValueError: a model with no token vocabulary and no ``batch_fn``; bad ``batch_size``/``multiple_of``/budget/
            ``host_budget``.
    """
    budgets = [parse_bytes(b) for b in budget] if isinstance(budget, (list, tuple)) else [parse_bytes(budget)]  # type: ignore[arg-type]  # a str or int
    if not budgets:
        raise ValueError("max_context(budget=[]): give at least one size, e.g. '24GiB'.")
    for name, value in (("batch_size", batch_size), ("multiple_of", multiple_of), ("max_regenerate", max_regenerate)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"max_context({name}={value!r}): must be an int >= 1.")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"max_context(device={device!r}): 'cpu' or 'cuda'.")
    if max_regenerate > 1 and (host_budget is None or device != "cuda"):
        # was ignored silently: remade inputs are chosen only where the offloaded inputs overflow the host budget
        raise ValueError(
            f"max_context(max_regenerate={max_regenerate}, host_budget={host_budget!r}, device={device!r}): remade "
            "inputs are planned only where the inputs offloaded to the host overflow host_budget, so max_regenerate "
            "needs host_budget='64GiB' (say) and device='cuda' (on 'cpu' nothing is offloaded). Fix: give both, or "
            "max_regenerate=1."
        )
    host_limit = None if host_budget is None else parse_bytes(host_budget)
    template = build_template(model)
    make_batch = batch_fn if batch_fn is not None else _token_batches(template, batch_size)
    longest = _position_limit(template.module, multiple_of) if batch_fn is None else None  # batch_fn: its own lengths

    def lengths(offload: bool, regenerate: int = 1) -> _Lengths:
        return _Lengths(template, plugin, list(callbacks or ()), strategy, make_batch, device, multiple_of, offload,
                        regenerate, longest)

    planned = lengths(device == "cuda")
    unoffloaded = functools.cache(lambda: lengths(False))  # planned only when a host budget is too small for offload
    # one per regenerate=n, shared by every budget: each budget that remade inputs with a fresh one built, set up and
    # planned the model again at lengths another budget had planned (the same plans: a call's own, never stale)
    remaking = functools.cache(functools.partial(lengths, True))
    solved = {}
    for limit in sorted(set(budgets)):  # shortest first: each budget's confirmed lengths sharpen the next one's guess
        solved[limit] = _solve(limit, planned, batch_size)
        if host_limit is not None and solved[limit].host > host_limit:
            device_bound = solved[limit]
            solved[limit] = _within_host(device_bound, host_limit, planned, unoffloaded, batch_size)
            if max_regenerate > 1:
                remade = _remade(device_bound, host_limit, max_regenerate, remaking, batch_size)
                solved[limit] = max(solved[limit], remade, key=lambda r: r.tokens)
    results = [solved[limit] for limit in budgets]
    return results if isinstance(budget, (list, tuple)) else results[0]


class _Lengths:
    """One configuration planned at many lengths: every plan kept, what only decides structure decided once."""

    def __init__(self, template: Template, plugin: Any, callbacks: list[Any], strategy: Any,
                 make_batch: Callable[[int], Any], device: str, step: int, offload: bool, regenerate: int = 1,
                 longest: Optional[tuple[int, str]] = None) -> None:
        own, self.choices = _configuration(template, callbacks, device, offload, regenerate)
        self.regenerate = regenerate
        self.longest = longest  # (tokens, why): the model's own longest sequence (its position table), a multiple of step
        self.candidate = Candidate.from_trainer(plugin, own, strategy)
        self.template, self.make_batch, self.device, self.step = template, make_batch, device, step
        self._trainer = (plugin, callbacks, strategy)
        self._partial: dict[int, Candidate] = {}
        self.cache: dict[Any, Prediction] = {}
        self.decided = Decided()  # the probe's forwards decide the same at every length past _PROBE_TOKENS
        #: experts layers whose load the trace chooses (``LinearExperts``, fake tensors route no token)
        self.routed = any(experts.supported(m) for m in template.module.modules())
        self._points: dict[int, int] = {}

    def predict_at(self, tokens: int, offload: Optional[int] = None) -> Prediction:
        """The plan at ``tokens``; ``offload``: only the first ``offload`` blocks offload their inputs (the same
        models set up, :func:`~lightning_hbm.planner.tracing.trace` sets the count per step)."""
        key = tokens if offload is None else (tokens, offload)
        if key not in self.cache:  # the forwards that only decide structure run on a short batch (probe_batch)
            probe = self.make_batch(min(tokens, _PROBE_TOKENS)) if tokens > _PROBE_TOKENS else None
            start = time.perf_counter()
            self.cache[key] = predict(self.template, self.make_batch(tokens), self._candidate(offload), device=self.device,
                                      probe_batch=probe, decided=self.decided if probe is not None else None)
            _log.info("max_context: %s tokens (offload %s) -> %s (planned in %.0f s)", f"{tokens:,}", offload,
                      format_bytes(self.cache[key].total), time.perf_counter() - start)
        return self.cache[key]

    def balanced_at(self, tokens: int, offload: Optional[int] = None) -> Prediction:
        """:meth:`predict_at` with the MoE experts under a balanced router's load, not the worst
        (:func:`~lightning_hbm.layers.experts.balanced_load`), the structure decided as the worst-load plan decided it.

        Only the traced step is balanced: decided under a balanced load, a MoE MLP saved too little per token for its
        token chunks to pay (2 tokens fill 4 of 4 experts' rows, not 6), and the plan without chunks was 447 KiB over
        the worst-load plan with them (Qwen3-MoE at 256 tokens), where the run chunks as the worst-load plan does.
        """
        key = (tokens, offload, "balanced")
        if key not in self.cache:
            probe, decided = self.make_batch(min(tokens, _PROBE_TOKENS)), self.decided
            if tokens <= _PROBE_TOKENS:  # predict_at decided nothing to keep at this length: decide it (worst load)
                decided = Decided()
                predict(self.template, self.make_batch(tokens), self._candidate(offload), device=self.device,
                        probe_batch=probe, decided=decided)
            with experts.balanced_load():
                self.cache[key] = predict(self.template, self.make_batch(tokens), self._candidate(offload),
                                          device=self.device, probe_batch=probe, decided=decided)
        return self.cache[key]

    def _candidate(self, offload: Optional[int]) -> Candidate:
        if offload is None:
            return self.candidate
        if offload not in self._partial:
            plugin, callbacks, strategy = self._trainer
            own, _ = _configuration(self.template, callbacks, self.device, offload, self.regenerate)
            self._partial[offload] = Candidate.from_trainer(plugin, own, strategy)
        return self._partial[offload]

    def points(self, budget: int) -> dict[int, int]:
        """{length: planned total}: :data:`_FIRST_LENGTHS` planned shortest first up to the first one over ``budget``
        (at least two), and every length solved since (the same dict).

        Was: all three planned for every call, 131,072 tokens too where 2,048 or 32,768 is already over the largest
        budget (a small model's answer of a few thousand tokens planned 131k for nothing, once per configuration).
        Past the longest planned, a later (larger) budget plans the next of them: the 8B's seven budgets plan all three,
        as before. The fit reads the points nearest the budget, and the first one over it bounds them.

        Where every planned length is over the budget already, the second point is a quarter of the shortest, not the
        next (16x longer) of :data:`_FIRST_LENGTHS`: a model whose trace grows with the tokens (transformers' Mamba
        without its CUDA kernels scans token by token) spent over 10 min of CPU planning 32,768 tokens for an answer
        of 1,000 (FalconMamba, Jamba; benchmarks/README.md, session 39)."""
        for n in self._first_lengths():
            if n in self._points:
                continue
            if len(self._points) >= 2 and any(total >= budget for total in self._points.values()):
                break  # one planned length is over: the budget is bracketed, longer ones only cost plans
            shortest = min(self._points, default=0)
            if shortest >= 8 * self.step and all(total > budget for total in self._points.values()):
                shorter = _round_down(shortest // 4, self.step)
                self._points[shorter] = self.predict_at(shorter).total
                continue  # the budget is below every planned length: bracket it from below
            self._points[n] = self.predict_at(n).total
        return self._points

    def _first_lengths(self) -> list[int]:
        """:data:`_FIRST_LENGTHS` as multiples of the step, below the model's longest sequence, at least two."""
        lengths = sorted({_round(n, self.step) for n in _FIRST_LENGTHS})
        if self.longest is not None:  # never past the model's own longest sequence (it cannot run there)
            cap = self.longest[0]
            lengths = sorted({n for n in lengths if n < cap} | {cap, max(self.step, _round_down(cap // 4, self.step))})
        while len(lengths) < 2 and self.longest is None:  # a multiple_of past 16k rounds them together: a line needs two lengths
            lengths.append(4 * lengths[-1])
        return lengths

    def result(self, budget: int, tokens: int, batch_size: int, limit: str = "", offload: Optional[int] = None) -> ContextResult:
        """The result at ``tokens`` (planned), with the loss chunk chosen there; ``limit``: what holds it;
        ``offload``: the first ``offload`` blocks only offload their inputs."""
        prediction = self.predict_at(max(tokens, self.step), offload)
        choices = _with_loss(self.choices, self.template, batch_size, max(tokens, self.step))
        if offload is not None:
            choices["offload"] = offload
        if tokens == 0:  # not even the shortest length: say which term alone is over
            return ContextResult(budget, 0, prediction, choices, limit or _over(prediction, budget))
        # the worst routing load's share, planned (one more plan at the answer, MoE models only): was not said, and a
        # user read the answer as what their run needs (issue 51, session 41)
        extra = prediction.total - self.balanced_at(tokens, offload).total if self.routed else None
        return ContextResult(budget, tokens, prediction, choices, limit or _held_by(prediction), extra)


def _solve(budget: int, lengths: _Lengths, batch_size: int) -> ContextResult:
    """The longest multiple of the step whose plan fits ``budget``, within :data:`_SLACK`: the guess from the planned
    points nearest the budget (:func:`_nearest`), confirmed by one plan, corrected from the confirmed points while it
    misses. ``lengths.points(budget)`` gains every length planned here.
    """
    step = lengths.step
    if lengths.longest is not None:
        cap, why = lengths.longest
        if lengths.predict_at(cap).total <= budget or cap == step:  # the whole table fits, or no shorter length is left
            fits = cap if lengths.predict_at(cap).total <= budget else 0
            return lengths.result(budget, fits, batch_size, why if fits else "")
    points = lengths.points(budget)
    fits, over = step, None  # the longest length planned to fit, the shortest planned over
    # aimed a little short (half the slack): a guess just over the budget costs a second plan, one just short does not
    guess = _capped(_aim(_Quadratic(_nearest(points, budget)).solve(budget), step), lengths)
    for _ in range(_CONFIRMS):
        points[guess] = lengths.predict_at(guess).total
        if points[guess] <= budget:
            fits = max(fits, guess)
        else:
            over = guess if over is None else min(over, guess)
        # the line through the planned points on either side of the guess: where it says the budget is reached
        reach = _Quadratic(_bracket(points, guess)).solve(budget)
        if over is not None:
            reach = min(reach, over - step)
        if _round_down(reach, step) <= fits + _slack(fits, step) or (over is not None and over - fits <= step):
            break  # the confirmed length is the answer: the next one up is over (planned, or by the local fit)
        guess = _capped(_aim(reach, step), lengths)
    return lengths.result(budget, fits if lengths.predict_at(fits).total <= budget else 0, batch_size)


def _within_host(
    result: ContextResult, host: int, lengths: _Lengths, unoffloaded: Callable[[], _Lengths], batch_size: int
) -> ContextResult:
    """``result`` (offloaded, over the ``host`` budget) made to fit it: the longest of the longest offloaded length
    whose pinned block inputs fit ``host`` (:func:`_host_fit`, confirmed by a plan), the longest with only as many
    blocks offloaded as ``host`` holds (:func:`_partial_fit`) and the longest without offload."""
    budget, step = result.budget, lengths.step
    tokens, prediction = result.tokens, result.prediction
    # what else the host holds (optimizer states a strategy offloads) does not shrink with the length: only the rest
    # is the block inputs' (none left: no length fits, and no plan is spent finding that out)
    inputs = host - (prediction.host - host_bytes(prediction)[HOST_ACTIVATIONS])
    for _ in range(_CONFIRMS):
        shorter = min(_host_fit(prediction.host_sizes, tokens, inputs, step), tokens - step) if inputs >= 0 else 0
        if shorter < step:
            tokens = 0
            break
        tokens, prediction = shorter, lengths.predict_at(shorter)
        if prediction.host <= host:
            break
    else:
        tokens = 0
    partial, count = _partial_fit(result, inputs, host, tokens, lengths) if inputs > 0 else (0, 0)
    plain = _solve(budget, unoffloaded(), batch_size)
    if plain.tokens >= max(tokens, partial) and plain.host <= host:  # as long without the offload: faster, no host RAM
        return plain
    if partial > tokens:
        blocks = result.prediction.offloaded_blocks
        limit = (f"host RAM {format_bytes(host)} (the pinned inputs of {count} of {blocks} blocks; all offloaded "
                 f"{tokens:,} tokens, without offload {plain.tokens:,})")
        return lengths.result(budget, partial, batch_size, limit, offload=count)
    limit = f"host RAM {format_bytes(host)} (the pinned block inputs; without offload {plain.tokens:,} tokens)"
    return lengths.result(budget, tokens, batch_size, limit)


def _remade(
    result: ContextResult, host: int, most: int, lengths: Callable[[int], _Lengths], batch_size: int
) -> ContextResult:
    """``result`` (every input offloaded, over ``host``) with only every n-th block keeping its input: the smallest
    ``n`` up to ``most`` whose kept inputs fit ``host`` at ``result.tokens`` (each input alike; confirmed by a plan:
    the device holds what it held, the remade input taking the place of the restored one), else ``most`` at the
    longest length whose kept inputs fit (:func:`_host_fit`, confirmed)."""
    prediction, tokens, at = result.prediction, result.tokens, result.tokens
    inputs = host - (prediction.host - host_bytes(prediction)[HOST_ACTIVATIONS])
    sizes, blocks = prediction.host_sizes, prediction.offloaded_blocks
    none = dataclasses.replace(result, tokens=0)  # no length: the caller keeps its own answer
    if inputs <= 0 or not sizes or blocks < 2:
        return none
    each = sum(sizes) / len(sizes)  # one block's inputs at tokens

    def kept(n: int, length: int) -> int:  # pinned bytes of the inputs every n-th block keeps
        return -(-blocks // n) * pinned_footprint(-(-int(each) * length // at))

    n = next((n for n in range(2, most + 1) if kept(n, tokens) <= inputs), most)
    planned, by_host = lengths(n), False
    for _ in range(_CONFIRMS):
        if kept(n, tokens) > inputs:
            by_host = True
            tokens = _host_fit([int(each)] * -(-blocks // n), at, inputs, planned.step) if tokens else 0
            tokens = min(tokens, at)
        if tokens < planned.step:
            return none
        remade = planned.predict_at(tokens)
        if remade.total <= result.budget and remade.host <= host:
            held = f"host RAM {format_bytes(host)}" if by_host else _held_by(remade)
            limit = f"{held}; the input of one block in {n} kept, the others remade" + (
                "" if by_host else f" (host RAM {format_bytes(host)})")
            return planned.result(result.budget, tokens, batch_size, limit)
        tokens -= max(planned.step, _slack(tokens, planned.step))
    return none


def _partial_fit(result: ContextResult, inputs: int, host: int, shortest: int, lengths: _Lengths) -> tuple[int, int]:
    """(length, blocks): the longest length longer than ``shortest`` at which the first ``blocks`` offloaded block
    inputs fit ``inputs`` bytes of host RAM (as many as fit: each one offloaded frees its bytes on the device) and
    the plan fits the budget, with that count; (0, 0) when none is longer.

    Solved on a model, confirmed by plans (each one three traces): the device total of every block offloaded (the
    quadratic through the planned points) plus, per block kept, its input's bytes; a miss shifts the model by it.
    """
    budget, step, full = result.budget, lengths.step, result.prediction
    blocks, at = full.offloaded_blocks, max(result.tokens, step)
    if blocks < 2 or not full.host_sizes:
        return 0, 0
    curve = _Quadratic(_nearest(lengths.points(budget), budget))

    def count(length: int) -> int:  # the blocks whose pinned inputs fit, each block's inputs alike
        pinned = sum(pinned_footprint(-(-size * length // at)) for size in full.host_sizes) / blocks
        return int(min(blocks, inputs // max(pinned, 1)))

    def modelled(length: int) -> float:
        kept = (blocks - count(length)) * sum(full.host_sizes) * length / at / blocks
        return curve.a + curve.b * length + curve.c * length * length + kept

    best, best_count, low, high, shift = 0, 0, shortest // step, result.tokens // step, 0.0
    for _ in range(_CONFIRMS):
        while low < high:  # the longest length the shifted model fits (it grows with the length)
            middle = (low + high + 1) // 2
            low, high = (middle, high) if modelled(middle * step) + shift <= budget else (low, middle - 1)
        guess = low * step
        if guess <= max(best, shortest) or count(guess) < 1:
            break
        prediction = lengths.predict_at(guess, count(guess))
        if prediction.total <= budget and prediction.host <= host:
            best, best_count = guess, count(guess)
            high = result.tokens // step
        else:
            high = low - 1
        low = best // step if best else shortest // step
        shift = prediction.total - modelled(guess)
        if high - low <= max(1, _slack(best, step) // step):
            break
    return best, best_count
def _host_fit(sizes: Sequence[int], tokens: int, host: int, step: int) -> int:
    """The longest multiple of ``step`` up to ``tokens`` whose offloaded tensors (``sizes`` bytes at ``tokens``, each
    taken as proportional to the length) fit ``host`` as pinned (:func:`~lightning_hbm.activations.pinned_footprint`)."""

    def pinned(length: int) -> int:
        return sum(pinned_footprint(-(-size * length // tokens)) for size in sizes)

    low, high = 0, tokens // step  # in steps: pinned(low * step) fits, (high + 1) * step need not
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if pinned(middle * step) <= host else (low, middle - 1)
    return low * step


def _capped(guess: int, lengths: _Lengths) -> int:
    """``guess``, below the model's longest sequence (planned first: it was over the budget)."""
    if lengths.longest is None:
        return guess
    return min(guess, max(lengths.step, lengths.longest[0] - lengths.step))


#: Leaf names of a learned position table (``nn.Embedding``): GPT-2/nanoGPT ``wpe``, BERT ``position_embeddings``,
#: OPT ``embed_positions`` (with an ``offset``), ``pos_emb``: the model cannot run a longer sequence.
_POSITION_TABLES = ("wpe", "position_embeddings", "embed_positions", "pos_emb", "pos_embedding", "position_embedding")


def _position_limit(module: nn.Module, step: int) -> Optional[tuple[int, str]]:
    """(tokens, why): the longest sequence ``module``'s learned position table holds, as a multiple of ``step``;
    ``None`` without one (rotary or relative positions: no table bounds the length).

    Was: ``max_context`` planned 2,048 tokens first whatever the model, so any model with a position table shorter
    than that (nanoGPT's ``block_size``, GPT-2's 1,024, BERT's 512) failed with its own error ("Sequence length 2048
    exceeds block_size 256", an ``IndexError``), and past the lengths planned with real values (on meta tensors) a
    table that no index can reach was planned as if the model ran there.
    """
    tables = [(_position_rows(sub), name) for name, sub in module.named_modules()
              if isinstance(sub, nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES]
    if not tables:
        return None
    tokens, name = min(tables)
    if tokens < step:
        raise ValueError(
            f"max_context(multiple_of={step}): {type(module).__name__} runs at most {tokens:,} tokens (its position "
            f"table {name} indexes {tokens:,} positions), fewer than one multiple of {step}. Fix: multiple_of <= {tokens}."
        )
    return tokens // step * step, f"the model's longest sequence ({tokens:,} positions in its position table {name})"


def _position_rows(table: nn.Embedding) -> int:
    """How many positions a learned position table indexes: its rows less OPT's ``offset``, and with a
    ``padding_idx`` only the rows on the longer side of it (RoBERTa, XLM-R, ESM number positions from
    ``padding_idx + 1``: 514 rows run 512 tokens; was 514, planned past the model's own ``IndexError``, session 31)."""
    padding = table.padding_idx
    rows = table.num_embeddings if padding is None else max(padding, table.num_embeddings - padding - 1)
    return rows - int(getattr(table, "offset", 0) or 0)


def _slack(tokens: int, step: int) -> int:
    """How far below the longest fitting length an answer may stop (:data:`_SLACK` of it, whole steps)."""
    return int(tokens * _SLACK) // step * step


def _aim(reach: float, step: int) -> int:
    """The length to plan for a budget the fit reaches at ``reach`` tokens: half the slack short of it."""
    if not math.isfinite(reach):
        return _round_down(reach, step)
    return _round_down(reach - _slack(int(reach), step) / 2, step)


def _nearest(points: dict[int, int], budget: int) -> list[tuple[int, int]]:
    """Planned points whose totals are nearest ``budget``, at least 10 % apart in length (points closer than that
    differ by allocator rounding as much as by length, and bend a curve through them anywhere), by length: three for a
    budget between planned totals, the two longest for one past them all (a line: far from the short lengths the loss
    chunk and the attention's blocks have stopped growing, and a quadratic from there bends the wrong way)."""
    near: list[tuple[int, int]] = []
    beyond = all(total < budget for total in points.values())
    order = sorted(points.items(), reverse=True) if beyond else sorted(points.items(), key=lambda item: abs(item[1] - budget))
    for n, total in order:
        if all(abs(n - m) > 0.1 * max(n, m) for m, _ in near):
            near.append((n, total))
    return sorted(near[: 2 if beyond else 3])


class _Quadratic:
    """``total(n) = a + b n + c n^2`` through three (length, bytes) points (a line through two)."""

    def __init__(self, points: Sequence[tuple[int, int]]) -> None:
        self.points = list(points)
        xs = [float(x) for x, _ in self.points]
        ys = [float(y) for _, y in self.points]
        if len(xs) >= 3:
            (x0, x1, x2), (y0, y1, y2) = xs[:3], ys[:3]
            d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
            self.c = max(0.0, (d12 - d01) / (x2 - x0))
            self.b = d01 - self.c * (x0 + x1)
        else:
            (x0, x1), (y0, y1) = xs[:2], ys[:2]
            self.c, self.b = 0.0, (y1 - y0) / (x1 - x0)
        self.a = y0 - self.b * x0 - self.c * x0 * x0

    def solve(self, total: int) -> float:
        """The length at which the fit reaches ``total`` (the larger root); infinite when it never does."""
        a = self.a - total
        if self.c > 0:
            return (-self.b + math.sqrt(max(0.0, self.b * self.b - 4 * self.c * a))) / (2 * self.c)
        return -a / self.b if self.b > 0 else math.inf


def _bracket(points: dict[int, int], around: int) -> list[tuple[int, int]]:
    """Two planned points for a local line at ``around``: it and the nearest one longer (else the nearest shorter).

    A line, not the quadratic: chunked terms (the loss's chunk grows until its cap, the MLP's chunks round up) bend the
    total piece by piece, and a quadratic through three points on two pieces can say the budget is never reached.
    """
    longer = sorted(n for n in points if n > around)
    shorter = sorted(n for n in points if n < around)
    other = longer[0] if longer else shorter[-1]
    return sorted([(around, points[around]), (other, points[other])])


def _round(n: int, step: int) -> int:
    return max(step, -(-n // step) * step)


def _round_down(n: float, step: int) -> int:
    if not math.isfinite(n):
        return 2**40
    return max(step, int(n) // step * step)


def _over(prediction: Prediction, budget: int) -> str:
    """Which term alone is over ``budget`` at the shortest length (or the largest, and the sum)."""
    terms = {**prediction.categories, "CUDA context": prediction.overhead}
    alone = [name for name, n in terms.items() if n > budget]
    if alone:
        return f"{alone[0]} alone ({format_bytes(terms[alone[0]])}) is over the budget"
    largest = max(terms, key=lambda name: terms[name])
    return (f"nothing fits: {format_bytes(prediction.total)} at the shortest length, largest term {largest} "
            f"({format_bytes(terms[largest])})")


def _held_by(prediction: Prediction) -> str:
    """The device term that grows the total most at this length (the largest category)."""
    largest = max(CATEGORIES, key=lambda name: prediction.categories[name])
    return f"largest term {largest} {format_bytes(prediction.categories[largest])}"


def _token_batches(template: Template, batch_size: int) -> Callable[[int], Any]:
    """``length -> (tokens, targets)`` of the model's vocabulary; a clear error for a model that takes no tokens."""
    module = template.module
    vocab = getattr(getattr(module, "hparams", {}), "get", lambda _k: None)("vocab_size")
    if vocab is None:
        embedding = next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
        vocab = embedding.num_embeddings if embedding is not None else None
    if vocab is None:
        raise ValueError(
            f"max_context: {type(module).__name__} has no token vocabulary (no `vocab_size` hyperparameter, no "
            "nn.Embedding), so a sequence length means nothing to it by default. Pass batch_fn=lambda length: <one "
            "training batch at that length>, e.g. for a vision model the images whose patch count is the length."
        )

    def batch(length: int) -> Any:
        # small: real values (data-dependent reads exact); contiguous, as a DataLoader collates it
        device = None if batch_size * (length + 1) <= MAX_TWIN_ELEMENTS else "meta"
        return tuple(t.contiguous() for t in synthetic_batch(batch_size, length, vocab_size=int(vocab), device=device))

    return batch


def _mlp_chunks(template: Template) -> int:
    """A power of two near 4x the widest Linear of a block over its narrowest input, at most :data:`_MAX_MLP_CHUNKS`:
    each chunk of the MLP recompute then holds about as much as the block's input (Llama 8B/70B: 16)."""
    blocks = find_blocks(template.module)
    if not blocks:
        return 8
    widths = [(int(getattr(m, "in_features")), int(getattr(m, "out_features"))) for m in blocks[0][1].modules()
              if hasattr(m, "in_features") and hasattr(m, "out_features")]
    if not widths:
        return 1
    ratio = max(out for _, out in widths) / min(inp for inp, _ in widths)
    return int(min(_MAX_MLP_CHUNKS, max(1, 2 ** round(math.log2(max(1.0, 4 * ratio))))))


def _configuration(
    template: Template, callbacks: list[Any], device: str, offload: Union[bool, int], regenerate: int = 1
) -> tuple[list[Any], dict[str, Any]]:
    """The user's callbacks with max_context's ``ActivationCheckpointing`` and ``FusedLoss``; the choices made."""
    checkpointing = next((c for c in callbacks if isinstance(c, ActivationCheckpointing)), None)
    loss = next((c for c in callbacks if isinstance(c, FusedLoss)), None)
    kept = [c for c in callbacks if not isinstance(c, (ActivationCheckpointing, FusedLoss))]
    chunks = _mlp_chunks(template)
    blocks = checkpointing.blocks if checkpointing is not None else None
    kept.append(ActivationCheckpointing("full", blocks=blocks, offload=offload, mlp_chunks=chunks, regenerate=regenerate))
    kept.append(FusedLoss(heads=loss.heads if loss is not None else None))
    choices = {"checkpointing": "full", "offload": offload, "mlp_chunks": chunks, "loss_chunk_tokens": None,
               "regenerate": regenerate}
    return kept, choices


def _with_loss(choices: dict[str, Any], template: Template, batch_size: int, tokens: int) -> dict[str, Any]:
    """``choices`` with the fused loss's automatic chunk at ``tokens`` (:func:`chunk_tokens`, bf16 logits)."""
    vocab = getattr(getattr(template.module, "hparams", {}), "get", lambda _k: None)("vocab_size")
    if vocab is None:
        return dict(choices)
    return {**choices, "loss_chunk_tokens": chunk_tokens(batch_size * tokens, int(vocab))}


def host_bytes(prediction: Prediction) -> dict[str, int]:
    """The host terms of ``prediction`` by name (``host_activations``, ``host_offload``)."""
    terms = prediction.terms
    return {t.name: terms[t.name] for t in host_terms()}


__all__ = ["ContextResult", "host_bytes", "max_context"]
