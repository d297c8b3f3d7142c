"""``AttentionKernel``: run ``F.scaled_dot_product_attention`` on a chosen kernel.

What it shrinks: the **activations** term (and time). The math kernel materializes the
``b*a*s*s`` attention scores and keeps them for backward (the ``5*a*s/h`` part of Korthikanti's
``s*b*h*(34 + 5*a*s/h)`` per layer); the fused kernels (flash, memory-efficient, cuDNN) keep only
the output and a ``b*a*s`` log-sum-exp, so attention memory grows linearly with the sequence.

How: ``torch.nn.attention.sdpa_kernel`` is entered around every training, validation, test and
predict batch (backward included, so recomputation under activation checkpointing uses the same
kernel) and left afterwards: the user's code is not changed. Hugging Face models choose their
attention function from ``config._attn_implementation``; they are switched to ``"sdpa"`` (or to
``"flash_attention_2"`` for ``"flash"`` on CUDA when the optional ``flash-attn`` package is
installed) at lightning_hbm's surgery point.

Which kernel exists depends on the device, the dtype and the torch build, so availability is
asked from torch itself: a tiny attention call is run under the requested kernel on the model's
device and in its compute dtype before anything is changed. On CPU, torch ships a flash kernel
(``_scaled_dot_product_flash_attention_for_cpu``) and the math kernel; "efficient" and "cudnn"
are CUDA only.
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any, Literal, Optional, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.surgery import Stage, SurgeryCallback

_FLASH_ATTN_AVAILABLE = RequirementCache("flash-attn")

KERNELS: dict[str, SDPBackend] = {
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "math": SDPBackend.MATH,
}
# "auto" tries these in order: the fused kernels first (linear memory in the sequence length).
_AUTO_ORDER = ("flash", "efficient", "cudnn", "math")


def _compute_device_and_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    trainer = lightning_compat.attached_trainer(module)
    params = [p for p in module.parameters() if p.is_floating_point()]
    device = trainer.strategy.root_device if trainer is not None else (params[0].device if params else torch.device("cpu"))
    # The most common floating dtype: quantized models keep norms/embeddings in the compute dtype.
    dtypes = [p.dtype for p in params]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    return device, dtype


def kernel_error(name: str, device: torch.device, dtype: torch.dtype, context: Any = None) -> Optional[str]:
    """``None`` if torch runs attention forward and backward on kernel ``name`` here, else torch's reason."""
    # head_dim 64, a multiple of 8: the fused kernels' common requirement, as in real models.
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype, requires_grad=True)
    try:
        with context if context is not None else nullcontext(), sdpa_kernel(KERNELS[name]):
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except RuntimeError as err:
        return str(err).splitlines()[0]
    return None


