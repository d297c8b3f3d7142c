"""The ``nn.Linear`` kind (``lightning_hbm/layers/linear.py``) in real models: ``_keep_in_fp32_modules``, the output
head, ``modules_to_save``, layers narrower than LoRA's r, Linear subclasses with their own forward."""

from __future__ import annotations

import math
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from kind_models import VOCAB, Wrapped, build, build_any, fit, fit_epochs_module, tokens
from torch import nn
from torch.utils.data import DataLoader

from lightning_hbm import LoRA, quantize_model
from lightning_hbm.layers import base_layer, coverage


def test_t5_keep_in_fp32_modules_stay_fp32_and_nf4_runs() -> None:
    module = build("t5")
    module.model.to(torch.bfloat16)
    quantize_model(module, "nf4", dtype="bfloat16")
    wo = module.model.encoder.block[0].layer[1].DenseReluDense.wo
    assert type(wo) is nn.Linear and wo.weight.dtype == torch.float32
    loss = module.loss(tokens())  # crashed in dropout: "result type BFloat16 can't be cast to ... Byte"
    loss.backward()
    assert math.isfinite(loss.item())



def test_output_head_stays_full_precision_unless_asked() -> None:
    module = build("mixtral")
    quantize_model(module, "nf4-dq", dtype="float32")
    assert module.model.lm_head.weight.is_floating_point()
    module = build("mixtral")
    quantize_model(module, "nf4-dq", dtype="float32", quantize_head=True)
    assert not module.model.lm_head.weight.is_floating_point()



def test_bert_modules_to_save_stay_unquantized_and_train(tmp_path: Any) -> None:
    module = build("bert")
    fit(module, "nf4-dq", steps=2, lora={"modules_to_save": ["classifier"]}, tmp_path=tmp_path)
    classifier = module.model.classifier
    assert type(classifier) is nn.Linear and classifier.weight.requires_grad and classifier.weight.grad is not None
    rows = {r.kind: r for r in module.lightning_hbm_coverage}
    assert "LoRA modules_to_save: trained in full precision" in rows["Linear"].reasons



def test_all_linear_leaves_out_layers_narrower_than_r_and_says_so(tmp_path: Any, caplog: pytest.LogCaptureFixture) -> None:
    """Was: "LoRA r=8 is larger than the width of 2 target layer(s): ['...mlp.shared_expert_gate (1)']" (Qwen2-MoE)."""
    import logging

    module = build_any("qwen2_moe")
    with caplog.at_level(logging.INFO):
        recorder = fit_epochs_module(module, 2, tmp_path)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    gates = ["model.model.layers.0.mlp.shared_expert_gate", "model.model.layers.1.mlp.shared_expert_gate"]
    assert any(f"LoRA r=8 leaves out 2 layer(s) narrower than r (target_modules='all-linear'): {gates}" in r.getMessage() for r in caplog.records)
    assert all(not hasattr(module.get_submodule(g), "lora_A") for g in gates)
    assert hasattr(module.get_submodule("model.model.layers.0.mlp.shared_expert.up_proj"), "lora_A")
    # without quantization the gates are left alone: the coverage table says why
    lora = LoRA(r=8)
    other = build_any("qwen2_moe")
    lora.transform_model(other)
    rows = {r.kind: r for r in coverage(other, quantizing=False, adapting=True)}
    assert rows["Linear"].reasons.get("narrower than LoRA r=8: left out of 'all-linear'") == 2 * 64
    with pytest.raises(ValueError, match=r"LoRA r=8 is larger than the width of 2 target layer\(s\): \['model.model.layers.0.mlp.shared_expert_gate \(1\)'"):
        LoRA(r=8, target_modules=["shared_expert_gate", "up_proj"]).check_model(build_any("qwen2_moe"))



class OwnForwardRouter(nn.Linear):
    """transformers Llama4Router: an nn.Linear subclass whose forward returns (scores, logits)."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        logits = super().forward(x)
        return logits.softmax(-1), logits



def test_a_linear_with_its_own_forward_is_kept_and_named() -> None:
    """Was: replaced by bitsandbytes' Linear4bit, so the router lost its forward ("too many values to unpack")."""
    from lightning_hbm.layers import weight_readers

    torch.manual_seed(0)
    model = nn.ModuleDict({"router": OwnForwardRouter(32, 32), "proj": nn.Linear(32, 32)})
    assert weight_readers(model) == {"router": "OwnForwardRouter.forward (an nn.Linear subclass with its own forward)"}
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4).transform_model(model)
    assert type(model.router) is OwnForwardRouter and model.router.weight.is_floating_point()
    scores, logits = model.router(torch.randn(2, 32))
    assert scores.shape == logits.shape == (2, 32)
    assert not base_layer(model.proj).weight.is_floating_point() and hasattr(model.proj, "lora_A")  # the plain Linear: as before
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=True)}
    assert rows["Linear"].undeliberate == ["router"] and rows["Linear"].quantized == 32 * 32 + 32



def test_a_linear_subclass_computing_the_same_product_is_an_ordinary_linear() -> None:
    """transformers FalconLinear: ``input @ self.weight.T + self.bias`` in its own forward (was: 'selects no Linear')."""
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from lightning_hbm.layers import weight_readers

    model = nn.ModuleDict({"router": OwnForwardRouter(32, 32), "dense": FalconLinear(32, 32)})
    state = torch.random.get_rng_state()
    assert weight_readers(model) == {"router": "OwnForwardRouter.forward (an nn.Linear subclass with its own forward)"}
    assert torch.equal(torch.random.get_rng_state(), state)  # the probe draws no random numbers (LoRA's init stays)
    quantize_model(model, "nf4-dq", dtype="float32")
    assert not model.dense.weight.is_floating_point() and model.router.weight.is_floating_point()


