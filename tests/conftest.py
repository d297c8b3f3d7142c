"""Shared fixtures: factories for tiny models, data and trainers (torchtune style)."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Any, Callable, Iterator

import lightning.pytorch as pl
import pytest
import torch

from lightning_hbm.data import ByteTextDataModule
from lightning_hbm.models import LazyNanoGPT, LlamaLM, NanoGPT
from lightning_hbm.pretrained import INSTALL

# pytest-xdist (pyproject addopts `-n 2`): each worker gets its share of the cores, so two workers do not run four
# torch threads on two cores.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# bitsandbytes logs a harmless line about an optional kernel hub at import; Lightning tips are noise.
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*LeafSpec.*")

TINY_GPT = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=172, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: set by .ci/run: a test skipped because the pretrained weights are missing fails instead (README, Testing)
REQUIRE_WEIGHTS = "LIGHTNING_HBM_REQUIRE_WEIGHTS"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Under ``LIGHTNING_HBM_REQUIRE_WEIGHTS=1``, a skip whose reason is ``lightning_hbm.pretrained.missing``'s
    (it ends with the install line, :data:`lightning_hbm.pretrained.INSTALL`) is reported as a failure.

    Every real-weights test skips through ``missing()`` (``pytest.skip`` or ``skipif``); in CI a skip there would
    let the suite pass without running them. Other skips (GPU, optional libraries) are left as they are.
    """
    report = yield
    if report.skipped and os.environ.get(REQUIRE_WEIGHTS, "0") not in ("", "0") and call.excinfo is not None:
        reason = str(call.excinfo.value)
        if INSTALL in reason:
            report.outcome = "failed"
            report.longrepr = (f"{REQUIRE_WEIGHTS}={os.environ[REQUIRE_WEIGHTS]} (set by .ci/run): this real-weights "
                               f"test would have skipped: {reason}. Install the weights with `bash scripts/install.sh`.")
    return report


@pytest.fixture(autouse=True)
def _no_leaked_global_seed() -> Iterator[None]:
    """LightningCLI's seed_everything sets PL_GLOBAL_SEED in os.environ; DDP ranks re-seed from it.

    Without this, a CLI test changes the RNG stream of every later multi-process test (LoRA's
    random init then differs between a 2-rank run and its single-process reference).
    """
    yield
    for name in ("PL_GLOBAL_SEED", "PL_SEED_WORKERS"):
        os.environ.pop(name, None)


@pytest.fixture
def gpt_factory() -> Callable[..., NanoGPT]:
    """``gpt_factory(**overrides)``: a ~100k-parameter NanoGPT, seeded."""

    def make(seed: int = 0, **overrides: Any) -> NanoGPT:
        torch.manual_seed(seed)
        return NanoGPT(**{**TINY_GPT, **overrides})

    return make


@pytest.fixture
def lazy_gpt_factory() -> Callable[..., LazyNanoGPT]:
    """``lazy_gpt_factory(**overrides)``: a NanoGPT that builds its layers in ``configure_model``."""

    def make(seed: int = 0, **overrides: Any) -> LazyNanoGPT:
        torch.manual_seed(seed)
        return LazyNanoGPT(**{**TINY_GPT, **overrides})

    return make


@pytest.fixture
def llama_factory() -> Callable[..., LlamaLM]:
    """``llama_factory(**overrides)``: a tiny transformers Llama inside a LightningModule, seeded."""

    def make(seed: int = 0, **overrides: Any) -> LlamaLM:
        torch.manual_seed(seed)
        return LlamaLM(**{**TINY_LLAMA, **overrides})

    return make


@pytest.fixture
def datamodule_factory() -> Callable[..., ByteTextDataModule]:
    """``datamodule_factory(seq_len=32, batch_size=4, ...)``: byte-level stdlib text."""

    def make(**kwargs: Any) -> ByteTextDataModule:
        kwargs = {"seq_len": 32, "batch_size": 4, "train_samples": 256, "val_samples": 8, "max_bytes": 300_000, **kwargs}
        return ByteTextDataModule(**kwargs)

    return make


@pytest.fixture
def no_process_group() -> Iterator[None]:
    """For a test that runs a 1-rank ``QuantizedFSDPStrategy`` in this process: that starts a gloo group here and
    Lightning exports MASTER_PORT, WORLD_SIZE, ... to ``os.environ``. Destroy the group and restore the environment
    after, or later multi-process tests (which inherit the environment) join the wrong group."""
    import torch.distributed as dist

    environ = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ.clear()
    os.environ.update(environ)