def _hf_models(module: nn.Module) -> list[nn.Module]:
    """Outermost transformers ``PreTrainedModel``s inside ``module`` (their sub-models follow them)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, child in module.named_modules():
        if isinstance(child, PreTrainedModel) and not any(name.startswith(n + ".") for n, _ in found if n):
            found.append((name, child))
    return [m for _, m in found]


class AttentionKernel(SurgeryCallback):
    """Choose the kernel behind ``F.scaled_dot_product_attention`` for the user's unchanged model.

    Args:
        backend: ``"flash"``, ``"efficient"`` (memory-efficient), ``"cudnn"``, ``"math"``, or
            ``"auto"``: the first available of flash, efficient, cudnn, math on the model's device
            and dtype (logged). Requesting a kernel that is not available is a ``ValueError``
            before training (no silent fallback), naming the kernels available here.

    Hugging Face models are switched to ``attn_implementation="sdpa"``; with ``"flash"`` on CUDA
    and ``flash-attn`` installed, to ``"flash_attention_2"`` instead.

    Logged keys: none (no metric). The chosen kernel is logged once through Python logging (rank
    zero) and kept in :attr:`chosen`.

    Example::

        trainer = Trainer(precision="bf16-true", callbacks=[AttentionKernel("flash")])

    YAML (LightningCLI)::

        trainer:
          callbacks:
            - class_path: lightning_hbm.AttentionKernel
              init_args: {backend: auto}
    """

    stage = Stage.KERNELS
    reapply = True  # a new instance (e.g. a test Trainer after fit) chooses its kernel again

    def __init__(self, backend: Literal["auto", "flash", "efficient", "cudnn", "math"] = "auto") -> None:
        check_args(AttentionKernel.__init__, locals())
        if backend != "auto" and backend not in KERNELS:
            raise ValueError(
                f"AttentionKernel(backend={backend!r}): choose one of {['auto', *KERNELS]} ('auto' picks the best "
                "available on the model's device and dtype)."
            )
        self.backend = backend
        self.chosen: Optional[str] = None
        self.hf_implementation: Optional[str] = None
        self._kernels: list[SDPBackend] = []
        self._stack = ExitStack()

    @override
    def transform_model(self, module: nn.Module) -> None:
        device, dtype = _compute_device_and_dtype(module)
        trainer = lightning_compat.attached_trainer(module)
        # Probe under the precision plugin's forward context: autocast ("bf16-mixed") changes the dtype.
        context = trainer.strategy.precision_plugin.forward_context() if trainer is not None else None
        errors = {name: kernel_error(name, device, dtype, context) for name in _AUTO_ORDER}
        available = [name for name in _AUTO_ORDER if errors[name] is None]
        if self.backend != "auto" and self.backend not in available:
            hint = ""
            if self.backend == "flash" and device.type == "cuda" and dtype == torch.float32:
                hint = " Flash attention needs float16/bfloat16: train with precision='bf16-true' or 'bf16-mixed'."
            raise ValueError(
                f"AttentionKernel(backend={self.backend!r}): the {self.backend!r} attention kernel is not available on "
                f"{device.type} with {dtype} (torch: {errors[self.backend]}).{hint} Available here: {available}; "
                "choose one of them or 'auto'."
            )
        self.chosen = available[0] if self.backend == "auto" else self.backend
        hf_models = _hf_models(module)
        implementation = "sdpa"
        if self.chosen == "flash" and device.type == "cuda" and _FLASH_ATTN_AVAILABLE:
            implementation = "flash_attention_2"
        unsupported = [type(m).__name__ for m in hf_models if implementation == "sdpa" and not getattr(m, "_supports_sdpa", False)]
        if unsupported:
            raise ValueError(
                f"AttentionKernel: the transformers models {unsupported} do not support attn_implementation='sdpa', so no "
                "kernel can be chosen for them. Remove AttentionKernel for this model."
            )
        for model in hf_models:
            cast(Any, model).set_attn_implementation(implementation)  # a transformers PreTrainedModel
        self.hf_implementation = implementation if hf_models else None
        # "auto" keeps the other available kernels as fallbacks (in priority order) for shapes the
        # first one does not take (e.g. an odd head size); an explicit choice allows only that kernel.
        self._kernels = [KERNELS[n] for n in available] if self.backend == "auto" else [KERNELS[self.chosen]]
        note = ""
        if hf_models:
            note = f"; transformers attn_implementation={implementation!r}"
            if self.chosen == "flash" and implementation == "sdpa" and device.type == "cuda":
                note += " (torch's flash kernel; pip install flash-attn for flash_attention_2)"
        rank_zero_info(f"lightning_hbm: attention kernel {self.chosen!r} ({self.backend}) on {device.type}/{dtype}{note}")

    def _enter(self) -> None:
        self._exit()  # a batch that raised never reached its *_batch_end
        if self.chosen is not None:
            self._stack.enter_context(sdpa_kernel(self._kernels, set_priority=self.backend == "auto"))

    def _exit(self) -> None:
        self._stack.close()

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._enter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._exit()

    @override
    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._enter()

    @override
    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._exit()

    @override
    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._enter()

    @override
    def on_test_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._exit()

    @override
    def on_predict_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._enter()

    @override
    def on_predict_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        self._exit()

    @override
    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._exit()

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._exit()


__all__ = ["KERNELS", "AttentionKernel", "kernel_error"]
