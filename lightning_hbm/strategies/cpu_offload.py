"""``CPUOffloadStrategy``: optimizer states (and optionally gradients) live in CPU RAM, the step runs there.

What it shrinks: the **optimizer states** term (all of it, in HBM) and, with
``offload_gradients=True``, the **gradients** term (each gradient leaves HBM as soon as backward
has accumulated it). Parameters stay on the accelerator; after each step the updated values are
copied back. This is ZeRO-offload for one device.

Implementation. On CUDA, torchao's ``CPUOffloadOptimizer`` does the heavy lifting where it fits: it
copies each gradient to pinned CPU memory from a post-accumulate-grad hook on a side stream,
steps per parameter on CPU and copies parameters back asynchronously. What it lacks, and what
:class:`OffloadedOptimizer` adds around it:

* LR schedulers: torchao's ``param_groups`` are one group per parameter (plus a group for small
  on-device tensors), so a scheduler built on the user's groups sees a different structure.
  :class:`OffloadedOptimizer` exposes the user's own param groups and copies their hyperparameters
  (lr, betas, ...) into the engine's groups before every step.
* Checkpoints: Lightning moves every tensor in ``optimizer.state`` back to the root device after a
  resume; our wrapper keeps its own ``state`` empty, so offloaded states stay offloaded.
* CPU testability and gradient clipping: torchao refuses any device but CUDA/XPU, and it copies
  gradients during backward, before Lightning clips them (clipping would be silently ignored).
  Otherwise, :class:`OffloadedOptimizer` runs its own engine, written here: fp32 master copies of
  the trainable parameters on an injectable ``offload_device``, the user's optimizer class built
  on them, gradients copied after the closure (i.e. after clipping), parameters copied back.
  On a CPU test machine the offload device is the CPU as well, and the mechanism is still
  observable: states belong to the master copies, never to the model's parameters.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy, StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.imports import RequirementCache
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hbm._validate import check_args
from lightning_hbm.memory.storage import host_offload_bytes, nested_tensors  # host_offload_bytes: public here too
from lightning_hbm.resume import CheckedCheckpointIO
from lightning_hbm.surgery import repoint_lr_schedulers

log = logging.getLogger(__name__)

_TORCHAO_AVAILABLE = RequirementCache("torchao>=0.10")  # torchao.optim.CPUOffloadOptimizer
_ENGINE_OWN = "lightning_hbm"
_ENGINE_TORCHAO = "torchao"


class OffloadedOptimizer(Optimizer):
    """The user's optimizer, stepping on copies of the trainable parameters on ``offload_device``.

    ``param_groups`` are the user's groups (the parameters on the accelerator): LR schedulers,
    gradient clipping and ``LearningRateMonitor`` see what they expect. ``offloaded`` is the
    optimizer that really steps (its ``state`` is on the offload device); ``state`` is empty.

    Args:
        optimizer: the optimizer ``configure_optimizers`` returned (any class whose ``step`` needs
            no closure). It is not stepped any more; its param group dicts are shared.
        offload_device: where master copies, gradients copies and states live.
        offload_gradients: move each gradient off the accelerator as soon as it is accumulated.
        use_torchao: step with torchao's ``CPUOffloadOptimizer`` (CUDA parameters, CPU offload device).
    """

    def __init__(
        self,
        optimizer: Optimizer,
        offload_device: Union[str, torch.device] = "cpu",
        offload_gradients: bool = False,
        use_torchao: bool = False,
    ) -> None:
        _check_steppable(optimizer)
        # Same group dicts as the user's optimizer: a scheduler that held them sees the same values.
        # ``self.state`` (set by Optimizer) stays empty: see the module docstring (Lightning's resume).
        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.offload_device = torch.device(offload_device)
        self.offload_gradients = offload_gradients
        self.engine = _ENGINE_TORCHAO if use_torchao else _ENGINE_OWN
        self._hooks: list[Any] = []
        trainable = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        if use_torchao:
            from torchao.optim import CPUOffloadOptimizer

            self.masters: dict[torch.Tensor, torch.Tensor] = {}
            self.offloaded: Optimizer = CPUOffloadOptimizer(
                self._engine_groups(lambda p: p), optimizer_class=type(optimizer), offload_gradients=offload_gradients
            )
        else:
            pin = self.offload_device.type == "cpu" and any(p.is_cuda for p in trainable)  # async D2H/H2D
            # fp32 master copies: as in mixed-precision ZeRO-offload, bf16 parameters get fp32 updates.
            self.masters = {p: p.detach().to(self.offload_device, torch.float32, copy=True) for p in trainable}
            self._grads = {p: torch.zeros_like(m, pin_memory=pin) for p, m in self.masters.items()}
            self.offloaded = cast(Callable[..., Optimizer], type(optimizer))(self._engine_groups(self.masters.__getitem__))  # a subclass: defaults of its own
            if offload_gradients:
                self._hooks = [p.register_post_accumulate_grad_hook(self._offload_grad) for p in trainable]
        self._group_pairs = self._pair_groups()

    def _engine_groups(self, to_engine: Callable[[torch.Tensor], torch.Tensor]) -> list[dict[str, Any]]:
        return [
            {**{k: v for k, v in group.items() if k != "params"}, "params": [to_engine(p) for p in group["params"] if p.requires_grad]}
            for group in self.param_groups
        ]

    def _pair_groups(self) -> list[tuple[dict[str, Any], dict[str, Any]]]:
        """(user group, engine group) pairs. torch's ``load_state_dict`` replaces the group dicts: redo after it.

        Our engine has the user's group structure; torchao has one group per large parameter, plus
        groups for the small tensors it keeps on the device.
        """
        if self.engine == _ENGINE_OWN:
            return list(zip(self.param_groups, self.offloaded.param_groups))
        pairs, seen = [], set()
        device_groups = self.offloaded.d_opt.param_groups if self.offloaded.d_opt is not None else []  # type: ignore[attr-defined]
        for group in self.param_groups:
            for p in group["params"]:
                if p in self.offloaded.optim_dict:  # type: ignore[attr-defined]
                    inner = self.offloaded.optim_dict[p].param_groups[0]  # type: ignore[attr-defined]
                else:
                    inner = next((g for g in device_groups if any(q is p for q in g["params"])), None)
                if inner is not None and id(inner) not in seen:
                    seen.add(id(inner))
                    pairs.append((group, inner))
        return pairs

    def _offload_grad(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: accumulate into the offloaded gradient, free the device one."""
        master, buffer = self.masters[param], self._grads[param]
        if master.grad is None:
            buffer.copy_(cast(torch.Tensor, param.grad), non_blocking=True)  # set: a post-accumulate-grad hook
            master.grad = buffer
        else:  # gradient accumulation over micro-batches happens on the offload device
            master.grad.add_(cast(torch.Tensor, param.grad).to(buffer.device, buffer.dtype))
        param.grad = None

    def _sync_hyperparameters(self) -> None:
        """Carry what LR schedulers changed in the user's groups (lr, betas, ...) to the engine."""
        for group, inner in self._group_pairs:
            inner.update({k: v for k, v in group.items() if k != "params"})

    @override
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()  # forward, backward and Lightning's gradient clipping
        self._sync_hyperparameters()
        if self.engine == _ENGINE_TORCHAO:
            self.offloaded.step()
            return loss
        if not self.offload_gradients:
            for param, master in self.masters.items():
                master.grad = None if param.grad is None else self._grads[param].copy_(param.grad, non_blocking=True)
        if self.offload_device.type == "cpu" and torch.cuda.is_available():
            torch.cuda.synchronize()  # the non-blocking copies into pinned memory must have landed
        self.offloaded.step()
        for param, master in self.masters.items():
            if master.grad is not None:
                param.copy_(master, non_blocking=True)
        return loss

    @override
    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.engine == _ENGINE_TORCHAO:
            self.offloaded.zero_grad(set_to_none=True)  # torchao only supports set_to_none
            return
        for param, master in self.masters.items():
            param.grad = None
            master.grad = None

    @override
    def state_dict(self) -> dict[str, Any]:
        self._sync_hyperparameters()
        state: dict[str, Any] = {"offload_engine": self.engine, "offloaded": self.offloaded.state_dict()}
        if any(p.dtype != torch.float32 for p in self.masters):
            # fp32 masters of bf16/fp16 parameters hold more than the checkpoint's weights: keep them
            state["master_params"] = [m.cpu() for m in self.masters.values()]
        return state

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        engine = state_dict.get("offload_engine")
        if engine is None and self.engine == _ENGINE_OWN:
            # A checkpoint of a run without offload: the user's optimizer class wrote it, and our
            # engine is that class on the master copies (torch maps states by position).
            self.offloaded.load_state_dict(state_dict)
        elif engine != self.engine:
            raise ValueError(
                f"The checkpoint's optimizer state was written by the {engine or 'non-offloaded'!r} optimizer, but this "
                f"run offloads with the {self.engine!r} engine, whose state layout differs. Resume on the same kind "
                "of device with the same CPUOffloadStrategy settings (torchao is used on CUDA without gradient clipping)."
            )
        else:
            self.offloaded.load_state_dict(state_dict["offloaded"])
            for master, saved in zip(self.masters.values(), state_dict.get("master_params", [])):
                master.copy_(saved)
        self._group_pairs = self._pair_groups()
        for group, inner in self._group_pairs:  # restored lr etc. become visible to the schedulers
            group.update({k: v for k, v in inner.items() if k != "params"})

    def host_tensors(self) -> list[torch.Tensor]:
        """What lives on the offload device: parameter copies, their gradient buffers, the engine's states.

        Own engine: fp32 master copies (4 B/param), fp32 gradient buffers (4 B) and the states of the
        user's optimizer class built on the masters (AdamW: 8 B). torchao engine: host copies in the
        parameter's dtype (bf16 parameters: 2 B each for copy and gradient, and torch AdamW's states follow
        that dtype); torchao keeps tensors under 4096 elements, with their states, on the device (not here).
        """
        if self.engine == _ENGINE_TORCHAO:
            copies = list(self.offloaded.param_d2h_map.values())  # type: ignore[attr-defined]
            grads = [c.grad for c in copies if c.grad is not None]
            engines = list(self.offloaded.optim_dict.values())  # type: ignore[attr-defined]
        else:
            copies, grads, engines = list(self.masters.values()), list(self._grads.values()), [self.offloaded]
        states = [t for engine in engines for state in engine.state.values() for t in nested_tensors(state)]
        return copies + grads + states

    def remove_hooks(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


def _check_steppable(optimizer: Optimizer) -> None:
    if isinstance(optimizer, torch.optim.LBFGS):
        raise TypeError(
            "CPUOffloadStrategy cannot offload torch.optim.LBFGS: its step re-evaluates the model through the "
            "closure many times, which cannot run on the offload device. Use a first-order optimizer (AdamW, SGD, "
            "bitsandbytes 8-bit ...) or another strategy."
        )


class CPUOffloadStrategy(SingleDeviceStrategy):
    """One device; optimizer states (and optionally gradients) on ``offload_device``, step there.

    Shrinks: **optimizer states** (none left in HBM) and, with ``offload_gradients``, **gradients**.
    Composes with ``QuantizedPrecision``, ``LoRA`` (only trainable parameters are offloaded, which
    with adapters may be tiny: the strategy logs the offloaded bytes and says so) and
    ``MemoryEfficientOptimizer`` (8-bit states, in CPU RAM).

    Args:
        device: the accelerator device, e.g. ``"cuda:0"``. Default: the one the Trainer picks
            (``Trainer(strategy="cpu_offload", accelerator="gpu", devices=1)``).
        offload_device: where states, fp32 master copies and gradient copies live (``"cpu"``).
        offload_gradients: free each gradient on the device as soon as backward accumulated it
            (gradient accumulation works; gradient clipping does not, since no gradient stays on
            the device: that combination is an error).

    Logs nothing per step; at setup it logs (Python logging, INFO) the bytes it offloads.

    Example::

        trainer = Trainer(accelerator="gpu", devices=1, strategy="cpu_offload")
        trainer = Trainer(strategy=CPUOffloadStrategy(offload_gradients=True))
    """

    strategy_name = "cpu_offload"

    def __init__(
        self,
        device: Optional[Union[str, torch.device]] = None,
        offload_device: Union[str, torch.device] = "cpu",
        offload_gradients: bool = False,
        accelerator: Optional[pl.accelerators.Accelerator] = None,
        checkpoint_io: Optional[Any] = None,
        precision_plugin: Optional[Any] = None,
    ) -> None:
        check_args(CPUOffloadStrategy.__init__, locals())
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io if checkpoint_io is not None else CheckedCheckpointIO(),  # atomic saves
            precision_plugin=precision_plugin,
        )
        # Lightning's connector fills ``parallel_devices`` of a strategy given by name: that is how
        # Trainer(strategy="cpu_offload", accelerator="gpu") finds its device (see the setter).
        self._parallel_devices: list[torch.device] = []
        if device is not None:
            self.parallel_devices = [torch.device(device)]
        try:
            self.offload_device = torch.device(offload_device)
        except RuntimeError as err:
            raise ValueError(
                f"CPUOffloadStrategy(offload_device={offload_device!r}) is not a device torch knows ({err}). "
                "Use 'cpu' (the default)."
            ) from err
        self.offload_gradients = offload_gradients

    @property
    def parallel_devices(self) -> list[torch.device]:
        return self._parallel_devices

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device]) -> None:
        if len(devices) > 1:
            raise ValueError(
                f"CPUOffloadStrategy runs on a single device, but the Trainer was given {len(devices)}: {devices}. "
                "Use devices=1, or strategy='fsdp_cpu_offload' / 'deepspeed_stage_2_offload' for several GPUs."
            )
        self._parallel_devices = list(devices)
        if devices:
            self._root_device = torch.device(devices[0])

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self.offload_gradients and trainer.gradient_clip_val:
            raise ValueError(
                f"CPUOffloadStrategy(offload_gradients=True) frees every gradient on the device during backward, so "
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}) would clip nothing. Use offload_gradients=False "
                "(gradients are copied after clipping) or remove gradient_clip_val."
            )
        super().setup(trainer)
        if not fitting:
            return
        for optimizer in self.optimizers:
            _check_steppable(optimizer)  # all checked before any is replaced
        use_torchao = (
            bool(_TORCHAO_AVAILABLE)
            and self.root_device.type == "cuda"
            and self.offload_device.type == "cpu"
            and not trainer.gradient_clip_val  # torchao copies gradients before Lightning clips them
            and not (self.offload_gradients and trainer.accumulate_grad_batches > 1)  # torchao overwrites, not adds
        )
        offloaded: list[Optimizer] = []
        for optimizer in self.optimizers:
            new = OffloadedOptimizer(optimizer, self.offload_device, self.offload_gradients, use_torchao)
            repoint_lr_schedulers(self.lr_scheduler_configs, optimizer, new)
            offloaded.append(new)
        self.optimizers = offloaded
        self._report(trainer, use_torchao)

    def _report(self, trainer: pl.Trainer, use_torchao: bool) -> None:
        model = trainer.lightning_module
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        log.info(
            "lightning_hbm: CPUOffloadStrategy offloads the optimizer of %d trainable parameters to %s (engine: %s)",
            trainable,
            self.offload_device,
            _ENGINE_TORCHAO if use_torchao else _ENGINE_OWN,
        )
        if total and trainable / total < 0.01:
            log.info(
                "lightning_hbm: only %.2f%% of the parameters are trainable (adapters?): their optimizer states are "
                "small, so offloading them saves little HBM and costs a host round trip per step.",
                100 * trainable / total,
            )

    @override
    def teardown(self) -> None:
        for optimizer in self.optimizers:
            if isinstance(optimizer, OffloadedOptimizer):
                optimizer.remove_hooks()
        super().teardown()


