"""The ``FusedLoss`` callback: finds the output heads and makes them return :class:`LazyLogits`."""

from __future__ import annotations

from typing import Literal, Optional, Sequence, Union

from lightning.pytorch.utilities import rank_zero_info
from torch import nn
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.activations.loss.lazy import _HeadState, _LazyHead
from lightning_hbm.layers import output_heads
from lightning_hbm.surgery import Stage, SurgeryCallback


def default_heads(module: nn.Module) -> list[str]:
    """The output heads :func:`lightning_hbm.layers.output_heads` finds, else Linear-like modules named ``lm_head``."""
    heads = output_heads(module)
    if not heads:
        heads = [n for n, m in module.named_modules() if n.rpartition(".")[2] == "lm_head"]
    return heads


def _model_name(module: nn.Module, head: str) -> str:
    """The class owning ``head`` and the root's (``BartForConditionalGeneration in MyModule``), for warnings."""
    owner = module.get_submodule(head.rpartition(".")[0])
    if owner is module:
        return type(module).__name__
    return f"{type(owner).__name__} in {type(module).__name__}"


class FusedLoss(SurgeryCallback):
    """Compute the output head and the cross-entropy chunk by chunk, never the full logits.

    Args:
        heads: module names of the output heads (default: :func:`lightning_hbm.layers.output_heads`: transformers'
            output embeddings, a tied head, or the last Linear as wide as the vocabulary; else modules named ``lm_head``).
        chunk_size: tokens per chunk (default: as many as fit :data:`CHUNK_BYTES`, 32 MiB of logits beside the fp32
            rows being softmaxed, at least :data:`MIN_CHUNK_TOKENS` = 96: 394 tokens at a 32k bf16 vocabulary, 98 at 128k).
        kernel: ``"auto"`` (Liger's fused kernel on CUDA when ``liger-kernel`` is installed and the head is
            a plain ``nn.Linear``, else chunked), ``"chunked"`` (always the portable path).

    Your model code does not change: a transformers causal LM called with ``labels=`` and a
    ``training_step`` computing ``F.cross_entropy(logits[..., :-1, :].reshape(-1, V), y)`` (or
    ``nn.CrossEntropyLoss()``) both go through the fused path. ``ignore_index``, ``label_smoothing`` and
    ``reduction`` are honoured. Elementwise ops on the logits stay fused, applied chunk by chunk: ``tanh``
    (soft-capping) and ``+ - * /`` by a number or a tensor along the vocabulary (BART's ``final_logits_bias``, a
    per-vocab or scalar scale, trainable or not). Anything else (``sort``, ``@``, ``gather``, class weights,
    probability targets) computes the full logits, with a ``UserWarning`` at the first step naming the op and the model.

    Logged keys: none (no metric).

    Example::

        trainer = Trainer(plugins=[QuantizedPrecision("nf4-dq")], callbacks=[LoRA(r=16), FusedLoss()])

    YAML (LightningCLI)::

        trainer:
          callbacks:
            - class_path: lightning_hbm.FusedLoss
              init_args: {chunk_size: 1024}
    """

    stage = Stage.KERNELS
    reapply = True  # idempotent: a new instance installs its own settings

    def __init__(self, heads: Optional[Union[str, Sequence[str]]] = None, chunk_size: Optional[int] = None,
                 kernel: Literal["auto", "chunked"] = "auto") -> None:
        check_args(FusedLoss.__init__, locals())
        if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size <= 0):
            raise ValueError(f"FusedLoss(chunk_size={chunk_size!r}): give a positive number of tokens, or None for automatic.")
        if kernel not in ("auto", "chunked"):
            raise ValueError(f"FusedLoss(kernel={kernel!r}): choose 'auto' or 'chunked'.")
        if isinstance(heads, str):
            heads = [heads]
        if heads is not None and not heads:
            raise ValueError("FusedLoss(heads=[]): an empty list fuses nothing. Name the output head(s), e.g. "
                             "heads=['lm_head'], or pass None to find them automatically.")
        self.heads = list(heads) if heads is not None else None
        self.chunk_size, self.kernel = chunk_size, kernel
        self.applied_heads: list[str] = []

    def _resolve(self, module: nn.Module) -> list[str]:
        names = dict(module.named_modules())
        heads = self.heads if self.heads is not None else default_heads(module)
        linears = sorted((n for n, m in names.items() if hasattr(m, "out_features")),
                         key=lambda n: -int(names[n].out_features))[:5]
        if not heads:
            raise ValueError(
                f"FusedLoss: found no output head in {type(module).__name__} (no transformers model, no module named "
                f"'lm_head'). Name it: FusedLoss(heads=[...]); the widest Linear layers here are {linears}."
            )
        missing = [h for h in heads if h not in names]
        if missing:
            raise ValueError(f"FusedLoss(heads={heads}): {missing} match no submodule. Linear layers here: {linears}.")
        not_linear = [h for h in heads if not hasattr(names[h], "out_features")]
        several = [h for h in not_linear if isinstance(names[h], nn.ModuleList) and all(hasattr(m, "out_features") for m in names[h])]
        if several:  # transformers' Musicgen: one head per codebook, the model's loss over all of them
            raise ValueError(
                f"FusedLoss: the output head(s) {several} of {type(module).__name__} are lists of Linear heads "
                f"({', '.join(f'{len(names[h])} in {h}' for h in several)}: one output each, e.g. one per codebook), and "
                "FusedLoss fuses the loss of one head's logits. Leave FusedLoss out of the Trainer's callbacks for this "
                "model (its loss then runs as written; LoRA and ActivationCheckpointing work without it)."
            )
        if not_linear:
            raise ValueError(
                f"FusedLoss(heads={heads}): {not_linear} have no `out_features` (not Linear-like: "
                f"{[type(names[h]).__name__ for h in not_linear]}). Name the Linear that produces the logits: {linears}."
            )
        return heads

    @override
    def check_model(self, module: nn.Module) -> None:
        self._resolve(module)

    @override
    def transform_model(self, module: nn.Module) -> None:
        self.applied_heads = self._resolve(module)
        for name in self.applied_heads:
            head = module.get_submodule(name)
            # an instance attribute shadows the class's forward; the state calls the class's forward
            state = _HeadState(name, head, self.chunk_size, self.kernel, _model_name(module, name))
            torch_compat.override_forward(head, _LazyHead(state))
        rank_zero_info(f"lightning_hbm: FusedLoss on {self.applied_heads} (chunked cross-entropy, kernel={self.kernel!r})")

