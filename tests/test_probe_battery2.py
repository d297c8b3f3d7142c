"""Which output tensor the probe forwards measure (``probe.probe_output``), attacked from outside (session 26).

Was: an output whose first tensor is an integer one (a prediction's ``argmax`` beside the logits) was measured, and
the 4-bit conv plan widened every convolution to int8 to keep class indices equal (planned 0.9547 -> 0.9985 on the
indices; the features measure 0.9904 uniform); a forward returning ``(x, features)`` was measured on its own input
(cosine 1.0 whatever the quantization: no convolution could be widened); a forward returning only an integer tensor
was planned on it; ``(loss, features)`` was measured on the loss (one value: cosine 1.0); an output holding -inf where the model as built masks (a head masking classes) measured NaN: the
conv plan was chosen on NaN ("planned to a probe output cosine of nan") and the accuracy check went unmeasured, silently.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch import nn

from lightning_hbm import QuantizedPrecision
from lightning_hbm.precision.accuracy import centred_cosine
from lightning_hbm.probe import compare_outputs, probe_output

X = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(1))


class ConvNet(nn.Module):
    """Two convolutions around a BatchNorm with a trained network's statistics; ``kind`` picks what forward returns."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kind = kind
        self.c1, self.bn, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.Conv2d(16, 16, 3, padding=1)
        with torch.no_grad():
            self.bn.running_mean.normal_(0, 0.5)
            self.bn.running_var.uniform_(0.05, 0.2)

    def forward(self, x: torch.Tensor) -> Any:
        features = self.c2(torch.relu(self.bn(self.c1(x))))
        return {
            "features": features,
            "argmax-first": (features.argmax(1), features),
            "input-first": (x, features),
            "dict": {"index": features.argmax(1), "out": {"features": features}},
            "argmax-only": features.argmax(1),
            "loss-first": (features.square().mean(), features),
            "masked": torch.cat([features.flatten(1), torch.full((x.shape[0], 4), float("-inf"))], 1),
        }[self.kind]


def _plan(kind: str) -> tuple[Any, list[str]]:
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(ConvNet(kind))
    return plugin.quantization.conv_report, [str(w.message) for w in seen]


@pytest.mark.parametrize("kind", ["argmax-first", "input-first", "dict", "loss-first"])
def test_the_plan_measures_the_floating_output_not_indices_or_the_input(kind: str) -> None:
    want, _ = _plan("features")
    got, _ = _plan(kind)
    assert want is not None and got is not None
    assert (got.uniform_cosine, got.cosine, got.modes) == (want.uniform_cosine, want.cosine, want.modes)
    assert want.uniform_cosine < 0.999  # the features do move under nf4: measuring the input read 1.0


def test_an_integer_output_is_not_measured_and_the_plan_says_so() -> None:
    report, said = _plan("argmax-only")
    assert report is None
    assert any("without a measured plan" in s and "a torch.int64 tensor" in s for s in said), said
    with pytest.raises(TypeError, match="return a floating tensor .* got a torch.int64 tensor"):
        probe_output(ConvNet("argmax-only"), X)


def test_an_inf_both_outputs_give_is_left_out_of_the_figures() -> None:
    want, _ = _plan("features")
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", probe_batch=X)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        plugin.convert_module(ConvNet("masked"))
    got, measured = plugin.quantization.conv_report, plugin.quantization.conv_accuracy
    assert got is not None and measured is not None
    assert 0.9 < got.uniform_cosine <= got.cosine and got.modes == want.modes  # rows of other widths: another figure
    assert measured.cosine == measured.cosine and measured.cosine > 0.9  # a figure, not NaN
    assert not any("nan" in str(w.message) for w in seen)
    reference = torch.tensor([[1.0, 2.0, float("-inf")], [3.0, -1.0, float("-inf")]])
    assert compare_outputs(reference.clone(), reference, lm=False)["quant/cosine_similarity"] == pytest.approx(1.0)
    assert centred_cosine(reference.flatten(), reference.flatten()) == pytest.approx(1.0)
    worse = reference.clone()
    worse[0, 2] = 0.0  # finite where the reference is -inf: not agreeing, no figure (NaN), as before
    assert centred_cosine(worse.flatten(), reference.flatten()) != centred_cosine(worse.flatten(), reference.flatten())


