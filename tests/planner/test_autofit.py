"""AutoFit: chooses a configuration whose measured peak is under the budget, or fails before training."""

from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

from lightning_hbm import AutoFit
from lightning_hbm.precision import QuantizedPrecision
from lightning_hbm.profiling.profiler import HBMProfiler
from lightning_hbm.surgery import applied_transforms


@pytest.mark.slow
def test_tight_budget_measured_peak_under_budget(
    gpt_factory: Callable[..., Any],
    datamodule_factory: Callable[..., Any],
    trainer_factory: Callable[..., Any],
    loss_recorder: Callable[[], Any],
    tmp_path: Any,
    capsys: pytest.CaptureFixture,
) -> None:
    # tiny GPT, batch 4 x 64: full fine-tuning in fp32 peaks at ~4.8 MiB; 2 MiB forces a smaller configuration
    model = gpt_factory()
    # accurate_bytes_per_weight: the rank-16 correction on this width-64 GPT is 1.296 bytes per weight (session 41)
    autofit = AutoFit(budget="2MiB", lora_ranks=[0, 8], checkpointing=["full"], optimizers=["user"], accurate_bytes_per_weight=1.3)
    profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    recorder = loss_recorder()
    trainer = trainer_factory(max_steps=2, callbacks=[autofit, profiler, recorder])
    trainer.fit(model, datamodule_factory(seq_len=64, batch_size=4))

    chosen = autofit.chosen
    assert chosen is not None and chosen.total <= 2 * 2**20
    assert not autofit.plan.predictions[0].fits  # the fastest candidate did not fit
    measured = profiler.rows[-1]["tracked_peak"]
    assert measured <= 2 * 2**20
    assert measured == pytest.approx(chosen.peak, rel=0.10)
    # applied through the same plugin and callbacks a user would configure; the accurate 4-bit base fits (issue 52:
    # its correction's bytes are in the predicted and the measured peak, tests/planner/test_autofit_correction.py)
    assert chosen.candidate.name == "nf4-dq-b32+gptq+corr16+lora8+ac-full"
    assert isinstance(trainer.strategy.precision_plugin, QuantizedPrecision)
    assert applied_transforms(model) == ["QuantizedPrecision(nf4-dq-b32)", "LoRA", "ActivationCheckpointing"]
    assert len(recorder.losses) == 2
    # at the end: one table, predicted and measured step peak side by side, per category
    out = capsys.readouterr().out
    table = out[out.index(f"AutoFit: {chosen.candidate.name}, predicted vs measured step peak (MiB)"):].splitlines()
    assert table[1].split() == ["category", "predicted", "measured,", "step", "1", "measured/predicted"]
    total = table[7].split()
    assert total[0] == "total"
    assert float(total[1]) == pytest.approx(chosen.peak / 2**20, abs=0.006)
    assert float(total[2]) == pytest.approx(measured / 2**20, abs=0.006)


