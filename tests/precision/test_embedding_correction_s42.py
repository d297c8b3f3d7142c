"""The calibrated correction of a quantized input embedding and of the head tied to it (issue 52, session 42): the
row-weighted fit, the lookup and the tied head computing with ``Q + L R``, its bytes to the byte, the fit-start
warning, a resume bit for bit, the adapter export (real bitsandbytes and peft)."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from torch import nn

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.layers import coverage
from lightning_hbm.layers import embedding as embedding_module
from lightning_hbm.layers.correction import correction_of, storage_dtype
from lightning_hbm.layers.embedding import QuantizedEmbedding, TiedHead
from lightning_hbm.memory import parameter_bytes
from lightning_hbm.planner import quantized_parameter_bytes
from lightning_hbm.precision.embedding_correction import fit_row_factors

VOCAB, DIM, RANK = 384, 64, 8
#: a probe that reads the first 96 tokens only, unevenly (a language's frequencies): the others are never read
PROBE = (torch.randint(0, 96, (8, 32), generator=torch.Generator().manual_seed(0)) ** 2) // 96


class TinyLM(nn.Module):
    """An embedding, one Linear and a head tied to the embedding (SmolLM2's and GPT-2's layout, at toy size)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if tied:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(ids))))


class TinyModule(pl.LightningModule):
    """:class:`TinyLM` trained on next-token loss (the planner and the Trainer take a LightningModule)."""

    def __init__(self, tied: bool = True) -> None:
        super().__init__()
        self.lm = TinyLM(tied)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, self.lm(ids))

    def training_step(self, batch: torch.Tensor, _: int) -> torch.Tensor:
        logits = self.lm(batch[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _quantized(model: nn.Module, **settings: Any) -> QuantizedPrecision:
    plugin = QuantizedPrecision(**{"mode": "nf4-dq", "dtype": "float32", "probe_batch": PROBE, "quantize_embeddings": True,
                                   "correction_rank": RANK, **settings})  # fmt: skip
    plugin.convert_module(model)
    return plugin


def _weighted_error(error: torch.Tensor, weights: torch.Tensor) -> float:
    return float((weights[:, None] * error.double() ** 2).sum())


def test_the_row_fit_is_the_weighted_optimum_and_the_plain_fit_without_counts() -> None:
    generator = torch.Generator().manual_seed(0)
    error = torch.randn(200, 32, generator=generator, dtype=torch.float64)
    counts = torch.zeros(200, dtype=torch.float64)
    counts[:40] = torch.randint(1, 30, (40,), generator=generator).double()
    weights = counts + counts.mean()
    right, left = fit_row_factors(error, counts, 4, smoothing=1.0)
    assert right.shape == (4, 32) and left.shape == (200, 4)
    best = _weighted_error(error - left @ right, weights)
    # any other rank-4 term leaves more weighted error: the unweighted fit, and random perturbations of the optimum
    u, s, vh = torch.linalg.svd(error, full_matrices=False)
    assert best < _weighted_error(error - (u[:, :4] * s[:4]) @ vh[:4], weights)
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        moved = (left + 1e-3 * torch.randn(left.shape, generator=g, dtype=torch.float64)) @ (right + 1e-3 * torch.randn(right.shape, generator=g, dtype=torch.float64))
        assert best < _weighted_error(error - moved, weights)
    # equal counts: the plain truncated SVD of the error (Eckart-Young)
    r2, l2 = fit_row_factors(error, torch.full((200,), 3.0, dtype=torch.float64), 4)
    torch.testing.assert_close(l2 @ r2, (u[:, :4] * s[:4]) @ vh[:4])


def test_the_embedding_and_its_tied_head_compute_with_the_corrected_table() -> None:
    model, plain = TinyLM(), TinyLM()
    table = model.embed.weight.detach().clone()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plugin = _quantized(model)
    _quantized(plain, correction_rank=None)
    embed, head = model.embed, model.head
    assert isinstance(embed, QuantizedEmbedding) and isinstance(head, TiedHead)
    correction = correction_of(embed)
    assert correction is not None and correction.rank == RANK
    assert correction.left.shape == (VOCAB, RANK) and correction.right.shape == (RANK, DIM)
    assert correction.left.dtype == storage_dtype(torch.float32) and not correction.left.requires_grad
    assert "embed" in plugin.correction_report.corrected
    # the fit-start warning no longer names the embedding as left without one
    said = " ".join(str(w.message) for w in caught if "calibrated correction" in str(w.message))
    assert "embed" not in said and "Embedding layer" not in said
    # the lookup reads Q + L R, row by row
    quantized = plain.embed.weight.detach()
    corrected = quantized + correction.left.float() @ correction.right.float()
    ids = torch.arange(VOCAB).view(4, -1)
    torch.testing.assert_close(embed(ids), corrected[ids])
    torch.testing.assert_close(embed.weight, corrected)
    # and lowers the output error on the probe, count-weighted (what it minimises), and on the tokens it never read
    counts = torch.bincount(PROBE.flatten(), minlength=VOCAB).double()
    seen = counts > 0
    assert _weighted_error(table - corrected, counts) < 0.9 * _weighted_error(table - quantized, counts)
    assert ((table - corrected)[~seen] ** 2).sum() < ((table - quantized)[~seen] ** 2).sum()


def test_the_tied_head_adds_the_correction_slice_by_slice_forward_and_backward(monkeypatch: Any) -> None:
    model = TinyLM()
    _quantized(model)
    correction = correction_of(model.embed)
    assert correction is not None
    table = model.embed.weight.detach()  # Q + L R, dequantized whole
    # slices of 40 rows: 10 slices over the vocabulary, the correction's rows added to each
    monkeypatch.setattr(embedding_module, "SLICE_BYTES", 40 * DIM * 4)
    monkeypatch.setattr(embedding_module, "MIN_SLICE_BYTES", 0)
    assert embedding_module.slice_rows(DIM, torch.float32, 6, VOCAB) < VOCAB
    hidden = torch.randn(2, 3, DIM, requires_grad=True)
    logits = model.head(hidden)
    torch.testing.assert_close(logits, hidden.detach() @ table.t())
    upstream = torch.randn_like(logits)
    (logits * upstream).sum().backward()
    assert hidden.grad is not None
    torch.testing.assert_close(hidden.grad, upstream @ table, atol=1e-4, rtol=1e-5)  # slices summed in another order


def test_the_bytes_to_the_byte_run_planner_coverage_and_report() -> None:
    model, plain = TinyLM(), TinyLM()
    plugin = _quantized(model)
    _quantized(plain, correction_rank=None)
    size = storage_dtype(torch.float32).itemsize
    linear = RANK * (DIM + DIM) * size  # the one Linear's factors
    table = RANK * (VOCAB + DIM) * size  # the embedding's: [vocab, r] and [r, dim]
    assert parameter_bytes(model) - parameter_bytes(plain) == linear + table == plugin.correction_report.bytes
    planned = [quantized_parameter_bytes(TinyModule(), "nf4-dq", "float32", correction_rank=rank, quantize_embeddings=True) for rank in (0, RANK)]
    assert planned == [parameter_bytes(plain), parameter_bytes(model)]
    # the coverage table counts them in the embedding's bytes, not as weights
    rows = {row.kind: row for row in coverage(model, quantizing=True, adapting=False)}
    plain_rows = {row.kind: row for row in coverage(plain, quantizing=True, adapting=False)}
    assert rows["Embedding"].bytes - plain_rows["Embedding"].bytes == table
    assert rows["Embedding"].params == plain_rows["Embedding"].params


def test_the_planner_refuses_a_bad_quantize_embeddings() -> None:
    with pytest.raises(ValueError, match=r"quantize_embeddings='bogus'\): pass .*'int8'"):
        quantized_parameter_bytes(TinyModule(), "nf4-dq", "float32", correction_rank=RANK, quantize_embeddings="bogus")


def test_an_embedding_the_probe_never_calls_is_named_in_the_warning() -> None:
    class FedEmbeddings(TinyLM):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # the probe gives vectors, not ids: the table is unread
            return self.head(torch.tanh(self.mix(ids)))

    model = FedEmbeddings()
    with pytest.warns(UserWarning, match=r"embed: the probe batch did not reach it"):
        QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=torch.randn(4, 32, DIM), quantize_embeddings=True,
                           correction_rank=RANK).convert_module(model)  # fmt: skip
    assert correction_of(model.embed) is None


def _fit(root: Path, max_steps: int, probe: torch.Tensor, ckpt_path: Any = None) -> nn.Module:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    torch.manual_seed(0)
    module = TinyModule()
    # two batches an epoch: the checkpoint of step 2 ends one, so the resumed run reads the batches the straight one does
    data = torch.utils.data.DataLoader(torch.randint(0, VOCAB, (8, 17), generator=torch.Generator().manual_seed(2)), batch_size=4)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=root, plugins=[QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=probe, correction_rank=RANK,
                                                           quantize_embeddings=True)],
        callbacks=[LoRA(r=2, target_modules=["mix"]), ModelCheckpoint(dirpath=root, every_n_train_steps=2, save_top_k=-1, filename="{step}")],
    )  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(module, data, ckpt_path=ckpt_path)
    return module


