"""The blocks activation checkpointing wraps (``find_blocks``) in models of every layer kind: found as the model
names them, the finest stack, fewer saved activations; T5's decoder cache turned off."""

from __future__ import annotations

from typing import Any

from kind_models import MODELS, Stage, ViTLike, build, fit, tokens
from torch import nn

from lightning_hbm import ActivationCheckpointing, quantize_model
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.memory import saved_activation_bytes


def test_checkpointing_lowers_saved_activations() -> None:
    for name in MODELS:
        module = build(name).train()
        quantize_model(module, "nf4-dq", dtype="float32")
        batch = tokens()
        before = saved_activation_bytes(lambda: module.loss(batch), module)  # noqa: B023 - called at once
        ActivationCheckpointing().transform_model(module)
        after = saved_activation_bytes(lambda: module.loss(batch), module)  # noqa: B023 - called at once
        assert after < 0.8 * before, (name, before, after)



def test_t5_with_checkpointing_turns_the_cache_off(tmp_path: Any) -> None:
    module = build("t5")
    assert module.model.config.use_cache
    recorder = fit(module, "nf4-dq", steps=2, tmp_path=tmp_path)  # was: CheckpointError (tensors saved differ)
    assert not module.model.config.use_cache and not module.model.decoder.config.use_cache
    assert len(recorder.losses) == 2



def test_sequential_blocks_are_found() -> None:
    module = build("sequential")
    assert [n for n, _ in find_blocks(module)] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))) == []  # an MLP is not a stack



def test_blocks_are_named_as_the_model_names_them_and_are_the_finest() -> None:
    """Was: "Sequential has no attribute 0" (ViT's OrderedDict); the 4 stages of a ConvNeXt, not their blocks."""
    vit = ViTLike()
    assert [n for n, _ in find_blocks(vit)] == ["encoder.layers.encoder_layer_0", "encoder.layers.encoder_layer_1"]
    stages = nn.Sequential(Stage(16), Stage(16), Stage(16))  # timm ConvNeXt: stages, each with its blocks
    assert [n for n, _ in find_blocks(stages)] == ["0.blocks.0", "0.blocks.1", "1.blocks.0", "1.blocks.1", "2.blocks.0", "2.blocks.1"]
    # the experts of a MoE layer (a ModuleList called side by side) stay inside their decoder layer
    moe = build("mixtral")
    from lightning_hbm.layers import prepare_model

    prepare_model(moe)
    assert [n for n, _ in find_blocks(moe)] == ["model.model.layers.0", "model.model.layers.1"]

