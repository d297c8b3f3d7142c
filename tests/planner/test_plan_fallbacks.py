"""The planner plans models whose fake trace fails where the real model trains (issue 53 item 4), and names the way.

SAM indexes its largest list of blocks beyond the cut (the whole model is traced instead); a detection loss selects the
foreground anchors with a boolean mask fake tensors hold no values for (planned at the largest selection); Qwen2-VL
builds ``torch.tensor`` of a list of 0-d tensors in ``get_rope_index`` (their values are read from the real twins).
Each is the real transformers class from a tiny config (random weights), checked against torch's MemTracker peak of a
real step. torchvision (Faster R-CNN's RPN) is not installed here: its boolean masks are the detection loss's pattern.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lightning_hbm.planner import Candidate, plan, predict
from lightning_hbm.planner.reference import memtracker_peak

FP32 = Candidate("32-true")


class TinySam(pl.LightningModule):
    """transformers' SamModel: its mask decoder reads ``output_hypernetworks_mlps[i]`` for i < 8, the largest list (8:
    enough blocks to cut and extend; a list of 4 to 7 is traced whole at once)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import SamConfig, SamModel
        from transformers.models.sam.configuration_sam import SamMaskDecoderConfig, SamPromptEncoderConfig, SamVisionConfig

        vision = SamVisionConfig(hidden_size=32, output_channels=16, num_hidden_layers=2, num_attention_heads=2,
                                 image_size=64, patch_size=8, mlp_dim=64, global_attn_indexes=[1], window_size=4,
                                 num_pos_feats=8)  # fmt: skip
        prompt = SamPromptEncoderConfig(hidden_size=16, image_size=64, patch_size=8, mask_input_channels=4)
        decoder = SamMaskDecoderConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, mlp_dim=32,
                                       iou_head_hidden_dim=16, num_multimask_outputs=7)  # fmt: skip
        self.model = SamModel(SamConfig(vision_config=vision, prompt_encoder_config=prompt, mask_decoder_config=decoder))

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        out = self.model(pixel_values=batch["pixel_values"], input_points=batch["points"], multimask_output=True)
        return F.binary_cross_entropy_with_logits(out.pred_masks, batch["masks"]) + out.iou_scores.mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def sam_batch() -> dict:
    g = torch.Generator().manual_seed(0)
    masks = (torch.rand(2, 1, 7, 32, 32, generator=g) > 0.5).float()  # 7 masks per point at the decoder's 4x upscale
    return {"pixel_values": torch.randn(2, 3, 64, 64, generator=g), "points": torch.rand(2, 1, 1, 2, generator=g) * 64,
            "masks": masks}  # fmt: skip


def test_a_cut_that_fails_plans_the_whole_model_and_says_so() -> None:
    batch = sam_batch()
    with pytest.warns(UserWarning, match=r"model\.mask_decoder\.output_hypernetworks_mlps cut to 3 of 8 blocks failed "
                      r"\(IndexError: index 3 is out of range\); traced the whole model instead"):  # fmt: skip
        result = plan(TinySam, batch, candidates=[FP32])
    prediction = result.predictions[0]
    assert "output_hypernetworks_mlps cut to 3 of 8 blocks failed" in prediction.uncut
    assert any("traced the whole model instead" in note for note in result.notes())
    reference = memtracker_peak(TinySam, batch, FP32)  # a real training step of the same model
    assert abs(prediction.peak / reference - 1) < 0.03, (prediction.peak, reference)


class AnchorDetector(pl.LightningModule):
    """A one-stage detector: per-anchor class logits and box deltas; the loss regresses the foreground anchors
    selected by a boolean mask (``boxes[fg]``, as torchvision's detection losses and RPN do)."""

    def __init__(self, unique_classes: bool = False) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.cls = nn.Conv2d(16, 9 * 2, 1)
        self.box = nn.Conv2d(16, 9 * 4, 1)
        self.unique_classes = unique_classes

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        images, labels, targets = batch
        features = self.backbone(images)
        logits = self.cls(features).permute(0, 2, 3, 1).reshape(images.shape[0], -1, 2)
        boxes = self.box(features).permute(0, 2, 3, 1).reshape(images.shape[0], -1, 4)
        fg = labels > 0
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten().clamp(min=0))
        if self.unique_classes:  # a data-dependent op with no largest size: the plan must say where and what
            loss = loss * logits.argmax(-1).unique().numel()  # the classes predicted
        return loss + F.smooth_l1_loss(boxes[fg], targets[fg])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def detection_batch(side: int) -> tuple[torch.Tensor, ...]:
    """Images of ``side`` x ``side`` pixels, 9 anchors per pixel: labels -1 (ignored), 0 (background), 1 (object)."""
    g = torch.Generator().manual_seed(0)
    anchors = side * side * 9
    return (torch.randn(2, 3, side, side, generator=g), torch.randint(-1, 2, (2, anchors), generator=g),
            torch.randn(2, anchors, 4, generator=g))  # fmt: skip


