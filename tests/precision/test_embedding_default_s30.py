"""The default of ``QuantizedPrecision(quantize_embeddings=...)``: int8 (issue 51, session 30).

The issue's rule: a default where it costs under 0.3 %. The int8 table measured -0.01 % held-out loss on SmolLM2-135M
before training, no worse after 150 steps (two seeds), and at most 0.017 % sentence cosine on all-MiniLM-L6-v2 (two
seeds; benchmarks/README.md). So the input embeddings (and a head tied to one) are stored in int8 unless
``quantize_embeddings=False``; what shows the choice (repr, ``layer_modes``, the coverage table, the planner's
candidate names, ``LoRA.merge``'s keys) and what cannot be converted (kept, named, never an error) are checked here on
small plain models (each test well under a second).
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from bitsandbytes.nn import Linear8bitLt
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.layers.coverage_table import coverage, format_coverage
from lightning_hbm.layers.embedding import QuantizedEmbedding, TiedHead
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import Candidate


class Tied(nn.Module):
    """A token model with a head tied to its embedding (SmolLM2's, GPT-2's layout)."""

    def __init__(self, embedding: nn.Embedding | None = None) -> None:
        super().__init__()
        self.emb = embedding if embedding is not None else nn.Embedding(128, 64)
        self.mid = nn.Linear(64, 64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(ids)))


class Scaled(nn.Embedding):
    """Gemma's scaled embedding: a forward of its own."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return super().forward(input) * 8.0


