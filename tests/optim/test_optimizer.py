"""MemoryEfficientOptimizer: real bitsandbytes 8-bit/paged optimizers on CPU, via the surgery spine."""

from __future__ import annotations

import copy
import math
import warnings
from typing import Any, Callable

import bitsandbytes as bnb
import pytest
import torch

from lightning_hbm import MemoryEfficientOptimizer
from lightning_hbm.memory.storage import optimizer_state_bytes
from lightning_hbm.models import NanoGPT


class ScheduledGPT(NanoGPT):
    """NanoGPT whose unchanged configure_optimizers returns AdamW + a per-step StepLR, two param groups."""

    def configure_optimizers(self) -> Any:
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1, "name": "decay"}, {"params": no_decay, "weight_decay": 0.0, "lr": 1e-3}],
            lr=self.lr,
            betas=(0.8, 0.95),
            eps=1e-6,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LBFGSGPT(NanoGPT):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters())


def test_swap_keeps_param_groups_and_hyperparameters(gpt_factory: Callable[..., NanoGPT]) -> None:
    model = gpt_factory()
    params = list(model.parameters())
    original = torch.optim.AdamW(
        [{"params": params[:3], "lr": 1e-2, "betas": (0.8, 0.9), "name": "a"}, {"params": params[3:], "weight_decay": 0.0}],
        lr=3e-4,
        eps=1e-7,
        weight_decay=0.05,
    )
    (new,) = MemoryEfficientOptimizer("adamw8bit").transform_optimizers([original], [])
    assert type(new) is bnb.optim.AdamW8bit
    assert len(new.param_groups) == 2
    for old_group, new_group in zip(original.param_groups, new.param_groups):
        assert [id(p) for p in new_group["params"]] == [id(p) for p in old_group["params"]]
        for key in ("lr", "betas", "eps", "weight_decay"):
            assert new_group[key] == old_group[key], key
    assert new.param_groups[0]["name"] == "a"  # the user's own group key travels too
    assert new.param_groups[1]["lr"] == 3e-4  # the default lr of the user's optimizer


def test_lion_takes_lr_betas_weight_decay(gpt_factory: Callable[..., NanoGPT]) -> None:
    original = torch.optim.AdamW(gpt_factory().parameters(), lr=1e-4, betas=(0.9, 0.99), weight_decay=0.2)
    (new,) = MemoryEfficientOptimizer("lion8bit").transform_optimizers([original], [])
    assert type(new) is bnb.optim.Lion8bit
    group = new.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"]) == (1e-4, (0.9, 0.99), 0.2)


def test_lr_scheduler_drives_new_optimizer(gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any) -> None:
    torch.manual_seed(0)
    model = ScheduledGPT(**{**dict(n_layer=2, n_head=2, n_embd=64, block_size=128), "lr": 4e-3})
    trainer = trainer_factory(max_steps=3, callbacks=[MemoryEfficientOptimizer("adamw8bit")])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule_factory())
    # torch warns when scheduler.step() runs before (or without a tracked) optimizer.step()
    assert not [w for w in caught if "optimizer.step()" in str(w.message)]
    optimizer = trainer.optimizers[0]
    assert type(optimizer) is bnb.optim.AdamW8bit
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert scheduler.optimizer is optimizer
    # StepLR(gamma=0.5) stepped after each of the 3 steps: the 8-bit optimizer's lr changed.
    assert optimizer.param_groups[0]["lr"] == pytest.approx(4e-3 * 0.5**3)
    assert optimizer.param_groups[1]["lr"] == pytest.approx(1e-3 * 0.5**3)
    assert optimizer.param_groups[0]["initial_lr"] == 4e-3
    assert optimizer.state  # it really stepped
    assert all(s["state1"].dtype == torch.uint8 for s in optimizer.state.values() if s["state1"].numel() >= 4096)


def _expected_8bit_bytes(params: list[torch.Tensor]) -> int:
    """Hand count of bitsandbytes' block-wise 8-bit Adam state (its defaults: block 256, min_8bit_size 4096)."""
    total = 2 * 256 * 4  # qmap1 + qmap2: two fp32 code books of 256 entries, shared by all parameters
    for p in params:
        n = p.numel()
        if n >= 4096:
            total += 2 * n + 2 * 4 * math.ceil(n / 256)  # uint8 moments + one fp32 absmax per block, each
        else:
            total += 2 * 4 * n  # small tensors keep 32-bit moments
    return total


