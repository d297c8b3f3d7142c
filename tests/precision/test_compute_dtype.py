"""``QuantizedPrecision(dtype="auto")``: the compute dtype chosen by timing both on this machine."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from lightning_hbm import LoRA, QuantizedPrecision
from lightning_hbm.precision.compute_dtype import BF16_MARGIN, DtypeChoice, auto_dtype, block_seconds, choose


@pytest.mark.parametrize(("bf16", "expected"), [(0.5, torch.bfloat16), (BF16_MARGIN, torch.bfloat16), (0.95, torch.float32), (3.0, torch.float32)])
def test_bf16_only_when_clearly_faster(bf16: float, expected: torch.dtype) -> None:
    assert choose({"float32": 1.0, "bfloat16": bf16}) == expected


@pytest.mark.parametrize("seconds", [{"float32": 1.0}, {"float32": 1.0, "bfloat16": 0.0}, {"float16": 1.0, "bfloat16": 1.0}])
def test_choose_refuses_incomplete_figures(seconds: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="needs a positive time for float32 and for bfloat16"):
        choose(seconds)


def test_the_timed_block_trains_in_both_dtypes() -> None:
    # each time is a real forward + backward (attention, gated MLP), well above the clock's resolution
    assert block_seconds(torch.float32, repeats=1) > 1e-4 and block_seconds(torch.bfloat16, repeats=1) > 1e-4


def test_auto_on_cpu_is_decided_by_its_own_figures() -> None:
    choice = auto_dtype("cpu")
    assert set(choice.seconds) == {"float32", "bfloat16"} and choice.dtype == choose(choice.seconds)
    ratio = f"({choice.seconds['bfloat16'] / choice.seconds['float32']:.2f}x)"
    assert ratio in choice.describe() and "ms in bf16" in choice.reason and choice.device == "cpu"


def test_auto_refuses_another_device() -> None:
    with pytest.raises(ValueError, match="chooses for 'cpu' or 'cuda', not 'mps'"):
        auto_dtype("mps")


def test_auto_fit_computes_in_the_chosen_dtype_and_says_why(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="AUTO")
    assert plugin.dtype_choice is not None and plugin.dtype == plugin.dtype_choice.dtype
    model = gpt_factory()
    trainer = trainer_factory(max_steps=2, plugins=[plugin], callbacks=[LoRA(r=4)])
    with caplog.at_level(logging.INFO):
        trainer.fit(model, datamodule=datamodule_factory())
    assert trainer.global_step == 2 and trainer.precision == {torch.bfloat16: "bf16-true", torch.float32: "32-true"}[plugin.dtype]
    assert model.model.wte.weight.dtype == plugin.dtype  # the parameters kept unquantized are stored in it
    assert plugin.dtype_choice.describe() in caplog.text


def test_auto_chosen_for_another_device_is_refused_before_any_change(
    gpt_factory: Any, trainer_factory: Any, datamodule_factory: Any, snapshot: Any
) -> None:
    plugin = QuantizedPrecision("nf4-dq", dtype="bfloat16")
    plugin.dtype_choice = DtypeChoice(torch.bfloat16, "cuda", reason="the GPU supports bf16")  # as built on a GPU machine
    model = gpt_factory()
    before = snapshot(model)
    trainer = trainer_factory(max_steps=1, plugins=[plugin], callbacks=[LoRA(r=4)])
    with pytest.raises(ValueError, match=r"chose torch.bfloat16 for cuda when it was built, but this Trainer computes on cpu: pass the dtype by name"):
        trainer.fit(model, datamodule=datamodule_factory())
    assert snapshot(model) == before