@pytest.fixture
def trainer_factory(tmp_path: Any) -> Callable[..., pl.Trainer]:
    """``trainer_factory(max_steps=5, **trainer_kwargs)``: a quiet CPU Trainer writing under tmp_path."""

    def make(**kwargs: Any) -> pl.Trainer:
        defaults: dict[str, Any] = dict(
            accelerator="cpu",
            devices=1,
            max_steps=5,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            default_root_dir=tmp_path,
        )
        defaults.update(kwargs)
        return pl.Trainer(**defaults)

    return make


class LossRecorder(pl.Callback):
    """Records the training loss of every step."""

    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.fixture
def loss_recorder() -> Callable[[], LossRecorder]:
    return LossRecorder


class StepOps(pl.Callback):
    """How often each op ran in each training and validation step (``steps``), by torch's profiler.

    The profiler, not a TorchDispatchMode: under ``inference_mode`` (validation) a dispatch mode sees only
    ``aten.scaled_dot_product_attention``, never the kernel it dispatched to.
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, int]] = []
        self._profile: Any = None

    @property
    def names(self) -> set[str]:
        return {name for step in self.steps for name in step}

    def on_train_batch_start(self, *args: Any) -> None:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU])
        self._profile.__enter__()

    def on_train_batch_end(self, *args: Any) -> None:
        self._profile.__exit__(None, None, None)
        counts: dict[str, int] = {}
        for event in self._profile.events():
            counts[event.name] = counts.get(event.name, 0) + 1
        self.steps.append(counts)

    on_validation_batch_start = on_train_batch_start
    on_validation_batch_end = on_train_batch_end


def model_snapshot(model: torch.nn.Module) -> dict[str, Any]:
    """What a refusal must leave as it was: every tensor's bytes, every module's type and train/eval flag."""
    import hashlib

    digest = hashlib.sha256()
    for key, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.Tensor):  # bytes, not values: NaN == NaN, and -0.0 != 0.0
            data = value.detach().cpu().contiguous().reshape(-1)
            digest.update(key.encode() + str(value.dtype).encode() + repr(tuple(value.shape)).encode())
            digest.update(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"")
    return {
        "state_dict": digest.hexdigest(),
        "types": {name: type(m).__qualname__ for name, m in model.named_modules()},
        "training": {name: m.training for name, m in model.named_modules()},
    }


@pytest.fixture
def snapshot() -> Callable[[torch.nn.Module], dict[str, Any]]:
    """``snapshot(model)``: compare before and after a refused call (``assert snapshot(model) == before``)."""
    return model_snapshot


def peft_lora_layer(kind: str, model_dtype: torch.dtype, dora: bool = False) -> torch.nn.Module:
    """One peft LoRA layer (plain ``Linear`` or bitsandbytes ``Linear4bit``), B nonzero as after training."""
    import bitsandbytes as bnb
    import peft
    from torch import nn

    from lightning_hbm._compat import peft as peft_compat

    if kind == "4bit":
        torch.manual_seed(0)
        layer = bnb.nn.Linear4bit(64, 64, bias=False, quant_type="nf4", compute_dtype=model_dtype)
        layer.weight = bnb.nn.Params4bit(torch.randn(64, 64), requires_grad=False, quant_type="nf4").to("cpu")
        model = nn.Sequential(layer)
        peft_compat.mark_quantized(model, ["4bit"])
    else:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(64, 64)).to(model_dtype)
    peft.inject_adapter_in_model(peft.LoraConfig(r=8, lora_alpha=16, target_modules=["0"], use_dora=dora), model)
    nn.init.normal_(model[0].lora_B["default"].weight, std=0.05)
    return model[0]


@pytest.fixture
def read_only_mount(tmp_path: Any) -> Iterator[Any]:
    """A real read-only filesystem (a tmpfs remounted read-only: root is refused there too, EROFS not EACCES) holding
    a folder ``folder`` with a user's ``notes.txt`` ("mine"); skipped where no filesystem can be mounted."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("cannot mount a filesystem here (not root, or no CAP_SYS_ADMIN)")
    try:
        (mount / "folder").mkdir()
        (mount / "folder" / "notes.txt").write_text("mine")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
