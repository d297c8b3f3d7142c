"""AttentionKernel: the chosen kernel really runs (ops recorded), HF models switch, clear errors."""

from __future__ import annotations

import logging
from typing import Any, Callable

import pytest
import torch
from conftest import StepOps

from lightning_hbm import ActivationCheckpointing, AttentionKernel, QuantizedPrecision

FLASH_CPU_OP = "aten::_scaled_dot_product_flash_attention_for_cpu"
MATH_OP = "aten::_scaled_dot_product_attention_math"


def _fit_recording_ops(trainer: Any, model: Any, datamodule: Any) -> set[str]:
    recorder = StepOps()
    trainer.callbacks.append(recorder)
    trainer.fit(model, datamodule=datamodule)
    return recorder.names


@pytest.mark.parametrize(("backend", "flash_runs"), [("math", False), ("flash", True)])
def test_chosen_kernel_runs_in_training_and_validation(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, backend: str, flash_runs: bool
) -> None:
    callback = AttentionKernel(backend)
    trainer = trainer_factory(max_steps=1, limit_val_batches=1, val_check_interval=1, callbacks=[callback])
    ops = _fit_recording_ops(trainer, gpt_factory(), datamodule_factory(seq_len=16, batch_size=2))
    assert callback.chosen == backend
    assert (FLASH_CPU_OP in ops) is flash_runs
    assert (MATH_OP in ops) is not flash_runs  # the math kernel ran instead
    # the global kernel flags are restored after each batch
    assert torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()


def test_recompute_under_checkpointing_uses_the_same_kernel(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    """Backward (where checkpointed blocks run their forward again) is inside the kernel's scope."""
    trainer = trainer_factory(max_steps=1, callbacks=[ActivationCheckpointing(), AttentionKernel("math")])
    ops = _fit_recording_ops(trainer, gpt_factory(), datamodule_factory(seq_len=16, batch_size=2))
    assert FLASH_CPU_OP not in ops


def test_new_trainer_on_an_already_changed_model_uses_its_own_kernel(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable
) -> None:
    model, datamodule = gpt_factory(), datamodule_factory(seq_len=16, batch_size=2)
    trainer_factory(max_steps=1, callbacks=[AttentionKernel("flash")]).fit(model, datamodule=datamodule)
    callback, recorder = AttentionKernel("math"), StepOps()
    trainer_factory(limit_val_batches=1, callbacks=[callback, recorder]).validate(model, datamodule=datamodule, verbose=False)
    assert callback.chosen == "math" and FLASH_CPU_OP not in recorder.names
    assert MATH_OP in recorder.names


def test_auto_picks_the_best_available_and_logs_it(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, caplog: pytest.LogCaptureFixture
) -> None:
    callback = AttentionKernel("auto")
    trainer = trainer_factory(max_steps=1, callbacks=[callback])
    with caplog.at_level(logging.INFO):
        trainer.fit(gpt_factory(), datamodule=datamodule_factory(seq_len=16, batch_size=2))
    assert callback.chosen == "flash"  # torch ships a flash kernel for CPU; efficient/cudnn are CUDA only
    assert "attention kernel 'flash' (auto) on cpu/torch.float32" in caplog.text


def test_hf_model_switches_to_sdpa(llama_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable) -> None:
    model = llama_factory()
    model.model.set_attn_implementation("eager")
    callback = AttentionKernel("math")
    trainer = trainer_factory(max_steps=1, plugins=[QuantizedPrecision("nf4", dtype="float32")], callbacks=[callback])
    ops = _fit_recording_ops(trainer, model, datamodule_factory(seq_len=16, batch_size=2))
    assert model.model.config._attn_implementation == "sdpa" and callback.hf_implementation == "sdpa"
    assert MATH_OP in ops and FLASH_CPU_OP not in ops

    model = llama_factory()
    model.model.set_attn_implementation("eager")
    callback = AttentionKernel("flash")  # no flash-attn on CPU: torch's own flash kernel through "sdpa"
    ops = _fit_recording_ops(trainer_factory(max_steps=1, callbacks=[callback]), model, datamodule_factory(seq_len=16, batch_size=2))
    assert model.model.config._attn_implementation == "sdpa" and FLASH_CPU_OP in ops


@pytest.mark.parametrize("backend", ["efficient", "cudnn"])
def test_unavailable_kernel_is_an_error_before_training(
    gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable, backend: str
) -> None:
    model = gpt_factory()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = trainer_factory(max_steps=1, callbacks=[AttentionKernel(backend)])  # type: ignore[arg-type]
    with pytest.raises(
        ValueError,
        match=rf"backend='{backend}'\): the '{backend}' attention kernel is not available on cpu with torch.float32 "
        r"\(torch: .*\)\. Available here: \['flash', 'math', 'blocked'\]; choose one of them or 'auto'",
    ):
        trainer.fit(model, datamodule=datamodule_factory(seq_len=16, batch_size=2))
    assert trainer.global_step == 0
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_unknown_backend_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"backend='xformers'\): choose one of \['auto', 'flash', 'efficient', 'cudnn', 'math', 'blocked'\]"):
        AttentionKernel("xformers")  # type: ignore[arg-type]


@pytest.mark.gpu
def test_flash_runs_on_cuda_with_bf16(gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable) -> None:
    callback = AttentionKernel("flash")
    trainer = trainer_factory(accelerator="cuda", precision="bf16-true", max_steps=2, callbacks=[callback])
    ops = _fit_recording_ops(trainer, gpt_factory(), datamodule_factory(seq_len=64, batch_size=2))
    assert callback.chosen == "flash"
    assert "aten::_scaled_dot_product_flash_attention" in ops


@pytest.mark.gpu
def test_flash_in_fp32_on_cuda_is_an_error(gpt_factory: Callable, datamodule_factory: Callable, trainer_factory: Callable) -> None:
    trainer = trainer_factory(accelerator="cuda", precision="32-true", max_steps=1, callbacks=[AttentionKernel("flash")])
    with pytest.raises(ValueError, match=r"not available on cuda with torch.float32.*precision='bf16-true'"):
        trainer.fit(gpt_factory(), datamodule=datamodule_factory(seq_len=16, batch_size=2))


def test_both_callbacks_parse_from_lightning_cli(tmp_path: Any, capsys: pytest.CaptureFixture) -> None:
    from lightning.pytorch.cli import LightningCLI

    from lightning_hbm.models import NanoGPT

    callbacks = (
        '[{"class_path": "lightning_hbm.ActivationCheckpointing", "init_args": {"policy": "selective", "every": 2, '
        '"blocks": ["Block"], "offload": true}}, {"class_path": "lightning_hbm.AttentionKernel", "init_args": {"backend": "math"}}]'
    )
    args = [f"--trainer.default_root_dir={tmp_path}", "--trainer.accelerator=cpu", f"--trainer.callbacks={callbacks}"]
    cli = LightningCLI(NanoGPT, args=args, run=False, save_config_callback=None)
    checkpointing, kernel = (c for c in cli.trainer.callbacks if isinstance(c, (ActivationCheckpointing, AttentionKernel)))
    assert (checkpointing.policy, checkpointing.every, checkpointing.blocks) == ("selective", 2, ["Block"])
    assert checkpointing.offload is not None and kernel.backend == "math"
    bad = [f"--trainer.callbacks={callbacks.replace('selective', 'sometimes')}"]
    with pytest.raises(SystemExit):  # jsonargparse rejects a value outside the Literal
        LightningCLI(NanoGPT, args=bad, run=False, save_config_callback=None)
    assert "sometimes" in capsys.readouterr().err
