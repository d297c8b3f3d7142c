"""``max_context``: the longest context for a budget, planned; proven against a real step measured by torch's MemTracker.

The proof (issue 51, item 5): a small transformers Llama, QLoRA, with offload (to a host memory MemTracker cannot
see, as pinned memory is outside a GPU's allocator), MLP token chunks and the fused loss's chunks on. The peak
measured at the predicted length is within 3 % of the prediction, and the next length up is over the budget.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm._compat import _disable_current_modes
from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations import checkpointing
from lightning_hbm.activations.checkpointing import ActivationCheckpointing, OffloadSavedTensors, pinned_footprint
from lightning_hbm.activations.loss import FusedLoss
from lightning_hbm.data import synthetic_batch
from lightning_hbm.layers import embedding
from lightning_hbm.models import LlamaLM
from lightning_hbm.planner import CUDA_CONTEXT_BYTES, Candidate, max_context, plan, tracing
from lightning_hbm.planner import context as context_module
from lightning_hbm.planner.api import predict
from lightning_hbm.planner.reference import memtracker_peak
from lightning_hbm.planner.tracing import Decided

SMALL_LLAMA = partial(LlamaLM, vocab_size=512, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)  # fmt: skip
STEP = 256


class _HostOutsideTorch(OffloadSavedTensors):
    """The injected offload target: host copies made with every dispatch mode off, so MemTracker never counts them
    (pinned host memory is likewise outside the GPU allocator's count). What stays on the device is the library's."""

    def _host_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        with _disable_current_modes():
            return tensor.detach().clone()


def _measured(tokens: int, choices: dict[str, Any]) -> int:
    """MemTracker's peak of one steady-state step at ``tokens`` with max_context's choices, offload injected."""
    checkpointing = ActivationCheckpointing("full", mlp_chunks=choices["mlp_chunks"], offload=True)
    checkpointing.offload = _HostOutsideTorch("cpu")
    callbacks = [LoRA(r=8), checkpointing, FusedLoss()]
    candidate = Candidate.from_trainer(QuantizedPrecision("nf4-dq", dtype="float32"), callbacks)
    batch = tuple(t.contiguous() for t in synthetic_batch(1, tokens, vocab_size=512))
    return memtracker_peak(SMALL_LLAMA, batch, candidate)


DEEP_LLAMA = partial(LlamaLM, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=32,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2**20)  # fmt: skip
_SHARED_PLANS: dict[tuple[Any, ...], Any] = {}


@pytest.fixture
def shared_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """max_context's plans shared between calls, keyed by model, configuration, length and offloaded count. The two
    host-budget tests of DEEP_LLAMA solve one device budget: each call plans the same configurations at the same lengths
    (offloaded: 2k, 32k, 7,680, 7,424, 4,096 tokens; without offload: 2k, 32k, 2,304), eight of the second test's ten
    plans; SMALL_LLAMA with LoRA(r=4) on CUDA, offloaded, is planned at 2k and 32k tokens by two tests; the two calls of
    the CPU-offloaded-states test share three of their ten plans (2k, 32k, 2,816). A plan depends on nothing else (a call's own cache keeps them the same way, and
    a model stepped again plans as a fresh one: test_the_structure_forwards_run_once_across_lengths_and_plan_the_same_bytes),
    so what the tests check of max_context's choices is unchanged; run alone, each test plans everything itself."""
    original = context_module._Lengths.predict_at

    def shared(self: Any, tokens: int, offload: Any = None) -> Any:
        key = (str(self.template.module), self.candidate.yaml(), self.regenerate, self.device, tokens, offload)
        if key not in _SHARED_PLANS:
            _SHARED_PLANS[key] = original(self, tokens, offload)
        return _SHARED_PLANS[key]

    monkeypatch.setattr(context_module._Lengths, "predict_at", shared)


@pytest.mark.slow
def test_predicted_longest_context_matches_a_measured_step() -> None:
    budget = CUDA_CONTEXT_BYTES + 12 * 2**20
    result = max_context(SMALL_LLAMA, budget, plugin=QuantizedPrecision("nf4-dq", dtype="float32"), callbacks=[LoRA(r=8)],
                         multiple_of=STEP)
    assert isinstance(result, type(result)) and result.tokens > 0 and result.tokens % STEP == 0
    assert result.choices["offload"] and result.choices["mlp_chunks"] > 1 and result.choices["checkpointing"] == "full"
    # the host term: one pinned block input per layer (fp32, hidden 64)
    assert result.host == 2 * pinned_footprint(result.tokens * 64 * 4)
    measured = _measured(result.tokens, result.choices)
    assert measured == pytest.approx(result.prediction.peak, rel=0.03)
    assert result.prediction.total <= budget
    assert _measured(result.tokens + STEP, result.choices) + CUDA_CONTEXT_BYTES > budget  # the next length up is over


@pytest.mark.usefixtures("shared_plans")
def test_several_budgets_give_one_result_each_and_a_hopeless_one_names_its_term() -> None:
    tiny, roomy = 2**20, CUDA_CONTEXT_BYTES + 6 * 2**20
    results = max_context(SMALL_LLAMA, [tiny, roomy], callbacks=[LoRA(r=4)], multiple_of=64)
    assert isinstance(results, list) and [r.budget for r in results] == [tiny, roomy]
    assert results[0].tokens == 0 and "CUDA context alone" in results[0].limit
    assert results[1].tokens > 0 and results[1].prediction.total <= roomy
    assert "host_activations" in results[1].prediction.terms and results[1].host > 0


class _Regressor(pl.LightningModule):
    """Not a token model: features in, one value out."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.mse_loss(self.net(x).squeeze(-1), y)

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters())


def test_a_model_without_tokens_needs_a_batch_fn() -> None:
    with pytest.raises(ValueError, match=r"_Regressor has no token vocabulary.*batch_fn=lambda length"):
        max_context(_Regressor, "1GiB", device="cpu")


def test_bad_arguments_are_clear_errors() -> None:
    with pytest.raises(ValueError, match=r"multiple_of=0\): must be an int >= 1"):
        max_context(SMALL_LLAMA, "1GiB", multiple_of=0)
    with pytest.raises(ValueError, match=r"ambiguous"):
        max_context(SMALL_LLAMA, "24G")


def test_a_fake_trace_runs_three_iterations_of_a_chunk_loop_and_plans_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # every loop of the step has more than three equal iterations: the sliced 4-bit head's vocabulary slices (slices
    # made small here), the fused loss's token chunks and softmax rows, the MLP's token chunks (bf16: the norms too)
    monkeypatch.setattr(embedding, "SLICE_BYTES", 16 * 2**10)  # 128 of the 512 vocabulary rows per slice
    batch = tuple(t.contiguous() for t in synthetic_batch(1, 1024, vocab_size=512))

    def planned() -> Any:
        plugin = QuantizedPrecision("nf4-dq", dtype="bfloat16", quantize_head=True, quantize_embeddings=True)
        callbacks = [LoRA(r=8), ActivationCheckpointing("full", mlp_chunks=8, offload=True), FusedLoss(chunk_size=128)]
        return plan(SMALL_LLAMA, batch, device="cuda", plugin=plugin, callbacks=callbacks).predictions[0]

    elided: list[int] = []
    original = torch_compat.chunk_starts

    def counting(stop: int, step: int, tensor: torch.Tensor) -> Any:
        starts = original(stop, step, tensor)
        elided.append(len(range(0, stop, step)) - len(starts))
        return starts

    monkeypatch.setattr(torch_compat, "chunk_starts", counting)
    fast = planned()
    assert sum(elided) > 100  # iterations not traced
    monkeypatch.setattr(torch_compat, "chunk_starts", lambda stop, step, tensor: range(0, stop, step))
    every = planned()
    assert (fast.categories, fast.side, fast.host, fast.loss) == (every.categories, every.side, every.host, every.loss)


def test_the_structure_forwards_run_once_across_lengths_and_plan_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    # max_context plans one model at a dozen lengths: what the probe batch decides (which parameters the loss reaches,
    # each token-chunked layer's verdict) is decided once and reused, and each plan is the one a fresh trace makes
    plugin = QuantizedPrecision("nf4-dq", dtype="bfloat16")
    callbacks = [LoRA(r=8), ActivationCheckpointing("full", mlp_chunks=8, offload=True), FusedLoss()]
    candidate = Candidate.from_trainer(plugin, callbacks)

    def batch(tokens: int) -> Any:
        return tuple(t.contiguous() for t in synthetic_batch(1, tokens, vocab_size=512))

    probe = batch(256)
    calls: list[int] = []
    setups: list[int] = []
    original, set_up = tracing._gradient_receivers, tracing._set_up
    monkeypatch.setattr(tracing, "_gradient_receivers", lambda *args: calls.append(1) or original(*args))
    monkeypatch.setattr(tracing, "_set_up", lambda *args: setups.append(1) or set_up(*args))
    decided = Decided()
    for tokens in (512, 2048, 1024):  # longer, then shorter: nothing of the longer step stays counted
        kept = predict(SMALL_LLAMA, batch(tokens), candidate, device="cuda", probe_batch=probe, decided=decided)
        fresh = predict(SMALL_LLAMA, batch(tokens), candidate, device="cuda", probe_batch=probe)
        assert (kept.categories, kept.side, kept.host, kept.loss) == (fresh.categories, fresh.side, fresh.host, fresh.loss)
        assert (kept.trainable_params, kept.total_params, kept.guessed_reads) == (
            fresh.trainable_params, fresh.total_params, fresh.guessed_reads)
    assert len(calls) == 4  # the kept one's first plan, and each fresh plan
    assert len(setups) == 4  # the model is built and its surgery run once for the kept plans (and once per fresh one)
    (_reached, verdicts), = decided.by_depth.values()
    assert "" in verdicts.values()  # chunked layers were decided on the probe, and their verdicts restored
    with pytest.raises(ValueError, match=r"decided=\.\.\.\) needs the probe_batch"):
        predict(SMALL_LLAMA, probe, candidate, decided=decided)


@pytest.mark.slow
def test_a_model_stepped_again_at_another_length_plans_as_a_fresh_one_when_its_blocks_are_cut() -> None:
    # eight blocks are traced cut to 3 and to 4 (two models kept, one per depth), and extended to 8
    deep = partial(LlamaLM, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)
    candidate = Candidate.from_trainer(QuantizedPrecision("nf4-dq", dtype="bfloat16"),
                                       [LoRA(r=8), ActivationCheckpointing("full", mlp_chunks=4, offload=True), FusedLoss()])
    probe = tuple(t.contiguous() for t in synthetic_batch(1, 256, vocab_size=512))
    decided = Decided()
    for tokens in (2048, 1024):
        batch = tuple(t.contiguous() for t in synthetic_batch(1, tokens, vocab_size=512))
        kept = predict(deep, batch, candidate, device="cuda", probe_batch=probe, decided=decided)
        fresh = predict(deep, batch, candidate, device="cuda", probe_batch=probe)
        assert (kept.categories, kept.side, kept.host_sizes) == (fresh.categories, fresh.side, fresh.host_sizes)
    assert sorted(decided.built) == [3, 4] and len(kept.host_sizes) == 8


@pytest.mark.usefixtures("shared_plans")
def test_a_multiple_of_past_the_planned_lengths_still_plans_two_lengths() -> None:
    # 2k, 8k and 32k all round up to one multiple of 65536: the fit needs a second length (a crash before)
    result = max_context(SMALL_LLAMA, CUDA_CONTEXT_BYTES + 2**30, callbacks=[LoRA(r=4)], multiple_of=65536)
    assert isinstance(result, type(result)) and result.tokens > 0 and result.tokens % 65536 == 0
    assert result.prediction.total <= CUDA_CONTEXT_BYTES + 2**30


def test_the_host_fit_counts_pinned_pieces_not_a_power_of_two_per_input() -> None:
    # four offloaded inputs of 5 MiB at 4,096 tokens pin 6 MiB each (pieces of 4 + 2 MiB): 24 MiB holds all 4,096
    # tokens; pinned in one request each (8 MiB), 24 MiB held 3,072 tokens (3.75 MiB each, 4 MiB pinned)
    mib = 2**20
    assert context_module._host_fit([5 * mib] * 4, 4096, 24 * mib, STEP) == 4096
    assert context_module._host_fit([5 * mib] * 4, 4096, 24 * mib - 1, STEP) == 3072  # 3,328 tokens: 4.06 MiB, 6 pinned


def test_the_planned_host_bytes_are_the_pinned_pieces_the_run_takes() -> None:
    """The host_activations term of an offloaded plan is what the run's copies allocate: the pinned pieces of each block
    input (:func:`pinned_pieces`, 4 + 2 MiB for 5 MiB), not the power of two one request would take (8 MiB)."""
    factory = partial(LlamaLM, vocab_size=512, hidden_size=320, intermediate_size=640, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096)
    batch = tuple(t.contiguous() for t in synthetic_batch(1, 4096, vocab_size=512))
    candidate = Candidate("32-true", lora_r=4, checkpointing="full", offload_activations=True)
    prediction = predict(factory, batch, candidate, device="cuda")
    block_input = 4096 * 320 * 4  # fp32 hidden states: 5 MiB
    assert prediction.host_sizes == (block_input,) * 4
    run = checkpointing._Pieces(torch.zeros(1, 4096, 320), torch.device("cpu"), pin=False)  # one block input's copy
    pieces = sum(piece.untyped_storage().nbytes() for piece in run.pieces)
    assert prediction.host == prediction.terms["host_activations"] == 4 * pieces == 4 * 6 * 2**20


@pytest.mark.slow
@pytest.mark.usefixtures("shared_plans")
def test_a_host_budget_bounds_the_pinned_block_inputs_or_turns_offload_off() -> None:
    # the offloaded block inputs are pinned, each rounded up to a power of two: a machine with less host RAM than the
    # offload needs gets the longest length whose pinned inputs fit, or the longest without offload if that is longer
    deep = DEEP_LLAMA
    budget, host = CUDA_CONTEXT_BYTES + 32 * 2**20, 32 * 2**20
    bounded = max_context(deep, budget, callbacks=[LoRA(r=4)], multiple_of=STEP, host_budget=host)
    # unbounded, the answer is 7,424 tokens with 64 MiB pinned; 32 inputs of 64 fp32 values per token fit 32 MiB up
    # to 4,096 tokens (1 MiB each), one step longer each takes 2 MiB; without offload 2,304 tokens fit the device
    assert bounded.choices["offload"] and bounded.tokens == 4096 and bounded.host == host
    assert bounded.prediction.host_sizes == (4096 * 64 * 4,) * 32 and bounded.prediction.total <= budget
    assert bounded.limit == "host RAM 32.00 MiB (the pinned block inputs; without offload 2,304 tokens)"
    # nothing may be pinned: the two-block model trains longer without offload than with 1 byte of inputs pinned
    none = max_context(SMALL_LLAMA, CUDA_CONTEXT_BYTES + 12 * 2**20, callbacks=[LoRA(r=4)], multiple_of=STEP, host_budget=1)
    assert not none.choices["offload"] and none.host == 0 and none.tokens == 3072
    with pytest.raises(ValueError, match="lots"):
        max_context(SMALL_LLAMA, "1GiB", host_budget="lots")


@pytest.mark.slow
@pytest.mark.usefixtures("shared_plans")
def test_a_host_budget_fits_the_block_inputs_to_what_the_offloaded_optimizer_states_leave() -> None:
    # the states CPUOffloadStrategy keeps in host RAM do not shrink with the length: the pinned block inputs must fit
    # what they leave of the budget. Fitted to the whole budget, each guess was over and planned again (four plans)
    from lightning_hbm import CPUOffloadStrategy

    def lengths_planned(**kwargs: Any) -> tuple[Any, set[int]]:
        calls: list[tuple[int, int]] = []
        original = context_module._Lengths.predict_at

        def counted(self: Any, tokens: int, offload: Any = None) -> Any:
            calls.append((id(self), tokens))
            return original(self, tokens, offload)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(context_module._Lengths, "predict_at", counted)
            # rank 64: 0.94 MiB of states beside 2 x 1 MiB of pinned block inputs
            result = max_context(SMALL_LLAMA, CUDA_CONTEXT_BYTES + 12 * 2**20, callbacks=[LoRA(r=64)],
                                 strategy=CPUOffloadStrategy(), multiple_of=STEP, **kwargs)
        return result, {tokens for owner, tokens in calls if owner == calls[0][0]}  # the offloaded configuration's

    free, planned = lengths_planned()
    inputs = context_module.host_bytes(free.prediction)["host_activations"]
    states = free.host - inputs
    assert free.tokens > 0 and states > 0 and inputs > 0
    bounded, bounded_planned = lengths_planned(host_budget=inputs + states // 2)  # the inputs fit, not with the states
    assert bounded.host <= inputs + states // 2
    assert len(bounded_planned - planned) <= 1  # the one length whose inputs fit what the states leave, confirmed


@pytest.mark.slow
@pytest.mark.usefixtures("shared_plans")
def test_a_host_budget_that_holds_some_block_inputs_offloads_only_those_and_trains_longer() -> None:
    # 48 MiB of host RAM: every pinned input fits up to 4,096 tokens (32 x 1 MiB); one step longer each takes 2 MiB,
    # so all 32 no longer fit, but 24 do. Offloading those 24 (the first blocks) and keeping 8 on the device is
    # longer than both options before: all offloaded (4,096 tokens) and none (2,304)
    deep = DEEP_LLAMA
    budget, host = CUDA_CONTEXT_BYTES + 32 * 2**20, 48 * 2**20
    result = max_context(deep, budget, callbacks=[LoRA(r=4)], multiple_of=STEP, host_budget=host)
    assert result.tokens > 4096 and result.choices["offload"] == 24 and result.prediction.offloaded_blocks == 24
    assert result.host == 24 * 2 * 2**20 <= host and result.prediction.total <= budget
    assert "the pinned inputs of 24 of 32 blocks; all offloaded 4,096 tokens, without offload 2,304" in result.limit
    # the next length up does not fit with as many blocks offloaded as the host holds there (24 again)
    longer = result.tokens + STEP
    callbacks = [LoRA(r=4), ActivationCheckpointing("full", mlp_chunks=result.choices["mlp_chunks"], offload=24), FusedLoss()]
    batch = tuple(t.contiguous() for t in synthetic_batch(1, longer, vocab_size=512))
    assert predict(deep, batch, Candidate.from_trainer(None, callbacks), device="cuda").total > budget