def test_a_resume_takes_the_embeddings_factors_from_the_checkpoint_bit_for_bit(tmp_path: Path) -> None:
    straight = _fit(tmp_path / "straight", 4, PROBE)
    checkpoint = torch.load(tmp_path / "straight" / "step=2.ckpt", weights_only=False)
    assert "lm.embed.lowrank_correction.left" in checkpoint["lightning_hbm"]["state_dict"]
    # another probe would fit other factors: the resume takes the file's
    other = torch.randint(0, VOCAB, (8, 32), generator=torch.Generator().manual_seed(5))
    resumed = _fit(tmp_path / "resumed", 4, other, ckpt_path=tmp_path / "straight" / "step=2.ckpt")
    want, got = straight.state_dict(), resumed.state_dict()
    keys = [k for k in want if ".lora_" in k or ".lowrank_correction." in k]
    assert "lm.embed.lowrank_correction.left" in keys
    for key in keys:
        assert torch.equal(want[key], got[key]), key


def _exported(model: nn.Module, folder: Path) -> Path:
    from lightning_hbm.surgery import run_surgery

    run_surgery(model, QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=PROBE, correction_rank=RANK, quantize_embeddings=True),
                [LoRA(r=2, target_modules=["mix"])])  # fmt: skip
    return LoRA.save_adapter(model, folder, with_correction=True)


