"""CPUOffloadStrategy on CPU: the offload device is the CPU too, so the tests look at *where* state is
kept (separate fp32 master copies, the engine's state) and that training equals the plain run."""

from __future__ import annotations

import copy
from typing import Any

import bitsandbytes as bnb
import pytest
import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, StrategyRegistry

from lightning_hbm import CPUOffloadStrategy, LoRA, MemoryEfficientOptimizer, QuantizedPrecision
from lightning_hbm.memory.storage import optimizer_state_bytes
from lightning_hbm.models import NanoGPT
from lightning_hbm.strategies.cpu_offload import OffloadedOptimizer, host_offload_bytes

TINY = dict(n_layer=2, n_head=2, n_embd=64, block_size=128)


class ScheduledGPT(NanoGPT):
    """Unchanged-user-style module: AdamW with weight decay + a per-step LambdaLR."""

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _fit(trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any, steps: int = 4, **kwargs: Any) -> tuple:
    torch.manual_seed(0)
    model = ScheduledGPT(**TINY)
    recorder = loss_recorder()
    trainer = trainer_factory(max_steps=steps, callbacks=[recorder, *kwargs.pop("callbacks", [])], **kwargs)
    trainer.fit(model, datamodule_factory(train_samples=16))
    return trainer, model, torch.tensor(recorder.losses)


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_updates_equal_plain_run(
    offload_gradients: bool, trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any
) -> None:
    _, plain, plain_losses = _fit(trainer_factory, datamodule_factory, loss_recorder)
    trainer, model, losses = _fit(
        trainer_factory, datamodule_factory, loss_recorder, strategy=CPUOffloadStrategy(offload_gradients=offload_gradients)
    )
    # fp32 everywhere and the same optimizer class on copies: equal up to float reassociation (1e-6)
    torch.testing.assert_close(losses, plain_losses, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)

    optimizer = trainer.optimizers[0]
    assert isinstance(optimizer, OffloadedOptimizer) and optimizer.engine == "lightning_hbm"
    # The LR scheduler drives the offloaded optimizer: LambdaLR after 4 steps -> lr / 5, in both views.
    assert trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer
    assert optimizer.param_groups[0]["lr"] == pytest.approx(model.lr / 5)
    assert optimizer.state_dict()["offloaded"]["param_groups"][0]["lr"] == pytest.approx(model.lr / 5)
    # Where the state lives: nothing is keyed by the model's parameters, all of it by separate
    # master copies on the offload device. Host memory: fp32 masters (4 B/param) + gradient buffers (4 B)
    # + AdamW moments (8 B) + a step counter per tensor: twice the 8 B/param a plain run keeps as states.
    assert len(optimizer.state) == 0
    masters = list(optimizer.masters.values())
    params = [p for p in model.parameters()]
    assert {id(m) for m in masters} == {id(m) for m in optimizer.offloaded.state}
    assert not {m.untyped_storage().data_ptr() for m in masters} & {p.untyped_storage().data_ptr() for p in params}
    assert all(m.device == optimizer.offload_device and m.dtype == torch.float32 for m in masters)
    n = sum(p.numel() for p in params)
    assert host_offload_bytes(trainer.optimizers) == 16 * n + 4 * len(params)
    if offload_gradients:  # gradients were freed on the device as soon as they were accumulated
        assert all(p.grad is None for p in params)


def test_bf16_parameters_get_fp32_masters(gpt_factory: Any) -> None:
    model = gpt_factory().to(torch.bfloat16)
    optimizer = OffloadedOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), "cpu")
    idx = torch.randint(0, 256, (2, 16))
    model.loss((idx, idx)).backward()
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.step()
    state = optimizer.offloaded.state[next(iter(optimizer.masters.values()))]
    assert state["exp_avg"].dtype == torch.float32
    for p, m, b in zip(model.parameters(), optimizer.masters.values(), before):
        assert not torch.equal(p, b)  # the update reached the device parameter
        torch.testing.assert_close(p, m.to(torch.bfloat16), rtol=0, atol=0)  # it is the rounded master
    assert "master_params" in optimizer.state_dict()  # fp32 masters carry more than bf16 weights


