"""Input embeddings stored quantized (``QuantizedPrecision(quantize_embeddings=True)``) and a head unpacked a vocabulary
slice at a time under ``FusedLoss`` (issue 51 item 1)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import ActivationCheckpointing, FusedLoss, LoRA, QuantizedPrecision
from lightning_hbm.layers import QuantizedEmbedding, coverage
from lightning_hbm.layers import embedding as head_slices
from lightning_hbm.layers.embedding import convertible
from lightning_hbm.memory.torch_tracker import torch_peak_bytes
from lightning_hbm.planner import plan
from lightning_hbm.precision.registry import get_format

# a vocabulary-dominated Llama (issue 51): 8.2 M of its 17.7 M parameters are the embedding, as many the head
VOCAB_LLAMA = dict(vocab_size=32000, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, tie_word_embeddings=False)  # fmt: skip


@pytest.mark.parametrize("mode", ["nf4", "nf4-dq", "nf4-dq-b32", "fp4-dq", "int8", "int4-g32"])
def test_gather_rows_equals_rows_of_the_whole_dequantization(mode: str) -> None:
    torch.manual_seed(0)
    fmt = get_format(mode)
    layer = fmt.replace(nn.Linear(256, 1000, bias=False), torch.bfloat16, None)
    index = torch.tensor([0, 5, 999, 5, 123, 640])
    rows = fmt.gather_rows(layer, index, torch.bfloat16)
    assert rows.dtype == torch.bfloat16 and torch.equal(rows, fmt.dequantize(layer, torch.bfloat16)[index])


def _fit(llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, steps: int, **options: Any) -> tuple[Any, Any]:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_head=True, quantize_embeddings=True, **options)
    model = llama_factory(**VOCAB_LLAMA)
    trainer = trainer_factory(max_steps=steps, plugins=[plugin],
                              callbacks=[LoRA(r=4), FusedLoss(chunk_size=16), ActivationCheckpointing()])  # fmt: skip
    trainer.fit(model, datamodule_factory())
    return model, trainer


def test_vocabulary_llama_trains_with_embedding_and_head_quantized_at_062_bytes_per_parameter(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any
) -> None:
    original = sum(p.numel() for p in llama_factory(**VOCAB_LLAMA).parameters())
    model, trainer = _fit(llama_factory, trainer_factory, datamodule_factory, 3)
    embedding = model.model.get_input_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and trainer.global_step == 3
    frozen = {k: v for k, v in model.state_dict().items() if "lora_" not in k}
    per_parameter = sum(t.numel() * t.element_size() for t in frozen.values()) / original
    assert per_parameter <= 0.62  # issue 51: 1.2 with the head alone quantized, about 1.9 with neither
    rows = {row.kind: row for row in coverage(model, quantizing=True, adapting=True)}
    assert rows["Embedding"].quantized == rows["Embedding"].params == 32000 * 256


def test_quantized_embedding_lookup_equals_the_dequantized_table(llama_factory: Any) -> None:
    from lightning_hbm.precision import quantize_model

    model = llama_factory(**VOCAB_LLAMA)
    reference = copy.deepcopy(model)
    quantize_model(model, "nf4-dq", "float32", quantize_embeddings=True)
    embedding = model.model.get_input_embeddings()
    ids = torch.randint(0, 32000, (2, 7))
    table = get_format("nf4-dq").dequantize(embedding.storage(), torch.float32)
    assert torch.equal(embedding(ids), table[ids])
    # the rest of the model computes as before: only the table's rounding differs
    with torch.no_grad():
        ours, theirs = model.model(input_ids=ids).logits, reference.model(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.95


def test_resume_rebuilds_the_quantized_embedding_bit_exact(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    # the run whose checkpoint is resumed is the reference: the frozen base is what training leaves unchanged (was: a
    # third fit, uninterrupted to step 4, whose non-LoRA tensors are these same ones; session 42, for the suite's time)
    at_save, first = _fit(llama_factory, trainer_factory, datamodule_factory, 2)
    path = tmp_path / "half.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["lightning_hbm"]["configs"]["QuantizedPrecision"]
    assert saved["quantize_embeddings"] is True
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_head=True, quantize_embeddings=True)
    resumed_model = llama_factory(**VOCAB_LLAMA)
    resumed = trainer_factory(max_steps=4, plugins=[plugin], callbacks=[LoRA(r=4), FusedLoss(chunk_size=16), ActivationCheckpointing()])
    resumed.fit(resumed_model, datamodule_factory(), ckpt_path=path)
    assert resumed.global_step == 4
    ours, theirs = at_save.state_dict(), resumed_model.state_dict()
    assert ours.keys() == theirs.keys() and any("embed_tokens.quantized.weight" in k for k in ours)
    for name in (k for k in ours if "lora_" not in k):  # the frozen base, embedding and head included, rebuilt bit for bit
        assert torch.equal(ours[name], theirs[name]), name
    # the same checkpoint without the option: refused, naming it
    other = trainer_factory(max_steps=4, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", quantize_head=True)],
                            callbacks=[LoRA(r=4), FusedLoss(chunk_size=16), ActivationCheckpointing()])  # fmt: skip
    with pytest.raises(ValueError, match="quantize_embeddings"):
        other.fit(llama_factory(**VOCAB_LLAMA), datamodule_factory(), ckpt_path=path)


def test_a_tied_head_computes_with_the_embeddings_one_quantized_copy(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    """SmolLM2-style tied embedding and head: one quantized table, saved once; the head computes with it a slice at a
    time, as the dequantized table would; training and resume work."""
    from lightning_hbm.layers.embedding import TiedHead
    from lightning_hbm.precision import quantize_model

    model = llama_factory(tie_word_embeddings=True)
    reference = copy.deepcopy(model)
    quantize_model(model, "nf4-dq", "float32", quantize_embeddings=True)
    embedding, head = model.model.get_input_embeddings(), model.model.get_output_embeddings()
    assert isinstance(embedding, QuantizedEmbedding) and isinstance(head, TiedHead)
    assert not any("lm_head" in k for k in model.state_dict())  # the table is saved once, under the embedding
    x = torch.randn(3, 5, embedding.embedding_dim)
    table = get_format("nf4-dq").dequantize(embedding.storage(), torch.float32)
    torch.testing.assert_close(head(x), x @ table.t())
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        ours, theirs = model.model(input_ids=ids).logits, reference.model(input_ids=ids).logits
    assert torch.nn.functional.cosine_similarity(ours.flatten(), theirs.flatten(), dim=0) > 0.95

    def run(steps: int, ckpt: Any = None) -> tuple[Any, Any]:
        fitted = llama_factory(tie_word_embeddings=True)
        trainer = trainer_factory(max_steps=steps, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=True)],
                                  callbacks=[LoRA(r=4), FusedLoss(chunk_size=16)])  # fmt: skip
        trainer.fit(fitted, datamodule_factory(), ckpt_path=ckpt)
        return fitted, trainer

    _, first = run(1)
    first.save_checkpoint(tmp_path / "tied.ckpt")
    resumed, again = run(2, tmp_path / "tied.ckpt")
    assert again.global_step == 2 and isinstance(resumed.model.get_output_embeddings(), TiedHead)


def test_an_embedding_shared_with_anything_else_is_kept_with_a_warning(trainer_factory: Any) -> None:
    from lightning_hbm.precision.targets import _quantizable_linears

    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.other = nn.Embedding(64, 16)
            self.other.weight = self.embed.weight  # not a Linear head: TiedHead cannot stand in for it
            self.proj = nn.Linear(16, 16)

    model = Shared()
    targets, skipped = _quantizable_linears(model, (), False, (), True)
    assert not any(isinstance(layer, nn.Embedding) for _, layer in targets)
    assert skipped["embed"] == ("weight shared with a module that is not a plain nn.Linear head: kept in the compute dtype", False)
    plan = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=True).quantization
    with pytest.warns(UserWarning, match=r"quantize_embeddings=True\) keeps 2 input embedding\(s\) in torch.float32: embed: weight shared"):
        plan.target_listing.say_embeddings_kept(model)


def test_what_cannot_be_converted_is_named() -> None:
    class Scaled(nn.Embedding):
        def forward(self, input: torch.Tensor) -> torch.Tensor:
            return super().forward(input) * 2.0

    assert "Scaled has a forward of its own" in str(convertible(Scaled(10, 4), {}))
    assert "max_norm" in str(convertible(nn.Embedding(10, 4, max_norm=1.0), {}))
    assert convertible(nn.Embedding(10, 4), {}) is None


def test_fused_loss_never_dequantizes_a_4bit_head_whole(llama_factory: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The head is unpacked a slice of rows at a time in forward and backward: the whole-weight dequantization never
    runs, and the loss step's peak holds no [vocab, hidden] copy (torch's MemTracker)."""
    from lightning_hbm.precision import quantize_model

    monkeypatch.setattr(head_slices, "SLICE_BYTES", 32000 * 256 * 4 // 8)  # 8 slices of the head
    model = llama_factory(**VOCAB_LLAMA)
    quantize_model(model, "nf4-dq", "float32", quantize_head=True, quantize_embeddings=True)
    LoRA(r=4).transform_model(model)
    FusedLoss(chunk_size=16).transform_model(model)
    whole = []
    fmt = type(get_format("nf4-dq"))
    original = fmt.dequantize
    monkeypatch.setattr(fmt, "dequantize", lambda self, m, dtype=None: whole.append(m) or original(self, m, dtype))
    ids = torch.randint(0, 32000, (2, 32))

    def step() -> None:
        model.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()

    peak = torch_peak_bytes(step)
    assert model.model.lm_head not in whole
    head_bytes = 32000 * 256 * 4  # the fp32 head a whole dequantization would make
    assert peak < head_bytes


def test_plan_counts_the_quantized_embedding_within_3_percent(llama_factory: Any) -> None:
    from lightning_hbm.memory import parameter_bytes
    from lightning_hbm.precision import quantize_model

    ids = torch.randint(0, 32000, (2, 33))
    batch = (ids[:, :-1], ids[:, 1:])
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", quantize_head=True, quantize_embeddings=True)
    predicted = plan(lambda: llama_factory(**VOCAB_LLAMA), batch, plugin=plugin, callbacks=[LoRA(r=4)]).predictions[0]
    model = llama_factory(**VOCAB_LLAMA)
    quantize_model(model, "nf4-dq", "float32", quantize_head=True, quantize_embeddings=True)
    LoRA(r=4).transform_model(model)
    measured = parameter_bytes(model)
    assert abs(predicted.categories["parameters"] - measured) <= 0.03 * measured