class ReadsTable(nn.Module):
    """An embedding whose table the model's code reads directly (``F.embedding(ids, self.emb.weight)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        self.mid = nn.Linear(64, 64)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.mid(F.embedding(ids, self.emb.weight))


def _converted(model: nn.Module, **options: Any) -> tuple[QuantizedPrecision, list[str]]:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin.convert_module(model)
    return plugin, [str(w.message) for w in caught if "lightning_hbm" in str(w.message) or "QuantizedPrecision" in str(w.message)]


def test_by_default_the_embedding_and_its_tied_head_are_int8_and_every_view_says_so() -> None:
    torch.manual_seed(0)
    model, ids = Tied(), torch.randint(0, 128, (2, 9))
    reference = model(ids)
    plugin, said = _converted(model)
    assert plugin.quantize_embeddings == "int8" and plugin.config.embeddings_by_default and not said
    assert isinstance(model.emb, QuantizedEmbedding) and isinstance(model.emb.storage(), Linear8bitLt)
    assert isinstance(model.head, TiedHead)  # the one int8 copy, not a second table
    assert parameter_bytes(model.emb) < 128 * 64 * 4 / 3  # a byte a weight and a scale a row, was 4 bytes (fp32)
    assert plugin.layer_modes == {"emb": "int8"}  # listed beside the Linears' mode
    assert plugin.quantization.settings()["quantize_embeddings"] == "int8"  # saved and compared on resume
    assert "quantize_embeddings='int8'" in repr(plugin)
    table = format_coverage(coverage(model, quantizing=True, adapting=False))
    assert "stored in int8" in next(line for line in table.splitlines() if line.startswith("Embedding"))
    assert torch.nn.functional.cosine_similarity(model(ids).flatten(), reference.flatten(), dim=0) > 0.99


def test_false_keeps_the_embedding_as_it_was_and_an_int8_run_stores_it_in_its_own_mode() -> None:
    model = Tied()
    plugin, said = _converted(model, quantize_embeddings=False)
    assert type(model.emb) is nn.Embedding and model.emb.weight.requires_grad and model.head.weight is model.emb.weight
    assert plugin.layer_modes is None and "quantize_embeddings=False" in repr(plugin) and not said
    assert "quantize_embeddings" not in plugin.quantization.settings()  # as checkpoints saved before this option
    int8 = QuantizedPrecision("int8", dtype="float32")
    assert int8.quantize_embeddings is True  # the run's own mode: the same setting as True
    model = Tied()
    int8.convert_module(model)
    assert isinstance(model.emb.storage(), Linear8bitLt) and int8.layer_modes is None  # nothing other than the mode


def test_a_model_without_an_embedding_is_left_alone_without_a_word() -> None:
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    _, said = _converted(model)
    assert not said  # the default changes nothing here and says nothing
    _, asked = _converted(nn.Sequential(nn.Linear(64, 64)), quantize_embeddings="int8")
    assert any("has no nn.Embedding" in message for message in asked)  # asked for by name: said


@pytest.mark.parametrize("kind", ["padding_idx", "sparse"])
def test_padding_and_sparse_embeddings_are_stored_int8_and_look_up_the_same_rows(kind: str) -> None:
    torch.manual_seed(0)
    embedding = nn.Embedding(128, 64, padding_idx=0) if kind == "padding_idx" else nn.Embedding(128, 64, sparse=True)
    model, ids = Tied(embedding), torch.randint(0, 128, (2, 9))
    ids[0, 0] = 0
    rows = embedding(ids).detach()
    _converted(model)  # a frozen table: padding_idx and sparse only shape a gradient it no longer gets
    assert isinstance(model.emb, QuantizedEmbedding)
    assert torch.allclose(model.emb(ids), rows, atol=0.02)
    if kind == "padding_idx":
        assert torch.equal(model.emb(ids)[0, 0], torch.zeros(64))  # the zero padding row stays exactly zero


def test_what_cannot_be_stored_is_kept_wide_with_its_reason_never_an_error() -> None:
    torch.manual_seed(0)
    for embedding, reason in ((nn.Embedding(128, 64, max_norm=1.0), "max_norm"), (Scaled(128, 64), "forward of its own")):
        model, ids = Tied(embedding), torch.randint(0, 128, (2, 9))
        _, said = _converted(model)
        assert type(model.emb) is type(embedding), reason
        kept = [message for message in said if "keeps 1 input embedding(s)" in message]
        assert kept and reason in kept[0] and "the default, 'auto'" in kept[0], said
        assert model(ids).shape == (2, 9, 128)


def test_an_embedding_read_directly_is_kept_wide_with_its_reason() -> None:
    torch.manual_seed(0)
    model, ids = ReadsTable(), torch.randint(0, 128, (2, 9))
    reference = model(ids).detach()
    _, said = _converted(model, ignore_modules=["mid"])  # DeBERTa-v2's rel_embeddings: was UnobservedRead in a fit
    assert type(model.emb) is nn.Embedding and torch.equal(model(ids), reference)
    assert any("emb: weight read directly by ReadsTable.forward" in message for message in said), said


def test_the_planners_candidate_names_the_embeddings_mode_where_it_is_not_the_default() -> None:
    assert Candidate("nf4-dq", lora_r=8).name == "nf4-dq+lora8"  # the default (int8): as named before
    assert Candidate("nf4-dq", quantize_embeddings="int8") == Candidate("nf4-dq")  # the same configuration
    assert Candidate("int8", quantize_embeddings=True) == Candidate("int8")
    kept = Candidate("nf4-dq", lora_r=8, quantize_embeddings=False)
    assert kept.name == "nf4-dq[emb:none]+lora8" and "quantize_embeddings: false" in kept.yaml()
    assert kept.precision_plugin().quantize_embeddings is False
    assert Candidate("nf4-dq", quantize_embeddings=True).name == "nf4-dq[emb:nf4-dq]"
    assert Candidate("nf4-dq", layer_modes={"a": "int8"}, quantize_embeddings=False).name == "nf4-dq[mixed:1 int8][emb:none]"
    configured = Candidate.from_trainer(QuantizedPrecision("nf4-dq", quantize_embeddings=False))
    assert configured.name.startswith("nf4-dq[emb:none]") and Candidate.from_trainer(QuantizedPrecision("nf4-dq")).quantize_embeddings == "auto"
    with pytest.raises(ValueError, match=r"Candidate quantize_embeddings='int9': use 'auto' \(int8, the default\)"):
        Candidate("nf4-dq", quantize_embeddings="int9")


@pytest.mark.slow
def test_merge_of_a_tied_int8_head_gives_both_keys_as_the_model_as_built() -> None:
    import lightning.pytorch as pl

    from lightning_hbm import LoRA

    class Module(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = Tied()

        def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
            return self.net(batch).float().logsumexp(-1).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], 1e-3)

    torch.manual_seed(0)
    model = Module()
    original = {k: v.clone() for k, v in model.state_dict().items()}
    loader = torch.utils.data.DataLoader([torch.randint(0, 128, (8,)) for _ in range(2)], batch_size=2)
    trainer = pl.Trainer(plugins=[QuantizedPrecision("nf4-dq", dtype="float32")], callbacks=[LoRA(r=4)], max_steps=1, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")  # fmt: skip
    trainer.fit(model, loader)
    assert isinstance(model.net.head, TiedHead)
    for merged in (LoRA.merge(model, dtype="float32"), LoRA.merge(model, base_state_dict=original, dtype="float32")):
        assert set(merged) == set(original)  # was: AttributeError (an embedding has no bias), then no net.head.weight
        assert torch.equal(merged["net.head.weight"], merged["net.emb.weight"])
    assert torch.equal(merged["net.emb.weight"], original["net.emb.weight"])  # onto the original table, exactly


def test_gptq_says_nothing_of_the_default_int8_table_and_names_a_4bit_one() -> None:
    model = nn.Sequential(nn.Embedding(128, 64), nn.Linear(64, 64))
    probe = torch.randint(0, 128, (4, 32))
    _, said = _converted(model, rounding="gptq", probe_batch=probe)  # GPTQ rounds no 8-bit layer: nothing lost to say
    assert not [message for message in said if "nearest rounding" in message]
    model = nn.Sequential(nn.Embedding(128, 64), nn.Linear(64, 64))
    _, said = _converted(model, rounding="gptq", probe_batch=probe, quantize_embeddings=True)
    assert any("0: an input embedding, a lookup with no input to round against" in message for message in said)


def test_under_fsdp_the_default_stores_int8_unless_the_tied_head_is_in_another_unit() -> None:
    """Session 31 (h2): FSDP shards the int8 table as the 4-bit weights (tests/strategies/test_fsdp_int8_embedding_s31.py),
    so the default stores it there too. Only a head tied to it in another top-level submodule (another FSDP unit: it
    would read a shard of the table) keeps the tables wide, named in a warning; an explicit setting is refused there
    (was: every table kept wide under FSDP, "not sharded by FSDP2 yet")."""
    import warnings
    from types import SimpleNamespace

    from lightning_hbm.strategies import QuantizedFSDPStrategy

    trainer = SimpleNamespace(strategy=QuantizedFSDPStrategy(), callbacks=[])  # what the listing reads of a Trainer
    wrapped, plugin = nn.Sequential(Tied()), QuantizedPrecision("nf4-dq", dtype="float32")  # emb and head in one unit
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        targets = plugin.quantization._listed(wrapped, trainer)[1].targets
    assert "0.emb" in dict(targets) and plugin.quantization.settings()["quantize_embeddings"] == "int8"
    model, plugin = Tied(), QuantizedPrecision("nf4-dq", dtype="float32")  # emb and head: two top-level submodules
    with pytest.warns(UserWarning, match=r"keeps the input embeddings in torch.float32 under QuantizedFSDPStrategy: "
                      r"\['emb'\] are tied to the head\(s\) \['head'\] in another top-level submodule.*quantize_embeddings=False"):
        targets = plugin.quantization._listed(model, trainer)[1].targets
    assert "emb" not in dict(targets) and "mid" in dict(targets)  # the Linears as ever
    assert "quantize_embeddings" not in plugin.quantization.settings()  # saved as kept: a resume elsewhere must say False
    asked = QuantizedPrecision("nf4-dq", dtype="float32", quantize_embeddings=True)
    with pytest.raises(ValueError, match=r"quantize_embeddings=True under QuantizedFSDPStrategy: the input embedding\(s\) "
                       r"\['emb'\] are tied to head\(s\) \['head'\] in another top-level submodule"):
        asked.quantization._listed(Tied(), trainer)
    assert "0.emb" in dict(asked.quantization._listed(nn.Sequential(Tied()), trainer)[1].targets)


def test_a_hook_on_the_embedding_goes_on_with_its_int8_table() -> None:
    model, ids = Tied(), torch.randint(0, 128, (2, 9))
    model.emb.register_forward_hook(lambda module, args, output: output.requires_grad_())  # enable_input_require_grads()
    _converted(model)
    assert isinstance(model.emb, QuantizedEmbedding) and model.emb(ids).requires_grad  # was dropped with the module (Reformer)


@pytest.mark.slow
def test_a_checkpoint_saved_with_wide_embeddings_resumes_under_the_default_with_them_wide(
    llama_factory: Any, trainer_factory: Any, datamodule_factory: Any, tmp_path: Any
) -> None:
    """A run saved before the default changed (``quantize_embeddings=False`` then) resumes under the new default: the
    resume goes on as that run was, the embeddings wide, and says so (was: refused, "quantize_embeddings" differs, for
    every checkpoint saved before session 30). Another explicit setting is still refused."""
    from lightning_hbm import LoRA

    def run(steps: int, ckpt: Any = None, **options: Any) -> tuple[Any, Any]:
        model = llama_factory(vocab_size=1000, tie_word_embeddings=True, num_hidden_layers=1)
        trainer = trainer_factory(max_steps=steps, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", **options)], callbacks=[LoRA(r=4)])
        trainer.fit(model, datamodule_factory(train_samples=16), ckpt_path=ckpt)
        return model, trainer

    straight, _ = run(2, quantize_embeddings=False)
    _, first = run(1, quantize_embeddings=False)
    first.save_checkpoint(tmp_path / "wide.ckpt")
    with pytest.warns(UserWarning, match=r"keeps the input embeddings in torch.float32: the checkpoint being resumed was saved with them so"):
        resumed, again = run(2, tmp_path / "wide.ckpt")
    assert again.global_step == 2
    assert type(resumed.model.get_input_embeddings()) is nn.Embedding
    ours, theirs = straight.state_dict(), resumed.state_dict()
    assert ours.keys() == theirs.keys()
    assert [k for k in ours if "lora_" not in k and not torch.equal(ours[k], theirs[k])] == []  # the wide table and the base
    with pytest.raises(ValueError, match="quantize_embeddings"):
        run(2, tmp_path / "wide.ckpt", quantize_embeddings="int8")
