"""Which trainable parameters a long run updates that one step did not (:mod:`lightning_hbm.planner.routed`), on real
tensors and transformers' own classes: the experts a router skipped and the layers LayerDrop skipped count; a layer
that ran with its output dropped, and a head that never runs, do not."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_hbm.planner.routed import modules_run, routed_away

transformers = pytest.importorskip("transformers")


def _step(model: nn.Module, loss_of: object) -> tuple[set[int], set[int]]:
    """The ids of the modules one training forward ran and of the parameters its loss gave a gradient."""
    model.train()
    with modules_run() as ran:
        loss = loss_of(model)  # type: ignore[operator]
    loss.backward()
    return set(ran), {id(p) for p in model.parameters() if p.grad is not None}


class WithHead(nn.Module):
    """transformers Switch Transformers (16 experts, top-1) beside a trainable head its loss never calls."""

    def __init__(self) -> None:
        super().__init__()
        config = transformers.SwitchTransformersConfig(
            vocab_size=128, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, d_model=64, d_kv=16, d_ff=64,
            num_layers=1, num_decoder_layers=1, num_heads=4, num_experts=16, expert_capacity=8, encoder_sparse_step=1,
            decoder_sparse_step=1,
        )  # fmt: skip
        self.model = transformers.SwitchTransformersForConditionalGeneration(config)
        self.unused = nn.Linear(64, 64)


def test_the_experts_a_step_skipped_get_states_and_a_head_that_never_runs_does_not() -> None:
    torch.manual_seed(0)
    model = WithHead()
    ids = torch.randint(3, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    ran, reached = _step(model, lambda m: m.model(input_ids=ids, labels=ids).loss)
    routed = routed_away(model, ran, reached)
    skipped = {name for name, p in model.named_parameters() if ".experts." in name and p.grad is None}
    assert skipped and {name for name, p in model.named_parameters() if id(p) in routed.ids} == skipped
    assert not any(id(p) in routed.ids for p in model.unused.parameters())
    assert set(routed.containers) == {"model.encoder.block.0.layer.1.mlp.experts", "model.decoder.block.0.layer.2.mlp.experts"}
    experts = model.model.encoder.block[0].layer[1].mlp.experts
    not_run = sum(id(e) not in ran for e in experts.values())
    assert routed.containers["model.encoder.block.0.layer.1.mlp.experts"] == (
        f"{not_run} of 16 SwitchTransformersDenseActDense not run by the traced step")


def test_a_layer_layerdrop_skipped_gets_states() -> None:
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64, conv_dim=(16, 16),
        conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8, num_conv_pos_embedding_groups=4,
        layerdrop=0.5, mask_time_prob=0.0,
    )  # fmt: skip
    model = transformers.Wav2Vec2Model(config)
    torch.manual_seed(3)  # the draws of this step skip some layers and run others
    ran, reached = _step(model, lambda m: m(torch.randn(1, 400)).last_hidden_state.square().mean())
    layers = list(model.encoder.layers)
    dropped = [i for i, layer in enumerate(layers) if id(layer) not in ran]
    assert dropped and len(dropped) < len(layers), dropped
    routed = routed_away(model, ran, reached)
    assert routed.ids == {id(p) for i in dropped for p in layers[i].parameters()}
    assert routed.containers == {"encoder.layers": f"{len(dropped)} of 4 Wav2Vec2EncoderLayer not run by the traced step"}


class UnusedTail(nn.Module):
    """A list whose last layer runs and whose output the loss drops (as LLaVA's last vision layer under
    ``vision_feature_layer=-2``): it runs in every step and never gets a gradient, so never a state."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = [x]
        for layer in self.layers:
            hidden.append(layer(hidden[-1]))
        return hidden[-2].sum()


def test_a_layer_that_ran_with_its_output_dropped_gets_no_states() -> None:
    model = UnusedTail()
    ran, reached = _step(model, lambda m: m(torch.randn(2, 8)))
    assert not any(id(p) in reached for p in model.layers[2].parameters())
    routed = routed_away(model, ran, reached)
    assert routed.ids == set() and routed.containers == {}