# -------- adapters on Linears that a parent never calls, or whose output never reaches the loss


def test_a_dead_adapter_is_an_error_naming_it(tmp_path: Any) -> None:
    class ReadsWeight(nn.Module):  # reads its child's weight instead of calling it, as nn.MultiheadAttention did
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Linear(32, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(F.linear(self.embed(tokens), self.proj.weight))

    torch.manual_seed(0)
    module = Wrapped(ReadsWeight(), "plain")
    # an explicit target: "all-linear" leaves a layer whose weight its parent reads out (layers.weight_readers)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LoRA(r=4, target_modules=["proj", "head"])],
    )
    with pytest.raises(RuntimeError, match=r"\['model.proj'\] were never called although their parent module ran"):
        trainer.fit(module, DataLoader([tokens()], batch_size=None))



def test_an_adapter_cut_from_the_graph_warns_naming_it_and_the_rest_trains(tmp_path: Any) -> None:
    """The user's design (a BERT pooler under mean pooling), not a library failure: a warning, not an error."""

    class CutsGraph(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.proj, self.head = nn.Embedding(VOCAB, 32), nn.Linear(32, 32), nn.Linear(32, VOCAB)

        def forward(self, tokens: torch.Tensor) -> torch.Tensor:
            return self.head(self.proj(self.embed(tokens)).detach())

    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[LoRA(r=4, target_modules=["proj", "head"])],
    )  # the head is named: "all-linear" leaves the output head alone
    module = Wrapped(CutsGraph(), "plain")
    with pytest.warns(UserWarning, match=r"1 adapter\(s\) ran but their output never reaches the loss.*model\.proj"):
        trainer.fit(module, DataLoader([tokens(), tokens()], batch_size=None))
    assert trainer.global_step == 2 and trainer.callbacks[0].unused_modules == ["model.proj"]
    # the cut adapter keeps its initial (zero) lora_B; the head's adapter trained
    assert not module.model.proj.lora_B.default.weight.any() and module.model.head.lora_B.default.weight.any()



def test_adapters_whose_gradient_stays_all_zero_warn_naming_them(tmp_path: Any) -> None:
    """transformers SAM under ``multimask_output=False``: all four hypernetwork MLPs run, masks 1-3 are sliced away.

    Autograd sends them zeros, not ``None``: was silent (they sat in the optimizer, never trained). Now reported with
    the cut adapters (the IoU head's, whose output this loss does not read), after the first three backward passes.
    """
    from transformers import SamConfig, SamModel

    config = SamConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=64, patch_size=16,
                           output_channels=16, mlp_dim=64, global_attn_indexes=[0], window_size=0, num_pos_feats=8),
        prompt_encoder_config=dict(hidden_size=16, image_size=64, patch_size=16, mask_input_channels=4),
        mask_decoder_config=dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, mlp_dim=32, iou_head_hidden_dim=16),
    )

    class Segmenter(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = SamModel(config)

        def training_step(self, batch: Any, index: int) -> torch.Tensor:
            masks = self.model(pixel_values=batch[0], input_points=batch[1], multimask_output=False).pred_masks
            return F.binary_cross_entropy_with_logits(masks, torch.ones_like(masks))

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    module = Segmenter()
    data = [(torch.randn(1, 3, 64, 64), torch.rand(1, 1, 1, 2) * 64) for _ in range(4)]
    lora = LoRA(r=4, target_modules=["proj_in"])  # the first Linear of each hypernetwork MLP and of the IoU head
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, callbacks=[lora],
    )
    zero = [f"model.mask_decoder.output_hypernetworks_mlps.{i}.proj_in" for i in (1, 2, 3)]
    with pytest.warns(UserWarning, match=r"3 adapter\(s\) ran but their gradient was all zeros at each of the first 3 "
                      r"backward pass\(es\).*" + re.escape(f"LoRA(exclude_modules={zero!r})")):
        trainer.fit(module, DataLoader(data, batch_size=None))
    assert lora.unused_modules == ["model.mask_decoder.iou_prediction_head.proj_in", *zero]
    decoder = module.model.mask_decoder
    assert decoder.output_hypernetworks_mlps[0].proj_in.lora_B.default.weight.any()  # mask 0's adapter trained
    assert not decoder.output_hypernetworks_mlps[1].proj_in.lora_B.default.weight.any()


def test_an_all_zero_gradient_is_watched_only_while_it_stays_zero() -> None:
    """The check after the first pass looks only at the adapters still all-zero: an adapter with any gradient drops out."""
    from lightning_hbm.callbacks.lora.watch import _all_zero

    class Layer(nn.Module):
        def __init__(self, grad: float) -> None:
            super().__init__()
            self.lora_A, self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 2)}), nn.ModuleDict({"default": nn.Linear(2, 4)})
            for p in self.parameters():
                p.grad = torch.full_like(p, grad)

    assert _all_zero({"a": Layer(0.0), "b": Layer(1e-30), "c": Layer(float("nan")), "d": Layer(0.0)}) == ["a", "d"]