class _InPlace(nn.Module):
    def forward(self, pixel_values: Any) -> torch.Tensor:
        if not isinstance(pixel_values, torch.Tensor):  # forward(inputs) of an (inputs, targets) pair
            pixel_values = pixel_values["pixel_values"]
        pixel_values.mul_(2)  # x /= 255 in the user's forward
        return pixel_values.sum()


def test_a_transformers_batch_encoding_is_copied_counted_and_joined() -> None:
    """A tokenizer's / ``DataCollatorWithPadding``'s ``BatchEncoding`` (an image processor's ``BatchFeature``) is one
    leaf to torch's pytree: the probe forward edited the user's batch in place, it counted 0 tokens, and joining two
    raised "Boolean value of Tensor with more than one value is ambiguous" (``!=`` on the mappings)."""
    from transformers import BatchEncoding, BatchFeature

    from lightning_hbm.probe import forward_on
    from lightning_hbm.probe_batch import _join, _tokens

    for kind in (BatchEncoding, BatchFeature):
        pixels = torch.ones(2, 3)
        forward_on(_InPlace(), kind({"pixel_values": pixels}))
        forward_on(_InPlace(), (kind({"pixel_values": pixels}), torch.zeros(2)))
        assert bool((pixels == 1).all()), kind.__name__
    first = BatchEncoding({"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8, dtype=torch.long)})
    second = BatchEncoding({"input_ids": torch.zeros(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8, dtype=torch.long)})
    assert _tokens(first) == 16
    joined = _join([first, second])
    assert isinstance(joined, BatchEncoding) and torch.equal(joined["input_ids"], torch.cat([first["input_ids"], second["input_ids"]]))
    assert _join([(first, torch.ones(2)), (second, torch.ones(2))])[0]["attention_mask"].shape == (4, 8)
    assert _join([first, BatchEncoding({"input_ids": torch.zeros(2, 9, dtype=torch.long), "attention_mask": torch.ones(2, 9)})]) is None


def test_a_correction_probe_joins_batch_encodings_at_fit_start(tmp_path: Any) -> None:
    """QuantizedPrecision(correction_rank=r) joins the first batches up to 2048 tokens: with a HF collator's batches
    the fit stopped at its start with the ambiguous-boolean RuntimeError."""
    import lightning.pytorch as pl
    from transformers import BatchEncoding, LlamaConfig, LlamaForCausalLM

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                      num_attention_heads=2, num_key_value_heads=2))

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
            return self.model(input_ids=input_ids, attention_mask=attention_mask).logits

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.model(**batch, labels=batch["input_ids"]).loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.0)

    rows = [torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i)) for i in range(8)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=lambda items: BatchEncoding(
        {"input_ids": torch.stack(items), "attention_mask": torch.ones(len(items), 16, dtype=torch.long)}))
    plugin = QuantizedPrecision("nf4-dq", dtype="float32", correction_rank=2)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path, plugins=[plugin])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Tiny(), loader)
    assert trainer.global_step == 1 and plugin.quantization.correction_report is not None