def test_resume_plain_optimizer_state_into_offload(gpt_factory: Any) -> None:
    """A checkpoint written without offload loads into the offloaded engine and training continues identically."""
    batches = [torch.randint(0, 256, (2, 16)) for _ in range(3)]
    models = [gpt_factory(), gpt_factory()]
    plain = torch.optim.AdamW(models[0].parameters(), lr=1e-2)
    for idx in batches[:2]:
        models[0].loss((idx, idx)).backward()
        plain.step()
        plain.zero_grad()
    models[1].load_state_dict(models[0].state_dict())
    offloaded = OffloadedOptimizer(torch.optim.AdamW(models[1].parameters(), lr=1e-2))
    offloaded.load_state_dict(copy.deepcopy(plain.state_dict()))  # as read from a checkpoint file
    for model, optimizer in zip(models, (plain, offloaded)):
        model.loss((batches[2], batches[2])).backward()
        optimizer.step()
    for p, q in zip(models[1].parameters(), models[0].parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_checkpoint_round_trip(trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any, tmp_path: Any) -> None:
    """Stopping at an epoch end (4 batches) and resuming gives the uninterrupted run's losses."""
    _, _, full = _fit(trainer_factory, datamodule_factory, loss_recorder, steps=-1, max_epochs=2, strategy="cpu_offload")
    first, _, _ = _fit(trainer_factory, datamodule_factory, loss_recorder, steps=-1, max_epochs=1, strategy="cpu_offload")
    path = tmp_path / "offload.ckpt"
    first.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]
    assert saved["offload_engine"] == "lightning_hbm" and len(saved["offloaded"]["state"]) == len(first.optimizers[0].masters)

    torch.manual_seed(1)
    resumed = loss_recorder()
    trainer = trainer_factory(max_steps=-1, max_epochs=2, callbacks=[resumed], strategy="cpu_offload")
    trainer.fit(ScheduledGPT(**TINY), datamodule_factory(train_samples=16), ckpt_path=path)
    optimizer = trainer.optimizers[0]
    assert len(optimizer.state) == 0 and optimizer.offloaded.state  # Lightning did not pull states back
    torch.testing.assert_close(torch.tensor(resumed.losses), full[4:], rtol=1e-6, atol=1e-6)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(3e-3 / 9)  # scheduler state restored too


def test_composes_with_8bit_optimizer(trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any) -> None:
    trainer, model, losses = _fit(
        trainer_factory,
        datamodule_factory,
        loss_recorder,
        strategy=CPUOffloadStrategy(),
        callbacks=[MemoryEfficientOptimizer("adamw8bit")],
    )
    optimizer = trainer.optimizers[0]
    assert type(optimizer.offloaded) is bnb.optim.AdamW8bit  # 8-bit states, on the offload device
    n = sum(p.numel() for p in model.parameters())
    assert host_offload_bytes(optimizer) - 8 * n < 0.3 * 8 * n  # fp32 masters + gradient buffers + 8-bit states
    assert optimizer_state_bytes(optimizer) == 0
    assert losses[-1] < losses[0]


def test_profiler_reports_host_offload_beside_the_five_terms(
    trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any, tmp_path: Any
) -> None:
    """The five terms count what is on the training device and in ``optimizer.state``: 0 optimizer states for
    an offloaded run, which holds more than the plain one. ``hbm/host_offload`` says how much, in host memory."""
    import csv

    from lightning.pytorch.loggers import CSVLogger

    from lightning_hbm import HBMProfiler

    rows, logged = {}, {}
    for strategy in ("auto", "cpu_offload"):
        profiler = HBMProfiler(every_n_steps=1, summary=False, dirpath=str(tmp_path / strategy))
        logger = CSVLogger(tmp_path, name=strategy)
        trainer, model, _ = _fit(
            trainer_factory, datamodule_factory, loss_recorder, steps=2, strategy=strategy, callbacks=[profiler], logger=logger
        )
        rows[strategy] = profiler.rows[-1]
        with open(f"{logger.log_dir}/metrics.csv") as f:
            logged[strategy] = [r for r in csv.DictReader(f) if r.get("hbm/host_offload")]
    params = list(model.parameters())
    n = sum(p.numel() for p in params)
    assert rows["auto"]["optimizer_states"] == 8 * n + 4 * len(params) and rows["auto"]["host_offload"] == 0
    assert rows["cpu_offload"]["optimizer_states"] == 0
    assert rows["cpu_offload"]["host_offload"] == 16 * n + 4 * len(params)  # 2x the plain run's states
    assert logged["auto"] == [] and len(logged["cpu_offload"]) == 2
    assert float(logged["cpu_offload"][-1]["hbm/host_offload"]) == pytest.approx((16 * n + 4 * len(params)) / 2**20)


