"""Layer kinds of real models (issue 15): quantized, adapted and checkpointed, or named.

Every model is built from its library's own classes and a tiny config (no download): transformers
GPT-2 (Conv1D), T5 (``_keep_in_fp32_modules``, decoder cache), Mixtral (3-D experts), BERT with a
classifier head; ``nn.TransformerEncoder`` (``nn.MultiheadAttention``); blocks in an ``nn.Sequential``.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
import warnings
from typing import Any, Callable

import lightning.pytorch as pl
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from transformers import (
    BertConfig,
    BertForSequenceClassification,
    GPT2Config,
    GPT2LMHeadModel,
    MixtralConfig,
    MixtralForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
)
from transformers.pytorch_utils import Conv1D

from lightning_hbm import ActivationCheckpointing, LoRA, QuantizedPrecision, quantize_model
from lightning_hbm.callbacks.activation_checkpointing import find_blocks
from lightning_hbm.layers import ProjectedMultiheadAttention, base_layer, coverage, find_layers
from lightning_hbm.memory import quantization_tensors, saved_activation_bytes, unique_bytes

VOCAB, SEQ, BATCH = 128, 16, 4
# width 128: every quantized layer holds >= 16k weights, so bitsandbytes' per-layer constants (a 1 KiB
# nested code book with nf4-dq) stay under 0.1 B/param, as they do (far below) at real model sizes
WIDTH = 128


# ------------------------------------------------------------------------------------- models


class EncoderLM(nn.Module):
    """A small language model on torch's own nn.TransformerEncoder (nn.MultiheadAttention inside)."""

    def __init__(self, width: int = WIDTH, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        layer = nn.TransformerEncoderLayer(width, nhead=4, dim_feedforward=2 * width, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.encoder(self.embed(tokens), mask=mask))


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class SequentialLM(nn.Module):
    """Blocks in an nn.Sequential, as timm / torchvision encoders keep them."""

    def __init__(self, width: int = WIDTH, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(layers)])
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))


def gpt2() -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=WIDTH, n_head=2, vocab_size=VOCAB, n_positions=SEQ, bos_token_id=0, eos_token_id=0))


def t5() -> nn.Module:
    config = T5Config(d_model=WIDTH, d_ff=2 * WIDTH, num_layers=2, num_heads=2, d_kv=WIDTH // 2, vocab_size=VOCAB, decoder_start_token_id=0)
    return T5ForConditionalGeneration(config)


def mixtral() -> nn.Module:
    config = MixtralConfig(
        hidden_size=WIDTH, intermediate_size=2 * WIDTH, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    )
    return MixtralForCausalLM(config)


def bert() -> nn.Module:
    config = BertConfig(
        hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=2, intermediate_size=2 * WIDTH, vocab_size=VOCAB,
        max_position_embeddings=SEQ, num_labels=3,
    )
    return BertForSequenceClassification(config)


class Wrapped(pl.LightningModule):
    """The user's LightningModule around one of the models above."""

    def __init__(self, model: nn.Module, task: str) -> None:
        super().__init__()
        self.model, self.task = model, task

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.task == "causal":
            return self.model(input_ids=tokens, labels=tokens).loss
        if self.task == "seq2seq":
            return self.model(input_ids=tokens, labels=tokens.flip(1)).loss
        if self.task == "classify":
            return self.model(input_ids=tokens, labels=tokens[:, 0] % 3).loss
        logits = self.model(tokens)  # plain torch LM: next-token prediction
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))

    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.task in ("causal", "classify"):
            return self.model(input_ids=tokens).logits
        if self.task == "seq2seq":
            return self.model(input_ids=tokens, decoder_input_ids=tokens).logits
        return self.model(tokens)

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        return self.loss(batch)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "gpt2": (gpt2, "causal"),
    "t5": (t5, "seq2seq"),
    "mixtral": (mixtral, "causal"),
    "bert": (bert, "classify"),
    "transformer_encoder": (EncoderLM, "plain"),
    "sequential": (SequentialLM, "plain"),
}


