"""The ``nn.Linear`` kind (``lightning_hbm/layers/linear.py``) in real models: ``_keep_in_fp32_modules``, the output
head, ``modules_to_save``, layers narrower than LoRA's r, Linear subclasses with their own forward."""

from __future__ import annotations

import copy
import math
import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from kind_models import VOCAB, GradientRecorder, Wrapped, build, build_any, fit, fit_epochs_module, tokens
from torch import nn
from torch.utils.data import DataLoader
from transformers import T5Config, T5ForConditionalGeneration

from lightning_hbm import LoRA, QuantizedPrecision, coverage_of, quantize_model
from lightning_hbm.layers import base_layer, coverage, format_coverage, stored_in
from lightning_hbm.layers.linear import Fp32ComputeLinear
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.precision.registry import get_format


def t5_v11() -> nn.Module:
    """A tiny T5-v1.1 / Flan-T5 (gated GELU feed-forward), whose ``wo`` transformers keeps in fp32."""
    config = T5Config(
        d_model=128, d_ff=256, num_layers=2, num_heads=2, d_kv=64, vocab_size=VOCAB, decoder_start_token_id=0,
        feed_forward_proj="gated-gelu", dropout_rate=0.0,
    )  # fmt: skip
    return T5ForConditionalGeneration(config)


WO = "model.encoder.block.0.layer.1.DenseReluDense.wo"


def test_t5_wo_is_stored_in_the_mode_and_computes_in_fp32() -> None:
    """Was: ``wo`` (``_keep_in_fp32_modules``) kept as an fp32 weight, 4 bytes a weight (2.0 GB at T5-v1.1-XL)."""
    torch.manual_seed(0)
    module = Wrapped(t5_v11(), "seq2seq")
    module.model.to(torch.bfloat16)
    wos = [n for n, _ in module.named_modules() if n.endswith(".wo")]
    quantize_model(module, "nf4-dq", dtype="bfloat16")
    wo = module.get_submodule(WO)
    assert isinstance(wo, Fp32ComputeLinear) and not stored_in(wo).weight.is_floating_point()
    assert wo.weight.dtype == torch.float32 and wo.weight.shape == (128, 256)  # T5 casts its input to this dtype
    # 0.53 B a weight (nf4-dq) instead of 4: a 256 x 128 wo is 17 KiB, not 128 KiB
    assert all(parameter_bytes(module.get_submodule(n)) < 0.6 * 256 * 128 for n in wos)
    seen: dict[str, torch.Tensor] = {}
    wo.register_forward_hook(lambda layer, args, out: seen.update(x=args[0], out=out))
    loss = module.loss(tokens())
    loss.backward()
    assert math.isfinite(loss.item()) and seen["x"].dtype == seen["out"].dtype == torch.float32
    want = F.linear(seen["x"], get_format("nf4-dq").dequantize(stored_in(wo), torch.float32))
    torch.testing.assert_close(seen["out"], want, rtol=0, atol=0)
    rows = {r.kind: r for r in coverage(module, quantizing=True, adapting=False)}
    # said in the table (issue 53): stored small, computed in fp32; no "kept in fp32" reason
    fp32 = {why: n for why, n in rows["Linear"].reasons.items() if "fp32" in why}
    assert fp32 == {Fp32ComputeLinear.coverage_note: 256 * 128 * len(wos)}
    assert Fp32ComputeLinear.coverage_note in format_coverage(list(rows.values()))
    assert rows["Linear"].quantized == rows["Linear"].params - VOCAB * 128  # all but the head tied to the embedding


def fit_t5(tmp_path: Any, epochs: int, ckpt_path: Any = None, save: bool = False) -> tuple[Wrapped, GradientRecorder]:
    torch.manual_seed(0)
    module, recorder = Wrapped(t5_v11(), "seq2seq"), GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")], callbacks=[LoRA(r=8, alpha=16), recorder],
    )  # fmt: skip
    trainer.fit(module, DataLoader([tokens(1), tokens(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return module, recorder


@pytest.mark.slow
def test_t5_wo_trains_with_lora_in_bf16_and_resumes_exactly(tmp_path: Any) -> None:
    straight, recorder = fit_t5(tmp_path, 2)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    wo = straight.get_submodule(WO)
    assert isinstance(base_layer(wo), Fp32ComputeLinear) and wo.lora_A["default"].weight.grad is not None
    rows = {r.kind: r for r in coverage_of(straight)}
    fp32 = [why for why in rows["Linear"].reasons if "fp32" in why]
    assert fp32 == [Fp32ComputeLinear.coverage_note]
    assert rows["Linear"].unhandled == 0
    fit_t5(tmp_path, 1, save=True)
    resumed, _ = fit_t5(tmp_path, 2, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and any(".wo." in k for k in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


@pytest.mark.slow
def test_the_planner_counts_t5_wo_as_stored() -> None:
    from lightning_hbm.planner import Candidate, predict, quantized_parameter_bytes

    torch.manual_seed(0)
    module = Wrapped(t5_v11(), "seq2seq")
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "bfloat16")
    prediction = predict(copy.deepcopy(module), tokens(), Candidate(precision="nf4-dq", dtype="bfloat16", lora_r=8,
                                                                             quantize_embeddings=False))  # as quantize_model
    quantize_model(module, "nf4-dq", dtype="bfloat16")
    assert planned == parameter_bytes(module)
    LoRA(r=8).transform_model(module)
    assert isinstance(base_layer(module.get_submodule(WO)), Fp32ComputeLinear)
    assert prediction.categories["parameters"] == parameter_bytes(module)
    assert prediction.trainable_params == sum(p.numel() for p in module.parameters() if p.requires_grad)



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
    rows = {r.kind: r for r in coverage_of(module)}
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
    from lightning_hbm.adapters.lora.watch import _all_zero

    class Layer(nn.Module):
        def __init__(self, grad: float) -> None:
            super().__init__()
            self.lora_A, self.lora_B = nn.ModuleDict({"default": nn.Linear(4, 2)}), nn.ModuleDict({"default": nn.Linear(2, 4)})
            for p in self.parameters():
                p.grad = torch.full_like(p, grad)

    assert _all_zero({"a": Layer(0.0), "b": Layer(1e-30), "c": Layer(float("nan")), "d": Layer(0.0)}) == ["a", "d"]