def test_state_bytes_8bit_about_2_bytes_per_param(gpt_factory: Callable[..., NanoGPT]) -> None:
    results = {}
    for kind in (None, "adamw8bit"):
        model = gpt_factory()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if kind is not None:
            (optimizer,) = MemoryEfficientOptimizer(kind).transform_optimizers([optimizer], [])
        idx = torch.randint(0, 256, (2, 16))
        model.loss((idx, idx)).backward()
        optimizer.step()
        results[kind] = optimizer_state_bytes(optimizer)
    params = list(gpt_factory().parameters())
    n_params = sum(p.numel() for p in params)
    # torch AdamW: exp_avg + exp_avg_sq in fp32 (8 B) + a 4-byte step tensor per parameter tensor
    assert results[None] == 8 * n_params + 4 * len(params)
    assert results["adamw8bit"] == _expected_8bit_bytes(params)
    large = sum(p.numel() for p in params if p.numel() >= 4096)
    assert large / n_params > 0.95  # so the per-parameter figure below is about the 8-bit path
    assert results["adamw8bit"] / n_params < 2.3
    assert results[None] / results["adamw8bit"] > 3.5


def test_loss_trajectory_close_to_adamw(gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, loss_recorder: Any) -> None:
    losses = {}
    for kind in (None, "adamw8bit"):
        recorder = loss_recorder()
        callbacks = [recorder] + ([MemoryEfficientOptimizer(kind)] if kind else [])
        trainer = trainer_factory(max_steps=10, callbacks=callbacks)
        trainer.fit(gpt_factory(), datamodule_factory())
        losses[kind] = torch.tensor(recorder.losses)
    assert type(trainer.optimizers[0]) is bnb.optim.AdamW8bit
    assert losses["adamw8bit"][-1] < losses["adamw8bit"][0] - 1.0  # it trains
    # 8-bit moments differ from fp32 ones by ~1% per update; over 10 steps the losses stayed within
    # 3e-4 (relative) of AdamW's on this machine: 1% leaves room for other CPUs' kernels.
    torch.testing.assert_close(losses["adamw8bit"], losses[None], rtol=0.01, atol=0.0)