def test_the_adapter_for_the_quantized_base_carries_an_untied_embeddings_correction(tmp_path: Path) -> None:
    """``save_adapter(with_correction=True)``: the embedding's factors as peft's embedding LoRA
    (``lora_embedding_A/B``); a plain peft reload onto the plain quantized base computes the run's outputs."""
    from peft import PeftModel

    model = TinyLM(tied=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        folder = _exported(model, tmp_path / "quantized")
    base = TinyLM(tied=False)
    QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=PROBE, quantize_embeddings=True).convert_module(base)
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert not torch.allclose(base.embed(ids), model.embed(ids))  # what the reload adds is the correction
    reloaded = PeftModel.from_pretrained(base, str(folder))
    model.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded.base_model.model.embed(ids), model.embed(ids))
        torch.testing.assert_close(reloaded(ids), model(ids))


def test_the_adapter_names_a_tied_embeddings_correction_as_left_out(tmp_path: Path) -> None:
    from safetensors.torch import load_file

    model = TinyLM()
    with pytest.warns(UserWarning, match=r"correction of the input embedding\(s\) embed is left out of the adapter: their head\(s\) head share"):
        folder = _exported(model, tmp_path / "quantized")
    assert not any(k.startswith("base_model.model.embed.") for k in load_file(folder / "adapter_model.safetensors"))


def test_an_int8_table_gets_none_and_is_named_with_its_bits() -> None:
    model = TinyLM()
    with pytest.warns(UserWarning, match=r"embed: an input embedding stored in [\d.]+ bits per value: corrected under 8 bits only"):
        _quantized(model, quantize_embeddings="int8")
    assert correction_of(model.embed) is None and correction_of(model.mix) is not None
