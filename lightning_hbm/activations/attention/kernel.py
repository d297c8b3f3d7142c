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

Beside torch's kernels, lightning_hbm's own (:mod:`lightning_hbm.activations.attention.blocked`: chunks of batched
matmuls, the scores recomputed in backward, saving less than a fused kernel): ``"blocked"`` asks for it on every
call it takes (from the second training step: the first finds the modules that call attention); ``"auto"`` times
it against torch's kernel on each attention shape the first time a training step runs that shape, and uses it from
the next step on where it is clearly faster (measured on CPU in bf16: 0.58-0.71x torch's CPU flash kernel's time,
``benchmarks/README.md``). Calls are routed by a ``TorchFunctionMode`` entered
in the ``forward`` of each module that calls ``F.scaled_dot_product_attention``, found while the first training step
runs (on torch's kernel), so that a recompute under activation checkpointing routes as its forward did; the names go
into checkpoints, so a resumed run routes from its first step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Literal, Optional, cast

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from lightning_utilities.core.imports import RequirementCache
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from typing_extensions import override

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._validate import check_args
from lightning_hbm.activations.attention.blocked import (
    CallerRecorder,
    Router,
    Signature,
    Timing,
    attention,
    route,
    time_kernels,
    unroute,
)
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
BACKENDS = ("auto", *KERNELS, "blocked")


def _compute_device_and_dtype(module: nn.Module) -> tuple[torch.device, torch.dtype]:
    trainer = lightning_compat.attached_trainer(module)
    params = [p for p in module.parameters() if p.is_floating_point()]
    device = trainer.strategy.root_device if trainer is not None else (params[0].device if params else torch.device("cpu"))
    # The most common floating dtype: quantized models keep norms/embeddings in the compute dtype.
    dtypes = [p.dtype for p in params]
    dtype = max(set(dtypes), key=dtypes.count) if dtypes else torch.float32
    return device, dtype


def kernel_error(name: str, device: torch.device, dtype: torch.dtype,
                 context: Optional[Callable[[], AbstractContextManager]] = None) -> Optional[str]:
    """``None`` if attention runs forward and backward on kernel ``name`` here (inside a fresh ``context()``), else
    the reason."""
    # head_dim 64, a multiple of 8: the fused kernels' common requirement, as in real models.
    q = torch.randn(1, 2, 16, 64, device=device, dtype=dtype, requires_grad=True)
    try:
        with context() if context is not None else nullcontext():
            if name == "blocked":
                attention(q, q, q, causal=True).sum().backward()
            else:
                with sdpa_kernel(KERNELS[name]):
                    F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
    except (RuntimeError, NotImplementedError) as err:
        return str(err).splitlines()[0]
    return None


def _attention_models(module: nn.Module) -> list[nn.Module]:
    """The transformers ``PreTrainedModel``s whose ``attn_implementation`` :class:`AttentionKernel` sets: ``module``
    itself if it is one, and the outermost ones inside it. Not :func:`lightning_hbm.layers.heads.hf_models` (the
    outermost models only, found by their config): a root model's sub-models (a VLM's vision tower, with a config of
    its own) are set one by one here, and only real ``PreTrainedModel``s have ``set_attn_implementation``."""
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
        backend: ``"flash"``, ``"efficient"`` (memory-efficient), ``"cudnn"``, ``"math"`` (torch's kernels),
            ``"blocked"`` (lightning_hbm's, see the module docstring), or ``"auto"``: the first available of flash,
            efficient, cudnn, math on the model's device and dtype (logged), and, shape by shape, the blocked kernel
            where it runs forward + backward in at most ``BLOCKED_MARGIN`` (0.9) of that kernel's time (timed at the
            end of the first training step that runs the shape; each choice logged with both times, kept in
            :attr:`timings` and in checkpoints, so that a resumed run computes as the first did). Requesting a
            kernel that is not available is a ``ValueError`` before training (no silent fallback), naming the
            kernels available here. With ``"blocked"``, a call it cannot take (attention dropout, a mask that needs
            a gradient, shapes that broadcast) runs on torch's kernel, and a warning names the reason.

    Hugging Face models are switched to ``attn_implementation="sdpa"``; with ``"flash"`` on CUDA
    and ``flash-attn`` installed, to ``"flash_attention_2"`` instead.

    Logged keys: none (no metric). The chosen kernel is logged once through Python logging (rank
    zero) and kept in :attr:`chosen`; ``"auto"``'s per-shape choices likewise, in :attr:`timings`.

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

    def __init__(self, backend: Literal["auto", "flash", "efficient", "cudnn", "math", "blocked"] = "auto") -> None:
        check_args(AttentionKernel.__init__, locals())
        if backend not in BACKENDS:
            raise ValueError(
                f"AttentionKernel(backend={backend!r}): choose one of {list(BACKENDS)} ('auto' picks the best "
                "available on the model's device and dtype)."
            )
        self.backend = backend
        self.chosen: Optional[str] = None
        self.hf_implementation: Optional[str] = None
        #: "auto": each attention shape timed on torch's kernel and on the blocked one (the blocked one runs it
        #: where ``blocked_s <= BLOCKED_MARGIN * torch_s``)
        self.timings: dict[Signature, Timing] = {}
        #: the modules whose forward calls ``F.scaled_dot_product_attention`` (found on the first training batch)
        self.routed: Optional[list[str]] = None
        self._kernels: list[SDPBackend] = []
        self._router: Optional[Router] = None
        self._recorder: Optional[CallerRecorder] = None
        self._restored_routes: Optional[list[str]] = None
        self._warned: set[str] = set()
        self._stack = ExitStack()

    @override
    def transform_model(self, module: nn.Module) -> None:
        device, dtype = _compute_device_and_dtype(module)
        trainer = lightning_compat.attached_trainer(module)
        # Probe under the precision plugin's forward context: autocast ("bf16-mixed") changes the dtype.
        context = trainer.strategy.precision_plugin.forward_context if trainer is not None else None
        errors = {name: kernel_error(name, device, dtype, context) for name in (*_AUTO_ORDER, "blocked")}
        available = [name for name in (*_AUTO_ORDER, "blocked") if errors[name] is None]
        if self.backend != "auto" and self.backend not in available:
            hint = ""
            if self.backend == "flash" and device.type == "cuda" and dtype == torch.float32:
                hint = " Flash attention needs float16/bfloat16: train with precision='bf16-true' or 'bf16-mixed'."
            raise ValueError(
                f"AttentionKernel(backend={self.backend!r}): the {self.backend!r} attention kernel is not available on "
                f"{device.type} with {dtype} (torch: {errors[self.backend]}).{hint} Available here: {available}; "
                "choose one of them or 'auto'."
            )
        self.chosen = [n for n in available if n != "blocked"][0] if self.backend == "auto" else self.backend
        hf_models = _attention_models(module)
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
        if self.backend == "auto":
            self._kernels = [KERNELS[n] for n in available if n != "blocked"]
        else:  # "blocked": the calls it does not take run on torch's own choice
            self._kernels = [KERNELS[self.chosen]] if self.chosen in KERNELS else []
        blocked = self.backend == "blocked" or (self.backend == "auto" and "blocked" in available)
        self._router = Router(self.backend == "blocked", self.timings) if blocked else None
        unroute(module)  # an earlier AttentionKernel's routing; this one finds the callers again
        self.routed = None
        note = ""
        if hf_models:
            note = f"; transformers attn_implementation={implementation!r}"
            if self.chosen == "flash" and implementation == "sdpa" and device.type == "cuda":
                note += " (torch's flash kernel; pip install flash-attn for flash_attention_2)"
        rank_zero_info(f"lightning_hbm: attention kernel {self.chosen!r} ({self.backend}) on {device.type}/{dtype}{note}")

    def _kernel_scope(self) -> AbstractContextManager:
        """torch's kernel choice (``sdpa_kernel``), or nothing to enter."""
        if self.chosen is None or not self._kernels:
            return nullcontext()
        return sdpa_kernel(self._kernels, set_priority=self.backend == "auto")

    def _enter(self) -> None:
        self._exit()  # a batch that raised never reached its *_batch_end
        self._stack.enter_context(self._kernel_scope())

    def _exit(self) -> None:
        self._stack.close()

    @contextmanager
    def scope(self) -> Iterator[None]:
        """The kernel choice around code run outside the Trainer's batch hooks (a benchmark's own training step).

        After fit: the timings "auto" made in fit apply; no new shape is timed.
        """
        self._enter()
        try:
            yield
        finally:
            self._exit()

    def _route(self, pl_module: pl.LightningModule, names: list[str]) -> None:
        assert self._router is not None
        self.routed = names
        route(pl_module, names, self._router)
        classes = ", ".join(dict.fromkeys(type(pl_module.get_submodule(n)).__name__ for n in names))
        if names:
            rank_zero_info(f"lightning_hbm: attention routed through {len(names)} modules ({classes})")
        elif self.backend == "blocked":
            rank_zero_warn(
                f"AttentionKernel('blocked'): no module of {type(pl_module).__name__} called "
                "F.scaled_dot_product_attention in the first training step, so the blocked kernel runs nowhere. Use "
                "a model whose attention calls it (transformers models: attn_implementation='sdpa'), or drop the callback."
            )

    def _settle(self) -> None:
        """After a training step: warn about calls "blocked" could not take; time the shapes "auto" has not seen."""
        assert self._router is not None
        for why, shapes in self._router.refused.items():
            if why not in self._warned and self.backend == "blocked":
                self._warned.add(why)
                rank_zero_warn(
                    f"AttentionKernel('blocked'): attention calls with {why} (e.g. q, k, v of shapes {shapes}) ran on "
                    "torch's kernel instead. Remove the cause (e.g. attention dropout 0) or use backend='auto'."
                )
        self._router.refused.clear()
        seen, self._router.seen = self._router.seen, {}
        if self.backend != "auto":
            return
        for signature, call in seen.items():
            if signature not in self.timings:
                timing = self.timings[signature] = time_kernels(call)
                choice = "blocked" if self._router.uses_blocked(signature) else f"torch's ({self.chosen})"
                rank_zero_info(
                    f"lightning_hbm: attention ({signature}): forward + backward {timing.torch_s * 1e3:.2f} ms on "
                    f"torch's {self.chosen} kernel, {timing.blocked_s * 1e3:.2f} ms blocked -> {choice} kernel from "
                    "the next step on"
                )

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._enter()
        if self._router is None or self.routed is not None:
            return
        restored, self._restored_routes = self._restored_routes, None
        if restored is not None and set(restored) <= {n for n, _ in pl_module.named_modules()}:
            self._route(pl_module, restored)  # a resumed run: routed as the run it resumes, from its first step
        else:  # the first step runs torch's kernel, and finds the modules that call attention (no extra forward)
            self._recorder = CallerRecorder(pl_module, self._router)
            self._stack.enter_context(self._recorder)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        recorder, self._recorder = self._recorder, None
        self._exit()  # the recorder's hooks and mode first: the timing below runs its own attention calls
        if recorder is not None:
            self._route(pl_module, list(recorder.found))
        if self._router is not None:
            with self._kernel_scope():  # torch's kernel timed as the step ran it
                self._settle()

    @override
    def state_dict(self) -> dict[str, Any]:
        if self.routed is None and not self.timings:
            return {}
        return {"timings": [(tuple(s), tuple(t)) for s, t in self.timings.items()], "routed": self.routed}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.timings.clear()  # the router reads this dict
        self.timings.update({Signature(*s): Timing(*t) for s, t in state_dict.get("timings", [])})
        self._restored_routes = state_dict.get("routed")

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


__all__ = ["BACKENDS", "KERNELS", "AttentionKernel", "kernel_error"]