def test_kl_leaves_out_tokens_both_models_mask_and_is_inf_where_only_the_quantized_one_does() -> None:
    # A vocabulary masked with -inf in both models made KL NaN (torchmetrics: 0 * (-inf + inf)); a token only the
    # quantized model rules out must read as what it is: inf, with a warning, not NaN.
    from torchmetrics import KLDivergence

    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 3, 8, generator=generator)
    output = reference + 0.1 * torch.randn(2, 3, 8, generator=generator)
    want = float(KLDivergence(log_prob=True)(reference.reshape(-1, 8).log_softmax(-1), output.reshape(-1, 8).log_softmax(-1)))
    assert compare_outputs(output, reference, lm=True)["quant/kl_divergence"] == pytest.approx(want, rel=1e-6)
    masked_ref, masked_out = torch.cat([reference, torch.full((2, 3, 2), float("-inf"))], -1), torch.cat([output, torch.full((2, 3, 2), float("-inf"))], -1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both mask the same entries: no warning, the unmasked figure
        assert compare_outputs(masked_out, masked_ref, lm=True)["quant/kl_divergence"] == pytest.approx(want, rel=1e-6)
    masked_out[0, 0, -1] = 5.0  # mass where the reference has none: no term (p = 0), a finite figure
    assert 0 < compare_outputs(masked_out, masked_ref, lm=True)["quant/kl_divergence"] < float("inf")
    ruled_out = masked_out.clone()
    ruled_out[1, 2, 0] = float("-inf")  # the quantized model rules out a token the reference gives mass to
    with pytest.warns(UserWarning, match=r"KL divergence is inf.*1 token\(s\).*in 1 of 6 rows"):
        assert compare_outputs(ruled_out, masked_ref, lm=True)["quant/kl_divergence"] == float("inf")


def test_kl_leaves_out_rows_the_reference_masks_whole_and_says_how_many() -> None:
    # (session 28) a row the full-precision model masks whole (every entry -inf: a padded position) has a NaN softmax:
    # the whole KL figure read NaN, and the cosine too when both models masked it; a row only the quantized model
    # masks whole read NaN instead of inf
    from torchmetrics import KLDivergence

    generator = torch.Generator().manual_seed(0)
    reference = torch.randn(2, 3, 8, generator=generator)
    output = reference + 0.1 * torch.randn(2, 3, 8, generator=generator)
    keep = torch.ones(6, dtype=torch.bool)
    keep[1] = False  # row (0, 1)
    want = float(KLDivergence(log_prob=True)(reference.reshape(-1, 8)[keep].log_softmax(-1), output.reshape(-1, 8)[keep].log_softmax(-1)))
    cosine = compare_outputs(output.reshape(-1, 8)[keep], reference.reshape(-1, 8)[keep], lm=True)["quant/cosine_similarity"]
    masked_ref, masked_out = reference.clone(), output.clone()
    masked_ref[0, 1], masked_out[0, 1] = float("-inf"), float("-inf")
    with pytest.warns(UserWarning, match=r"leaves out 1 of 6 rows the full-precision model masks whole .*1 of them the "
                      r"quantized model masks whole too\): the figure is the mean over the other 5 rows\."):
        both = compare_outputs(masked_out, masked_ref, lm=True)
    assert both["quant/kl_divergence"] == pytest.approx(want, rel=1e-6)
    assert both["quant/cosine_similarity"] == pytest.approx(cosine, rel=1e-6)  # the row both mask: left out too
    masked_out[0, 1] = 1.0  # only the reference masks it: still no distribution to compare with, left out
    with pytest.warns(UserWarning, match=r"leaves out 1 of 6 rows .*0 of them the quantized model masks whole too"):
        assert compare_outputs(masked_out, masked_ref, lm=True)["quant/kl_divergence"] == pytest.approx(want, rel=1e-6)
    ruled_out = output.clone()
    ruled_out[1, 2] = float("-inf")  # the quantized model masks a row the reference predicts: every token ruled out
    with pytest.warns(UserWarning, match=r"KL divergence is inf.*8 token\(s\).*in 1 of 6 rows"):
        assert compare_outputs(ruled_out, reference, lm=True)["quant/kl_divergence"] == float("inf")
    with pytest.warns(UserWarning, match=r"leaves out 6 of 6 rows .*over the other 0 rows \(none: NaN\)"):
        nothing = compare_outputs(output, torch.full_like(reference, float("-inf")), lm=True)["quant/kl_divergence"]
    assert nothing != nothing