# Presets for the engines users outgrow one GPU with. The classes are Lightning's own; only the
# names and settings are ours. DeepSpeed is imported by Lightning when the strategy is built, not
# here, so these names exist without DeepSpeed installed.
PRESETS: dict[str, tuple[str, dict[str, Any], str]] = {
    "cpu_offload_fsdp": (
        "fsdp",
        {"cpu_offload": True, "use_orig_params": True},
        "FSDP with parameters, gradients and optimizer states offloaded to CPU; use_orig_params=True so frozen "
        "and trainable (LoRA) parameters can share a wrapped unit",
    ),
    "cpu_offload_zero2": (
        "deepspeed",
        {"stage": 2, "offload_optimizer": True},
        "DeepSpeed ZeRO-2 with optimizer states offloaded to CPU (ZeRO-offload)",
    ),
    "cpu_offload_zero3": (
        "deepspeed",
        {"stage": 3, "offload_optimizer": True, "offload_parameters": True},
        "DeepSpeed ZeRO-3 with optimizer states and parameters offloaded to CPU",
    ),
}


def register(registry: Any = StrategyRegistry) -> None:
    """Register ``strategy="cpu_offload"`` and the presets with Lightning (idempotent)."""
    if CPUOffloadStrategy.strategy_name not in registry:
        registry.register(
            CPUOffloadStrategy.strategy_name,
            CPUOffloadStrategy,
            description="Single device, optimizer states (and optionally gradients) on CPU (lightning_hbm)",
        )
    for name, (base, init_params, description) in PRESETS.items():
        if name not in registry:
            registry.register(name, registry[base]["strategy"], description=description, **init_params)


__all__ = ["CPUOffloadStrategy", "OffloadedOptimizer", "PRESETS", "host_offload_bytes", "register"]
