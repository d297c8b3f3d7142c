"""``quantize_embeddings="int8"``: the input embeddings (and a head tied to one) in a mode of their own, named by the
mode, not by the layer (issue 51): the same stored bytes and outputs as the per-layer route
``quantize_embeddings=True, layer_modes={"model.model.embed_tokens": "int8"}`` (tests/layers/test_embedding_int8_s29.py),
whatever the wrapping names the embedding, with a measured plan too. Its resume from an adapter-only checkpoint:
tests/layers/test_embedding_int8_s29.py (mode-name)."""

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

TIED = dict(vocab_size=1000, tie_word_embeddings=True, num_hidden_layers=1)  # one block: fast, the same path
EMB8 = {"model.model.embed_tokens": "int8"}  # the per-layer route: the name as LlamaLM holds it


def _same_state(ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    assert ours.keys() == theirs.keys()
    for key in ours:
        if isinstance(ours[key], torch.Tensor):
            assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key


@pytest.mark.slow
def test_the_mode_name_stores_what_the_per_layer_route_stores(llama_factory: Any) -> None:
    reference = llama_factory(**TIED)
    named, routed = copy.deepcopy(reference), copy.deepcopy(reference)
    quantize_model(named, "nf4-dq", "float32", quantize_embeddings="int8")
    quantize_model(routed, "nf4-dq", "float32", quantize_embeddings=True, layer_modes=EMB8)
    embedding = named.model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(embedding.storage(), Linear8bitLt)
    assert isinstance(named.model.get_output_embeddings(), TiedHead)  # the tied head computes with the one int8 copy
    _same_state(named.state_dict(), routed.state_dict())
    assert parameter_bytes(named) == parameter_bytes(routed)
    assert repr(coverage(named, quantizing=True, adapting=False)) == repr(coverage(routed, quantizing=True, adapting=False))
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        assert torch.equal(named.model(input_ids=ids).logits, routed.model(input_ids=ids).logits)
    # the plain transformers model, whose embedding is "model.embed_tokens": the same spelling, the same bytes
    bare = copy.deepcopy(reference).model
    quantize_model(bare, "nf4-dq", "float32", quantize_embeddings="int8")
    _same_state({f"model.{k}": v for k, v in bare.state_dict().items()}, routed.state_dict())


def test_true_and_the_run_mode_are_the_same_setting(llama_factory: Any) -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings="int8")
    assert plugin.quantize_embeddings == "int8" and "quantize_embeddings='int8'" in repr(plugin)
    assert plugin.quantization.settings()["quantize_embeddings"] == "int8"  # saved, compared on resume
    same = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings="nf4-dq")
    assert same.quantize_embeddings is True and "quantize_embeddings=True" in repr(same)
    # the default (session 30): int8, said in the repr as the setting it chose; False said too
    assert "quantize_embeddings='int8'" in repr(QuantizedPrecision("nf4-dq", dtype="float32"))
    assert "quantize_embeddings=False" in repr(QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=False))
    model, routed = llama_factory(**TIED), llama_factory(**TIED)
    quantize_model(model, "nf4-dq", "float32", quantize_embeddings="nf4-dq")
    quantize_model(routed, "nf4-dq", "float32", quantize_embeddings=True)
    _same_state(model.state_dict(), routed.state_dict())


def test_a_bad_value_is_refused_naming_it_and_the_allowed_ones_before_any_change(llama_factory: Any) -> None:
    for bad in ("int9", "none", "INT8", "False"):
        with pytest.raises(ValueError, match=rf"QuantizedPrecision\(quantize_embeddings={bad!r}\): pass 'auto' \(the default: int8\), True .*False .*one of \[.*'int8'"):
            QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=bad)
    with pytest.raises(TypeError, match=r"QuantizedPrecision\(quantize_embeddings=8\): wrong type int; pass True or False or a str"):
        QuantizedPrecision("nf4-dq", quantize_embeddings=8)  # type: ignore[arg-type]
    model = llama_factory(**TIED)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"quantize_model\(quantize_embeddings='int9'\): pass 'auto' \(int8, as QuantizedPrecision's default\), True"):
        quantize_model(model, "nf4-dq", "float32", quantize_embeddings="int9")
    clash = {"model.model.embed_tokens": "nf4"}
    with pytest.raises(ValueError, match=r"quantize_embeddings='int8' stores the input embeddings in int8, but layer_modes names \{'model\.model\.embed_tokens': 'nf4'\}"):
        quantize_model(model, "nf4-dq", "float32", quantize_embeddings="int8", layer_modes=clash)
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings="int8", layer_modes=clash)
    with pytest.raises(ValueError, match=r"but layer_modes names \{'model\.model\.embed_tokens': 'nf4'\}"):
        plugin.check_model(model)
    after = model.state_dict()
    assert type(model.model.get_input_embeddings()) is torch.nn.Embedding and after.keys() == before.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the same mode in both: one setting, no clash
    quantize_model(model, "nf4-dq", "float32", quantize_embeddings="int8", layer_modes=EMB8)
    assert isinstance(model.model.get_input_embeddings().storage(), Linear8bitLt)


def test_with_a_measured_plan_the_embedding_takes_its_mode_and_the_linears_the_plan(llama_factory: Any) -> None:
    ids = torch.randint(0, 1000, (2, 17))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings="int8", min_cosine=0.999, sensitive_mode="int8", probe_batch=(ids[:, :-1], ids[:, 1:]))
    model = llama_factory(**TIED)
    plugin.check_model(model)
    plugin.convert_base(model)
    plan = plugin.quantization.layer_modes or {}  # the Linears' plan (saved as the plan); the embedding's is the setting's
    assert plan and "model.model.embed_tokens" not in plan and set(plan.values()) <= {"nf4-dq", "int8"}
    assert plugin.layer_modes == {"model.model.embed_tokens": "int8", **plan}  # listed beside it (session 30)
    assert isinstance(model.model.get_input_embeddings().storage(), Linear8bitLt)
    assert isinstance(model.model.get_output_embeddings(), TiedHead)


@pytest.mark.slow
def test_the_planner_counts_the_mode_name_as_the_per_layer_route(llama_factory: Any) -> None:
    ids = torch.randint(0, 1000, (2, 17))
    predicted = {}
    for name, options in (("named", dict(quantize_embeddings="int8")), ("routed", dict(quantize_embeddings=True, layer_modes=EMB8))):
        plugin = QuantizedPrecision("nf4-dq", dtype="float32", **options)  # type: ignore[arg-type]
        predicted[name] = plan(lambda: llama_factory(**TIED), (ids[:, :-1], ids[:, 1:]), plugin=plugin, callbacks=[LoRA(r=4)]).predictions[0]
    assert predicted["named"].categories["parameters"] == predicted["routed"].categories["parameters"]
