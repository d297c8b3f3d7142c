"""The input embedding (and a head tied to it) in int8 while the Linears stay 4-bit, through the existing
per-layer modes: ``QuantizedPrecision("nf4-dq", quantize_embeddings=True, layer_modes={"<embedding>": "int8"})``
(issue 51 item 1; on the real SmolLM2-135M it costs nothing measurable in held-out loss where the 4-bit table costs
+5.3 %: benchmarks/README.md, "Embeddings and head stored small")."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from bitsandbytes.nn import Linear8bitLt

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import QuantizedEmbedding, coverage
from lightning_hbm.layers.embedding import TiedHead
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import plan
from lightning_hbm.precision import quantize_model
from lightning_hbm.precision.registry import get_format

TIED = dict(vocab_size=1000, tie_word_embeddings=True)
EMBEDDING = "model.model.embed_tokens"  # its name inside LlamaLM (a transformers model's own: "model.embed_tokens")
EMB8 = {EMBEDDING: "int8"}


def _cosine(model: Any, reference: Any, ids: torch.Tensor) -> float:
    with torch.no_grad():
        ours, theirs = model.model(input_ids=ids).logits, reference.model(input_ids=ids).logits
    return torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0).item()


def test_int8_embedding_is_stored_in_8_bits_and_computes_closer_than_the_4bit_one(llama_factory: Any) -> None:
    reference = llama_factory(**TIED)
    emb8, emb4 = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_model(emb8, "nf4-dq", "float32", quantize_embeddings=True, layer_modes=EMB8)
    quantize_model(emb4, "nf4-dq", "float32", quantize_embeddings=True)
    embedding = emb8.model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(embedding.storage(), Linear8bitLt)
    assert isinstance(emb8.model.get_output_embeddings(), TiedHead)  # the head computes with the one int8 copy
    state = {k: v for k, v in emb8.state_dict().items() if "embed_tokens" in k}
    assert state[f"{EMBEDDING}.quantized.weight"].dtype == torch.int8 and not any("lm_head" in k for k in emb8.state_dict())
    # 1 byte a weight and one fp32 scale a row (the 4-bit table: about 0.53 bytes a weight)
    assert sum(v.numel() * v.element_size() for v in state.values()) == 1000 * 64 + 1000 * 4 + 1
    rows = {row.kind: row for row in coverage(emb8, quantizing=True, adapting=False)}
    assert rows["Embedding"].quantized == 1000 * 64 and rows["Embedding"].bytes == 1000 * 64 + 1000 * 4
    ids = torch.randint(0, 1000, (2, 9))
    table = get_format("int8").dequantize(embedding.storage(), torch.float32)
    assert torch.equal(embedding(ids), table[ids])
    # both differ from the original by the Linears' 4-bit rounding; the int8 table adds less than the 4-bit one
    assert torch.allclose(table, reference.model.get_input_embeddings().weight, atol=0.02)
    assert _cosine(emb8, reference, ids) > _cosine(emb4, reference, ids)


def test_a_plan_naming_the_embedding_without_quantize_embeddings_is_refused_before_any_change(llama_factory: Any) -> None:
    model = llama_factory(**TIED)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"layer_modes names \['model\.model\.embed_tokens'\], which are not quantizable.*input embedding is one with quantize_embeddings=True"):
        quantize_model(model, "nf4-dq", "float32", layer_modes=EMB8)
    with pytest.raises(ValueError, match=r"Unknown lightning_hbm precision mode 'int9'.*Valid modes: .*int8"):
        quantize_model(model, "nf4-dq", "float32", quantize_embeddings=True, layer_modes={EMBEDDING: "int9"})
    after = model.state_dict()
    assert type(model.model.get_input_embeddings()) is torch.nn.Embedding and after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.slow
def test_plan_counts_the_int8_embedding_within_3_percent(llama_factory: Any) -> None:
    ids = torch.randint(0, 1000, (2, 17))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=True, layer_modes=EMB8)
    predicted = plan(lambda: llama_factory(**TIED), (ids[:, :-1], ids[:, 1:]), plugin=plugin, callbacks=[LoRA(r=4)]).predictions[0]
    model = llama_factory(**TIED)
    quantize_model(model, "nf4-dq", "float32", quantize_embeddings=True, layer_modes=EMB8)
    LoRA(r=4).transform_model(model)
    measured = parameter_bytes(model)
    assert abs(predicted.categories["parameters"] - measured) <= 0.03 * measured


@pytest.mark.slow
@pytest.mark.parametrize(
    "options",
    [dict(mode="int8"), dict(mode="nf4-dq", quantize_embeddings=True, layer_modes=EMB8), dict(mode="nf4-dq", quantize_embeddings="int8")],
    ids=["int8", "per-layer-route", "mode-name"],
)
def test_an_adapter_only_int8_checkpoint_resumes_bit_exact(
    options: dict[str, Any], llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    """bitsandbytes' int8 layer writes its row scales beside the weight (``x.SCB``, ``x.weight_format``): an
    adapter-only checkpoint omits them with the base weight, and the resume rebuilds them (was: refused, "does not
    hold these tensors ... SCB"); an int8 table beside 4-bit Linears, by its layer name or by the mode name
    (``quantize_embeddings="int8"``), rebuilt bit for bit too, and another embedding setting refused."""

    def run(steps: int, ckpt: Any = None, **changed: Any) -> tuple[Any, Any]:
        model = llama_factory(**TIED, num_hidden_layers=1)  # one block: fast, the same path
        plugin = QuantizedPrecision(dtype="float32", **{**options, **changed})
        trainer = trainer_factory(max_steps=steps, plugins=[plugin], callbacks=[LoRA(r=4)])
        trainer.fit(model, datamodule_factory(train_samples=16), ckpt_path=ckpt)
        return model, trainer

    straight, _ = run(2)
    _, first = run(1)
    first.save_checkpoint(tmp_path / "int8.ckpt")
    resumed, again = run(2, tmp_path / "int8.ckpt")
    assert again.global_step == 2
    ours, theirs = straight.state_dict(), resumed.state_dict()
    assert ours.keys() == theirs.keys()
    assert any(k.endswith(".SCB") for k in ours) if options["mode"] == "int8" else ours[f"{EMBEDDING}.quantized.weight"].dtype == torch.int8
    for name in (k for k in ours if "lora_" not in k):  # the int8 base and its scales, the int8 table, rebuilt bit for bit
        assert torch.equal(ours[name], theirs[name]), name
    if options.get("quantize_embeddings") == "int8":
        with pytest.raises(ValueError, match="quantize_embeddings"):  # another embedding setting: refused, said
            run(2, tmp_path / "int8.ckpt", quantize_embeddings=True)
