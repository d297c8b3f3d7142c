"""The line through cut models under ``ActivationCheckpointing(offload=k)`` and ``every > 1``: checked as the plain
line is, and cut in units of ``every`` blocks; each plan equal to the byte to the whole model traced, or traced whole."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, Optional

import pytest

from lightning_hbm import FusedLoss, LoRA
from lightning_hbm.activations.checkpointing import ActivationCheckpointing
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import Candidate, api, predict
from lightning_hbm.planner.tracing import build_template, trace

BATCH = tuple(t.contiguous() for t in synthetic_batch(1, 512))


def _llama(layers: int) -> Any:
    return partial(LlamaLM, hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                   num_key_value_heads=2)


def _candidate(*callbacks: Any) -> Candidate:
    return Candidate.from_trainer(None, [LoRA(r=4), *callbacks])


@contextmanager
def _traced_lengths() -> Iterator[list[Optional[int]]]:
    """The number of blocks each trace of a plan kept (None: the whole model), as predict asked for them."""
    lengths: list[Optional[int]] = []
    real = api._trace

    def recording(model: Any, batch: Any, candidate: Candidate, device: str, keep_blocks: Optional[int],
                  *args: Any) -> Any:
        lengths.append(keep_blocks)
        return real(model, batch, candidate, device, keep_blocks, *args)

    api._trace = recording
    try:
        yield lengths
    finally:
        api._trace = real


def _same(cut: Any, whole: Any) -> bool:
    return (cut.categories, cut.side, cut.host_sizes, cut.offloaded_blocks) == (
        whole.categories, whole.side, whole.host_sizes, whole.offloaded_blocks)


@pytest.mark.parametrize("offload", [False, 1, 3])  # k = count - 1: the sweep below (8 blocks, k = 7)
def test_checkpointing_every_other_block_is_cut_in_units_of_two_blocks(offload: Any) -> None:
    """``every=2`` (alone, or with the first k checkpointed blocks offloading their inputs): cut to 6 and 8 blocks (3 and
    4 units of 2, each ending as the model does), extended to 16, equal to the byte to the 16 blocks traced, and no
    whole trace. Was: a partial offload was always traced whole, and without offload the 3- and 4-block line was refused
    (+48 %) and the whole model traced after them."""
    candidate = _candidate(ActivationCheckpointing("full", every=2, offload=offload))
    with warnings.catch_warnings(), _traced_lengths() as lengths:
        warnings.filterwarnings("error", message="lightning_hbm plan")  # no fallback: the line holds
        cut = predict(_llama(16), BATCH, candidate, device="cuda")
    assert set(lengths) == {6, 8}
    whole = predict(_llama(16), BATCH, candidate, device="cuda", extrapolate=False)
    assert _same(cut, whole) and cut.offloaded_blocks == (offload or 0) and not cut.uncut


def test_checkpointing_every_third_block_of_an_odd_depth_is_cut_in_units() -> None:
    """``every=3`` over 20 blocks (checkpointed: 0, 3, ..., 18; the last unit 2 blocks long), the first 3 offloading:
    cut to 8 and 11 blocks, each ending as the model does, equal to the byte to the whole trace."""
    candidate = _candidate(ActivationCheckpointing("full", every=3, offload=3))
    with warnings.catch_warnings(), _traced_lengths() as lengths:
        warnings.filterwarnings("error", message="lightning_hbm plan")
        cut = predict(_llama(20), BATCH, candidate, device="cuda")
    assert set(lengths) == {8, 11}
    assert _same(cut, predict(_llama(20), BATCH, candidate, device="cuda", extrapolate=False))


def test_the_partial_offload_line_is_checked_and_traced_whole_where_its_traces_peak_apart() -> None:
    """The three traces of a partial offload (3 blocks with 2 offloading, 4 with 3, 4 with 2) are checked as the plain
    line's two are. Under the selective policy each offloading block keeps its matmul outputs on the device, so the
    forward's peak moves with the offloading blocks: block 1 with 2 of them, the last offloading with 3. The check cannot
    vouch for a line through peaks at different points: the whole model is traced, with the warning, equal to the byte.
    Was: combined unchecked (it held here; on nothing else is it known to fail: benchmarks/README.md, session 25)."""
    candidate = _candidate(ActivationCheckpointing("selective", offload=3))
    with pytest.warns(UserWarning, match=r"the first 3 checkpointed offloading their inputs, peak at points") as caught:
        cut = predict(_llama(10), BATCH, candidate, device="cuda")
    where = "forward (offloaded blocks): block 1 with 3 blocks (2 offloading), block offloading -1 with 4 (3 offloading)"
    assert where in cut.uncut and where in str(caught[0].message)
    assert _same(cut, predict(_llama(10), BATCH, candidate, device="cuda", extrapolate=False))


def test_the_three_traces_of_a_partial_offload_place_their_peaks_at_corresponding_points() -> None:
    """Full recompute, the first 3 of 8 offloading: each phase peaks at the same point of A, B and C (the offloading
    blocks named from their part's end), and the combination holds without a fallback."""
    template = build_template(_llama(8))
    candidate = _candidate(ActivationCheckpointing("full", offload=3))
    first, offloading, keeping = (trace(template, BATCH, candidate, "cuda", keep, None, None, None, moved)
                                  for keep, moved in ((3, 2), (4, 3), (4, 2)))
    assert first.where == offloading.where == keeping.where
    assert first.lines_apart([(offloading, 1), (keeping, 4)], 8) == []
    assert "block offloading -1" in offloading.regions["forward (offloaded blocks)"]


def test_a_partial_offload_with_the_fused_loss_and_mlp_chunks_is_cut_in_units() -> None:
    """``every=2``, the first 3 checkpointed blocks offloading, MLP token chunks and FusedLoss: equal to the byte."""
    candidate = _candidate(ActivationCheckpointing("full", every=2, offload=3, mlp_chunks=4), FusedLoss())
    with warnings.catch_warnings(), _traced_lengths() as lengths:
        warnings.filterwarnings("error", message="lightning_hbm plan")
        cut = predict(_llama(16), BATCH, candidate, device="cuda")
    assert set(lengths) == {6, 8}
    assert _same(cut, predict(_llama(16), BATCH, candidate, device="cuda", extrapolate=False))


# (blocks, every, policy, FusedLoss + mlp_chunks=4, k): one case per path of the line (k = 1 and 2 in both cut models,
# the three-trace combination, the count minus 1; in units of `every`; with the fused loss and MLP token chunks). The
# session-25 sweep of 20 cases (k = 1, 2, 3, count - 2, count - 1; selective too) passed the same way; cut to 3 cases
# (2 now) to keep the suite's time (it took 6 minutes): the selective fallback has its own test above. The three-trace
# combination without the fused loss (8 blocks, full, k=3 here until session 31) is the same model, candidate and
# branch of _cut_and_extend (3 <= k < count - 1) as k=5 in tests/planner/test_api.py::
# test_a_partial_activation_offload_is_planned_as_the_whole_model_traces_it, equal to the byte to the whole trace there
SWEEP = [
    (8, 1, "full", False, 7),
    (10, 1, "full", True, 3),
]  # k <= 2 and every=2: test_checkpointing_every_other_block_is_cut_in_units_of_two_blocks


@pytest.mark.slow
@pytest.mark.parametrize(("blocks", "every", "policy", "fused", "k"), SWEEP)
def test_a_partial_offload_is_planned_as_the_whole_model_or_traced_whole(blocks: int, every: int, policy: str,
                                                                        fused: bool, k: int) -> None:
    """Equal to the byte to the whole model traced, from the line or (where the check refuses it) from the whole trace:
    only the selective policy with 3 or more blocks offloading of every one checkpointed falls back."""
    checkpointing = ActivationCheckpointing(policy, every=every, offload=k, mlp_chunks=4 if fused else 1)
    candidate = _candidate(checkpointing, *([FusedLoss()] if fused else []))
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        cut = predict(_llama(blocks), BATCH, candidate, device="cuda")
    assert _same(cut, predict(_llama(blocks), BATCH, candidate, device="cuda", extrapolate=False))
    assert bool(cut.uncut) == (policy == "selective" and every == 1 and k >= 3), cut.uncut
