"""``lightning_hbm.quiet``: the library noise it drops is dropped, and nothing else is."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from lightning_hbm.quiet import NOISE, quieted

NOISY = {
    "torchao": "Failed to load /venv/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load this library",
    "torchao.kernel.intmm": "Warning: Detected no triton, on systems without Triton certain kernels will not work",
    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.",
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community: %s.",
    "lightning.pytorch.utilities.rank_zero": "💡 Tip: For seamless cloud logging and experiment tracking, try installing [litlogger]",
}


def test_every_noisy_message_is_dropped_and_others_pass(caplog: pytest.LogCaptureFixture) -> None:
    assert set(NOISY) == set(NOISE)
    caplog.set_level(logging.INFO, logger="bitsandbytes")  # tests/conftest.py raises it to ERROR
    with caplog.at_level(logging.INFO), quieted():
        for name, message in NOISY.items():
            logging.getLogger(name).warning(message, "x") if "%s" in message else logging.getLogger(name).warning(message)
            logging.getLogger(name).warning("a message the user needs")
    assert [r.name for r in caplog.records] == list(NOISY)  # only the other message, once per logger
    assert all(r.getMessage() == "a message the user needs" for r in caplog.records)


def test_lightning_pytree_deprecation_is_dropped_and_other_warnings_pass() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        import lightning_hbm.quiet

        with lightning_hbm.quiet.quieted():  # adds the filter on top of simplefilter
            warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`", UserWarning, stacklevel=1)
            warnings.warn("Found 3 module(s) in eval mode", UserWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["Found 3 module(s) in eval mode"]


@pytest.mark.slow
def test_a_qlora_cli_run_prints_no_library_noise_and_honest_parameter_counts(tmp_path: Path) -> None:
    # a subprocess: torchao, peft and Lightning print at their import, which the test process did long ago
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "lightning_hbm.cli", "fit", "--model.init_args.hidden_size=64", "--model.init_args.intermediate_size=172",
           "--model.init_args.num_hidden_layers=2", "--data.init_args.seq_len=32", "--data.init_args.max_bytes=200000",
           "--trainer.precision=nf4-dq", "--trainer.callbacks+=LoRA", "--trainer.callbacks+=HBMProfiler", "--trainer.max_steps=2",
           "--trainer.limit_val_batches=0", f"--trainer.default_root_dir={tmp_path}"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=root, env=env)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    for noise in ("torchao", "Failed to load", "💡 Tip", "Enum subclass", "LeafSpec", "Detected no triton"):
        assert noise not in output, noise
    # the model summary counts 4-bit weights unpacked: its total is LoRA's count of all parameters
    total = int(re.search(r"LoRA: [\d,]+ trainable of ([\d,]+) parameters", output).group(1).replace(",", ""))
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

    assert f"frozen, {get_human_readable_count(total).strip()} total (4-bit weights counted unpacked)" in output


_STATE = """
import logging, sys, warnings
import lightning.pytorch as pl, peft, bitsandbytes, torchao  # their own filters, set at their import, in both runs
from lightning.pytorch.demos.boring_classes import BoringModel
names = {names!r}
def state():
    return [repr(f) for f in warnings.filters], {{n: list(map(repr, logging.getLogger(n).filters)) for n in names}}
before = state()
{body}
assert before == state(), (before, state())
print("--- fit ---", flush=True)
print("--- fit ---", file=sys.stderr, flush=True)
trainer = pl.Trainer(accelerator="cpu", max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(BoringModel())
print(state(), [type(c).__name__ for c in trainer.callbacks], flush=True)
"""


@pytest.mark.slow
def test_a_plain_trainer_keeps_its_warnings_logging_and_console() -> None:
    """Issue 55: ``import lightning_hbm`` installed global filters, so a plain run's own messages disappeared
    (Lightning's "💡 Tip" line). With and without importing lightning_hbm's public names first, a plain Trainer's fit
    prints the same lines and ends with the same callbacks, warnings filters and logging filters."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    runs = []
    for body in ("", "import lightning_hbm\nfrom lightning_hbm import LoRA, QuantizedPrecision"):
        # ``-I`` ignores PYTHONPATH: the checkout under test goes first on sys.path by hand (otherwise the
        # subprocess imports whatever lightning_hbm the environment has installed, another checkout's)
        code = f"import sys; sys.path.insert(0, {str(root)!r})\n" + _STATE.format(names=sorted(NOISE), body=body)
        proc = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=300, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append((proc.stdout.split("--- fit ---\n", 1)[1], proc.stderr.split("--- fit ---\n", 1)[1]))
    assert runs[0] == runs[1]
    stdout, stderr = runs[1]
    assert "💡 Tip" in stdout + stderr and "max_steps=2` reached" in stdout + stderr  # what a plain fit prints, kept
    assert "PluginAttach" not in stdout