@pytest.mark.parametrize("kind", ["adamw8bit", "paged_adamw8bit"])
def test_save_resume_round_trip(
    kind: str, gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, loss_recorder: Any, tmp_path: Any
) -> None:
    """Resuming from step 3 gives exactly the losses of the uninterrupted 6-step run.

    3 batches per epoch and epoch limits: the checkpoint is at an epoch end, since a run stopped by
    ``max_steps`` at the last batch resumes into the same epoch and replays a batch.

    Paged kinds run non-paged on CPU; on CUDA bitsandbytes' load_state_dict also un-pages their
    states, which ``_repage_state`` repairs (covered by the GPU test).
    """

    def data() -> Any:
        return datamodule_factory(train_samples=12)

    full = loss_recorder()
    trainer_factory(max_steps=-1, max_epochs=2, callbacks=[full, MemoryEfficientOptimizer(kind)]).fit(gpt_factory(), data())

    first = trainer_factory(max_steps=-1, max_epochs=1, callbacks=[MemoryEfficientOptimizer(kind)])
    first.fit(gpt_factory(), data())
    ckpt_path = tmp_path / "step3.ckpt"
    first.save_checkpoint(ckpt_path)
    saved = torch.load(ckpt_path, weights_only=False)["optimizer_states"][0]
    # the 8-bit state is what was saved (bitsandbytes nests it under its own key, for FSDP)
    quant_state = saved["state"][0]["__bnb_optimizer_quant_state__"]
    assert quant_state["state1"].dtype == torch.uint8 and quant_state["state1"].numel() >= 4096

    resumed = loss_recorder()
    trainer = trainer_factory(max_steps=-1, max_epochs=2, callbacks=[resumed, MemoryEfficientOptimizer(kind)])
    trainer.fit(gpt_factory(seed=1), data(), ckpt_path=ckpt_path)
    assert type(trainer.optimizers[0]).__name__ == {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit"}[kind]
    torch.testing.assert_close(torch.tensor(resumed.losses), torch.tensor(full.losses[3:]), rtol=1e-5, atol=1e-6)


def test_paged_resume_repages_after_lightning_restored_and_moved_the_state(
    gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any, tmp_path: Any, monkeypatch: Any
) -> None:
    """The repaging runs at on_train_start of a resumed fit: after Lightning's ``load_optimizer_state_dict``
    (bitsandbytes' ``load_state_dict``, which calls no torch post-hook, then ``_optimizer_to_device``).

    On CPU there is no paging, so this checks the point it runs at; where the memory lives is the GPU test's.
    """
    from lightning.pytorch.strategies import SingleDeviceStrategy

    import lightning_hbm.optim.optimizer as module

    events: list[Any] = []
    load = SingleDeviceStrategy.load_optimizer_state_dict
    monkeypatch.setattr(SingleDeviceStrategy, "load_optimizer_state_dict", lambda *a: (events.append("load"), load(*a)))
    repage = module._repage_state
    monkeypatch.setattr(module, "_repage_state", lambda opt: (events.append(("repage", len(opt.state))), repage(opt)))

    first = trainer_factory(max_steps=2, callbacks=[MemoryEfficientOptimizer("paged_adamw8bit")])
    first.fit(gpt_factory(), datamodule_factory())
    assert events == [("repage", 0)]  # a fresh run: nothing loaded, nothing to repage
    first.save_checkpoint(tmp_path / "paged.ckpt")
    events.clear()
    trainer = trainer_factory(max_steps=3, callbacks=[MemoryEfficientOptimizer("paged_adamw8bit")])
    trainer.fit(gpt_factory(), datamodule_factory(), ckpt_path=tmp_path / "paged.ckpt")
    n_states = len(trainer.optimizers[0].state)
    assert n_states > 0 and events == ["load", ("repage", n_states)]  # once, on the loaded and moved states
    # no torch load_state_dict post-hook is registered any more (bitsandbytes would never call it)
    assert not trainer.optimizers[0]._optimizer_load_state_dict_post_hooks
    events.clear()
    trainer_factory(max_steps=2, callbacks=[MemoryEfficientOptimizer("adamw8bit")]).fit(gpt_factory(), datamodule_factory())
    assert events == []  # non-paged kinds are left alone


@pytest.mark.parametrize("kind", ["adamw8bit", "paged_adamw"])
def test_state_dtypes_survive_load_with_bf16_params(kind: str) -> None:
    """Known bitsandbytes resume trap: load_state_dict casts floating state to the parameter dtype.

    For bf16 parameters that would turn fp32 moments, absmax and code books into bf16. Checked on
    the real library: dtypes and the next update are exactly those of the uninterrupted optimizer.
    """

    def make() -> tuple[torch.nn.Parameter, torch.optim.Optimizer]:
        torch.manual_seed(0)
        param = torch.nn.Parameter(torch.randn(64, 128, dtype=torch.bfloat16))
        (optimizer,) = MemoryEfficientOptimizer(kind).transform_optimizers([torch.optim.AdamW([param], lr=1e-2)], [])
        return param, optimizer

    grads = [torch.randn(64, 128, dtype=torch.bfloat16) for _ in range(3)]
    param, optimizer = make()
    for grad in grads[:2]:
        param.grad = grad
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())  # as read from a checkpoint file
    resumed_param, resumed = make()
    with torch.no_grad():
        resumed_param.copy_(param)
    resumed.load_state_dict(saved)
    dtypes = {k: v.dtype for k, v in optimizer.state[param].items() if isinstance(v, torch.Tensor)}
    assert {k: v.dtype for k, v in resumed.state[resumed_param].items() if isinstance(v, torch.Tensor)} == dtypes
    assert dtypes["state1"] == (torch.uint8 if kind.endswith("8bit") else torch.float32)
    for p, opt in ((param, optimizer), (resumed_param, resumed)):
        p.grad = grads[2]
        opt.step()
    torch.testing.assert_close(resumed_param, param, rtol=0, atol=0)


def test_unsupported_optimizer_is_clear_error(lazy_gpt_factory: Any, datamodule_factory: Any, trainer_factory: Any) -> None:
    model = LBFGSGPT(**dict(n_layer=1, n_head=2, n_embd=32, block_size=64))
    trainer = trainer_factory(max_steps=1, callbacks=[MemoryEfficientOptimizer("adamw8bit")])
    with pytest.raises(TypeError, match=r"torch\.optim\.lbfgs\.LBFGS\. Supported kinds: \['adam8bit', 'adamw8bit'"):
        trainer.fit(model, datamodule_factory())


def test_unsupported_hyperparameters_replace_nothing(gpt_factory: Callable[..., NanoGPT]) -> None:
    params = list(gpt_factory().parameters())
    fine = torch.optim.AdamW(params[:2])
    callback = MemoryEfficientOptimizer("adam8bit")
    with pytest.raises(ValueError, match=r"weight_decay=0\.1 \(an L2 term.*Use torch\.optim\.AdamW"):
        callback.transform_optimizers([fine, torch.optim.Adam(params[2:], weight_decay=0.1)], [])
    with pytest.raises(ValueError, match="sets amsgrad=True, which bitsandbytes Adam8bit cannot reproduce"):
        callback.transform_optimizers([torch.optim.AdamW(params, amsgrad=True)], [])
    # torch's Adam with decoupled decay is AdamW: accepted
    (new,) = callback.transform_optimizers([torch.optim.Adam(params, weight_decay=0.1, decoupled_weight_decay=True)], [])
    assert new.param_groups[0]["weight_decay"] == 0.1