@pytest.mark.slow
def test_roomy_budget_keeps_the_users_configuration(
    lazy_gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    # a model built in configure_model, and a plain DataLoader passed to fit (no datamodule)
    model = lazy_gpt_factory()
    autofit = AutoFit(budget="1GiB", lora_ranks=[0], checkpointing=["none", "full"], optimizers=["user"])
    trainer = trainer_factory(max_steps=1, callbacks=[autofit])
    trainer.fit(model, datamodule_factory(seq_len=32, batch_size=2).train_dataloader())
    assert autofit.chosen.candidate.name == "32-true"
    assert [p.candidate.name for p in autofit.plan.predictions] == ["32-true", "32-true+ac-full"]
    assert applied_transforms(model) == []
    assert model.model is not None and all(p.requires_grad for p in model.parameters())


@pytest.mark.slow
def test_impossible_budget_raises_before_training(
    gpt_factory: Callable[..., Any],
    datamodule_factory: Callable[..., Any],
    trainer_factory: Callable[..., Any],
    loss_recorder: Callable[[], Any],
) -> None:
    model = gpt_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    recorder = loss_recorder()
    autofit = AutoFit(budget="100KiB", lora_ranks=[0, 8], checkpointing=["full"], optimizers=["user"])
    trainer = trainer_factory(max_steps=2, callbacks=[autofit, recorder])
    with pytest.raises(ValueError, match=r"no candidate fits the budget of 100.00 KiB(.|\n)*Closest:(.|\n)*needs"):
        trainer.fit(model, datamodule_factory(seq_len=32, batch_size=2))
    assert recorder.losses == []
    assert applied_transforms(model) == []
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, before[key], rtol=0, atol=0)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="Cannot read the memory size 'lots'"):
        AutoFit(budget="lots")
    with pytest.raises(TypeError, match=r"AutoFit\(lora_ranks='8'\): wrong type str; pass a list of ints or None"):
        AutoFit(lora_ranks="8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoFit\(optimizers=\[\]\): pass at least one value"):
        AutoFit(optimizers=[])
    with pytest.raises(ValueError, match="checkpointing must be one of .*got 'sometimes'"):
        AutoFit(checkpointing=["sometimes"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="Candidate precision 'nf3' is unknown"):
        AutoFit(precisions=["nf3"])


def test_budget_units_gb_is_decimal_gib_binary_bare_g_refused() -> None:
    # GB and GiB are both read, each as its standard says; the plan line shows a decimal budget in both units
    assert AutoFit(budget="1 GB").budget == 10**9 and AutoFit(budget="1 GiB").budget == 2**30
    assert AutoFit(budget="80GB").budget == 80 * 10**9 and AutoFit(budget="512 MiB").budget == 512 * 2**20
    assert AutoFit(budget="1 GB")._budget_text == "953.67 MiB (1 GB = 1,000,000,000 bytes, decimal)"
    assert AutoFit(budget="1 GiB")._budget_text == "1.00 GiB"
    with pytest.raises(
        ValueError,
        match=r"The memory size '24G' is ambiguous: a bare 'G' means GiB to some tools and GB to others\. Write '24GiB' "
        r"\(powers of 1024, as torch.cuda and nvidia-smi count\) or '24GB' \(powers of 1000\)\.",
    ):
        AutoFit(budget="24G")
    with pytest.raises(ValueError, match=r"The memory size '512 m' is ambiguous: a bare 'M' .* Write '512MiB' .* or '512MB'"):
        AutoFit(budget="512 m")
    with pytest.raises(
        ValueError,
        match=r"Cannot read the memory size '1 GiGa'\. Write a number and a unit, e\.g\. '24GiB', '80GB'; units: B, "
        r"KiB/MiB/GiB/TiB \(powers of 1024\), KB/MB/GB/TB \(powers of 1000: 1 GB = 10\*\*9 bytes = 0\.93 GiB\)\.",
    ):
        AutoFit(budget="1 GiGa")


def test_lightning_cli_reads_the_init_args() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(AutoFit, "autofit")
    config = parser.parse_args(["--autofit.budget=8GiB", "--autofit.checkpointing=[full]", "--autofit.lora_ranks=[0, 8]"])
    autofit = parser.instantiate_classes(config).autofit
    assert (autofit.budget, autofit.checkpointing, autofit.lora_ranks) == (8 * 2**30, ["full"], [0, 8])
    with pytest.raises(Exception, match="sometimes"):
        parser.parse_args(["--autofit.checkpointing=[sometimes]"])


def test_resume_with_another_choice_is_an_error() -> None:
    from lightning_hbm.planner import Candidate, Prediction

    autofit = AutoFit(budget="1GiB")
    autofit.chosen = Prediction(Candidate("nf4-dq", lora_r=16), categories={})
    autofit.load_state_dict({"choice": "nf4-dq+lora16"})  # same choice: fine
    with pytest.raises(ValueError, match=r"AutoFit chose nf4-dq\+lora16 but the checkpoint was trained with bf16-true"):
        autofit.load_state_dict({"choice": "bf16-true"})


def test_conflicting_callbacks_are_an_error(
    gpt_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any]
) -> None:
    from lightning_hbm import LoRA

    trainer = trainer_factory(max_steps=1, callbacks=[LoRA(r=4), AutoFit(budget="1GiB")])
    with pytest.raises(ValueError, match=r"the Trainer already has \['LoRA'\]. Remove them"):
        trainer.fit(gpt_factory(), datamodule_factory(seq_len=16, batch_size=2))


def test_comparison_without_a_profiler_says_how_to_measure() -> None:
    from lightning_hbm.planner import Candidate, Prediction
    from lightning_hbm.planner.autofit import compare_with_measured

    prediction = Prediction(Candidate("nf4-dq", lora_r=16), categories={"parameters": 2**20, "activations": 3 * 2**20})
    text = compare_with_measured(prediction, None)
    assert text.splitlines()[0] == "AutoFit: nf4-dq+lora16, predicted vs measured step peak (MiB)"
    assert "total" in text and "4.00" in text and "Add the HBMProfiler callback" in text