def build(name: str, seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    factory, task = MODELS[name]
    return Wrapped(factory(), task)


def tokens(seed: int = 1) -> torch.Tensor:
    return torch.randint(1, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


class GradientRecorder(pl.Callback):
    """Losses of every step; the LoRA parameters that had no gradient after some backward."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.no_grad: set[str] = set()

    def on_after_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.no_grad |= {n for n, p in pl_module.named_parameters() if ".lora_" in n and p.grad is None}

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


def fit(module: Wrapped, mode: str, steps: int = 8, lora: dict | None = None, tmp_path: Any = None, **plugin: Any) -> GradientRecorder:
    recorder = GradientRecorder()
    batch = tokens()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision(mode, dtype="float32", **plugin)],
        callbacks=[LoRA(r=8, alpha=16, **(lora or {})), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([batch] * steps, batch_size=None))
    return recorder


def quantized_bytes_per_param(module: nn.Module) -> dict[str, float]:
    """Per kind: storage bytes of the quantized weights (constants included) per logical weight element."""
    tensors: dict[str, list[torch.Tensor]] = {}
    counts: dict[str, int] = {}
    for _, layer, kind in find_layers(module):
        layer = base_layer(layer)
        if isinstance(layer, nn.Linear) and not layer.weight.is_floating_point():
            tensors.setdefault(kind.name, []).extend([layer.weight, *quantization_tensors(layer)])
            if getattr(layer, "state", None) is not None and getattr(layer.state, "SCB", None) is not None:
                tensors[kind.name].append(layer.state.SCB)
            counts[kind.name] = counts.get(kind.name, 0) + layer.in_features * layer.out_features
    return {k: unique_bytes(tensors[k]) / counts[k] for k in counts}


def relative_error(reference: torch.Tensor, approximation: torch.Tensor) -> float:
    return ((reference - approximation).norm() / reference.norm()).item()


# ---------------------------------------------------------- every model: nf4-dq + LoRA + checkpointing


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.slow
def test_trains_with_nf4_dq_lora_and_checkpointing(name: str, tmp_path: Any) -> None:
    module = build(name)
    lora = {"modules_to_save": ["classifier"]} if name == "bert" else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        recorder = fit(module, "nf4-dq", lora=lora, tmp_path=tmp_path)
    losses = recorder.losses
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    assert not recorder.no_grad, f"adapters without gradient: {sorted(recorder.no_grad)[:6]}"
    per_param = quantized_bytes_per_param(module)
    assert per_param and all(v <= 0.6 for v in per_param.values()), per_param
    kinds = [r for r in module.lightning_hbm_coverage if not r.kind.startswith(("other", "LoRA adapters"))]
    # the blocks hold the bulk of every model's layers (heads and poolers sit outside them)
    assert sum(r.checkpointed for r in kinds) > 0.5 * sum(r.params for r in kinds), kinds
    assert not [w for w in caught if "layers left as they were" in str(w.message)]  # every kind is handled
    if name == "mixtral":
        experts = next(r for r in module.lightning_hbm_coverage if r.kind.startswith("Experts"))
        assert experts.quantized == experts.adapted == experts.params  # was: 77 % left in 16 bits, silently


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize(("mode", "limit"), [("nf4-dq", 0.3), ("int8-dynamic", 0.05)])
def test_outputs_before_training_match_the_unquantized_model(name: str, mode: str, limit: float) -> None:
    """Relative logit error (float32 compute). Measured: see benchmarks/README.md (layer kinds)."""
    module = build(name).eval()
    batch = tokens()
    with torch.no_grad():
        expected = module.logits(batch)
        quantize_model(module, mode, dtype="float32")
        actual = module.logits(batch)
    assert relative_error(expected, actual) < limit


@pytest.mark.parametrize("name", ["gpt2", "transformer_encoder", "bert"])
def test_int8_dynamic_covers_the_same_kinds(name: str, tmp_path: Any) -> None:
    module = build(name)
    lora = {"modules_to_save": ["classifier"]} if name == "bert" else {}
    recorder = fit(module, "int8-dynamic", steps=6, lora=lora, tmp_path=tmp_path)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    per_param = quantized_bytes_per_param(module)
    assert per_param and all(v <= 1.1 for v in per_param.values()), per_param
    rows = {r.kind: r for r in module.lightning_hbm_coverage}
    kind = {"gpt2": "Conv1D", "transformer_encoder": "MultiheadAttention", "bert": "Linear"}[name]
    assert rows[kind].quantized > 0 and rows[kind].adapted > 0


def test_checkpointing_lowers_saved_activations() -> None:
    for name in MODELS:
        module = build(name).train()
        quantize_model(module, "nf4-dq", dtype="float32")
        batch = tokens()
        before = saved_activation_bytes(lambda: module.loss(batch), module)
        ActivationCheckpointing().transform_model(module)
        after = saved_activation_bytes(lambda: module.loss(batch), module)
        assert after < 0.8 * before, (name, before, after)


@pytest.mark.parametrize("name", list(MODELS))
def test_planned_parameter_bytes_equal_the_real_ones_for_every_kind(name: str) -> None:
    """The planner quantizes a fake copy through the same quantize_model, layer kinds included: byte-exact."""
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import quantized_parameter_bytes

    module = build(name)
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "float32")
    quantize_model(module, "nf4-dq", dtype="float32")
    assert planned == parameter_bytes(module)


@pytest.mark.slow
def test_planner_traces_a_quantized_adapted_mixtral() -> None:
    """Routing needs values a fake tensor lacks: LinearExperts plans a balanced load; parameters stay exact."""
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import Candidate, predict

    prediction = predict(build("mixtral"), tokens(), Candidate(precision="nf4-dq", dtype="float32", lora_r=8, checkpointing="full"))
    module = build("mixtral")
    quantize_model(module, "nf4-dq", dtype="float32")
    LoRA(r=8).transform_model(module)
    assert prediction.categories["parameters"] == parameter_bytes(module)
    assert prediction.trainable_params == sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert prediction.categories["activations"] > 0


# ------------------------------------------------ regression tests: the "what happens today" rows


def test_gpt2_conv1d_is_quantized_and_adapted_by_all_linear() -> None:
    module = build("gpt2")
    names = quantize_model(module, "nf4-dq", dtype="float32")
    assert "model.transformer.h.0.attn.c_attn" in names
    assert not any(isinstance(m, Conv1D) for m in module.modules())  # no fp32 Conv1D left
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert "model.transformer.h.0.mlp.c_fc" in lora.adapted_modules
    assert not any(p.requires_grad and p.is_floating_point() and ".lora_" not in n for n, p in module.named_parameters())


def test_gpt2_lora_without_quantization_adapts_conv1d() -> None:
    module = build("gpt2")
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert {"model.transformer.h.0.attn.c_attn", "model.transformer.h.1.mlp.c_proj"} <= set(lora.adapted_modules)
    rows = {r.kind: r for r in coverage(module, quantizing=False, adapting=True)}
    assert rows["Conv1D"].adapted == rows["Conv1D"].params


def test_multihead_attention_projections_are_quantized_and_out_proj_adapter_is_alive(tmp_path: Any) -> None:
    module = build("transformer_encoder")
    quantize_model(module, "nf4-dq", dtype="float32")
    attn = module.model.encoder.layers[0].self_attn
    assert isinstance(attn, ProjectedMultiheadAttention)
    assert all(not getattr(attn, p).weight.is_floating_point() for p in ("q_proj", "k_proj", "v_proj", "out_proj"))
    assert not any(p.dim() == 2 and p.is_floating_point() and p.shape[0] == 3 * WIDTH for p in module.parameters())
    recorder = fit(build("transformer_encoder"), "nf4-dq", steps=2, tmp_path=tmp_path)
    assert not recorder.no_grad


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


def test_t5_keep_in_fp32_modules_stay_fp32_and_nf4_runs() -> None:
    module = build("t5")
    module.model.to(torch.bfloat16)
    quantize_model(module, "nf4", dtype="bfloat16")
    wo = module.model.encoder.block[0].layer[1].DenseReluDense.wo
    assert type(wo) is nn.Linear and wo.weight.dtype == torch.float32
    loss = module.loss(tokens())  # crashed in dropout: "result type BFloat16 can't be cast to ... Byte"
    loss.backward()
    assert math.isfinite(loss.item())


def test_t5_with_checkpointing_turns_the_cache_off(tmp_path: Any) -> None:
    module = build("t5")
    assert module.model.config.use_cache
    recorder = fit(module, "nf4-dq", steps=2, tmp_path=tmp_path)  # was: CheckpointError (tensors saved differ)
    assert not module.model.config.use_cache and not module.model.decoder.config.use_cache
    assert len(recorder.losses) == 2


def test_mixtral_experts_become_linears_with_equal_outputs_and_gradients() -> None:
    from lightning_hbm.layers import LinearExperts
    from lightning_hbm.layers import prepare_model

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


def test_sequential_blocks_are_found() -> None:
    module = build("sequential")
    assert [n for n, _ in find_blocks(module)] == ["model.blocks.0", "model.blocks.1", "model.blocks.2"]
    assert find_blocks(nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Linear(4, 4))) == []  # an MLP is not a stack


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


# ------------------------------------------------------------ the MultiheadAttention replacement


@pytest.mark.parametrize(("batch_first", "kdim", "need_weights", "average"), list(itertools.product([True, False], [None, 24], [True, False], [True, False])))
def test_projected_attention_equals_torch(batch_first: bool, kdim: int | None, need_weights: bool, average: bool) -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4, batch_first=batch_first, kdim=kdim, vdim=kdim).double()
    new = ProjectedMultiheadAttention.from_torch(mha)
    n, length, source = 3, 5, 6
    query = torch.randn(n, length, 32, dtype=torch.double, requires_grad=True)
    key = torch.randn(n, source, kdim or 32, dtype=torch.double, requires_grad=True)
    q, k = (query, key) if batch_first else (query.transpose(0, 1), key.transpose(0, 1))
    attn_mask = torch.rand(length, source, generator=torch.Generator().manual_seed(0)) > 0.7
    attn_mask[:, 0] = False
    padding = torch.zeros(n, source, dtype=torch.bool)
    padding[0, -2:] = True
    for masks in ({}, {"attn_mask": attn_mask}, {"key_padding_mask": padding}, {"attn_mask": attn_mask, "key_padding_mask": padding},
                  {"attn_mask": torch.randn(n * 4, length, source, dtype=torch.double)}):
        out, weights = mha(q, k, k, need_weights=need_weights, average_attn_weights=average, **masks)
        out2, weights2 = new(q, k, k, need_weights=need_weights, average_attn_weights=average, **masks)
        torch.testing.assert_close(out2, out)
        assert (weights is None) == (weights2 is None)
        if weights is not None:
            torch.testing.assert_close(weights2, weights)
        grads = torch.autograd.grad(out.sum(), [query, key, mha.out_proj.weight, mha.in_proj_weight if kdim is None else mha.q_proj_weight])
        grads2 = torch.autograd.grad(out2.sum(), [query, key, new.out_proj.weight, new.q_proj.weight])
        for g, g2 in zip(grads[:3], grads2[:3]):
            torch.testing.assert_close(g2, g)
        torch.testing.assert_close(grads2[3], grads[3][:32])


def test_projected_attention_unbatched_and_in_transformer_layers_eval() -> None:
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(32, 4).double()
    new = ProjectedMultiheadAttention.from_torch(mha)
    x = torch.randn(5, 32, dtype=torch.double)
    torch.testing.assert_close(new(x, x, x)[0], mha(x, x, x)[0])
    module = build("transformer_encoder").eval()
    batch = tokens()
    padding = torch.zeros(BATCH, SEQ, dtype=torch.bool)
    padding[:, -3:] = True
    with torch.no_grad():  # eval + key padding: torch's fused fast path would read the raw in_proj weights
        expected = module.model.encoder(module.model.embed(batch), src_key_padding_mask=padding)
        from lightning_hbm.layers import prepare_model

        prepare_model(module)
        actual = module.model.encoder(module.model.embed(batch), src_key_padding_mask=padding)
    torch.testing.assert_close(actual[~padding], expected[~padding], atol=1e-5, rtol=1e-4)


def test_unsupported_attention_options_are_clear_errors_before_any_change() -> None:
    model = nn.Sequential(nn.Linear(32, 32), nn.MultiheadAttention(32, 4, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"add_bias_kv=True.*not supported.*ignore_modules"):
        quantize_model(model, "nf4-dq", dtype="float32")
    assert type(model[0]) is nn.Linear  # nothing changed


# ------------------------------------------------ issue 24: adapter-only resume on converted layer kinds


def olmoe() -> nn.Module:
    from transformers import OlmoeConfig, OlmoeForCausalLM

    config = OlmoeConfig(
        hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=SEQ, eos_token_id=0, pad_token_id=0,
    )
    return OlmoeForCausalLM(config)


def mamba() -> nn.Module:
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=VOCAB, state_size=8, eos_token_id=0, pad_token_id=0))


class SwinLikeAttention(nn.Module):
    """torchvision Swin's attention: its parent reads ``self.qkv.weight`` and calls a function, never ``self.qkv``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = F.linear(x, self.qkv.weight, self.qkv.bias).chunk(3, dim=-1)
        return x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class SwinLikeLM(nn.Module):
    def __init__(self, width: int = WIDTH, layers: int = 2) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.layers = nn.ModuleList(nn.Sequential(SwinLikeAttention(width), Block(width)) for _ in range(layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def qwen2_moe() -> nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    config = Qwen2MoeConfig(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=4, num_experts_per_tok=2,
        vocab_size=VOCAB, max_position_embeddings=SEQ, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return Qwen2MoeForCausalLM(config)


def deepseek_v3() -> nn.Module:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    config = DeepseekV3Config(
        hidden_size=64, intermediate_size=64, moe_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1,
        vocab_size=VOCAB, max_position_embeddings=SEQ, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16, eos_token_id=0, pad_token_id=0, bos_token_id=0,
    )
    return DeepseekV3ForCausalLM(config)


MODELS_24: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "olmoe": (olmoe, "causal"),
    "deepseek_v3": (deepseek_v3, "causal"),
    "qwen2_moe": (qwen2_moe, "causal"),
    "mamba": (mamba, "causal"),
    "swin_like": (SwinLikeLM, "plain"),
}


def build_any(name: str, seed: int = 0) -> Wrapped:
    torch.manual_seed(seed)
    factory, task = {**MODELS, **MODELS_24}[name]
    return Wrapped(factory(), task)


def fit_epochs(name: str, epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> tuple[Wrapped, GradientRecorder]:
    """Whole epochs of 2 different batches (a resumed run replays the same batches), nf4-dq + LoRA + checkpointing."""
    module = build_any(name)
    return module, fit_epochs_module(module, epochs, tmp_path, ckpt_path, save)


def fit_epochs_module(module: Wrapped, epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> GradientRecorder:
    recorder = GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, default_root_dir=tmp_path,
        plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=8, alpha=16), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([tokens(1), tokens(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "half.ckpt")
    return recorder


@pytest.mark.parametrize("name", ["mixtral", "olmoe", "qwen2_moe", "deepseek_v3", "transformer_encoder"])
def test_adapter_only_checkpoint_of_converted_layers_resumes_exactly(name: str, tmp_path: Any) -> None:
    """Was: "does not hold these tensors ...experts.gate_up_proj.0.base_layer.weight" although the settings matched."""
    straight, recorder = fit_epochs(name, 2, tmp_path)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    fit_epochs(name, 1, tmp_path, save=True)
    meta = torch.load(tmp_path / "half.ckpt", weights_only=False)["lightning_hbm"]
    converted = "experts.gate_up_proj" if name != "transformer_encoder" else "self_attn.in_proj_weight"
    # the converted as-built weights are left out (fingerprinted), not saved as placeholders
    assert any(k.endswith(converted) for k in meta["omitted"]) and not any(k.endswith(converted) for k in meta["placeholders"])
    assert all(".lora_" in k for k in meta["state_dict"])
    resumed, _ = fit_epochs(name, 2, tmp_path, ckpt_path=tmp_path / "half.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got) and any("experts" in k or "q_proj" in k for k in want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_converted_keys_map_back_to_the_tensors_as_built() -> None:
    from lightning_hbm.layers import prepare_model
    from lightning_hbm.resume import KeyMap

    module = nn.Sequential(nn.MultiheadAttention(32, 4), nn.MultiheadAttention(32, 4, kdim=16, vdim=16))
    prepare_model(module)
    keys = KeyMap(module)
    assert keys.as_built("0.k_proj.base_layer.weight.absmax") == ("0.in_proj_weight.absmax", True)
    assert keys.as_built("0.v_proj.bias") == ("0.in_proj_bias", True)
    assert keys.as_built("1.k_proj.weight_scale") == ("1.k_proj_weight", True)
    assert keys.covered("0.q_proj.base_layer.weight", ["0.in_proj_weight"])
    assert not keys.covered("0.q_proj.lora_A.default.weight", ["0.in_proj_weight"])  # an adapter is no form of the base
    experts = build("mixtral")
    prepare_model(experts)
    keys = KeyMap(experts)
    base = "model.model.layers.0.mlp.experts.gate_up_proj"
    assert keys.covered(f"{base}.3.base_layer.weight.nested_absmax", [base])
    assert not keys.covered(f"{base}.3.lora_B.default.weight", [base])


# --------------------------------------------------- issue 24: layers whose weight the parent reads directly


@pytest.mark.parametrize(("name", "read", "reader", "warned"), [
    # on the path that trains (no CUDA kernels) Mamba reads only dt_proj's weight (`self.dt_proj.weight @ x`): x_proj
    # and out_proj, read only by the kernel branch, are quantized (issue 33); dt_proj is under 5 %: a table row only
    ("mamba", ["model.backbone.layers.0.mixer.dt_proj", "model.backbone.layers.1.mixer.dt_proj"], "MambaMixer.forward", False),
    ("swin_like", ["model.layers.0.0.qkv", "model.layers.1.0.qkv"], "SwinLikeAttention.forward", True),
])
def test_layers_whose_weight_is_read_directly_stay_in_compute_dtype_and_are_named(name: str, read: list[str], reader: str, warned: bool, tmp_path: Any) -> None:
    """Was: a low-level dtype error in the parent's matmul, no layer named (transformers Mamba, torchvision Swin)."""
    module = build_any(name)
    if warned:
        with pytest.warns(UserWarning, match=rf"layers left as they were .*{read[0]}.*weight read directly by {reader}"):
            recorder = fit_epochs_module(module, 3, tmp_path)
    else:
        recorder = fit_epochs_module(module, 3, tmp_path)
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    for layer in read:
        assert type(module.get_submodule(layer)) is nn.Linear and module.get_submodule(layer).weight.is_floating_point()
    rows = {r.kind: r for r in module.lightning_hbm_coverage}
    assert rows["Linear"].quantized > 0 and set(read) == set(rows["Linear"].undeliberate)
    assert any(why.startswith(f"weight read directly by {reader}") for why in rows["Linear"].reasons)


def test_weight_readers_ignore_init_code_and_device_reads() -> None:
    from lightning_hbm.layers import weight_readers

    class Reads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
            nn.init.zeros_(self.a.weight)  # initialisation is not a reader

        def reset_parameters(self) -> None:
            nn.init.ones_(self.b.weight)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x.to(self.a.weight.device).to(self.d.weight.dtype)  # .device: harmless; .dtype: wrong once quantized
            return self.a(x) + self.b(x) + x @ self.c.weight.T + self.d(x)

    assert weight_readers(nn.Sequential(Reads())) == {"0.c": "Reads.forward", "0.d": "Reads.forward"}
    assert weight_readers(nn.Sequential(Reads()), uses_only=True) == {"0.c": "Reads.forward"}  # an adapter on d works
    for name in ("gpt2", "mixtral", "bert", "transformer_encoder"):  # they call their layers
        assert weight_readers(build(name)) == {}, name


# ------------------------------------------------ issue 24: BatchNorm under bf16, convolutions as a layer kind


class BasicBlock(nn.Module):
    """torchvision ResNet's BasicBlock: Conv2d + BatchNorm2d, twice, and the residual."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.conv2, self.bn2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))))


class ResNetLike(nn.Module):
    """torchvision's resnet18 layout in miniature (no torchvision here: it does not import beside torch 2.13)."""

    def __init__(self, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels)
        self.layer1 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.layer2 = nn.Sequential(BasicBlock(channels), BasicBlock(channels))
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layer2(self.layer1(F.relu(self.bn1(self.conv1(x))))).mean((2, 3)))


class Classifier(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = ResNetLike()

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch
        return F.cross_entropy(self.model(images).float(), labels)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def images(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 8, 8, generator=generator), torch.randint(0, 10, (8,), generator=generator)


def fit_cnn(epochs: int, tmp_path: Any, ckpt_path: Any = None, save: bool = False) -> tuple[Classifier, GradientRecorder]:
    torch.manual_seed(0)
    module, recorder = Classifier(), GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_epochs=epochs, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="bfloat16")],
        callbacks=[LoRA(r=4), ActivationCheckpointing(), recorder],
    )
    trainer.fit(module, DataLoader([images(1), images(2)], batch_size=None), ckpt_path=ckpt_path)
    if save:
        trainer.save_checkpoint(tmp_path / "cnn.ckpt")
    return module, recorder


def test_batchnorm_cnn_trains_in_bf16_with_convolutions_quantized_and_adapted(tmp_path: Any) -> None:
    """Was: "expected scalar type BFloat16 but found Float" at the first batch; then (issue 33) every convolution
    kept at full size: bitsandbytes has no convolution kernel, so lightning_hbm stores their weight matrices."""
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        module, recorder = fit_cnn(3, tmp_path)
    assert not [w for w in warned if "Conv layers" in str(w.message)]
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    bn = module.model.layer1[0].bn1
    # as Lightning's mixed precision: BatchNorm weights and statistics in fp32 (batch_norm takes a bf16 input)
    assert bn.weight.dtype == bn.running_mean.dtype == torch.float32 and module.model.layer1[0].conv1.base_layer.weight.dtype == torch.bfloat16
    rows = {r.kind: r for r in module.lightning_hbm_coverage}
    assert rows["Conv"].adapted == rows["Conv"].quantized == rows["Conv"].params > 0.8 * sum(r.params for r in rows.values() if not r.kind.startswith("LoRA"))
    # nf4-dq: 4.127 bits a weight plus ~1 KiB of nested code book per layer, a lot for these 9k-weight convolutions
    # (0.65 B/weight here; ResNet18's sizes: tests/layers/test_conv.py)
    assert rows["Conv"].bytes < 0.7 * rows["Conv"].params
    assert any(".conv1.lora_A" in n for n in LoRA.adapter_state_dict(module))


def test_batchnorm_cnn_adapter_checkpoint_resumes_exactly(tmp_path: Any) -> None:
    straight, _ = fit_cnn(2, tmp_path)
    fit_cnn(1, tmp_path, save=True)
    resumed, _ = fit_cnn(2, tmp_path, ckpt_path=tmp_path / "cnn.ckpt")
    want, got = LoRA.adapter_state_dict(straight), LoRA.adapter_state_dict(resumed)
    assert set(want) == set(got)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)
    torch.testing.assert_close(resumed.model.bn1.running_var, straight.model.bn1.running_var, rtol=0, atol=0)


def test_planner_agrees_on_a_batchnorm_cnn_in_bf16() -> None:
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import quantized_parameter_bytes

    torch.manual_seed(0)
    module = Classifier()
    planned = quantized_parameter_bytes(copy.deepcopy(module), "nf4-dq", "bfloat16")
    quantize_model(module, "nf4-dq", dtype="bfloat16")
    assert planned == parameter_bytes(module)
    assert module.model.bn1.weight.dtype == torch.float32 and module.model.conv1.weight.dtype == torch.bfloat16


def test_grouped_convolutions_are_not_all_linear_targets() -> None:
    from lightning_hbm.layers import adaptable_names

    model = nn.Sequential(nn.Conv2d(8, 8, 3, groups=8), nn.Conv1d(8, 8, 3), nn.ConvTranspose2d(8, 8, 2), nn.Linear(8, 8))
    assert adaptable_names(model) == ["1", "3"]


class DepthwiseCNN(nn.Module):
    """timm ConvNeXt's block in miniature: a depthwise convolution (groups = channels) then a pointwise MLP."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, width, 2, stride=2)
        self.conv_dw = nn.Conv2d(width, width, 7, padding=3, groups=width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_dw(self.stem(x)).permute(0, 2, 3, 1)
        return self.fc2(F.gelu(self.fc1(x)))


@pytest.mark.parametrize("quantizing", [True, False])
def test_grouped_convolutions_left_by_lora_are_named_with_the_reason_and_fix(quantizing: bool) -> None:
    from lightning_hbm.layers import report_coverage

    torch.manual_seed(0)
    module = DepthwiseCNN()
    if quantizing:
        quantize_model(module, "nf4-dq", dtype="float32")
    lora = LoRA(r=4)
    lora.transform_model(module)
    assert "stem" in lora.adapted_modules and "conv_dw" not in lora.adapted_modules
    why = r"not adapted: LoRA skips grouped/depthwise convolutions \(peft needs r divisible by groups and cannot merge them\)\. To train them: LoRA\(modules_to_save=\[their names\]\)"
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        rows = {r.kind: r for r in report_coverage(module, quantizing=quantizing)}
    conv = rows["Conv"]
    if quantizing:  # quantized like every convolution (issue 33), frozen and not adapted, as a Linear LoRA skips
        assert conv.quantized == conv.params and conv.left_alone == 0 and not conv.undeliberate
        assert not [w for w in warned if "Conv layers" in str(w.message)]
        return
    assert conv.left_alone == module.conv_dw.weight.numel() + module.conv_dw.bias.numel()
    [reason] = [r for r in conv.reasons if "grouped" in r]
    assert re.search(why, reason) and conv.reasons[reason] == conv.left_alone
    assert reason.startswith("frozen in full precision (no QuantizedPrecision);")


# -------------------------------------- issue 24: block discovery, 3-D parameters that are not experts


class MLPBlock(nn.Sequential):
    def __init__(self, width: int) -> None:
        super().__init__(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))


class EncoderBlock(nn.Module):
    """torchvision ViT's EncoderBlock: nn.MultiheadAttention and an MLP, pre-norm."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.self_attention = nn.MultiheadAttention(width, 4, batch_first=True)
        self.mlp = MLPBlock(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.ln_1(x)
        x = x + self.self_attention(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class ViTLike(nn.Module):
    """torchvision's vit_b_16 layout in miniature: encoder.layers is an nn.Sequential built from an OrderedDict,
    the class token and position table are 3-D Parameters [1, ., width]."""

    def __init__(self, width: int = 64, layers: int = 2, classes: int = 10) -> None:
        super().__init__()
        from collections import OrderedDict

        self.conv_proj = nn.Conv2d(3, width, 4, stride=4)
        self.class_token = nn.Parameter(torch.zeros(1, 1, width))
        self.encoder = nn.Module()
        self.encoder.pos_embedding = nn.Parameter(torch.randn(1, 5, width) * 0.02)
        self.encoder.layers = nn.Sequential(OrderedDict((f"encoder_layer_{i}", EncoderBlock(width)) for i in range(layers)))
        self.encoder.ln = nn.LayerNorm(width)
        self.heads = nn.Sequential(OrderedDict(head=nn.Linear(width, classes)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv_proj(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.class_token.expand(x.shape[0], -1, -1), x], dim=1) + self.encoder.pos_embedding
        return self.heads(self.encoder.ln(self.encoder.layers(x))[:, 0])


class Stage(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.downsample = nn.Linear(width, width)
        self.blocks = nn.Sequential(Block(width), Block(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(self.downsample(x))


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


class ViTClassifier(Classifier):
    def __init__(self) -> None:
        pl.LightningModule.__init__(self)
        self.model = ViTLike()


def test_vit_trains_and_its_tokens_are_not_called_experts(tmp_path: Any) -> None:
    torch.manual_seed(0)
    module, recorder = ViTClassifier(), GradientRecorder()
    trainer = pl.Trainer(
        accelerator="cpu", max_steps=4, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, default_root_dir=tmp_path, plugins=[QuantizedPrecision("nf4-dq", dtype="float32")],
        callbacks=[LoRA(r=4), ActivationCheckpointing(), recorder],
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, DataLoader([images(1)] * 4, batch_size=None))
    assert recorder.losses[-1] < recorder.losses[0] and not recorder.no_grad
    assert not [w for w in caught if "Experts" in str(w.message)]
    rows = {r.kind: r for r in module.lightning_hbm_coverage}
    assert "Experts (3-D parameters)" not in rows  # was: "Experts (3-D parameters): this variant is not supported yet"
    assert rows["other (embeddings, norms, ...)"].params >= module.model.class_token.numel() + module.model.encoder.pos_embedding.numel()
    assert rows["MultiheadAttention"].quantized == rows["MultiheadAttention"].params > 0
    blocks = rows["MultiheadAttention"].checkpointed + rows["Linear"].checkpointed
    assert rows["MultiheadAttention"].checkpointed == rows["MultiheadAttention"].params and blocks > 0


# ------------------------------------------------ issue 24: default LoRA on layers narrower than r


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


def test_siglip_probe_is_no_expert_and_its_patch_convolution_is_adapted() -> None:
    """SigLIP: a 3-D pooling ``probe`` [1, 1, width], nn.MultiheadAttention in the pooling head, a Conv2d patch
    embedding whose weight's dtype its parent reads (harmless for an adapter, so it is adapted)."""
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8)
    model = SiglipVisionModel(config)
    quantize_model(model, "nf4-dq", dtype="float32")
    LoRA(r=4).transform_model(model)
    rows = {r.kind: r for r in coverage(model, quantizing=True, adapting=True)}
    assert "Experts (3-D parameters)" not in rows  # was: "Experts (3-D parameters): this variant is not supported yet"
    assert rows["MultiheadAttention"].quantized == rows["MultiheadAttention"].adapted == rows["MultiheadAttention"].params
    assert rows["Conv"].adapted == rows["Conv"].params and rows["Conv"].quantized == 0
    model(pixel_values=torch.randn(2, 3, 32, 32)).pooler_output.pow(2).sum().backward()
    lora_b = {n: p.grad for n, p in model.named_parameters() if "lora_A" in n}
    assert lora_b and all(g is not None for g in lora_b.values()), [n for n, g in lora_b.items() if g is None]


@pytest.mark.parametrize(("factory", "dtype"), [(ViTClassifier, "float32"), (Classifier, "bfloat16")])
def test_planner_traces_vit_blocks_and_a_bf16_batchnorm_cnn(factory: Callable[[], pl.LightningModule], dtype: str) -> None:
    """Was: "Sequential has no attribute 0" (ViT's OrderedDict blocks) in the planner too."""
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.planner import Candidate, predict

    torch.manual_seed(0)
    prediction = predict(factory(), images(1), Candidate(precision="nf4-dq", dtype=dtype, lora_r=4, checkpointing="full"))
    torch.manual_seed(0)
    module = factory()
    quantize_model(module, "nf4-dq", dtype=dtype)
    LoRA(r=4).transform_model(module)
    assert prediction.categories["parameters"] == parameter_bytes(module)
    assert prediction.trainable_params == sum(p.numel() for p in module.parameters() if p.requires_grad)
    assert prediction.categories["activations"] > 0


# ------------------------------------ issue 24, round two: weights outside any layer, Linears with their own forward


class RawExperts(nn.Module):
    """DBRX's experts: 2-D ``w1``/``v1``/``w2`` Parameters ``[experts * ffn, width]`` used by the module's own code."""

    def __init__(self, experts: int = 4, width: int = 32, ffn: int = 32) -> None:
        super().__init__()
        self.embed, self.head = nn.Embedding(VOCAB, width), nn.Linear(width, VOCAB)
        self.ffn = ffn
        self.w1 = nn.Parameter(torch.randn(experts * ffn, width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(experts * ffn, width) / ffn**0.5)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(tokens)
        return self.head(hidden + F.silu(hidden @ self.w1[: self.ffn].t()) @ self.w2[: self.ffn])


def test_weights_outside_any_layer_are_a_named_row_and_warning() -> None:
    """Was: DBRX's experts (68 % of the parameters) counted with the embeddings and norms, no warning."""
    from lightning_hbm.layers import RAW_WEIGHTS, report_coverage

    torch.manual_seed(0)
    module = Wrapped(RawExperts(), "plain")
    quantize_model(module, "nf4-dq", dtype="float32")
    with pytest.warns(UserWarning, match=r"% of the parameters are weights outside any layer, left as they were .*Parameters of \['model'\]"):
        rows = {r.kind: r for r in report_coverage(module, quantizing=True)}
    assert rows[RAW_WEIGHTS].params == rows[RAW_WEIGHTS].left_alone == 2 * 4 * 32 * 32
    assert rows["other (embeddings, norms, ...)"].params == VOCAB * 32  # the embedding stays "other"


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
