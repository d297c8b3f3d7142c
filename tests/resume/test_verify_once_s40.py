"""One resume verifies its checkpoint once, whatever reads it (issue 54, "What must show"): the quantized base alone,
LoRA alone, QLoRA, QLoRA with host offload, and QLoRA under ``QuantizedFSDPStrategy`` (one rank, in this process:
the strategy reads the file itself, through ``resume.read_file``). ``tests/resume/test_resume_owner.py`` counts the
GPTQ + smoothing plugin with LoRA; each arm here reaches ``resume.sealing.verify`` by another road (the checked IO,
the load hook, the surgery's check, the plugin's saved parts, the strategy's own read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest

from lightning_hbm import CPUOffloadStrategy, LoRA, QuantizedFSDPStrategy, QuantizedPrecision
from tests.resume.test_resume_owner import _count_verifications


def _nf4() -> QuantizedPrecision:
    return QuantizedPrecision("nf4", dtype="float32")


ARMS: dict[str, Callable[[], dict[str, Any]]] = {
    "quantized base": lambda: dict(plugins=[_nf4()]),
    "LoRA": lambda: dict(callbacks=[LoRA(r=2)]),
    "QLoRA": lambda: dict(plugins=[_nf4()], callbacks=[LoRA(r=2)]),
    "QLoRA, host offload": lambda: dict(plugins=[_nf4()], callbacks=[LoRA(r=2)], strategy=CPUOffloadStrategy()),
    "QLoRA, FSDP": lambda: dict(plugins=[_nf4()], callbacks=[LoRA(r=2)], strategy=QuantizedFSDPStrategy()),
}


@pytest.mark.parametrize("arm", list(ARMS))
def test_each_kind_of_resume_verifies_once(
    arm: str, tmp_path: Path, trainer_factory: Callable, gpt_factory: Callable, datamodule_factory: Callable,
    monkeypatch: pytest.MonkeyPatch, no_process_group: Any,
) -> None:
    first = trainer_factory(max_steps=1, **ARMS[arm]())
    first.fit(gpt_factory(), datamodule_factory(train_samples=16))
    path = tmp_path / "run.ckpt"
    first.save_checkpoint(path)
    calls = _count_verifications(monkeypatch)
    trainer = trainer_factory(max_steps=2, **ARMS[arm]())
    trainer.fit(gpt_factory(), datamodule_factory(train_samples=16), ckpt_path=path)
    assert trainer.global_step == 2
    assert calls == [path], f"{arm}: resume.sealing.verify ran {len(calls)} times"