@pytest.mark.slow
def test_token_chunks_chosen_when_only_they_fit(
    llama_factory: Callable[..., Any], datamodule_factory: Callable[..., Any], trainer_factory: Callable[..., Any],
    tmp_path: Any,
) -> None:
    # AutoFit(mlp_chunks=[1, 4]): the chunks are planned as they run (layers chosen on fake tensors by their ops), so
    # a budget between the whole recompute's peak and the chunked one's picks the chunks, and the run stays under it
    axes = dict(precisions=["nf4-dq"], lora_ranks=[8], checkpointing=["full"], optimizers=["user"], fused_loss=[False],
                mlp_chunks=[1, 4])
    roomy = AutoFit(budget="1GiB", **axes)
    trainer_factory(max_steps=1, callbacks=[roomy]).fit(llama_factory(), datamodule_factory(seq_len=64, batch_size=4))
    totals = {p.candidate.name: p.total for p in roomy.plan.predictions}
    whole, chunked = totals["nf4-dq+lora8+ac-full"], totals["nf4-dq+lora8+ac-full-mlp4"]
    assert chunked < whole
    budget = (whole + chunked) // 2
    autofit = AutoFit(budget=budget, **axes)
    profiler = HBMProfiler(detailed_steps=[1], summary=False, dirpath=str(tmp_path))
    trainer_factory(max_steps=2, callbacks=[autofit, profiler]).fit(llama_factory(), datamodule_factory(seq_len=64, batch_size=4))
    assert autofit.chosen is not None and autofit.chosen.candidate.name == "nf4-dq+lora8+ac-full-mlp4"
    assert profiler.rows[-1]["tracked_peak"] <= budget
    assert abs(profiler.rows[-1]["tracked_peak"] - autofit.chosen.peak) <= 8


def test_mlp_chunks_axis_is_checked() -> None:
    with pytest.raises(TypeError, match=r"AutoFit\(mlp_chunks=4\): wrong type int; pass a list of ints or None"):
        AutoFit(mlp_chunks=4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"AutoFit\(mlp_chunks=\[\]\): pass at least one value, e.g. \[1, 4\]"):
        AutoFit(mlp_chunks=[])
    with pytest.raises(ValueError, match=r"Candidate mlp_chunks must be an int >= 1"):
        AutoFit(mlp_chunks=[0])


def _onto_4bit_grid(model: torch.nn.Module) -> int:
    """Every Linear weight (widths in multiples of 32) replaced by its int4-g32 reading: a dequantized Q4_1 model."""
    from lightning_hbm.precision.int4_asym import dequantize_groups, quantize_groups

    moved = 0
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, torch.nn.Linear) and layer.in_features % 32 == 0:
                layer.weight.copy_(dequantize_groups(*quantize_groups(layer.weight), dtype=layer.weight.dtype))
                moved += 1
    return moved


@pytest.mark.slow
def test_weights_on_a_4bit_grid_make_the_default_base_int4_g32(
    gpt_factory: Callable[..., Any],
    datamodule_factory: Callable[..., Any],
    trainer_factory: Callable[..., Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # the tight budget of test_tight_budget_measured_peak_under_budget (it chose an NF4 base), on a model that was 4-bit once
    model = gpt_factory()
    assert _onto_4bit_grid(model) > 0
    autofit = AutoFit(budget="2MiB", lora_ranks=[0, 8], checkpointing=["full"], optimizers=["user"])
    trainer = trainer_factory(max_steps=1, callbacks=[autofit])
    with caplog.at_level("INFO"):
        trainer.fit(model, datamodule_factory(seq_len=64, batch_size=4))
    assert autofit.chosen is not None and autofit.chosen.candidate.name == "int4-g32+lora8+ac-full"
    assert applied_transforms(model) == ["QuantizedPrecision(int4-g32)", "LoRA", "ActivationCheckpointing"]
    assert "already hold 4-bit values" in caplog.text and "AutoFit(precisions=['nf4-dq'])" in caplog.text


def test_grid_choice_only_for_the_default_and_only_on_grid_weights(gpt_factory: Callable[..., Any]) -> None:
    from lightning_hbm.planner.autofit import _on_grid_mode

    model = gpt_factory()
    assert _on_grid_mode(model) is None  # trained-like (random) weights: ~32 distinct values per group
    _onto_4bit_grid(model)
    assert _on_grid_mode(model) == "int4-g32"
    assert AutoFit()._default_precisions and not AutoFit(precisions=["nf4-dq"])._default_precisions


def test_the_trainers_calibrated_correction_is_in_the_baseline_candidate() -> None:
    """AutoFit plans the Trainer's QuantizedPrecision(correction_rank=...) with the correction's bytes."""
    import lightning.pytorch as pl

    from lightning_hbm.planner.autofit import _baseline_precision

    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         plugins=[QuantizedPrecision("nf4-dq", correction_rank=16)])
    assert _baseline_precision(trainer) == ("nf4-dq", "bfloat16", None, 16, "nearest")
    plain = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False)
    assert _baseline_precision(plain)[3] == 0