def test_bad_kind_is_clear_error() -> None:
    with pytest.raises(ValueError, match=r"kind='adamw4bit'\) is not a supported kind\. Use one of \['adam8bit'"):
        MemoryEfficientOptimizer("adamw4bit")  # type: ignore[arg-type]


def test_cli_parses_kind() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(MemoryEfficientOptimizer, "opt")
    assert parser.parse_args(["--opt.kind", "paged_adamw8bit"]).opt.kind == "paged_adamw8bit"
    with pytest.raises(Exception, match="adamw4bit"):
        parser.parse_args(["--opt.kind", "adamw4bit"])


def _cuda_memory_type(tensor: torch.Tensor) -> int:
    """``cudaPointerGetAttributes(...).type`` of ``tensor``'s data: 2 device memory, 3 managed (paged) memory.

    libcudart is the one torch loaded into this process (found in /proc/self/maps).
    """
    import ctypes

    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    assert paths, "libcudart is not loaded in this process: cannot ask CUDA where the state lives"
    cudart = ctypes.CDLL(sorted(paths)[0])

    class Attributes(ctypes.Structure):
        # type, device, devicePointer, hostPointer; room for fields newer CUDA versions append
        _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("device_pointer", ctypes.c_void_p),
                    ("host_pointer", ctypes.c_void_p), ("reserved", ctypes.c_byte * 256)]  # fmt: skip

    attributes = Attributes()
    error = cudart.cudaPointerGetAttributes(ctypes.byref(attributes), ctypes.c_void_p(tensor.data_ptr()))
    assert error == 0, f"cudaPointerGetAttributes failed with error {error}"
    return attributes.type


@pytest.mark.gpu
def test_gpu_paged_state_lives_in_managed_memory_after_resume(tmp_path: Any) -> None:
    """A Lightning resume on CUDA: bitsandbytes' ``load_state_dict`` and Lightning's ``_optimizer_to_device``
    put the moments in ordinary device memory; ``MemoryEfficientOptimizer.on_train_start`` moves them back.

    Checked where the memory lives, not a Python attribute (``deepcopy`` keeps ``is_paged``): CUDA reports
    managed memory for every large state, and torch's CUDA allocator no longer holds those bytes.
    Not yet run on GPU.
    """
    import lightning.pytorch as pl

    from lightning_hbm.data import synthetic_batch

    class Probe(pl.Callback):
        """Lightning restores optimizer states between on_fit_start and on_train_start (this callback is last)."""

        def on_fit_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.before_restore = torch.cuda.memory_allocated()

        def on_train_start(self, trainer: pl.Trainer, pl_module: Any) -> None:
            self.restore_growth = torch.cuda.memory_allocated() - self.before_restore
            optimizer = trainer.optimizers[0]
            large = [(p, optimizer.state[p]) for g in optimizer.param_groups for p in g["params"] if p.numel() >= 1e5]
            self.types = [_cuda_memory_type(s[k]) for _, s in large for k in ("state1", "state2")]
            self.devices = {(p.device.type, s["state1"].device.type) for p, s in large}
            self.paged_bytes = sum(s[k].nbytes for _, s in large for k in ("state1", "state2"))

    def trainer(steps: int, *callbacks: Any) -> pl.Trainer:
        return pl.Trainer(
            accelerator="gpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, default_root_dir=tmp_path, limit_val_batches=0,
            callbacks=[MemoryEfficientOptimizer("paged_adamw8bit"), *callbacks],
        )  # fmt: skip

    def model() -> NanoGPT:
        torch.manual_seed(0)
        return NanoGPT(n_layer=2, n_head=4, n_embd=256, block_size=64)  # 256 x 768 c_attn: > 1e5, paged

    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*synthetic_batch(8, 64)), batch_size=4)
    first = trainer(2)
    first.fit(model(), data)
    first.save_checkpoint(tmp_path / "paged.ckpt")
    probe = Probe()
    resumed = trainer(3, probe)
    resumed.fit(model(), data, ckpt_path=tmp_path / "paged.ckpt")
    assert probe.types and all(t == 3 for t in probe.types), probe.types  # 3: cudaMemoryTypeManaged
    assert probe.devices == {("cuda", "cpu")}  # torch sees a frombuffer view of managed memory
    # Restoring added only the small (< 1e5 elements, never paged) states to torch's CUDA allocator: the
    # ~2.9 MB of paged moments are not in it. Without the repaging the growth is at least paged_bytes.
    assert probe.restore_growth < probe.paged_bytes // 2, (probe.restore_growth, probe.paged_bytes)
    assert resumed.global_step == 3  # it stepped on the repaged states
