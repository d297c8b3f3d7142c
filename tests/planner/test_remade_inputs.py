"""Remade block inputs (``ActivationCheckpointing(regenerate=n)``) planned: the line cut in units of ``n`` blocks equals
the whole model traced, MemTracker measures the planned peak, and ``max_context(max_regenerate=...)`` uses them where
a host budget cannot hold every offloaded input."""

from __future__ import annotations

from functools import partial
from typing import Any, Union

import pytest

from lightning_hbm import FusedLoss, LoRA
from lightning_hbm.activations.checkpointing import ActivationCheckpointing, pinned_footprint
from lightning_hbm.data import synthetic_batch
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import CUDA_CONTEXT_BYTES, Candidate, max_context
from lightning_hbm.planner.api import predict
from lightning_hbm.planner.reference import memtracker_peak
from tests.planner.test_context import _HostOutsideTorch

STEP = 256


def _llama(layers: int, positions: int = 2048) -> Any:
    return partial(LlamaLM, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions)  # fmt: skip


def _candidate(offload: Union[bool, int], regenerate: int) -> Candidate:
    return Candidate.from_trainer(None, [LoRA(r=4), ActivationCheckpointing("full", offload=offload, regenerate=regenerate)])


@pytest.mark.slow
def test_remade_inputs_whose_peaks_tie_from_unit_to_unit_are_planned_by_the_line_cut_in_units() -> None:
    # 9 blocks, regenerate=2: the units 0-1, 2-3, ..., 8; cut to 5 and 7 blocks, the line is the whole model's to the
    # byte. A vocabulary of 32 keeps the head small: the forward peaks in the blocks, at the same point of every unit
    # (the remade ones: 6.36 MB each). Named by blocks, that point was block 3 of both cuts, -2 of one and -4 of the
    # other: the line was refused and the 8B's plans traced all 32 blocks. Named by units (block 1 of unit 1) it is
    # one point. The whole trace also needs the remade inputs' hooks to free their record: a reference cycle held one
    # block input until Python's collector ran (512 KiB more in the backward at 6 and 8 blocks than at 10 and 12)
    factory = partial(LlamaLM, vocab_size=32, hidden_size=64, intermediate_size=128, num_hidden_layers=9,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)  # fmt: skip
    batch = tuple(t.contiguous() for t in synthetic_batch(1, 2048, vocab_size=32))
    candidate = Candidate.from_trainer(None, [LoRA(r=4), ActivationCheckpointing("full", offload=True, mlp_chunks=4,
                                                                                 regenerate=2), FusedLoss()])
    cut = predict(factory, batch, candidate, device="cuda", extrapolate=True)
    whole = predict(factory, batch, candidate, device="cuda", extrapolate=False)
    assert cut.uncut == ""
    assert (cut.categories, cut.side, cut.host_sizes) == (whole.categories, whole.side, whole.host_sizes)
    assert cut.host_sizes == (2048 * 64 * 4,) * 5  # blocks 0, 2, 4, 6 and 8 keep theirs


@pytest.mark.slow
def test_remade_inputs_free_on_the_device_what_memtracker_measures() -> None:
    # a partial offload: the first 3 checkpointed blocks offload (0 and 2 keep theirs there), the others keep theirs
    # on the device, one in two remade; MemTracker's peak is the plan's to the byte: three block inputs (blocks 3, 5
    # and 7 remade, 4 and 6 kept on the device) less than without
    factory, batch = _llama(8), tuple(t.contiguous() for t in synthetic_batch(1, 1024, vocab_size=512))
    checkpointing = ActivationCheckpointing("full", offload=3, regenerate=2)
    checkpointing.offload = _HostOutsideTorch("cpu")
    measured = memtracker_peak(factory, batch, Candidate.from_trainer(None, [LoRA(r=4), checkpointing]))
    planned = predict(factory, batch, _candidate(3, 2), device="cuda")
    assert measured == planned.peak and planned.host == 2 * pinned_footprint(1024 * 64 * 4)
    assert predict(factory, batch, _candidate(3, 1), device="cuda").peak - planned.peak == 3 * 1024 * 64 * 4


@pytest.mark.slow
def test_a_host_budget_too_small_for_every_input_remakes_half_of_them() -> None:
    # 8 blocks, 24 MiB beside the CUDA context: 6,400 tokens without a host limit, 8 inputs of 1.56 MiB pinned as 2 MiB
    # each (16 MiB). With 8 MiB of host RAM and one input in two remade, the 4 kept fit at that length, on the same
    # device total; offloading only the first 4 blocks reaches 5,376 tokens, no offload 4,352
    deep, budget, host = _llama(8, 2**20), CUDA_CONTEXT_BYTES + 24 * 2**20, 8 * 2**20
    result = max_context(deep, budget, callbacks=[LoRA(r=4)], multiple_of=STEP, host_budget=host, max_regenerate=2)
    assert isinstance(result, type(result))
    assert result.tokens == 6400 and result.choices["regenerate"] == 2 and result.choices["offload"] is True
    assert result.host == 4 * 2 * 2**20 <= host and result.prediction.total <= budget
    assert result.limit.endswith("; the input of one block in 2 kept, the others remade (host RAM 8.00 MiB)")