def test_composes_with_qlora(trainer_factory: Any, datamodule_factory: Any, loss_recorder: Any) -> None:
    """Only trainable (adapter and unquantized) parameters get master copies; training equals the plain QLoRA run."""
    runs = {}
    for strategy in ("auto", "cpu_offload"):
        runs[strategy] = _fit(
            trainer_factory,
            datamodule_factory,
            loss_recorder,
            steps=3,
            strategy=strategy,
            plugins=[QuantizedPrecision("nf4", dtype="float32")],
            callbacks=[LoRA(r=4)],
        )
    torch.testing.assert_close(runs["cpu_offload"][2], runs["auto"][2], rtol=1e-5, atol=1e-5)
    trainer, model, _ = runs["cpu_offload"]
    optimizer = trainer.optimizers[0]
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    assert {id(p) for p in optimizer.masters} == trainable
    assert any("lora_A" in n for n, p in model.named_parameters() if p.requires_grad)
    assert any(p.dtype == torch.uint8 for p in model.parameters())  # the 4-bit base is there, frozen


def test_errors(trainer_factory: Any, datamodule_factory: Any, gpt_factory: Any) -> None:
    with pytest.raises(ValueError, match=r"offload_device='host'\) is not a device torch knows.*Use 'cpu'"):
        CPUOffloadStrategy(offload_device="host")
    with pytest.raises(ValueError, match=r"single device, but the Trainer was given 2"):
        trainer_factory(strategy="cpu_offload", devices=2)
    trainer = trainer_factory(strategy=CPUOffloadStrategy(offload_gradients=True), gradient_clip_val=1.0)
    with pytest.raises(ValueError, match=r"gradient_clip_val=1.0\) would clip nothing"):
        trainer.fit(gpt_factory(), datamodule_factory())
    with pytest.raises(TypeError, match="cannot offload torch.optim.LBFGS"):
        OffloadedOptimizer(torch.optim.LBFGS(gpt_factory().parameters()))
    optimizer = OffloadedOptimizer(torch.optim.AdamW(gpt_factory().parameters()))
    with pytest.raises(ValueError, match=r"written by the 'torchao' optimizer, but this run offloads with the 'lightning_hbm'"):
        optimizer.load_state_dict({"offload_engine": "torchao", "offloaded": {}})


def test_registered_names() -> None:
    assert StrategyRegistry["cpu_offload"]["strategy"] is CPUOffloadStrategy
    assert StrategyRegistry["cpu_offload_fsdp"]["strategy"] is FSDPStrategy
    assert StrategyRegistry["cpu_offload_fsdp"]["init_params"] == {"cpu_offload": True, "use_orig_params": True}
    assert StrategyRegistry["cpu_offload_zero2"]["strategy"] is DeepSpeedStrategy
    assert StrategyRegistry["cpu_offload_zero3"]["init_params"]["offload_parameters"] is True


@pytest.mark.gpu
def test_gpu_states_leave_hbm(datamodule_factory: Any, trainer_factory: Any) -> None:
    """On CUDA, peak allocated memory drops by about the AdamW state bytes (torchao engine)."""
    peaks = {}
    for strategy in ("auto", "cpu_offload"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = NanoGPT(n_layer=4, n_head=4, n_embd=512, block_size=128)
        trainer = trainer_factory(accelerator="gpu", devices=1, max_steps=3, strategy=strategy)
        trainer.fit(model, datamodule_factory())
        peaks[strategy] = torch.cuda.max_memory_allocated()
        if strategy == "cpu_offload":
            assert trainer.optimizers[0].engine == "torchao"
            assert all(not t.is_cuda for s in trainer.optimizers[0].offloaded.optim_dict.values() for st in s.state.values() for t in st.values() if torch.is_tensor(t))
    state_bytes = 8 * sum(p.numel() for p in model.parameters())
    assert peaks["auto"] - peaks["cpu_offload"] > 0.7 * state_bytes


def test_cli_parses_strategy() -> None:
    from jsonargparse import ArgumentParser

    parser = ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(CPUOffloadStrategy, "strategy")
    config = parser.parse_args(["--strategy.offload_gradients", "true", "--strategy.offload_device", "cpu"])
    strategy = CPUOffloadStrategy(**config.strategy)
    assert strategy.offload_gradients is True and strategy.offload_device == torch.device("cpu")