def test_a_boolean_mask_in_the_loss_is_planned_at_its_largest_selection() -> None:
    batch = detection_batch(64)  # 73,728 anchors per mask: above the real twins' size, so no values
    with pytest.warns(UserWarning, match=r"aten\.index\.Tensor by a mask of 73,728 elements without real values in the "
                      r"LightningModule's own code \(training_step, forward\): planned with every element"):  # fmt: skip
        result = plan(AnchorDetector, batch, candidates=[FP32])
    prediction = result.predictions[0]
    assert prediction.selections == ("aten.index.Tensor by a mask of 73,728 elements without real values",)
    assert any("the largest size it can have (an upper bound" in note for note in result.notes())
    reference = memtracker_peak(AnchorDetector, batch, FP32)  # a third of the anchors are foreground
    assert 1 <= prediction.peak / reference < 1.25, (prediction.peak, reference)
    small = detection_batch(16)  # 4,608 anchors: the mask has real values, the selection its real size, nothing said
    assert predict(AnchorDetector, small, FP32).selections == ()


def test_a_data_dependent_op_in_the_loss_without_a_fallback_is_one_clear_error() -> None:
    with pytest.raises(ValueError, match=r"AnchorDetector\.training_step cannot run on fake tensors: "
                       r"DynamicOutputShapeException: aten\._unique2\.default.*Fix: write the branch without reading"):
        plan(lambda: AnchorDetector(unique_classes=True), detection_batch(64), candidates=[FP32])


class TinyQwen2VL(pl.LightningModule):
    """transformers' Qwen2VLForConditionalGeneration: text and one image, multimodal RoPE from ``get_rope_index``."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

        text = dict(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=256, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                    rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]})  # fmt: skip
        vision = dict(depth=2, embed_dim=32, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                      temporal_patch_size=2, in_channels=3)  # fmt: skip
        config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=299, video_token_id=298,
                               vision_start_token_id=297, vision_end_token_id=296)  # fmt: skip
        self.model = Qwen2VLForConditionalGeneration(config)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.model(**batch, labels=batch["input_ids"]).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def qwen2_vl_batch() -> dict:
    """16 tokens around one 8 x 8 image: 4 patches of 4 x 4 (2 frames each), merged 2 x 2 into 1 image token."""
    ids = torch.randint(0, 290, (1, 16), generator=torch.Generator().manual_seed(0))
    ids[0, 2:5] = torch.tensor([297, 299, 296])  # vision start, the image token, vision end
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == 299).long(),
            "pixel_values": torch.randn(4, 3 * 2 * 4 * 4), "image_grid_thw": torch.tensor([[1, 2, 2]])}  # fmt: skip


def test_qwen2_vl_rope_index_reads_its_positions_from_the_real_twins() -> None:
    batch = qwen2_vl_batch()
    prediction = predict(TinyQwen2VL, batch, FP32)  # torch.tensor([positions.max() + 1 - n]) of fake 0-d tensors
    assert prediction.fallbacks == () and prediction.selections == () and prediction.guessed_reads == 0
    reference = memtracker_peak(TinyQwen2VL, batch, FP32)
    assert abs(prediction.peak / reference - 1) < 0.03, (prediction.peak, reference)


class _Proposals(nn.Module):
    """torchvision's RPN pattern (torchvision is not installed here): objectness over every anchor, the anchors above
    a threshold kept per image by a boolean mask, returned as a list of boxes per image and a dict of losses."""

    def __init__(self) -> None:
        super().__init__()
        self.objectness = nn.Conv2d(16, 9, 1)
        self.deltas = nn.Conv2d(16, 9 * 4, 1)

    def forward(self, features: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        scores = self.objectness(features).flatten(1)
        boxes = self.deltas(features).permute(0, 2, 3, 1).reshape(features.shape[0], -1, 4)
        proposals = [image_boxes[image_scores > 0] for image_boxes, image_scores in zip(boxes, scores)]
        return proposals, {"loss_objectness": scores.sigmoid().mean(), "loss_box": boxes.abs().mean()}


class TwoStageDetector(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.rpn = _Proposals()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        proposals, losses = self.rpn(self.backbone(batch[0]))
        return sum(losses.values()) + sum(p.sum() for p in proposals) * 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def test_a_region_proposal_module_returning_lists_and_dicts_runs_for_real_and_is_named() -> None:
    batch = detection_batch(96)  # 82,944 anchors per image: the mask has no real values
    result = plan(TwoStageDetector, batch, candidates=[FP32])
    assert result.predictions[0].fallbacks == ("rpn (real tensors: DynamicOutputShapeException: aten.nonzero.default)",)
    # the fallback's stated limits (docs/planner.md): temporaries inside the real run are not counted and zeros select
    # no anchor; here the proposals module is most of the step, and the plan is 40 % under MemTracker's peak
    reference = memtracker_peak(TwoStageDetector, batch, FP32)
    assert 0.5 < result.predictions[0].peak / reference < 1, (result.predictions[0].peak, reference)
