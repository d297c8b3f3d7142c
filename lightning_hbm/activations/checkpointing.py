"""``ActivationCheckpointing``: recompute the activations of repeated blocks in backward.

What it shrinks: the **activations** term. Without recompute, every transformer block keeps
about ``s*b*h*(34 + 5*a*s/h)`` bytes alive for backward (Korthikanti et al.); with full recompute
it keeps only its input (``2*s*b*h``) and runs its forward a second time in backward. Lightning
offers this only inside FSDP; this callback gives it to any strategy (single device, DDP).

This module is the Lightning face, a thin adapter (as Lightning's ``ThroughputMonitor`` over ``Throughput``): it
holds the settings and the run's state and calls, at its hooks, the mechanism in :mod:`~lightning_hbm.activations.recompute`
(the blocks chosen and wrapped, what the first step tells) and :mod:`~lightning_hbm.activations.block_forward` (one
block's checkpointed ``forward``: non-reentrant ``torch.utils.checkpoint`` around the block's own forward, names and
state_dict keys unchanged).

The names this module held before session 34 stay importable from it: the offload hooks' (``OffloadSavedTensors``,
``host_footprint``, ...), ``check_offload_blocks``, ``report_chunks``, ``mutated_arguments``, ``find_blocks``, and the classes a pickled
model names by this module's path (``_BlockSetup``, its former name ``_BlockPlan``, ``_CheckpointedForward``).
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor, nn
from typing_extensions import override

from lightning_hbm._validate import check_args
from lightning_hbm.activations import recompute
from lightning_hbm.activations.block_forward import _BlockSetup as _BlockSetup  # a pickled model names it here
from lightning_hbm.activations.block_forward import _CheckpointedForward as _CheckpointedForward  # and this one
from lightning_hbm.activations.block_forward import mutated_arguments as mutated_arguments
from lightning_hbm.activations.offload import PIECE_BYTES as PIECE_BYTES  # the former home of the offload hooks
from lightning_hbm.activations.offload import OffloadSavedTensors, host_footprint, pinned_footprint, pinned_pieces
from lightning_hbm.activations.offload import _Pieces as _Pieces
from lightning_hbm.activations.recompute import check_offload_blocks as check_offload_blocks
from lightning_hbm.activations.recompute import (
    check_offload_device,
    check_settings,
    checkpoint_blocks,
    recount_coverage,
    report_chunks,
    resolve_blocks,
)
from lightning_hbm.activations.regenerate import Remade
from lightning_hbm.adapters.lora.order import LastAdapted, adapter_first
from lightning_hbm.layers.blocks import find_blocks as find_blocks  # imported from here (and callbacks.activation_checkpointing) before
from lightning_hbm.naming import has_submodule
from lightning_hbm.surgery import Stage, SurgeryCallback

#: the former name of :class:`_BlockSetup` (issue 54, session 33), kept only so that a model pickled before the rename
#: (``torch.save(model)``, a deep-copied Trainer's pickle) still loads: pickle finds a class by module and name, and
#: such a file names this one. Not used by the package; ``CheckpointedForward.__setstate__`` reads its former key.
_BlockPlan = _BlockSetup


class ActivationCheckpointing(SurgeryCallback):
    """Non-reentrant activation checkpointing of the model's repeated blocks, for any strategy.

    Args:
        policy: ``"full"`` recomputes the whole block in backward (keeps only its input);
            ``"selective"`` keeps the outputs of attention kernels and of matmuls contracting 64
            features or more, a quantized base's own matmul operators included
            (:class:`lightning_hbm.activations.selective.SelectivePolicy`), and recomputes the rest (norms,
            activations, residual adds, a LoRA adapter's low-rank products): less memory saved, less time spent.
        blocks: class names (``"LlamaDecoderLayer"``) or module paths relative to the
            LightningModule (``"model.h.0"``) to checkpoint. ``None`` finds the repeated blocks
            automatically (children of an ``nn.ModuleList`` sharing one class).
        every: checkpoint every ``every``-th block only (blocks 0, every, 2*every, ...): trades
            memory for time.
        offload: also move the tensors the checkpointed blocks save for backward (their inputs)
            to ``offload_device`` and bring them back for backward (pinned memory and a side
            stream on CUDA, so the copy overlaps with compute). ``True``: every checkpointed block; an int ``k``:
            the first ``k`` checkpointed blocks only (partial offload, for a host that cannot hold every input;
            ``0``: none), the rest keep their inputs on the device. A number of blocks, not a byte budget: the set
            offloaded is then the same at every sequence length (a byte budget would offload fewer blocks on a longer
            batch, so the device peak would grow past what was planned for it), as Megatron-Core's
            ``cpu_offloading_num_layers``; the bytes a host budget allows are turned into a count by
            :func:`lightning_hbm.planner.max_context` (``host_budget=``, reported in its choices).
        offload_device: where offloaded tensors go. ``"cpu"`` (host memory) is what a GPU run
            wants; on a CPU-only run the copy lands on the same device and saves nothing.
        mlp_chunks: recompute each block's token-wise layers that save most for backward (the MLP; a bf16 RMSNorm
            that computes in fp32, in the blocks and beside them) in this many chunks of tokens
            in the backward, so that only one chunk's intermediates live at once (``policy="full"`` only); the
            layers fed straight by a chunked one that keep a copy of their input (q/k/v behind ``input_layernorm``)
            then keep nothing and remake it in the backward (whole, the same gradients bit for bit). Which
            layers is decided by running them on the first training step
            (:func:`lightning_hbm.activations.token_chunks.decide`); a block none of whose layers qualifies is named
            in a warning with the reasons (the planner decides on its fake tensors by following the layers' ops:
            :mod:`lightning_hbm.activations.token_rows`). Same arithmetic, but each chunk dequantizes a quantized base again:
            measured on CPU at the 100M shape (1024 tokens), 2 chunks cost 4 % of the step and 4 chunks 9 %
            (``benchmarks/README.md``). ``1`` (the default): no chunks.
        regenerate: keep the input of every ``regenerate``-th checkpointed block only (blocks 0, n, 2n, ...: offloaded
            or on the device as ``offload`` says); each block between remakes its input in the backward by running the
            blocks before it forward again from the kept one (:mod:`lightning_hbm.activations.regenerate`): ``1/n`` of
            the inputs' memory (the host's, offloaded) for ``(n-1)/2`` more block forwards per block, the same
            gradients. ``policy="full"`` and ``every=1`` only. ``1`` (the default): every input kept.

    Applied at lightning_hbm's surgery point (:mod:`lightning_hbm.surgery`, stage
    ``CHECKPOINTING``): after quantization and adapters, before the optimizer exists.
    Parameter names and state_dict keys do not change.

    Logged keys (only with ``offload=True``, every training step):
        ``activations/offloaded_bytes``: bytes copied to ``offload_device`` in the step's forwards.

    Example::

        trainer = Trainer(callbacks=[ActivationCheckpointing("selective", every=2)])

    YAML (LightningCLI)::

        trainer:
          callbacks:
            - class_path: lightning_hbm.ActivationCheckpointing
              init_args: {policy: full, offload: true}
    """

    stage = Stage.CHECKPOINTING
    reapply = True  # a new instance re-wraps the blocks with its own settings (no parameter changes)

    def __init__(
        self,
        policy: Literal["full", "selective"] = "full",
        blocks: Optional[list[str]] = None,
        every: int = 1,
        offload: Union[bool, int] = False,
        offload_device: str = "cpu",
        mlp_chunks: int = 1,
        regenerate: int = 1,
    ) -> None:
        check_args(ActivationCheckpointing.__init__, locals())
        device = check_settings(policy, blocks, every, offload, offload_device, mlp_chunks, regenerate)
        self.policy = policy
        self.blocks = list(blocks) if blocks is not None else None
        self.every = every
        self.mlp_chunks = mlp_chunks
        self.regenerate = regenerate
        #: inputs remade in the step's backward (``regenerate > 1``), and the blocks that could not remake theirs
        self.remade = Remade(regenerate)
        self._remade_warned: set[str] = set()
        self._keywords_warned: set[str] = set()
        self.offload: Optional[OffloadSavedTensors] = OffloadSavedTensors(device) if offload else None
        #: how many of the checkpointed blocks (the first ones) offload their inputs; None: every one (offload=True)
        self.offload_blocks: Optional[int] = None if isinstance(offload, bool) else offload
        #: the blocks whose inputs were offloaded (the first ``offload_blocks`` of :attr:`checkpointed`)
        self.offloaded: list[str] = []
        self.checkpointed: list[str] = []
        #: the layers recomputed in token chunks, decided on the first training step (``mlp_chunks > 1``)
        self.chunked: list[str] = []
        self._chunk_report_due = False
        self._coverage_due = False  # the coverage table told of blocks the first training forward left unchecked
        #: the LoRA layers that compute their adapter term first (the last one of each block, found on the first
        #: training step under policy="full"): the recompute then stops before their base matmul
        self.adapter_first: list[str] = []
        self._order_due = False
        self._order: Optional[LastAdapted] = None
        self._restored_order: Optional[list[str]] = None  # a checkpoint's adapter_first: a resumed run starts with it
        self._resolved: Optional[list[str]] = None  # resolved by check_model on the model as built

    @override
    def check_model(self, module: nn.Module) -> None:
        """Resolve the blocks on the model as the user built it, before quantization and adapters.

        Names, not module objects, are kept: a block that quantization or LoRA replaces (``blocks=["Linear"]``)
        is checkpointed in its changed form, at the same path.
        """
        self._resolved = resolve_blocks(module, self.blocks, self.every)
        check_offload_blocks(self.offload_blocks, len(self._resolved))
        check_offload_device(self.offload)

    @override
    def transform_model(self, module: nn.Module) -> None:
        names = self._resolved if self._resolved is not None else resolve_blocks(module, self.blocks, self.every)
        self._resolved = None
        check_offload_blocks(self.offload_blocks, len(names))
        # the first blocks' inputs are offloaded (recompute.checkpoint_blocks says why the first ones)
        moved = len(names) if self.offload_blocks is None else self.offload_blocks
        self.remade = Remade(self.regenerate)
        counts = self.remade if self.regenerate > 1 else None  # regenerate=n: each forward linked to the one before
        # A model checkpointed by an earlier Trainer's callback gets this callback's settings instead.
        checkpoint_blocks(module, names, self.policy, self.offload, moved, self.mlp_chunks, counts)
        self._chunk_report_due = self.mlp_chunks > 1
        self._coverage_due = True
        self._order_due = self.policy == "full"  # selective keeps the matmul outputs: no base matmul to skip
        self.checkpointed = list(names)
        self.offloaded = self.checkpointed[:moved] if self.offload is not None else []
        offloaded = "" if self.offload is None else ", offload" if self.offload_blocks is None else f", offload of the first {moved}"
        remade = "" if self.regenerate == 1 else f", the input of one block in {self.regenerate} kept, the others remade"
        classes = dict.fromkeys(type(module.get_submodule(n)).__name__ for n in names)
        rank_zero_info(
            f"lightning_hbm: activation checkpointing ({self.policy}{offloaded}{remade}) "
            f"on {len(names)} blocks ({', '.join(classes)})"
        )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # the strategy's setup ran: FSDP2's units exist (QuantizedFSDPStrategy shards after the surgery)
        blocks = [n for n in self.checkpointed if has_submodule(pl_module, n)]  # as wrapped (a later change: not looked at)
        recompute.warn_fsdp_units(pl_module, blocks, self.regenerate, self._remade_warned)

    @override
    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        if self.offload is not None:
            self.offload.reset_counts()
        self.remade.reset()
        if self._order_due:
            self._order_due = False
            restored, self._restored_order = self._restored_order, None
            if restored and all(has_submodule(pl_module, n) for n in restored):
                # the run that saved it chose these: the same order from the first step, as uninterrupted
                self.adapter_first = [n for n in restored if adapter_first(pl_module.get_submodule(n))]
            else:
                self._order = LastAdapted(pl_module, self.checkpointed)

    @override
    def on_before_backward(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loss: Tensor) -> None:
        if self._order is not None:
            self._order.stop()  # the forward's order: the recompute may stop early

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._chunk_report_due:
            self._chunk_report_due = False
            self.chunked = report_chunks(pl_module, self.checkpointed, self.mlp_chunks)
        if self._coverage_due:
            self._coverage_due = False
            recount_coverage(pl_module)
        if self._order is not None:
            self.adapter_first, self._order = self._order.apply(pl_module), None
            if self.adapter_first:
                rank_zero_info(
                    f"lightning_hbm: the recompute skips the base matmul of {len(self.adapter_first)} layers (the last "
                    f"adapted layer of each block, e.g. {self.adapter_first[0]}): there their LoRA term is computed "
                    "first, so checkpoint's early stop ends the recompute before it (the same saved tensors)"
                )
        if self.offload is not None:
            pl_module.log("activations/offloaded_bytes", float(self.offload.copied_bytes), on_step=True, on_epoch=False)
        self.warn_unremade()
        self.warn_keywords_kept()

    def warn_keywords_kept(self) -> None:
        """Warn (once per block) about offloaded blocks called with a large tensor as a keyword: it stays on the device."""
        recompute.warn_keywords_kept(self.offload, self._keywords_warned)

    def warn_unremade(self) -> None:
        """Warn (once per block) about blocks that keep their input under ``regenerate`` because it is not the output of
        the checkpointed block called just before them (:func:`~lightning_hbm.activations.recompute.warn_unremade`)."""
        recompute.warn_unremade(self.remade, self.regenerate, self._remade_warned)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"adapter_first": list(self.adapter_first)} if self.adapter_first else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_order = state_dict.get("adapter_first")


__all__ = ["ActivationCheckpointing", "OffloadSavedTensors", "host_footprint", "pinned_footprint", "pinned_pieces"]
