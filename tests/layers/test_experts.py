"""The experts kind (``lightning_hbm/layers/experts.py``): Mixtral's 3-D expert Parameters become Linears with equal
outputs and gradients, are planned, and experts that cannot be converted are a named warning."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from kind_models import VOCAB, WIDTH, Wrapped, build, tokens
from torch import nn

from lightning_hbm import LoRA, quantize_model


def test_mixtral_experts_become_linears_with_equal_outputs_and_gradients() -> None:
    from lightning_hbm.layers import LinearExperts, prepare_model

    module = build("mixtral")
    reference = copy.deepcopy(module)
    prepare_model(module)
    assert isinstance(module.model.model.layers[0].mlp.experts, LinearExperts)
    embeds = reference.model.model.embed_tokens(tokens()).detach()
    grads = []
    for model in (reference, module):
        inputs = embeds.clone().requires_grad_()
        logits = model.model(inputs_embeds=inputs).logits
        logits.pow(2).mean().backward()
        grads.append((logits.detach(), inputs.grad))
    torch.testing.assert_close(grads[1][0], grads[0][0])
    torch.testing.assert_close(grads[1][1], grads[0][1])
    names = quantize_model(module, "nf4-dq", dtype="float32")
    assert "model.model.layers.1.mlp.experts.down_proj.3" in names



class OwnExperts(nn.Module):
    """A mixture of experts in 3-D Parameters with its own layout: not convertible, so it must be named."""

    def __init__(self, experts: int = 4, width: int = WIDTH) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.weight = nn.Parameter(torch.randn(experts, width, width) / width**0.5)
        self.num_experts = experts  # declared as MoE layers declare it: what makes 3-D weights experts (issue 33)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + torch.einsum("bsi,eoi->bso", hidden, self.weight) / self.weight.shape[0])



def test_experts_that_cannot_be_converted_are_a_named_warning() -> None:
    from lightning_hbm.layers import report_coverage

    torch.manual_seed(0)
    module = Wrapped(OwnExperts(), "plain")
    quantize_model(module, "nf4-dq", dtype="float32")
    with pytest.warns(UserWarning, match=r"% of the parameters are Experts \(3-D parameters\) layers left as they were.*'model'.*Option: "):
        rows = report_coverage(module, quantizing=True)
    experts = next(r for r in rows if r.kind.startswith("Experts"))
    assert experts.left_alone == experts.params > 0.5 * sum(r.params for r in rows)



@pytest.mark.slow
def test_planner_traces_a_quantized_adapted_mixtral() -> None:
    """Routing needs values a fake tensor lacks: LinearExperts plans its worst load; parameters stay exact."""
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import Candidate, predict

    prediction = predict(build("mixtral"), tokens(), Candidate(precision="nf4-dq", dtype="float32", lora_r=8, checkpointing="full",
                                                          quantize_embeddings=False))  # as quantize_model below
    module = build("mixtral")
    quantize_model(module, "nf4-dq", dtype="float32")
    LoRA(r=8).transform_model(module)
    assert prediction.categories["parameters"] == parameter_bytes(module)
    assert prediction.trainable_params == sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert prediction.categories["activations"] > 0



def _peak(run: Any) -> int:
    from lightning_hbm.memory import LiveStorageTracker

    tracker = LiveStorageTracker(track_peak=True)
    with tracker:
        run()
    tracker.finish_peak()
    return tracker.peak_bytes


@pytest.mark.parametrize("frozen", [False, True], ids=["trained-experts", "frozen-experts"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "full-recompute"])
def test_the_planned_load_is_never_below_a_real_routing(checkpointed: bool, frozen: bool) -> None:
    """What the planner traces for the experts (no routing on fake tensors) needs at least the memory of any routing.

    The planner's trace runs ``LinearExperts._worst_load`` on fake tensors, whose storages are the sizes real tensors
    have: run here on real tensors, its peak is the planned one. A balanced share for every expert, planned before,
    is below the run when an expert gets more tokens than its share. Frozen experts are the LoRA case (no weight
    gradients: the working set of the expert whose backward runs first decides); trained ones accumulate weight
    gradients through the backward (the expert whose backward runs last decides)."""
    from torch.utils.checkpoint import checkpoint

    from lightning_hbm.layers import LinearExperts, prepare_model

    module = build("mixtral")
    prepare_model(module)
    experts = module.model.model.layers[0].mlp.experts
    assert isinstance(experts, LinearExperts)
    experts.requires_grad_(not frozen)
    tokens, top_k = 64, 2
    hidden = torch.randn(tokens, WIDTH)
    weights = torch.full((tokens, top_k), 0.5)

    def step(forward: Any, *args: torch.Tensor) -> None:
        experts.zero_grad(set_to_none=True)  # every step starts without gradients: none is accumulated into
        inputs = hidden.clone().requires_grad_()
        out = checkpoint(forward, inputs, *args, use_reentrant=False) if checkpointed else forward(inputs, *args)
        out.pow(2).sum().backward()

    planned = _peak(lambda: step(lambda h, w: experts._worst_load(h, w), weights))
    routings = {
        "balanced": torch.stack([torch.arange(tokens) % 4, (torch.arange(tokens) + 1) % 4], dim=1),
        "random": torch.stack([torch.randperm(4)[:2] for _ in range(tokens)]),
        "every token to the last two experts": torch.tensor([[2, 3]] * tokens),
        "every token to the first two experts": torch.tensor([[0, 1]] * tokens),
        "every token to the first and the last expert": torch.tensor([[0, 3]] * tokens),
    }
    for name, index in routings.items():
        measured = _peak(lambda: step(experts, index, weights))  # noqa: B023 - called at once
        assert planned >= measured, f"{name}: planned {planned} B < run {measured} B"
