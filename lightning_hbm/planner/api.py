"""The planner's API: predict every configuration's peak memory before training, and pick one that fits.

What it shrinks: nothing by itself. It predicts the five terms of the memory sum
(:data:`lightning_hbm.memory.categories.CATEGORIES`) for each :class:`~lightning_hbm.planner.candidates.Candidate`
(precision mode x LoRA rank x activation checkpointing x optimizer kind), so that a user (or
:class:`~lightning_hbm.AutoFit`) can choose before the first step instead of trying until OOM. How a
step is traced without allocating the model: :mod:`lightning_hbm.planner.tracing`. Deep models are
traced with their repeated blocks cut to 3 and 4 and extended linearly (:func:`predict`).

Assumptions (stated, not measured here):

* ``CUDA_CONTEXT_BYTES``: the CUDA context and allocator reserve beyond the live tensors; added on
  ``device="cuda"`` only (the category sum is what ``torch.cuda.max_memory_allocated`` sees).
* The trace runs CPU kernels on fake tensors. For ``device="cuda"`` torch optimizers are traced with
  their CUDA default (foreach), but attention kernels keep the CPU choice (CUDA flash/efficient SDPA
  save a logsumexp instead), and cuBLAS workspaces are in the overhead constant.
* Step-time costs: :mod:`lightning_hbm.planner.candidates`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional, Union, cast

import lightning.pytorch as pl
from torch import nn

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations import ActivationCheckpointing
from lightning_hbm.activations.recompute import check_offload_blocks
from lightning_hbm.layers import CONV, LayerKind, kind_of
from lightning_hbm.memory import (
    CATEGORIES,
    LOSS_SCOPE,
    TERMS,
    host_terms,
    parameter_bytes,
    quantization_tensors,
    scope_terms,
    tensor_bytes,
    term,
)
from lightning_hbm.planner.block_cuts import _block_list
from lightning_hbm.planner.building import ModelLike, Template, _build, _fake_mode, _quiet_logs, build_template
from lightning_hbm.planner.candidates import Candidate, default_candidates, format_bytes, parse_bytes
from lightning_hbm.planner.fallbacks import UntraceableModule
from lightning_hbm.planner.peaks import END_OF_BACKWARD, block_index
from lightning_hbm.planner.realvalues import RealValues
from lightning_hbm.planner.trace_result import Trace
from lightning_hbm.planner.tracing import Decided, remade_unit
from lightning_hbm.planner.tracing import trace as _trace
from lightning_hbm.precision import QuantizedPrecision, get_format, quantize_model, to_dtype
from lightning_hbm.precision.config import EMBEDDINGS_AUTO
from lightning_hbm.precision.correction import CalibratedCorrection
from lightning_hbm.precision.sensitivity import ladder, weight_bytes

BatchLike = Union[Any, pl.LightningDataModule]

#: CUDA context + caching-allocator reserve beyond the live tensors, added to every prediction on CUDA.
#: ~500 MiB is what a CUDA 12 context takes on an A100/H100 with torch loaded; the rest is a margin for
#: allocator rounding/fragmentation. A stated constant, to be replaced by the GPU benchmark's figure.
CUDA_CONTEXT_BYTES = 768 * 2**20
#: The host term the ``offload`` axis predicts: the optimizer states it moves off the device.
HOST_OFFLOAD = term("host_offload").name
#: The host term the ``offload_activations`` axis predicts on CUDA: the checkpointed blocks' inputs, pinned.
HOST_ACTIVATIONS = term("host_activations").name


#: What the plan says of a selection by a mask without values (:attr:`Prediction.selections`).
_SELECTED = (
    "the LightningModule's own code (training_step, forward): planned with every element of the mask selected, the "
    "largest size it can have (an upper bound; a mask of at most lightning_hbm.planner.realvalues.MAX_TWIN_ELEMENTS "
    "elements is read exactly)"
)


@dataclass(frozen=True)
class Prediction:
    """The predicted memory of one candidate.

    Attributes:
        candidate: the configuration.
        categories: bytes per category (:data:`CATEGORIES`) at the predicted peak of a steady-state step.
        overhead: stated constant added on CUDA (:data:`CUDA_CONTEXT_BYTES`), 0 on CPU.
        trainable_params / total_params: parameter counts after the transforms (4-bit counted unpacked).
        cost: relative step time (:meth:`Candidate.relative_cost`).
        budget: the budget it was checked against, or None.
        host_bytes: bytes moved to CPU memory by ``offload`` (not part of ``peak``).
        block_bytes: bytes FSDP2 gathers for the largest repeated block (transformer layer), after the transforms: its
            parameters without its quantization constants (those stay whole on every rank: :attr:`replicated_bytes`).
        guessed_reads: values the traced code read that the planner could not know (``loss.item()``, a
            check over a large tensor), answered 0 / ``False`` (:mod:`lightning_hbm.planner.realvalues`).
        loss: bytes of the peak that ``FusedLoss`` holds (chunk logits, the fp32 rows softmaxed, the dequantized head,
            the hidden-state gradient): a term inside ``categories`` (HBMProfiler's ``loss``), 0 without it.
        side: bytes of every term beside the sum, by name (each scope term of the registry at the peak, registered
            ones included, and the host terms); ``loss`` and ``host_bytes`` are two of them with their own attribute.
        fallbacks: modules whose forward cannot run on fake tensors, run for real on zeros of their inputs'
            shapes instead, with the reason (``"blocks.0.mixer (real tensors: DynamicOutputShapeException: ...)"``):
            their outputs and what they save for backward are counted; temporaries inside them are not, and a
            data-dependent size is the one zeros give.
        uncut: why the trace with the repeated blocks cut failed (the model indexes a block beyond the cut: SAM's
            ``output_hypernetworks_mlps[3]``), or why the line through the cut traces is not the model's (they peak at
            points that do not correspond, :class:`PeaksApart`), when the whole model was traced instead; ``""`` when
            the cut traced and its line holds.
        selections: selections by a boolean mask in the LightningModule's own code (a detection loss's ``boxes[fg]``)
            whose mask fake tensors hold no values for (more than ``MAX_TWIN_ELEMENTS`` elements): planned with every
            element selected, the largest size they can have (an upper bound), by op and mask size.
        host_sizes: bytes of each tensor ``ActivationCheckpointing(offload=True)`` moves to pinned host memory (device
            ``"cuda"``), before the allocator rounds it up (``host_activations`` is their rounded sum).
        offloaded_blocks: checkpointed blocks whose inputs ``ActivationCheckpointing(offload=...)`` moves (all of
            them for ``True``, the first ``k`` for ``offload=k``; 0 without offload).
        replicated_bytes: the parameter bytes FSDP2 keeps whole on every rank, inside ``categories["parameters"]``: the
            quantization constants (absmax, code books, int8 row scales; :func:`quantization_constant_bytes`).
        replicated_state_bytes: the optimizer-state bytes FSDP2 keeps whole on every rank, inside
            ``categories["optimizer_states"]``: the 0-dim states (Adam's ``step``, 4 B per trainable parameter), plain
            tensors beside the sharded ones (:meth:`per_rank`; before session 35 split with them: 56-60 B per rank
            under on the 2-rank Llama layouts).
        remainder_bytes: the parameter bytes outside the repeated blocks in ``QuantizedFSDPStrategy``'s unit around
            them (a causal LM's ``model``: embeddings, final norm, a head inside it; quantization constants excluded),
            gathered while its forward and its backward run; 0 when no child of the LightningModule holds the blocks.
        unchecked: blocks ``ActivationCheckpointing`` chose but runs without checkpoint, their activations kept (and
            counted so): their forward changes a list or dict it is given (diffusers' Wan VAE ``feat_cache``), found on
            the first training forward of the trace as in training, with what changed.
        routed: lists of modules some of which the traced step did not run while it ran others of their class (the
            experts a router did not pick, layers LayerDrop skipped), with how many (``"model.encoder.block.1.layer.1.
            mlp.experts (4 of 16 SwitchTransformersDenseActDense not run by the traced step)"``): their trainable
            parameters' optimizer states are counted all the same, as a long run runs every one and Adam keeps the
            states of each it has updated; their gradients are not (at the peak they are one step's).
            :mod:`lightning_hbm.planner.routed` says which modules count.
        regions: per phase of the step, each region's peak bytes (``"before the blocks"``, ``"block 0"``, ``"after block
            -1"``, ...; :class:`~lightning_hbm.planner.peaks._PeakPoints`): where :meth:`per_rank` finds the peak of
            a rank, whose gathered parameters change from region to region.
        units: the strategy's other units outside the blocks (children of the LightningModule beside the one around
            the blocks: a head beside a backbone; :func:`~lightning_hbm.strategies.fsdp_qlora.remainder_units`), by
            name: the parameter bytes each gathers (constants excluded), only in its own region ``unit <name>``.
        forward_gradients: the gradient bytes alive through the forward (the previous step's, set to None before the
            backward): sharded per rank under FSDP2.
        rooted_blocks: no child of the LightningModule holds the blocks (its own ``nn.ModuleList`` of them): each block
            is an FSDP2 root of its own, its all-gather buffer freed at its own forward's end, nothing prefetched.
        block_gradient_bytes: the gradient bytes the largest block's backward makes (its trainable parameters'): per
            rank under FSDP2 a shard of each block done, and one whole reduce-scatter input (:func:`fsdp2_gradient_bytes`).
        depth: the model's number of blocks (the regions of the first blocks are named from the start).
        unit_gradient_bytes: the gradient bytes each unit apart makes in its backward (its trainable parameters': a head
            adapted by LoRA or trained as ``modules_to_save``), by name: per rank under FSDP2 a shard more than the
            trace has, once that unit's backward is done (:func:`fsdp2_unit_gradient_bytes`).
        inner_units: the strategy's units inside the unit around the blocks that are no block and hold none
            (transformers ConvNext's ``downsampling_layer`` members; :func:`~lightning_hbm.strategies.fsdp_qlora.inner_units`),
            by name: the parameter bytes each gathers (constants excluded, not in :attr:`remainder_bytes`), in its own
            region ``unit <name>`` beside the unit around the blocks (:func:`fsdp2_gathered_bytes`).
        remainder_gradient_bytes: the gradient bytes of the unit around the blocks (its trainable parameters outside
            the blocks: an embedding trained inside the backbone), reduce-scattered at the end of the backward
            (:func:`fsdp2_root_gradient_bytes`).
        remade_unit: the blocks of one unit the regions of the blocks are named by (``block 1 of unit -1``), under
            ``ActivationCheckpointing(regenerate=n)``: ``every * n``; 1 otherwise (:func:`~lightning_hbm.planner.peaks.block_index`).
        kept_from: under a partial offload (``ActivationCheckpointing(offload=k)``), the index of the first block that
            keeps its input (``k * every``): the blocks before it from the third on are named from the end of the
            offloading part (``block offloading -1``); None without one.
        chosen_convs: the convolutions whose mode the fit chooses at its start, on its probe batch and the model's real
            weights (a 4-bit ``precision`` without ``layer_modes``: the most sensitive widened to ``sensitive_mode``),
            by name: the bytes each adds stored in the widest mode it may take. The plan stores each in ``precision``
            (the trace holds no real weight to measure): under by at most their sum, said in :meth:`Plan.notes`; a
            fit's ``plugin.layer_modes`` given as ``Candidate(layer_modes=...)`` plans its choice exactly
            (:func:`chosen_convolutions`).
        chosen_linears: the same for the Linears a sensitivity plan (``max_bytes_per_param`` / ``min_cosine``) measures
            at fit start (:func:`chosen_linears`).
    """

    candidate: Candidate
    categories: dict[str, int]
    overhead: int = 0
    trainable_params: int = 0
    total_params: int = 0
    cost: float = 1.0
    budget: Optional[int] = None
    host_bytes: int = 0
    block_bytes: int = 0
    guessed_reads: int = 0
    loss: int = 0
    fallbacks: tuple[str, ...] = ()
    side: dict[str, int] = field(default_factory=dict)
    uncut: str = ""
    selections: tuple[str, ...] = ()
    host_sizes: tuple[int, ...] = ()
    offloaded_blocks: int = 0
    replicated_bytes: int = 0
    remainder_bytes: int = 0
    replicated_state_bytes: int = 0
    unchecked: tuple[str, ...] = ()
    regions: dict[str, dict[str, int]] = field(default_factory=dict)
    units: dict[str, int] = field(default_factory=dict)
    forward_gradients: int = 0
    rooted_blocks: bool = False
    routed: tuple[str, ...] = ()
    block_gradient_bytes: int = 0
    depth: int = 0
    unit_gradient_bytes: dict[str, int] = field(default_factory=dict)
    inner_units: dict[str, int] = field(default_factory=dict)
    remainder_gradient_bytes: int = 0
    remade_unit: int = 1
    kept_from: Optional[int] = None
    chosen_convs: dict[str, int] = field(default_factory=dict)
    chosen_linears: dict[str, int] = field(default_factory=dict)

    def per_rank(self, world_size: int, backend: str = "gloo") -> dict[str, int]:
        """Bytes per category at the peak of each of ``world_size`` ranks under FSDP2 (``QuantizedFSDPStrategy``).

        Predict with the per-rank batch. Parameters (the quantization constants, :attr:`replicated_bytes`, whole on
        every rank), gradients and optimizer states are split (:func:`shard_categories`), activations are the
        single-device peak's, and ``other`` holds the rest of the rank's peak: the step's other bytes and the
        parameters gathered there. The peak is the largest region of the step (:attr:`regions`) less what sharding
        saves of the parameters and states (and in the forward of the previous step's gradients), plus what FSDP2 holds gathered in it (:func:`fsdp2_gathered_bytes`). On 2
        gloo ranks it is the measured peak to 4 B (1,658,956 planned, 1,658,960 measured by ``HBMProfiler``, in the
        backward of the last block: ``tests/strategies/test_fsdp_qlora.py``; Adam's 0-dim ``step`` tensors are whole
        on each rank, :attr:`replicated_state_bytes`, since session 35). It follows the units the strategy makes
        (:attr:`remainder_bytes`, :attr:`units`, :attr:`rooted_blocks`): a transformers ``LlamaModel`` with an untied
        head beside it, a tied ``LlamaForCausalLM``, and Llama layers in the LightningModule's own list beside its
        embedding, norm and head, each to 12 B or less on 2 gloo ranks (``tests/strategies/test_fsdp_remainder_units_s34.py``);
        blocks in the LightningModule's ``nn.Sequential``, called or iterated, and six checkpointed ones whose gradients
        (:attr:`block_gradient_bytes`, sharded as the backward goes) put the peak late in the backward, each to 28 B or
        less (``tests/strategies/test_fsdp_sequential_blocks_s35.py``); a head beside the backbone adapted by LoRA or
        trained whole (:attr:`unit_gradient_bytes`, a shard more once its backward is done), to 4 B
        (``tests/strategies/test_fsdp_trained_units_s35.py``); eight checkpointed blocks of which one input in two is
        remade (``ActivationCheckpointing(regenerate=2)``, linked through FSDP2's pre-forward function since session
        37), to 4 B (``tests/strategies/test_fsdp_sequential_blocks_s35.py``).
        Without regions (a Prediction built by hand) the peak's own categories gather the largest block and the
        remainder at once.

        Args:
            world_size: the number of ranks the model is sharded over.
            backend: the process group's backend, ``"gloo"`` (the default: CPU ranks, and the larger figure) or
                ``"nccl"``; gloo holds one more whole-size buffer at the end of the backward where the unit around the
                blocks trains parameters (:func:`fsdp2_root_gradient_bytes`; NCCL's figure is not yet run on GPU).

        Raises:
            ValueError: ``backend`` is neither ``"gloo"`` nor ``"nccl"``.
        """
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"Prediction.per_rank: backend must be 'gloo' or 'nccl' (the process group's), got "
                             f"{backend!r}.")
        gathered = self.block_bytes + self.remainder_bytes + max(self.units.values(), default=0)
        per_rank = shard_categories(self.categories, world_size, gathered_bytes=gathered,
                                    replicated_parameter_bytes=self.replicated_bytes,
                                    replicated_state_bytes=self.replicated_state_bytes)
        if world_size == 1 or not self.regions:
            return per_rank
        # parameters and optimizer states are the same all through the step: what sharding saves of them, saved everywhere
        saved = sum(self.categories[c] - per_rank[c] for c in ("parameters", "optimizer_states"))
        # the gradients: each rank's shard of them where the step holds them all (the previous step's, alive through
        # the forward; the optimizer step's), and in the backward what FSDP2's reduce-scatters hold of the blocks done
        grads = self.forward_gradients - -(-self.forward_gradients // world_size)
        peak = max(value - saved - (grads if phase.startswith("forward") or phase == "step" else 0)
                   - fsdp2_gradient_bytes(phase, region, self.block_gradient_bytes, self.depth, world_size,
                                          self.rooted_blocks, self.remade_unit, self.kept_from)
                   + fsdp2_gathered_bytes(phase, region, self.block_bytes, self.remainder_bytes, self.units,
                                          self.rooted_blocks, self.inner_units)
                   - fsdp2_unit_gradient_bytes(phase, list(regions), region, self.unit_gradient_bytes, world_size)
                   + fsdp2_root_gradient_bytes(region, self.remainder_gradient_bytes, self.block_gradient_bytes,
                                               self.depth, world_size, backend)
                   for phase, regions in self.regions.items() for region, value in regions.items())
        rest = peak - sum(per_rank[c] for c in CATEGORIES if c != "other")
        per_rank["other"] = max(rest, self.categories["other"])
        return per_rank

    @property
    def terms(self) -> dict[str, int]:
        """Bytes per memory term (:data:`lightning_hbm.memory.terms.TERMS`, registry order): the categories, then
        the terms beside them (:attr:`side`: ``loss`` inside them, ``host_offload`` off the device, any registered
        one; 0 when not predicted): HBMProfiler's columns."""
        # the two side terms that have their own attribute, for a Prediction built by hand; `side` as predicted wins
        side = {LOSS_SCOPE: self.loss, HOST_OFFLOAD: self.host_bytes, **self.side}
        return {t.name: self.categories[t.name] if t.kind == "category" else side.get(t.name, 0) for t in TERMS}

    @property
    def host(self) -> int:
        """Host memory the run needs beside the device: every host term (:func:`~lightning_hbm.memory.host_terms`)."""
        terms = self.terms
        return sum(terms[t.name] for t in host_terms())

    @property
    def peak(self) -> int:
        """Live tensor bytes at the peak (what ``torch.cuda.max_memory_allocated`` would report)."""
        return sum(self.categories.values())

    @property
    def total(self) -> int:
        """``peak + overhead``: what must fit in the device."""
        return self.peak + self.overhead

    @property
    def fits(self) -> Optional[bool]:
        return None if self.budget is None else self.total <= self.budget


def fsdp2_gathered_bytes(phase: str, region: str, block: int, remainder: int,
                         units: Optional[Mapping[str, int]] = None, rooted_blocks: bool = False,
                         inner: Optional[Mapping[str, int]] = None) -> int:
    """Bytes FSDP2 (``reshard_after_forward=True``, 2 ranks or more) holds gathered in ``region`` of ``phase`` (the
    planner's regions, :class:`~lightning_hbm.planner.peaks._PeakPoints`) beyond the sharded parameters, for blocks of
    ``block`` gathered bytes and ``remainder`` bytes outside them (the remainder unit(s), gathered through the forward
    and the backward).

    Read from torch 2.13's ``_fsdp_param_group`` and measured on 2 gloo ranks: besides a unit's unsharded parameters,
    the flat buffer its all-gather filled stays alive in the forward until the next unit's all-gather (freed after the
    copy-out only then, to overlap them), and in the backward each block's pre-backward prefetches the next block's
    all-gather (its flat buffer alive while the block's backward runs). So a block's region holds the remainder and two
    blocks, the forward before the blocks the remainder twice, every other region of the forward and the backward the
    remainder and one block's buffer; the loss and its backward outside the unit holding the blocks (``after the
    model``: the root's post-forward frees the last buffer and reshards) and the optimizer step nothing.

    ``units``: the units outside the blocks apart from the one around them (``remainder`` is that one's), by name: a
    head beside the backbone (session 34). Each is its own FSDP2 root, gathered in its region ``unit <name>`` alone:
    twice in the forward (its all-gather buffer is freed at its own post-forward), once in the backward.

    ``rooted_blocks``: no unit around the blocks (the LightningModule holds their list): each block is a root of its
    own, so the same in its region (twice in the forward, once in the backward: nothing prefetched) and nothing
    elsewhere (``remainder`` is 0).

    ``inner``: the units inside the one around the blocks that are no block (transformers ConvNext's downsampling
    members), by name: in its region ``unit <name>`` the remainder and that unit, twice in the forward (its all-gather
    buffer), and in the backward once with the next unit prefetched, planned as a block (the largest it can be: the
    next unit of the backward is a block or another such unit). The blocks of every list have their own regions
    (``block <name>`` for the lists the planner does not cut), as the blocks of the cut one (session 36: ConvNext's
    second stage was in ``after block -1``, one block gathered instead of two: 1.6 % under on 2 gloo ranks)."""
    forward = phase.startswith("forward")
    if region == END_OF_BACKWARD:  # every unit resharded
        return 0
    if units and region.startswith("unit ") and region[5:] in units:
        return units[region[5:]] * (2 if forward else 1)
    if inner and region.startswith("unit ") and region[5:] in inner:
        return remainder + (2 * inner[region[5:]] if forward else inner[region[5:]] + block)
    if rooted_blocks:
        return block * (2 if forward else 1) if region.startswith("block ") else 0
    if phase == "step" or region == "after the model":  # the loss and its backward, outside the units
        return 0
    if region in ("block 0", "block 0 of unit 0") and not forward:  # the last block of the backward: none to prefetch
        return remainder + block
    if region.startswith("block "):
        return remainder + 2 * block
    if region == "before the blocks" and phase.startswith("forward"):
        return 2 * remainder
    return remainder + block


def fsdp2_gradient_bytes(phase: str, region: str, block: int, depth: int, world_size: int,
                         rooted_blocks: bool = False, unit: int = 1, kept_from: Optional[int] = None) -> int:
    """Gradient bytes a trace counts in ``region`` of the backward that one of ``world_size`` FSDP2 ranks does not hold
    (negative: holds more), for blocks making ``block`` gradient bytes each, in a model of ``depth`` blocks.

    The trace keeps every gradient the backward has made, whole. FSDP2 (torch 2.13's ``_fsdp_param_group.post_backward``)
    reduce-scatters each block's gradients at its backward's end into a shard (``1 / world_size``), and keeps the
    reduce-scatter's input (the block's gradients, whole) until the next reduce-scatter of the same root
    (``reduce_scatter_max_input_buffers``: 1) or the backward's end. So in the region of a block with ``k`` blocks done
    after it, where the trace has ``k`` whole: ``k`` shards and one whole input under a unit around the blocks, ``k``
    shards and ``k`` whole inputs when each block is a root of its own (``rooted_blocks``: each root's input kept to
    the end). Measured on 2 gloo ranks (session 35), six checkpointed blocks with LoRA r=128: the rank's peak in the
    backward of the second block, planned 10.1 % over before; the blocks each a root, in the backward of the last, 11.7 %
    under before. The block a region names is found as the planner names it (:func:`~lightning_hbm.planner.peaks.
    block_index`): by units of ``unit`` blocks under ``ActivationCheckpointing(regenerate=n)`` (``block 1 of unit
    -1``), by the offloading part under a partial offload whose first block keeping its input is ``kept_from`` (``block
    offloading -1``): session 37, left as traced before (10.1 % and 0.9 % over on 2 gloo ranks,
    ``tests/strategies/test_fsdp_sequential_blocks_s35.py``). Regions other than a block's are left as traced (the units
    apart, their gradients whole; the blocks of a list not cut, ConvNext's later stages)."""
    index = block_index(region, depth, unit, kept_from) if phase.startswith("backward") else None
    if index is None:
        return 0
    done = max(depth - 1 - index, 0)
    return done * (block - -(-block // world_size)) - (done if rooted_blocks else min(done, 1)) * block


def fsdp2_root_gradient_bytes(region: str, gradients: int, block: int, depth: int, world_size: int,
                              backend: str = "gloo") -> int:
    """Bytes one of ``world_size`` FSDP2 ranks holds beyond the trace at the end of the backward (``END_OF_BACKWARD``),
    where the unit around the blocks, a root, reduce-scatters its ``gradients`` (its trainable parameters outside the
    blocks). Measured on 2 gloo ranks (session 36, an 8192 x 1024 fp32 embedding trained inside a LlamaModel): its
    post-backward frees its gathered parameters, copies the whole gradients into the reduce-scatter's flat input, frees
    the last block's reduce-scatter input (``block`` gradient bytes) and allocates the shard; gloo allocates one more
    whole-size buffer (``backend="gloo"``; NCCL writes the shard in place: not yet run on GPU). The blocks' gradients,
    whole in the trace, are shards there (``depth`` of them done)."""
    if region != END_OF_BACKWARD or world_size == 1:
        return 0
    blocks = depth * (block - -(-block // world_size)) - (0 if gradients else min(depth, 1)) * block
    copies = 2 if backend == "gloo" else 1
    return (copies * gradients + -(-gradients // world_size) if gradients else 0) - blocks


def fsdp2_unit_gradient_bytes(phase: str, order: Sequence[str], region: str, unit_gradients: Mapping[str, int],
                              world_size: int) -> int:
    """Gradient bytes a trace counts in ``region`` of the backward that one of ``world_size`` FSDP2 ranks does not hold,
    for the units apart with trainable parameters (``unit_gradients``, by name; ``order``: the phase's regions as the
    step runs them): negative, as each unit is an FSDP2 root of its own whose backward's end reduce-scatters its
    gradients into a shard and keeps the reduce-scatter's input (the gradients, whole, as the trace has them) to the
    backward's end. So every region after ``unit <name>`` holds that unit's shard more. Measured on 2 gloo ranks
    (session 35): a ``LlamaModel`` with an untied 256 x 256 fp32 head trained as ``modules_to_save``, the rank's peak in
    the backward of the last block, planned 131,076 B under before (the head's shard: 1.9 %), 4 B after
    (``tests/strategies/test_fsdp_trained_units_s35.py``)."""
    if not phase.startswith("backward") or world_size == 1 or region not in order:
        return 0
    before = order[: order.index(region)]
    return -sum(-(-size // world_size) for name, size in unit_gradients.items() if f"unit {name}" in before)


def shard_categories(
    categories: dict[str, int], world_size: int, gathered_bytes: int = 0, replicated_parameter_bytes: int = 0,
    replicated_state_bytes: int = 0,
) -> dict[str, int]:
    """Per-rank bytes when parameters, gradients and optimizer states are sharded over ``world_size`` ranks.

    FSDP/ZeRO-3 semantics, each category by its sharding rule in :data:`lightning_hbm.memory.terms.TERMS`: the
    ``split`` ones (parameters, gradients, optimizer states) are split evenly (rounded up), each rank keeps the
    activations of its own micro-batch (``categories`` must come from a per-rank batch), and ``gathered_bytes``
    (the unsharded parameters of the largest wrapped unit, all-gathered during its forward/backward) is added
    to the ``gathered`` one (``other``). ``replicated_parameter_bytes`` are parameter bytes every
    rank keeps whole: FSDP2 shards a 4-bit weight's packed data but not its quantization constants
    (absmax, code books), see :func:`quantization_constant_bytes`. ``replicated_state_bytes`` are optimizer-state
    bytes every rank keeps whole: the 0-dim states (Adam's ``step``), plain tensors beside the sharded ones.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}.")
    unknown = set(categories) - set(CATEGORIES)
    if unknown:
        raise ValueError(f"Unknown categories {sorted(unknown)}; expected {list(CATEGORIES)}.")
    per_rank = dict(categories)
    for t in TERMS:  # each category by its registry sharding rule
        if t.sharding == "split":
            per_rank[t.name] = -(-categories.get(t.name, 0) // world_size)
        elif t.sharding == "gathered" and t.kind == "category":
            per_rank[t.name] = categories.get(t.name, 0) + (gathered_bytes if world_size > 1 else 0)
    for name, replicated in (("parameters", replicated_parameter_bytes), ("optimizer_states", replicated_state_bytes)):
        if replicated:
            per_rank[name] = -(-(categories.get(name, 0) - replicated) // world_size) + replicated
    return per_rank



def quantized_parameter_bytes(
    model: ModelLike,
    mode: str,
    dtype: str = "bfloat16",
    ignore_modules: Sequence[str] = (),
    layer_modes: Optional[Mapping[str, str]] = None,
    correction_rank: int = 0,
    quantize_embeddings: Union[bool, str] = False,
) -> int:
    """Bytes of the **parameters** category after ``quantize_model(model, mode, dtype, ...)``, without allocating.

    Computed on a fake copy (or a fake build, for a factory) with each mode's own fake-tensor construction:
    packed weights, absmax, nested constants and row scales at their exact sizes. ``layer_modes``: a
    mixed-precision plan ``{layer name: mode name}`` (``"none"``: kept in ``dtype``). ``correction_rank``:
    ``QuantizedPrecision(correction_rank=...)``'s frozen factors included (``min(r, in, out) x (in + out)`` elements in
    :func:`~lightning_hbm.layers.correction.storage_dtype` of ``dtype`` (the compute dtype) per quantized Linear-like layer; a
    convolution's ``in`` is its ``in / groups x kernel`` patch, grouped and transposed ones get none; a quantized input
    embedding's ``r x (vocab + hidden)``). ``quantize_embeddings``: as ``QuantizedPrecision``'s (``False`` here, as
    before the argument existed: the input embeddings counted in ``dtype``). The model is not changed.
    """
    return _count_quantized(model, mode, dtype, ignore_modules, parameter_bytes, layer_modes, correction_rank, quantize_embeddings)


def quantization_constant_bytes(
    model: ModelLike,
    mode: str,
    dtype: str = "bfloat16",
    ignore_modules: Sequence[str] = (),
    layer_modes: Optional[Mapping[str, str]] = None,
    quantize_embeddings: Union[bool, str] = EMBEDDINGS_AUTO,
) -> int:
    """Bytes of the quantization constants alone (absmax, code books, row scales) after ``quantize_model``
    (with the mixed-precision plan ``layer_modes``, if any).

    Sharding keeps these whole on every rank (FSDP2 shards only the packed weights and int8 tables): pass them as
    ``shard_categories(..., replicated_parameter_bytes=...)``. ``quantize_embeddings``: as ``QuantizedPrecision``'s
    (``"auto"``, its default: the input embeddings in int8, their row scales counted here; ``False``: kept wide).
    """

    def constants(module: nn.Module) -> int:
        return tensor_bytes(t for m in module.modules() for t in quantization_tensors(m))

    # "auto" as the plugin reads it: tables under SMALL_EMBEDDING_VALUES stay wide, without row scales (was: every
    # table counted in int8: 256 B over a two-rank run with a 64-row table, session 31)
    return _count_quantized(model, mode, dtype, ignore_modules, constants, layer_modes, embeddings=quantize_embeddings)


def _count_quantized(
    model: ModelLike,
    mode: str,
    dtype: str,
    ignore_modules: Sequence[str],
    count: Callable[[nn.Module], int],
    layer_modes: Optional[Mapping[str, str]] = None,
    correction_rank: int = 0,
    embeddings: Union[bool, str] = False,
) -> int:
    correct = CalibratedCorrection(CalibratedCorrection.check_rank(correction_rank), to_dtype(dtype)) if correction_rank else None
    fake_mode = _fake_mode()
    with warnings.catch_warnings(), _quiet_logs():
        warnings.simplefilter("ignore")
        module = _build(model, fake_mode, RealValues(fake_mode))
        with fake_mode:
            module.configure_model()
            quantize_model(module, get_format(mode).for_fake_tensors(), dtype, ignore_modules, layer_modes=layer_modes,
                           correct=correct, quantize_embeddings=embeddings)
            return count(module)


def example_batch(batch: BatchLike) -> Any:
    """The example batch: ``batch`` itself, or one training batch of a datamodule."""
    if batch is None:
        raise ValueError("plan() needs an example batch (or a LightningDataModule) to trace a training step.")
    if isinstance(batch, pl.LightningDataModule):
        if hasattr(batch, "example_batch"):
            return batch.example_batch()
        batch.prepare_data()
        batch.setup("fit")
        return next(iter(batch.train_dataloader()))
    if not torch_compat.tensor_leaves(batch):  # a BatchEncoding's too
        raise ValueError(f"The example batch holds no tensor (got {type(batch).__name__}); pass one training batch.")
    return batch


def predict(
    model: Union[ModelLike, Template],
    batch: BatchLike,
    candidate: Candidate,
    device: str = "cpu",
    budget: Optional[int] = None,
    extrapolate: Union[bool, Literal["auto"]] = "auto",
    probe_batch: Any = None,
    decided: Optional[Decided] = None,
) -> Prediction:
    """Predict the steady-state training peak of ``model`` on ``batch`` under ``candidate``, allocating no weights.

    ``extrapolate``: trace the model with its repeated blocks (the largest ``nn.ModuleList`` of one
    block class, as ``ActivationCheckpointing`` finds them) cut to 3 and to 4, and extend each phase's
    categories linearly to the real depth. ``"auto"`` does so from 8 blocks on (a 32-layer 8B model then
    traces 7 blocks instead of 32); ``False`` always traces the whole model. Cut to 2 and 3 instead, the
    line overshot by up to 34 % (the first and last blocks differ from the middle ones); from 3 and 4 it
    equals the full trace byte for byte on the 6- and 12-block test models (``tests/planner/test_api.py``).
    ``ActivationCheckpointing(every=n)``: cut in units of ``n`` blocks instead (:func:`_cuts`), each cut ending with the
    model's pattern of checkpointed blocks. Every line is checked by its own traces (:meth:`Trace.lines_apart`): where
    they peak at points that do not correspond, the whole model is traced instead, said in ``Prediction.uncut``.
    A candidate with named ``blocks`` or a mixed-precision plan (``layer_modes``) is always traced whole.
    ``probe_batch``: a shorter batch of the same structure for the forwards that only decide structure (the
    surgery's probe step, which parameters get gradients; :func:`~lightning_hbm.planner.tracing.trace`).
    ``decided``: with ``probe_batch``, what those forwards decided in an earlier prediction of the same model and
    candidate, reused (:class:`~lightning_hbm.planner.tracing.Decided`: ``max_context`` plans one model at many lengths).
    """
    if decided is not None and probe_batch is None:
        raise ValueError("predict(decided=...) needs the probe_batch those decisions were made on.")
    # a Decided of this prediction alone: its batch is the one these decisions are made on (a partial offload traces one
    # cut model at two offload counts: set up once)
    return _predict(model, batch, candidate, device, budget, extrapolate, probe_batch,
                    decided if decided is not None else Decided())


def _predict(
    model: Union[ModelLike, Template], batch: BatchLike, candidate: Candidate, device: str, budget: Optional[int],
    extrapolate: Union[bool, Literal["auto"]], probe_batch: Any, decided: Decided,
) -> Prediction:
    """:func:`predict`, ``decided`` made on ``probe_batch`` or, without one, on ``batch`` (:func:`plan`)."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda' (the target of the prediction), got {device!r}.")
    if extrapolate not in (True, False, "auto"):
        raise ValueError(f"extrapolate must be True, False or 'auto', got {extrapolate!r}.")
    if candidate.offload and device != "cuda":
        raise ValueError(
            f"{candidate.name}: offloading optimizer states to CPU memory only saves device memory on CUDA; "
            "plan it with device='cuda' (on a CPU machine the states stay in the same memory)."
        )
    batch = example_batch(batch)
    model = build_template(model)  # built once, copied for each trace
    real_types: dict[str, str] = {}
    count = offload_blocks(candidate)

    def trace(model: Any, batch: Any, candidate: Candidate, device: str, keep_blocks: Optional[int],
              offload: Optional[int] = count) -> Trace:
        # a module that fake tensors cannot run: every module of its class runs for real on zeros, retraced
        while True:
            try:
                return _trace(model, batch, candidate, device, keep_blocks, real_types, probe_batch, decided, offload)
            except UntraceableModule as err:
                if err.module_type in real_types or not err.runs_for_real:
                    raise
                decided.forget(keep_blocks)  # decided with that module on fake tensors: decide again
                real_types[err.module_type] = f"{type(err.__cause__).__name__}: {err.__cause__}".splitlines()[0]

    uncut = ""
    # named blocks: cutting the list would rename them; a mixed-precision plan differs block by block (no line);
    # checkpointing every n-th block of a list built in configure_model: the cuts depend on its length (_cuts)
    # a partial offload with remade inputs: its count is of blocks, not of units (no line is built for it)
    if extrapolate is False or candidate.blocks is not None or candidate.layer_modes is not None or (
        _every(candidate) > 1 and _block_list(model.module)[1] == 0
    ) or (count is not None and _remakes(candidate)):
        result = trace(model, batch, candidate, device, keep_blocks=None)
    else:
        try:
            result = _cut_and_extend(trace, model, batch, candidate, device, extrapolate, count)
        except Exception as err:
            path, depth = _block_list(model.module)
            if depth <= 3:
                raise  # nothing was cut: the whole model fails the same way
            result = trace(model, batch, candidate, device, keep_blocks=None)  # its own error if the whole fails too
            reason = f"{type(err).__name__}: {err}".splitlines()[0]
            uncut = str(err) if isinstance(err, PeaksApart) else (
                f"{path or 'the blocks'} cut to 3 of {depth} blocks failed ({reason}); traced the whole model instead")
            warnings.warn(f"lightning_hbm plan: {uncut} (exact, but slower to plan).", stacklevel=2)
    for selection in result.selections.values():
        warnings.warn(f"lightning_hbm plan: {selection} in {_SELECTED}", stacklevel=2)
    host = 0
    if candidate.offload:  # stated model: states leave the device, transfer buffers are not counted
        host = max(phase["optimizer_states"] for phase in result.phases.values())
        for phase in result.phases.values():
            phase["optimizer_states"] = 0
    scopes = result.peak_scopes()
    return Prediction(
        candidate=candidate,
        categories=result.peak_categories(),
        host_bytes=host,
        overhead=CUDA_CONTEXT_BYTES if device == "cuda" else 0,
        trainable_params=result.trainable,
        total_params=result.total,
        block_bytes=result.block_bytes,
        cost=candidate.relative_cost(),
        budget=budget,
        guessed_reads=result.guessed,
        loss=scopes.get(LOSS_SCOPE, 0),
        fallbacks=tuple(f"{name} (real tensors: {reason})" for name, reason in sorted(result.fallbacks.items())),
        uncut=uncut,
        selections=tuple(result.selections.values()),
        side={**scopes, HOST_OFFLOAD: host, HOST_ACTIVATIONS: result.host},
        host_sizes=result.host_sizes,
        offloaded_blocks=result.offloaded,
        replicated_bytes=result.replicated,
        replicated_state_bytes=result.replicated_states,
        remainder_bytes=result.remainder,
        unchecked=tuple(f"{name} (its forward changes {what})" for name, what in sorted(result.unchecked.items())),
        regions=result.regions,
        units=result.units,
        forward_gradients=result.phases.get("forward", {}).get("gradients", 0),
        rooted_blocks=result.rooted_blocks,
        block_gradient_bytes=result.block_gradients,
        unit_gradient_bytes=result.unit_gradients,
        inner_units=result.inner_units,
        remainder_gradient_bytes=result.remainder_gradients,
        depth=result.depth,
        remade_unit=remade_unit(candidate),
        kept_from=_kept_from(candidate, count, result.depth),
        chosen_convs=chosen_convolutions(model.module, candidate),
        chosen_linears=chosen_linears(model.module, candidate),
        routed=tuple(f"{name} ({what})" for name, what in sorted(result.routed.items())),
    )


def _cut_and_extend(
    trace: Callable[..., Trace],
    model: Template,
    batch: Any,
    candidate: Candidate,
    device: str,
    extrapolate: Union[bool, Literal["auto"]],
    count: Optional[int] = None,
) -> Trace:
    """The trace with the repeated blocks cut to 3 (and 4) units of ``every`` blocks (:func:`_cuts`), extended to the
    real depth (see :func:`predict`).

    ``count``: ``ActivationCheckpointing(offload=count)`` offloads the first ``count`` checkpointed blocks' inputs only
    (:func:`_partial_offload`)."""
    every = _every(candidate)
    hint = _block_list(model.module)[1]  # 0: blocks built in configure_model, known from the first trace
    if count is not None and count >= -(-hint // every) > 0:
        check_offload_blocks(count, -(-hint // every))
        count = None  # every checkpointed block
    first, second = _cuts(hint, every)
    if every > 1 and not _extends(hint, first, second, extrapolate):
        return trace(model, batch, candidate, device, None, count)  # (predict traces every > 1 whole without a hint)
    if count is not None:
        return _partial_offload(trace, model, batch, candidate, device, extrapolate, count)
    if hint > first and not _extends(hint, first, second, extrapolate):  # 4-7 blocks: the cut trace would be followed
        return trace(model, batch, candidate, device, None, None)  # by the whole one (a tiny MobileViT: half its plan)
    result = trace(model, batch, candidate, device, first, None)
    depth = result.depth
    if _extends(depth, first, second, extrapolate):
        deeper = trace(model, batch, candidate, device, second, None)
        return _checked_line(result, [(deeper, (depth - first) // every)], depth, model)
    if depth > first:
        return trace(model, batch, candidate, device, None, None)
    return result


def _cuts(depth: int, every: int) -> tuple[int, int]:
    """The two lengths the repeated blocks are cut to: 3 and 4 units of ``every`` blocks (checkpointing every
    ``every``-th one), the last unit as long as the model's (``depth % every`` blocks when that is not 0). Each cut
    model then ends with the real one's pattern of checkpointed blocks, and the second adds a whole unit to the first:
    cut to 3 and 4 blocks, ``every=2`` checkpointed the last block at 3 and not at 4, and the line through them planned
    48 % over the model. ``every=1``: 3 and 4 blocks, whatever the depth."""
    first = 2 * every + (depth % every or every)
    return first, first + every


def _extends(depth: int, first: int, second: int, extrapolate: Union[bool, Literal["auto"]]) -> bool:
    """Whether the traces cut to ``first`` and ``second`` blocks are extended to ``depth`` (``"auto"``: when they trace
    fewer blocks than the model has; 3 + 4 < 8 blocks for ``every=1``)."""
    return depth > second and (extrapolate is True or first + second < depth)


def _checked_line(first: Trace, steps: list[tuple[Trace, int]], depth: int, model: Template,
                  count: Optional[int] = None) -> Trace:
    """``first`` combined with ``steps`` (:meth:`Trace.combine`) to ``depth`` blocks, once the traces say that the line
    through them is the model's (:meth:`Trace.lines_apart`: decided by these traces, at no cost beyond them).

    Raises :class:`PeaksApart` where they peak at points that do not correspond. ``count``: a partial offload's count."""
    apart = first.lines_apart(steps, depth, offloading=count is not None)
    if apart:
        offloading = "" if count is None else f", the first {count} checkpointed offloading their inputs,"
        raise PeaksApart(f"{_block_list(model.module)[0] or 'the blocks'} cut to {first.kept} and {steps[0][0].kept} of "
                         f"{depth} blocks{offloading} peak at points that do not correspond ({'; '.join(apart)}): the line "
                         "through them is not the model's, traced the whole model instead")
    return first.combine(steps, depth)


def _partial_offload(
    trace: Callable[..., Trace],
    model: Template,
    batch: Any,
    candidate: Candidate,
    device: str,
    extrapolate: Union[bool, Literal["auto"]],
    count: int,
) -> Trace:
    """``count`` of the ``units`` checkpointed blocks offload their inputs (the first ones): the line through cut models,
    per kind of block (a unit: ``every`` blocks, the first checkpointed, :func:`_cuts`).

    A unit that offloads and one that keeps its input add different bytes, and where the kinds meet (the last input
    offloaded is in flight until the next block starts) is one more difference: each cut model keeps that meeting
    point. Cut to 3 units with 2 offloading (A), to 4 with 3 (B: one offloading unit more) and to 4 with 2 (C: one
    keeping unit more): ``A + (count - 2) (B - A) + (units - count - 1) (C - A)``, a third trace. A count of 1 or 2 is in
    both cut models (only keeping units are added), and ``units - 1`` needs no C: two traces, as a plain line. Checked
    as the plain line is (:func:`_checked_line`): where the three traces peak at points that do not correspond, the
    whole model is traced instead.
    """
    every = _every(candidate)
    cut, deeper = _cuts(_block_list(model.module)[1], every)
    first = trace(model, batch, candidate, device, cut, min(count, 2))
    depth = first.depth
    units = -(-depth // every)
    check_offload_blocks(count, units)
    if depth <= cut and count <= 2:
        return first  # the whole model
    if not _extends(depth, cut, deeper, extrapolate):
        return trace(model, batch, candidate, device, None, count)
    if count == units:  # every block, known only now (built in configure_model): the plain line
        first = trace(model, batch, candidate, device, cut, None)
        steps = [(trace(model, batch, candidate, device, deeper, None), units - 3)]
    elif count <= 2:
        steps = [(trace(model, batch, candidate, device, deeper, count), units - 3)]
    else:
        steps = [(trace(model, batch, candidate, device, deeper, 3), count - 2)]
        if count < units - 1:
            steps.append((trace(model, batch, candidate, device, deeper, 2), units - count - 1))
    return _checked_line(first, steps, depth, model, None if count == units else count)


def _set_ups_for(candidate: Candidate, last: tuple[Optional[Candidate], Decided],
                 probes: dict[tuple, Any]) -> tuple[Optional[Candidate], Decided]:
    """The models set up (:class:`~lightning_hbm.planner.tracing.Decided`) that ``candidate`` traces again: the last
    candidate's, where the two differ only by the optimizer (the grid of :func:`default_candidates` lists each
    configuration with ``"user"`` and ``"adamw8bit"`` side by side; the surgery, the probe step and the structure-deciding
    forward of the second were the first's again, a third of its plan), else new ones. Only the grid's own candidates
    with a transform besides the optimizer share (one configured by hand copies the user's callbacks; without another
    transform the optimizer's own is the model's only change, which prunes its frozen parameters from the optimizer).
    Every set-up of the plan shares ``probes``: the probe step of a cut model set up alike, whatever the candidate."""
    key = dataclasses.replace(candidate, optimizer="user") if candidate.configured is None else None
    if key is None or not key.callbacks():
        return None, Decided(probes=probes)
    return (key, last[1]) if key == last[0] else (key, Decided(probes=probes))


class PeaksApart(Exception):
    """The traces cut to 3 and 4 blocks peak at points of the step that do not correspond (:meth:`Trace.peaks_apart`):
    the line through them is not the model's, and :func:`predict` traces the whole model instead, saying so."""


def offload_blocks(candidate: Candidate) -> Optional[int]:
    """The ``k`` of a configured ``ActivationCheckpointing(offload=k)`` (None: ``True``, ``False`` or no such callback)."""
    configured = candidate.configured[1] if candidate.configured is not None else ()
    return next((c.offload_blocks for c in configured if isinstance(c, ActivationCheckpointing) and c.offload is not None),
                None)


def _every(candidate: Candidate) -> int:
    """The blocks of one unit the cuts count in: ``every`` (one checkpointed block, the rest not), or ``regenerate``
    (one block keeping its input, the rest remaking theirs)."""
    configured = candidate.configured[1] if candidate.configured is not None else ()
    return next((c.every * c.regenerate for c in configured if isinstance(c, ActivationCheckpointing)), 1)


def _kept_from(candidate: Candidate, count: Optional[int], depth: int) -> Optional[int]:
    """The index of the first block keeping its input under ``ActivationCheckpointing(offload=count)`` (every
    ``every``-th block checkpointed, the first ``count`` of them offloading): ``count * every``; None without a partial
    offload (:attr:`Prediction.kept_from`)."""
    configured = candidate.configured[1] if candidate.configured is not None else ()
    every = next((c.every for c in configured if isinstance(c, ActivationCheckpointing)), 1)
    return count * every if count is not None and count * every < depth else None


def chosen_convolutions(module: nn.Module, candidate: Candidate) -> dict[str, int]:
    """The convolutions of ``module`` (the model as built) whose mode a fit under ``candidate`` chooses at its start
    (``QuantizedPrecision``'s convolutions' plan: a 4-bit mode, no ``layer_modes`` pinned), by name: the bytes each
    adds stored in the widest mode of ``sensitive_mode`` it may take instead of the candidate's (0 where none is
    wider). The fit measures each one's output error on its probe batch with the model's real weights; the planner's
    model holds fake ones (a factory built on fake tensors, an instance copied so), so it plans them in the candidate's
    mode and names them (session 37: transformers ConvNext's patch embedding, int8 in the fit, 1,120 B per rank under on
    2 gloo ranks, ``tests/strategies/test_fsdp_convnext_stages_s35.py``)."""
    if candidate.layer_modes is not None or not any(CONV.matches(layer) for layer in module.modules()):
        return {}  # no convolution (a language model: nothing listed, each of max_context's plans)
    plugin = candidate.precision_plugin("cpu")
    if not isinstance(plugin, QuantizedPrecision) or plugin.config.layer_modes is not None or (
            plugin.config.format.peft_kind != "4bit"):
        return {}
    return _widening(plugin, module, lambda layer: CONV.matches(layer))


def chosen_linears(module: nn.Module, candidate: Candidate) -> dict[str, int]:
    """The Linears whose mode a fit under ``candidate`` measures at its start (``QuantizedPrecision(max_bytes_per_param=
    ...)`` or ``min_cosine=...`` without ``layer_modes``: the sensitivity plan), by name: the bytes each adds stored in
    the widest mode it may take. The planner's model holds no real weight to measure, so it plans them in the
    candidate's mode and names them in :meth:`Plan.notes` (session 38: ``plan()`` failed on such a plugin)."""
    plugin = candidate.precision_plugin("cpu") if candidate.layer_modes is None else None
    if not isinstance(plugin, QuantizedPrecision) or not plugin.config.measures_layer_modes:
        return {}
    return _widening(plugin, module, lambda layer: isinstance(layer, nn.Linear))  # as linear_names: what the plan measures


def _widening(plugin: QuantizedPrecision, module: nn.Module, kind: Callable[[nn.Module], bool]) -> dict[str, int]:
    """Per target layer of ``plugin`` that ``kind`` takes: the bytes its widest mode of ``sensitive_mode`` adds."""
    base, dtype = plugin.config.format.name, plugin.config.torch_dtype
    wider = ladder(base, plugin.config.sensitive_mode)
    chosen = {}
    for name, layer in plugin.quantization.targets(module):
        if kind(layer):
            features = cast(LayerKind, kind_of(layer)).features(layer)
            widest = max((weight_bytes(mode, *features, dtype) for mode in wider), default=0)
            chosen[name] = max(widest - weight_bytes(base, *features, dtype), 0)
    return chosen


def _remakes(candidate: Candidate) -> bool:
    configured = candidate.configured[1] if candidate.configured is not None else ()
    return any(isinstance(c, ActivationCheckpointing) and c.regenerate > 1 for c in configured)


@dataclass
class Plan:
    """Predictions for every candidate, fastest first, and the choice for the budget.

    Attributes:
        predictions: sorted by relative step time, then fidelity (closest to the user's training first).
        budget: bytes the configuration must fit in (peak + overhead), or None.
        device: ``"cpu"`` or ``"cuda"``.
        failures: candidates that could not be traced, with the reason.
    """

    predictions: list[Prediction]
    budget: Optional[int] = None
    device: str = "cpu"
    failures: list[tuple[Candidate, str]] = field(default_factory=list)

    @property
    def chosen(self) -> Optional[Prediction]:
        """The fastest prediction that fits the budget (the first one when there is no budget)."""
        if self.budget is None:
            return self.predictions[0] if self.predictions else None
        return next((p for p in self.predictions if p.fits), None)

    def closest(self, n: int = 3) -> list[Prediction]:
        """The ``n`` predictions with the smallest total memory."""
        return sorted(self.predictions, key=lambda p: p.total)[:n]

    def find(self, candidate: Candidate) -> Prediction:
        """The prediction of ``candidate``."""
        for prediction in self.predictions:
            if prediction.candidate == candidate:
                return prediction
        raise KeyError(f"{candidate.name} is not in this plan.")

    def scope_columns(self) -> list[str]:
        """The scope terms (registry order) some prediction holds bytes of: columns after the categories, inside them."""
        return [t.name for t in scope_terms() if any(p.terms[t.name] for p in self.predictions)]

    def header(self) -> list[str]:
        """The table's columns: candidate, each category, the scope terms held (:meth:`scope_columns`), peak, ..."""
        return ["candidate", *CATEGORIES, *self.scope_columns(), "peak", "peak+overhead", "fits", "step time"]

    def rows(self) -> list[list[str]]:
        """One row per prediction: name, each category, each of :meth:`scope_columns`, peak, total, fits, cost."""
        rows = []
        scopes = self.scope_columns()
        for p in self.predictions:
            fits = "-" if p.fits is None else ("yes" if p.fits else "no")
            terms = p.terms
            rows.append(
                [p.candidate.name]
                + [format_bytes(terms[name]) for name in (*CATEGORIES, *scopes)]
                + [format_bytes(p.peak), format_bytes(p.total), fits, f"{p.cost:.2f}x"]
            )
        return rows

    def table(self) -> Any:
        """A ``rich.table.Table`` of :meth:`rows` (the chosen row in bold)."""
        from rich.table import Table

        budget = "" if self.budget is None else f", budget {format_bytes(self.budget)}"
        table = Table(title=f"lightning_hbm plan ({self.device}{budget})")
        for column in self.header():
            table.add_column(column, justify="left" if column == "candidate" else "right")
        chosen = self.chosen
        for prediction, row in zip(self.predictions, self.rows()):
            table.add_row(*row, style="bold green" if prediction is chosen else None)
        return table

    def __str__(self) -> str:
        header = self.header()
        rows = [header, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)) for row in rows]
        return "\n".join(lines + self.notes())

    def notes(self) -> list[str]:
        """What the table does not say: candidates that could not be planned, values the trace had to guess."""
        notes = [f"not planned: {c.name}: {reason}" for c, reason in self.failures]
        for p in self.predictions:
            if p.fallbacks:
                notes.append(
                    f"{p.candidate.name}: fake tensors cannot run {', '.join(p.fallbacks)}; ran for real on zeros of "
                    "their inputs' shapes (outputs and saved tensors counted, temporaries inside them not)"
                )
        notes += [f"{p.candidate.name}: {p.uncut}" for p in self.predictions if p.uncut]
        notes += [
            f"{p.candidate.name}: not checkpointed, activations kept: {'; '.join(p.unchecked)}"
            for p in self.predictions if p.unchecked
        ]  # fmt: skip
        notes += [
            f"{p.candidate.name}: optimizer states counted for every expert (or dropped layer) a long run updates, "
            "run by the traced step or not: "
            f"{'; '.join(p.routed)}"
            for p in self.predictions if p.routed
        ]  # fmt: skip
        notes += [f"{p.candidate.name}: {s} in {_SELECTED}" for p in self.predictions for s in p.selections]
        notes += [
            f"{p.candidate.name}: {len(p.chosen_convs)} convolution(s) planned in {p.candidate.precision}, whose modes the "
            "fit chooses at its start on its probe batch and real weights (the most sensitive widened): up to "
            f"{format_bytes(sum(p.chosen_convs.values()))} more if all widen ({', '.join(list(p.chosen_convs)[:4])}"
            f"{', ...' if len(p.chosen_convs) > 4 else ''}); a fit's plugin.layer_modes as Candidate(layer_modes=...) "
            "plans its choice exactly"
            for p in self.predictions if p.chosen_convs
        ]  # fmt: skip
        notes += [
            f"{p.candidate.name}: {len(p.chosen_linears)} Linear(s) planned in {p.candidate.precision}, whose modes the "
            "fit's sensitivity plan (max_bytes_per_param / min_cosine) chooses at its start on its probe batch and real "
            f"weights: up to {format_bytes(sum(p.chosen_linears.values()))} more if all widen; a fit's "
            "plugin.layer_modes as Candidate(layer_modes=...) plans its choice exactly"
            for p in self.predictions if p.chosen_linears
        ]  # fmt: skip
        for p in self.predictions:  # the host terms (lightning_hbm.memory.terms): off the device, not in the peak
            terms = p.terms
            for t in host_terms():
                if terms[t.name]:
                    notes.append(f"{p.candidate.name}: {t.name} {format_bytes(terms[t.name])} in host memory, beside the peak")
        guessed = max((p.guessed_reads for p in self.predictions), default=0)
        if guessed:
            notes.append(
                f"the traced code read {guessed} value(s) of large tensors it cannot know (e.g. loss.item(), a check "
                "over a weight in its init): they were read as 0/False, which changes no tensor the plan counts "
                "unless the model allocates by them"
            )
        return notes


def plan(
    model: ModelLike,
    batch: BatchLike,
    budget: Union[str, int, None] = None,
    candidates: Optional[Sequence[Candidate]] = None,
    device: Literal["cpu", "cuda"] = "cpu",
    plugin: Optional[Any] = None,
    callbacks: Optional[Sequence[Any]] = None,
    strategy: Any = None,
) -> Plan:
    """Predict each candidate's training memory for ``model`` on ``batch`` without allocating the model.

    Args:
        model: the user's LightningModule, or a factory (e.g. the class) that builds it; a factory is
            called under ``FakeTensorMode``, so even an 8B model allocates nothing.
        batch: one training batch, or a LightningDataModule (its first training batch is used).
        budget: device memory the run must fit in (``"24GiB"``, bytes), or None.
        candidates: configurations to predict (default: :func:`default_candidates`).
        device: where training will run; ``"cuda"`` adds :data:`CUDA_CONTEXT_BYTES` to each total.
        plugin, callbacks, strategy: the very objects you give the Trainer (``plugins=[plugin]``, ``callbacks``,
            ``strategy``): that configuration is planned with every option as set
            (:meth:`Candidate.from_trainer`), alone unless ``candidates`` are given too.

    Returns a :class:`Plan`; ``plan(...).chosen`` is the fastest candidate that fits.
    """
    budget_bytes = None if budget is None else parse_bytes(budget)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}.")
    configured = plugin is not None or callbacks is not None or strategy is not None
    if configured:
        own = Candidate.from_trainer(plugin, callbacks or (), strategy)
        candidates = [own, *(candidates or [])]
    candidates = list(default_candidates() if candidates is None else candidates)
    if not candidates or not all(isinstance(c, Candidate) for c in candidates):
        raise TypeError(f"candidates must be a non-empty list of lightning_hbm.planner.Candidate, got {candidates!r}.")
    batch = example_batch(batch)
    template = build_template(model)  # the model is wrong (TypeError) or built once for every candidate
    predictions, failures = [], []
    probes: dict[tuple, Any] = {}  # the probe steps of the cut models, shared by every candidate's set-up
    shared: tuple[Optional[Candidate], Decided] = (None, Decided(probes=probes))
    for candidate in candidates:
        shared = _set_ups_for(candidate, shared, probes)
        try:
            predictions.append(_predict(template, batch, candidate, device, budget_bytes, "auto", None, shared[1]))
        except Exception as err:  # one candidate that cannot be traced must not hide the others
            if configured and candidate is candidates[0]:
                raise  # the user's own configuration: the error fit would raise, not a row of the table
            failures.append((candidate, f"{type(err).__name__}: {err}"))
    if not predictions:
        reasons = "; ".join(f"{c.name}: {r}" for c, r in failures[:5])
        # the model built, by its class: a factory is no name (issue 53: "for type:"; a lambda read "for <lambda>:")
        name = type(template.module).__name__
        raise ValueError(f"No candidate could be planned for {name}: {reasons}")
    predictions.sort(key=lambda p: (p.cost, -p.candidate.fidelity(), p.total))
    return Plan(predictions=predictions, budget=budget_bytes, device=device, failures=failures)


__all__ = [
    "CUDA_CONTEXT_BYTES",
    "HOST_ACTIVATIONS",
    "HOST_OFFLOAD",
    "Plan",
    "Prediction",
    "example_batch",
    "plan",
    "predict",
    "quantization_constant_bytes",
    "quantized_parameter_bytes",
    "shard_categories",
]
