"""``MemoryEfficientOptimizer``: swap the user's Adam/AdamW for its bitsandbytes 8-bit (or paged) twin.

What it shrinks: the **optimizer states** term. ``torch.optim.AdamW`` keeps two fp32 moments,
8 bytes per trainable parameter; bitsandbytes' block-wise 8-bit AdamW keeps two uint8 moments
plus one fp32 absmax per 256-element block, about 2.03 bytes per parameter (tensors smaller than
``min_8bit_size=4096`` elements keep 32-bit state: bitsandbytes' default, they are negligible in
a real model). Paged kinds put states in CUDA unified memory that the driver evicts to CPU RAM
under memory pressure instead of raising out-of-memory.

The user's ``configure_optimizers`` stays unchanged: the swap happens at lightning_hbm's optimizer
transform point (:mod:`lightning_hbm.surgery`), right after ``configure_optimizers`` and before
optimizer states are restored from a checkpoint, so resuming loads 8-bit states into an 8-bit
optimizer.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from torch import nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_hbm._validate import check_args
from lightning_hbm.precision.bnb import import_bnb
from lightning_hbm.surgery import Stage, SurgeryCallback, repoint_lr_schedulers

log = logging.getLogger(__name__)

OptimizerKind = Literal[
    "adamw8bit", "adam8bit", "paged_adamw8bit", "paged_adam8bit", "paged_adamw", "paged_adam", "lion8bit", "paged_lion8bit"
]

# kind -> (bitsandbytes.optim class name, hyperparameters carried over from each torch param group).
# bitsandbytes' Adam and AdamW run the same kernel with *decoupled* weight decay (checked against
# torch.optim.AdamW on CPU: equal to 4e-7 in 32-bit), so both map from torch's AdamW semantics.
# Lion has no eps: it takes lr, betas and weight_decay (Lion usually wants a 3-10x lower lr).
_ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
_LION_KEYS = ("lr", "betas", "weight_decay")
OPTIMIZER_KINDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "adamw8bit": ("AdamW8bit", _ADAM_KEYS),
    "adam8bit": ("Adam8bit", _ADAM_KEYS),
    "paged_adamw8bit": ("PagedAdamW8bit", _ADAM_KEYS),
    "paged_adam8bit": ("PagedAdam8bit", _ADAM_KEYS),
    "paged_adamw": ("PagedAdamW", _ADAM_KEYS),
    "paged_adam": ("PagedAdam", _ADAM_KEYS),
    "lion8bit": ("Lion8bit", _LION_KEYS),
    "paged_lion8bit": ("PagedLion8bit", _LION_KEYS),
}
_SUPPORTED_SOURCES = (torch.optim.Adam, torch.optim.AdamW)


class MemoryEfficientOptimizer(SurgeryCallback):
    """Replace the optimizers returned by ``configure_optimizers`` with bitsandbytes equivalents.

    Shrinks: **optimizer states** (AdamW: 8 B/param -> 8-bit kinds: ~2 B/param).

    Args:
        kind: the bitsandbytes optimizer to train with: ``"adamw8bit"`` (default), ``"adam8bit"``,
            ``"paged_adamw8bit"``, ``"paged_adam8bit"``, ``"paged_adamw"`` (32-bit, paged),
            ``"paged_adam"``, ``"lion8bit"``, ``"paged_lion8bit"``. Paged kinds fall back to
            non-paged behaviour on CPU (bitsandbytes warns once).

    Every ``torch.optim.Adam``/``AdamW`` the user returns is replaced, param group by param group:
    the same parameters, ``lr``, ``betas``, ``eps`` and ``weight_decay`` per group, plus any extra
    keys an LR scheduler or the user stored in the group (``initial_lr``, ``max_lr``, ...). LR
    schedulers are re-pointed to the new optimizer and keep changing its lr. Settings that
    bitsandbytes cannot reproduce (``amsgrad``, ``maximize``, torch ``Adam``'s coupled L2
    ``weight_decay``) and other optimizer types (SGD, LBFGS, ...) are a ``ValueError``/``TypeError``
    before training starts, and nothing is replaced.

    Lion takes ``lr``, ``betas`` and ``weight_decay`` (it has no ``eps``); it is a different
    algorithm that usually wants a 3-10x lower lr than AdamW, so pick it knowingly.

    Logs nothing (:func:`lightning_hbm.memory.storage.optimizer_state_bytes` counts the saving).

    Example::

        trainer = Trainer(callbacks=[MemoryEfficientOptimizer("paged_adamw8bit")])

    .. code-block:: yaml

        trainer:
          callbacks:
            - class_path: lightning_hbm.MemoryEfficientOptimizer
              init_args: {kind: adamw8bit}
    """

    stage = Stage.OPTIMIZER

    def __init__(self, kind: OptimizerKind = "adamw8bit") -> None:
        check_args(MemoryEfficientOptimizer.__init__, locals())
        super().__init__()
        if kind not in OPTIMIZER_KINDS:
            raise ValueError(f"MemoryEfficientOptimizer(kind={kind!r}) is not a supported kind. Use one of {sorted(OPTIMIZER_KINDS)}.")
        import_bnb()  # fail at construction, not at fit time, when bitsandbytes is missing
        self.kind = kind

    @override
    def check_model(self, module: nn.Module) -> None:
        """Check the optimizer types before the model changes, by calling ``configure_optimizers`` once ahead.

        The optimizers it returns now are thrown away (Lightning calls it again after the surgery). If
        it cannot run yet (it reads ``self.trainer.estimated_stepping_batches``, say), the same check
        runs when the real optimizers exist.
        """
        configure = getattr(module, "configure_optimizers", None)
        if not callable(configure):
            return
        try:
            returned = configure()
        except Exception:  # noqa: BLE001 - any failure here only postpones the check
            return
        for optimizer in _optimizers_in(returned):
            self._check(optimizer)

    @override
    def resume_config(self) -> dict[str, Any]:
        return {"kind": self.kind}

    @override
    def transform_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any]) -> list[Optimizer]:
        # Validate every optimizer first: an error must leave nothing half-replaced.
        for optimizer in optimizers:
            self._check(optimizer)
        replaced = []
        for optimizer in optimizers:
            new = self._build(optimizer)
            repoint_lr_schedulers(lr_scheduler_configs, optimizer, new)
            replaced.append(new)
        log.info("lightning_hbm: %d optimizer(s) replaced by bitsandbytes %s", len(replaced), OPTIMIZER_KINDS[self.kind][0])
        return replaced

    def _check(self, optimizer: Optimizer) -> None:
        if type(optimizer) not in _SUPPORTED_SOURCES:
            raise TypeError(
                f"MemoryEfficientOptimizer(kind={self.kind!r}) can only replace torch.optim.Adam or torch.optim.AdamW, "
                f"but configure_optimizers returned {type(optimizer).__module__}.{type(optimizer).__qualname__}. "
                f"Supported kinds: {sorted(OPTIMIZER_KINDS)}. Return Adam/AdamW from configure_optimizers, or remove the "
                "MemoryEfficientOptimizer callback for this model."
            )
        for index, group in enumerate(optimizer.param_groups):
            for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
                if group.get(flag):
                    raise ValueError(
                        f"param_groups[{index}] of {type(optimizer).__name__} sets {flag}=True, which bitsandbytes "
                        f"{OPTIMIZER_KINDS[self.kind][0]} cannot reproduce. Set {flag}=False in configure_optimizers or remove "
                        "the MemoryEfficientOptimizer callback."
                    )
            coupled = type(optimizer) is torch.optim.Adam and not group.get("decoupled_weight_decay", False)
            if coupled and group["weight_decay"] != 0:
                raise ValueError(
                    f"param_groups[{index}] of torch.optim.Adam has weight_decay={group['weight_decay']} (an L2 term "
                    "added to the gradient), but bitsandbytes applies weight decay decoupled, as AdamW does: the "
                    "training would change. Use torch.optim.AdamW (or Adam(decoupled_weight_decay=True)) in "
                    "configure_optimizers, or weight_decay=0."
                )

    def _build(self, optimizer: Optimizer) -> Optimizer:
        bnb = import_bnb()
        class_name, keys = OPTIMIZER_KINDS[self.kind]
        groups = []
        for group in optimizer.param_groups:
            carried = {key: _as_float(group[key]) for key in keys}
            # Keys the optimizer itself did not define were added by an LR scheduler (initial_lr,
            # max_lr, ...) or by the user (e.g. a group name): they travel with the group.
            extra = {k: v for k, v in group.items() if k != "params" and k not in optimizer.defaults}
            groups.append({**extra, **carried, "params": group["params"]})
        return getattr(bnb.optim, class_name)(groups)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The first point after a resume where the states are final: Lightning restores optimizer states
        # (``load_state_dict``, then ``_optimizer_to_device``) after ``on_fit_start`` and before this hook.
        # A torch ``load_state_dict`` post-hook cannot do it: bitsandbytes overrides ``load_state_dict`` and
        # never calls those hooks, and Lightning's device move would come after it anyway.
        for optimizer in trainer.optimizers:
            if getattr(optimizer, "is_paged", False):
                _repage_state(optimizer)


def _optimizers_in(returned: Any) -> list[Optimizer]:
    """The optimizers in whatever form ``configure_optimizers`` returned (one, lists, tuples, dicts)."""
    if isinstance(returned, Optimizer):
        return [returned]
    if isinstance(returned, dict):
        return [o for v in returned.values() for o in _optimizers_in(v)]
    if isinstance(returned, (list, tuple)):
        return [o for v in returned for o in _optimizers_in(v)]
    return []


def _as_float(value: Any) -> Any:
    """bitsandbytes kernels take Python numbers; torch allows tensor lr/betas."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, tuple):
        return tuple(_as_float(v) for v in value)
    return value


def _repage_state(optimizer: Optimizer) -> None:
    """Move a resumed paged optimizer's states back into paged (CUDA unified) memory.

    bitsandbytes' ``load_state_dict`` copies saved states with ``.to(param.device)`` and Lightning's
    ``_optimizer_to_device`` then moves every state tensor to the device: on CUDA the moments of a paged
    optimizer land in ordinary device memory and are never evicted again, so a resumed run would lose
    exactly the memory behaviour it asked for. Called from ``MemoryEfficientOptimizer.on_train_start``,
    after both. Each CUDA state gets a buffer from the optimizer's own allocator (``get_state_buffer``:
    paged for tensors of 1e5 elements or more, as in a fresh run; a paged buffer is a ``torch.frombuffer``
    view of managed memory and reports device ``cpu``). On CPU paging does not exist (nothing to do).
    """
    for group in optimizer.param_groups:
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            for key in ("state1", "state2"):
                value = state.get(key)
                if not isinstance(value, torch.Tensor) or value.device.type != "cuda" or getattr(value, "is_paged", False):
                    continue
                buffer = optimizer.get_state_buffer(param, dtype=value.dtype)  # type: ignore[attr-defined]
                buffer.copy_(value)
                state[key] = buffer
