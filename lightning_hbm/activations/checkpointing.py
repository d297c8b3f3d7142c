"""``ActivationCheckpointing``: recompute the activations of repeated blocks in backward.

What it shrinks: the **activations** term. Without recompute, every transformer block keeps
about ``s*b*h*(34 + 5*a*s/h)`` bytes alive for backward (Korthikanti et al.); with full recompute
it keeps only its input (``2*s*b*h``) and runs its forward a second time in backward. Lightning
offers this only inside FSDP; this callback gives it to any strategy (single device, DDP).

How: the ``forward`` of each chosen block is wrapped in non-reentrant ``torch.utils.checkpoint``.
Not ``checkpoint_wrapper``: a wrapper module prefixes every parameter name with
``_checkpoint_wrapped_module.``, which changes the state_dict keys and makes peft's adapter
state_dict silently empty (checked with peft 0.21). Wrapping ``forward`` keeps names,
keys and the module tree exactly as the user built them. Non-reentrant, because the reentrant
variant gives no gradients to adapters behind frozen embeddings (inputs without ``requires_grad``).
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal, Optional, Union, cast

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts
from typing_extensions import override

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm._validate import check_args
from lightning_hbm.activations.offload import PIECE_BYTES as PIECE_BYTES  # the former home of the offload hooks
from lightning_hbm.activations.offload import OffloadSavedTensors, host_footprint, pinned_footprint, pinned_pieces
from lightning_hbm.activations.offload import _Pieces as _Pieces
from lightning_hbm.activations.regenerate import InputHooks, Record, Remade, inner_forward, size
from lightning_hbm.activations.replay import ForwardState
from lightning_hbm.activations.selective import SelectivePolicy, format_matmuls, unkept_formats
from lightning_hbm.activations.token_chunks import ChunkedForward, candidates, inner_candidates
from lightning_hbm.adapters.lora.order import LastAdapted, adapter_first, recomputing
from lightning_hbm.layers.blocks import find_blocks
from lightning_hbm.layers.coverage_table import coverage
from lightning_hbm.layers.finding import lora_layer_classes
from lightning_hbm.naming import did_you_mean, has_submodule
from lightning_hbm.record import CheckpointedForward, checkpoint_setup, coverage_of, set_coverage
from lightning_hbm.surgery import Stage, SurgeryCallback


class _BlockSetup:
    """A block's checkpoint setup: what its wrapped ``forward`` needs, kept in that forward object on the block (no
    closure). Formerly ``_BlockPlan`` ("plan" names the planner's, issue 54): a pickled model holds it by class path."""

    def __init__(
        self,
        block: nn.Module,
        context_fn: Optional[Callable[[], tuple[AbstractContextManager, AbstractContextManager]]],
        offload: Optional[OffloadSavedTensors],
        moves: bool = True,
    ) -> None:
        # An instance-level forward someone set before us is kept (and put back by _unwrap); otherwise the
        # class's forward is looked up at call time: a bound method stored here would not survive pickling.
        self.own_forward: Optional[Callable[..., Any]] = torch_compat.forward_override(block)
        self.context_fn = context_fn
        self.offload = offload
        #: whether this block's inputs go through ``offload`` (partial offload: the first blocks only); a block that
        #: keeps them on the device still holds ``offload`` to end the previous block's copy in flight
        self.moves = moves
        #: ``regenerate=n``: the callback's counts, which link each forward to the checkpointed block called just
        #: before it (:mod:`lightning_hbm.activations.regenerate`); None: every input kept
        self.counts: Optional[Remade] = None
        self.name = ""
        #: whether the block's keyword tensors were looked at (:func:`_note_keywords`): on its first training forward only
        self.keywords_noted = False
        #: what its first training forward changed in a list or dict it was given (:func:`mutated_arguments`; ``""``:
        #: nothing; ``None``: not looked at yet): such a block runs without checkpoint (session 32)
        self.mutates: Optional[str] = None


class _CheckpointedForward(CheckpointedForward):
    """The block's new ``forward``: a picklable object (not a closure, not a bound method) holding the block and its
    setup, copied with the block; being one marks the block checkpointed (:func:`lightning_hbm.record.checkpoint_setup`,
    read by the coverage table)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return _checkpointed_forward(self.block, self.setup, *args, **kwargs)


#: the former name of :class:`_BlockSetup` (issue 54, session 33), kept only so that a model pickled before the rename
#: (``torch.save(model)``, a deep-copied Trainer's pickle) still loads: pickle finds a class by module and name, and
#: such a file names this one. Not used by the package; ``CheckpointedForward.__setstate__`` reads its former key.
_BlockPlan = _BlockSetup


def _wrap(block: nn.Module, setup: _BlockSetup) -> None:
    torch_compat.override_forward(block, _CheckpointedForward(block, setup))


def _unwrap(block: nn.Module) -> None:
    setup = cast(_BlockSetup, checkpoint_setup(block))  # called on wrapped blocks only
    torch_compat.override_forward(block, setup.own_forward)  # None: the class's forward again


def _checkpointed_forward(self: nn.Module, setup: _BlockSetup, /, *args: Any, **kwargs: Any) -> Any:
    inner = inner_forward(self, setup.own_forward)
    if not torch.is_grad_enabled():
        return inner(*args, **kwargs)  # evaluation: nothing is saved, nothing to recompute
    if setup.mutates is None or setup.mutates:
        looked = _looked_at(self, setup, inner, args, kwargs)
        if looked is not None:  # its first training forward, given a list or dict, or a forward that changes one
            return looked[0]
    extra: dict[str, Any] = {} if setup.context_fn is None else {"context_fn": setup.context_fn}
    calls = itertools.count()
    state = ForwardState(self)  # the buffers its forward changes (BatchNorm statistics, spectral_norm's u, v)

    def run(*a: Any, **k: Any) -> Any:
        # the first call is the forward; every later one is checkpoint's recompute, in the backward (lora.order)
        again = next(calls) > 0
        with recomputing(again), state.replayed(again):
            return inner(*a, **k)

    if setup.offload is not None and not setup.moves:
        setup.offload.settle()  # the offloaded blocks are behind: the last one's copy had this whole block to finish
    # The offload hooks are outside the checkpoint: what checkpoint itself saves (the block's
    # inputs) goes through them; what it recomputes never does.
    hooks: Optional[torch.autograd.graph.saved_tensors_hooks] = setup.offload if setup.offload is not None and setup.moves else None
    record, call = None, functools.partial(checkpoint, run)
    if setup.counts is not None:  # regenerate=n: linked to the block called before by data flow (regenerate.Link)
        link = setup.counts.link(setup.name, args, kwargs)
        args, kwargs, call = link.args, link.kwargs, functools.partial(checkpoint, link.call(run))
        unpack = hooks.unpack_hook if hooks is not None else _same
        record = Record(self, link.call(inner), args, kwargs, state, unpack, setup.name, link.position, setup.counts)
        hooks = InputHooks(hooks, link.source, record, setup.counts, setup.name)
    if setup.offload is not None and setup.moves and not setup.keywords_noted:
        setup.keywords_noted = True  # the warning names a block once: its later steps are not looked at again
        _note_keywords(setup.offload, setup.name, args, kwargs)
    with hooks if hooks is not None else nullcontext():
        out = call(*args, use_reentrant=False, **extra, **kwargs)
    if record is not None:
        record.returned(out)  # and the record is the one the next block called links to
    return out


def _same(tensor: Tensor) -> Tensor:
    return tensor


def _containers(args: tuple, kwargs: dict[str, Any]) -> list[tuple[str, Union[list, dict]]]:
    named = [(f"argument {i + 1}", a) for i, a in enumerate(args)] + [(f"{k!r}", v) for k, v in kwargs.items()]
    return [(name, value) for name, value in named if isinstance(value, (list, dict))]


def _items(container: Union[list, dict]) -> list[tuple[Any, Any]]:
    return list(container.items()) if isinstance(container, dict) else list(enumerate(container))


def _same_item(a: Any, b: Any) -> bool:
    return a is b or (type(a) is type(b) and isinstance(a, (int, float, str, bool)) and a == b)


def mutated_arguments(before: list[tuple[str, list[tuple[Any, Any]]]], given: list[tuple[str, Union[list, dict]]]) -> str:
    """What a forward changed in the lists and dicts it was given (``before``: their items as it began), or ``""``."""
    said = []
    for (name, old), (_, container) in zip(before, given):
        new = _items(container)
        changed = sum(1 for (k, a), (j, b) in zip(old, new) if k != j or not _same_item(a, b)) + abs(len(new) - len(old))
        if changed:
            what = "dict" if isinstance(container, dict) else "list"
            said.append(f"the {what} given as {name} ({changed} of {max(len(old), len(new))} items replaced, added or removed)")
    return "; ".join(said)


def _looked_at(block: nn.Module, setup: _BlockSetup, inner: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Optional[tuple[Any]]:
    """A block whose forward changes a list or dict it is given (diffusers' Wan VAE: ``feat_cache`` and ``feat_idx``,
    appended to and indexed by a counter the forward moves on) cannot be recomputed: the recompute in backward sees
    other values (Wan: ``IndexError``, or other cached frames). Decided by running: its first training forward given a
    list or dict runs without checkpoint, those compared before and after; changed, the block is never checkpointed,
    warned by name with what changed; unchanged, it is checkpointed from its next call (this one keeps its activations
    once). Returns ``(output,)`` when the block ran here, ``None`` when it is to be checkpointed now."""
    given = _containers(args, kwargs)
    if setup.mutates is None and not given:
        setup.mutates = ""  # nothing it could change: checkpointed as ever
        return None
    if setup.mutates:
        return (inner(*args, **kwargs),)
    before = [(name, _items(container)) for name, container in given]
    out = inner(*args, **kwargs)
    setup.mutates = mutated_arguments(before, given)
    if setup.mutates:
        rank_zero_warn(
            f"lightning_hbm: ActivationCheckpointing leaves {setup.name or type(block).__name__!r} ({type(block).__name__}) "
            f"without checkpoint: its forward changes {setup.mutates}, measured on its first training forward, so a "
            "recompute in backward would run on other values than the forward did (diffusers' AutoencoderKLWan: "
            "IndexError). Its activations are kept, as without checkpointing. Fix: ActivationCheckpointing(blocks=[...]) "
            "naming modules inside it whose forward takes and changes no list or dict."
        )
    return (out,)


def _recount_coverage(module: nn.Module) -> None:
    """The coverage table printed at fit start counted every chosen block as checkpointed; a block its first training
    forward found changing a list or dict (:func:`_looked_at`) runs without: the table kept in the model's record
    (``coverage_of``) is counted again, naming it, as the warning did."""
    rows = coverage_of(module)
    if rows is None or not any(getattr(checkpoint_setup(m), "mutates", None) for m in module.modules()):
        return
    quantizing = any(r.quantized for r in rows)
    lora = lora_layer_classes()
    set_coverage(module, coverage(module, quantizing, bool(lora) and any(isinstance(m, lora) for m in module.modules())))


def _note_keywords(offload: OffloadSavedTensors, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Note the keyword tensors the offload never sees that are at least as large as the block's largest positional
    tensor (its hidden states passed as ``hidden_states=h``; not a position-id or a small mask beside them)."""
    largest = max((a.numel() * a.element_size() for a in args if isinstance(a, Tensor)), default=0)
    kept = [(k, v.numel() * v.element_size()) for k, v in kwargs.items() if isinstance(v, Tensor) and not isinstance(v, nn.Parameter)]
    kept = [(k, b) for k, b in kept if b and b >= largest]
    if kept:
        offload.keywords_kept[name] = kept


def _device_available(device: torch.device) -> bool:
    backend = getattr(torch, device.type, None)
    available = getattr(backend, "is_available", None)
    return bool(callable(available) and available())


def _blocks_by_spec(module: nn.Module, spec: Sequence[str]) -> list[tuple[str, nn.Module]]:
    named = list(module.named_modules())
    chosen: list[tuple[str, nn.Module]] = []
    unknown: list[str] = []
    for entry in spec:
        matches = [(n, m) for n, m in named if n == entry or type(m).__name__ == entry]
        if not matches:
            unknown.append(entry)
        chosen.extend(m for m in matches if m[0] not in {n for n, _ in chosen})
    if unknown:
        classes = sorted({type(m).__name__ for _, m in named if any(True for _ in m.children())})
        hint = "".join(did_you_mean(u, [*classes, *(n for n, _ in named if n)]) for u in unknown[:3])
        raise ValueError(
            f"ActivationCheckpointing(blocks={list(spec)!r}): {unknown} name no submodule path and no module class "
            f"of {type(module).__name__}.{hint} Use class names such as {classes[:12]} or module paths such as "
            f"{[n for n, _ in named if n][:8]}, or leave blocks=None to find the repeated blocks automatically."
        )
    nested = [n for n, _ in chosen if any(n.startswith(o + ".") for o, _ in chosen)]
    if nested:
        raise ValueError(
            f"ActivationCheckpointing(blocks={list(spec)!r}) selects modules nested inside other selected modules: "
            f"{nested[:5]}. Checkpoint either the outer blocks or the inner ones, not both."
        )
    return chosen


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
        _check_regenerate(regenerate, policy, every)
        if not isinstance(offload, bool) and offload < 0:
            raise ValueError(
                f"ActivationCheckpointing(offload={offload!r}): a number of blocks must be >= 0 (the first {offload!r} "
                "blocks cannot be offloaded). Pass True for every block, an int k for the first k, or False."
            )
        if policy not in ("full", "selective"):
            raise ValueError(f"ActivationCheckpointing(policy={policy!r}): choose 'full' or 'selective'.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(
                f"ActivationCheckpointing(every={every!r}): must be an int >= 1 (1 checkpoints every block, "
                "2 every second block, ...)."
            )
        if isinstance(mlp_chunks, bool) or not isinstance(mlp_chunks, int) or mlp_chunks < 1:
            raise ValueError(
                f"ActivationCheckpointing(mlp_chunks={mlp_chunks!r}): must be an int >= 1 (1: no chunks; 2 or 4 split "
                "each block's MLP recompute into that many chunks of tokens)."
            )
        if mlp_chunks > 1 and policy != "full":
            raise ValueError(
                f"ActivationCheckpointing(policy={policy!r}, mlp_chunks={mlp_chunks}): token chunks need policy='full' "
                "(the selective policy keeps the matmul outputs a chunk would recompute). Use policy='full' or mlp_chunks=1."
            )
        if blocks is not None and (isinstance(blocks, str) or not all(isinstance(b, str) for b in blocks) or not blocks):
            raise TypeError(
                f"ActivationCheckpointing(blocks={blocks!r}): pass a non-empty list of class names or module paths, "
                "e.g. ['Block'] or ['model.h.0', 'model.h.1'], or None for automatic detection."
            )
        try:
            device = torch.device(offload_device)
        except (RuntimeError, TypeError) as err:
            raise ValueError(
                f"ActivationCheckpointing(offload_device={offload_device!r}) is not a torch device: use 'cpu'."
            ) from err
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

    def _resolve(self, module: nn.Module) -> list[str]:
        """Names of the blocks to checkpoint; raises (changing nothing) if there are none."""
        found = _blocks_by_spec(module, self.blocks) if self.blocks is not None else find_blocks(module)
        if not found:
            lists = [n for n, m in module.named_modules() if isinstance(m, nn.ModuleList)]
            raise ValueError(
                f"ActivationCheckpointing found no repeated blocks in {type(module).__name__} (no nn.ModuleList or "
                f"nn.Sequential whose children share one class; ModuleLists seen: {lists[:8]}). Pass blocks=[...] with the class names "
                "or module paths of the layers to checkpoint."
            )
        hf_checkpointing = [n for n, m in found if getattr(m, "gradient_checkpointing", False)]
        if hf_checkpointing:
            raise ValueError(
                f"Blocks {hf_checkpointing[:3]} already use transformers' own gradient checkpointing; doing it twice "
                "recomputes every block twice. Call model.gradient_checkpointing_disable() or drop ActivationCheckpointing."
            )
        return [n for i, (n, _) in enumerate(found) if i % self.every == 0]

    @override
    def check_model(self, module: nn.Module) -> None:
        """Resolve the blocks on the model as the user built it, before quantization and adapters.

        Names, not module objects, are kept: a block that quantization or LoRA replaces (``blocks=["Linear"]``)
        is checkpointed in its changed form, at the same path.
        """
        self._resolved = self._resolve(module)
        check_offload_blocks(self.offload_blocks, len(self._resolved))
        target = self.offload.device if self.offload is not None else None
        if target is not None and target.type != "cpu" and not _device_available(target):
            raise ValueError(
                f"ActivationCheckpointing(offload_device={str(target)!r}): no {target.type} device here, so the first "
                "training step would fail. Offload to host memory: offload_device='cpu' (the default)."
            )

    @override
    def transform_model(self, module: nn.Module) -> None:
        names = self._resolved if self._resolved is not None else self._resolve(module)
        self._resolved = None
        check_offload_blocks(self.offload_blocks, len(names))
        chosen = [(n, module.get_submodule(n)) for n in names]
        context_fn = None
        if self.policy == "selective":  # the quantized layers' matmul operators are kept too (QuantFormat.matmul_ops)
            matmuls = {op for _, block in chosen for op in format_matmuls(block)}
            policy = SelectivePolicy(matmuls)
            _warn_unkept(unkept_formats([b for _, b in chosen], policy))
            context_fn = functools.partial(create_selective_checkpoint_contexts, policy)
        # A model checkpointed by an earlier Trainer's callback gets this callback's settings instead.
        for block in module.modules():
            if checkpoint_setup(block) is not None:
                _unwrap(block)
            chunked = torch_compat.forward_override(block)
            if isinstance(chunked, ChunkedForward):
                torch_compat.override_forward(block, chunked.own_forward)
        # Partial offload moves the FIRST blocks' inputs: an input lives from its block's forward to its block's
        # backward, and backward runs the blocks in reverse, so block 0's input is alive for the whole step and the
        # last block's is freed as soon as backward starts. At the peak (the start of backward) the first k inputs
        # off the device free k inputs; the last k would free k - 2 there (the last block's input is back on the
        # device to be used, and the one before it prefetched), and k - 1 at the end of the forward (one in flight).
        moved = len(chosen) if self.offload_blocks is None else self.offload_blocks
        setups = [_BlockSetup(block, context_fn, self.offload, moves=index < moved) for index, (_, block) in enumerate(chosen)]
        for setup, (name, _) in zip(setups, chosen):
            setup.name = name
        self._link(setups)
        for index, (setup, (_, block)) in enumerate(zip(setups, chosen)):
            _wrap(block, setup)
            for _, layer in candidates(block) if self.mlp_chunks > 1 else ():
                torch_compat.override_forward(layer, ChunkedForward(layer, self.mlp_chunks, block=index))
            for _, layer in inner_candidates(block) if self.mlp_chunks > 1 else ():
                torch_compat.override_forward(layer, ChunkedForward(layer, self.mlp_chunks, block=index, fed_only=True))
        for layer in _beside_blocks(module, [n for n, _ in chosen]) if self.mlp_chunks > 1 else ():
            torch_compat.override_forward(layer, ChunkedForward(layer, self.mlp_chunks))
        self._chunk_report_due = self.mlp_chunks > 1
        self._coverage_due = True
        self._order_due = self.policy == "full"  # selective keeps the matmul outputs: no base matmul to skip
        self.checkpointed = [n for n, _ in chosen]
        self.offloaded = self.checkpointed[:moved] if self.offload is not None else []
        _disable_hf_cache(module)
        offloaded = "" if self.offload is None else ", offload" if self.offload_blocks is None else f", offload of the first {moved}"
        remade = "" if self.regenerate == 1 else f", the input of one block in {self.regenerate} kept, the others remade"
        rank_zero_info(
            f"lightning_hbm: activation checkpointing ({self.policy}{offloaded}{remade}) "
            f"on {len(chosen)} blocks ({', '.join(dict.fromkeys(type(b).__name__ for _, b in chosen))})"
        )

    def _link(self, setups: list[_BlockSetup]) -> None:
        """``regenerate=n``: every block's forward is linked to the block called before it by what it is fed
        (:meth:`Remade.link`), not by module order."""
        self.remade = Remade(self.regenerate)
        if self.regenerate == 1:
            return
        for setup in setups:
            setup.counts = self.remade

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
            _recount_coverage(pl_module)
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
        kept = self.offload.keywords_kept if self.offload is not None else {}
        new = [n for n in kept if n not in self._keywords_warned]
        if not new:
            return
        self._keywords_warned.update(new)
        named = "; ".join(f"{n}: {', '.join(f'{k} ({size(b)})' for k, b in kept[n])}" for n in new[:12])
        rank_zero_warn(
            f"lightning_hbm: ActivationCheckpointing(offload=...) keeps on the device the keyword tensor inputs of "
            f"{len(new)} block(s): {named}{'; ...' if len(new) > 12 else ''}. torch's checkpoint saves only positional "
            "tensors through the saved-tensor hooks that offload; a tensor passed as a keyword stays in its closure, on "
            "the device, until the block's backward (what regenerate remakes, the output of the block called just "
            "before, is moved and offloaded). Call the blocks with it positionally (block(h), not block(hidden_states=h))."
        )

    def warn_unremade(self) -> None:
        """Warn (once per block) about blocks that keep their input under ``regenerate`` because it is not the output of
        the checkpointed block called just before them: each by name with the bytes it keeps and that block, then what
        is remade and what is kept as every n-th link (the whole picture of the step, in call order)."""
        counts = self.remade
        new = [n for n in counts.unmatched if n not in self._remade_warned]
        if not new:
            return
        self._remade_warned.update(new)
        unmatched = list(counts.unmatched.items())
        kept = "; ".join(f"{n} ({size(b)}, the block called before it: {before})" for n, (b, before) in unmatched[:12])
        kept += f"; and {len(unmatched) - 12} more" if len(unmatched) > 12 else ""
        rank_zero_warn(
            f"lightning_hbm: ActivationCheckpointing(regenerate={self.regenerate}) could not remake the input of "
            f"{len(unmatched)} block(s), which keep it as without regenerate ({size(sum(b for _, (b, _) in unmatched))}"
            f" in all): {kept}. A block's input is remade only when it is exactly the output of the checkpointed "
            "block called just before it (as that block returned it); these are fed something else (layers between "
            "the blocks: a downsampler, a skip connection concatenated, the hidden states scaled or changed in place). "
            f"Remade: {_named_sizes(counts.made)}; kept as one block in {self.regenerate} of a chain: "
            f"{_named_sizes(counts.kept)}. Use regenerate=1 (the same memory for these blocks, no block forward run "
            "again), or checkpoint blocks that feed each other directly."
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"adapter_first": list(self.adapter_first)} if self.adapter_first else {}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored_order = state_dict.get("adapter_first")


def _named_sizes(named: dict[str, int]) -> str:
    """``2 block(s), 4.00 KiB: a (2.00 KiB), b (2.00 KiB)`` (the first 8 named)."""
    if not named:
        return "none"
    listed = ", ".join(f"{n} ({size(b)})" for n, b in list(named.items())[:8])
    more = f", and {len(named) - 8} more" if len(named) > 8 else ""
    return f"{len(named)} block(s), {size(sum(named.values()))}: {listed}{more}"


def _check_regenerate(regenerate: int, policy: str, every: int) -> None:
    if isinstance(regenerate, bool) or not isinstance(regenerate, int) or regenerate < 1:
        raise ValueError(
            f"ActivationCheckpointing(regenerate={regenerate!r}): must be an int >= 1 (1 keeps every block's input, "
            "2 every second one, the others remade in the backward)."
        )
    if regenerate > 1 and (policy != "full" or every != 1):
        raise ValueError(
            f"ActivationCheckpointing(regenerate={regenerate}, policy={policy!r}, every={every}): remade inputs need "
            "policy='full' and every=1 (a block's input is remade from the checkpointed block just before it). Use "
            "policy='full', every=1, or regenerate=1."
        )


def check_offload_blocks(count: Optional[int], blocks: int) -> None:
    """Raise ``ValueError`` when ``ActivationCheckpointing(offload=count)`` names more blocks than the ``blocks``
    checkpointed (``count`` None: every block)."""
    if count is not None and count > blocks:
        raise ValueError(
            f"ActivationCheckpointing(offload={count}): the model has {blocks} checkpointed blocks, so the first {count} "
            f"cannot be offloaded. Pass offload={blocks} or offload=True (every block), or fewer blocks."
        )


def _beside_blocks(module: nn.Module, blocks: Sequence[str]) -> list[nn.Module]:
    """The other children of the module holding the blocks (a Llama's final ``norm``, its embedding): chunked as a
    block's layers are, where :func:`~lightning_hbm.activations.token_chunks.decide` says yes on the first step.

    Why: the final norm runs outside every checkpoint. A bf16 RMSNorm computing in fp32 then kept its fp32 copy and
    made its backward's fp32 copies whole, the step's largest backward peak once the blocks' own norms were chunked.
    """
    lists = {name.rpartition(".")[0] for name in blocks}  # the container of the blocks (a ModuleList's path)
    if len(lists) != 1:
        return []
    owner_name, _, list_name = lists.pop().rpartition(".")
    owner = module.get_submodule(owner_name)
    # leaves only: a sibling with children (a vision tower) is no token-wise layer to chunk as one
    return [child for name, child in owner.named_children() if name != list_name and not list(child.children())]


def _warn_unkept(unkept: dict[str, tuple[str, list[str]]]) -> None:
    for kind, (layer, ops) in unkept.items():
        rank_zero_warn(
            f"lightning_hbm: ActivationCheckpointing('selective') keeps matmul outputs, but the quantized {kind} layers (e.g. "
            f"{layer!r} in each block) run no matmul operator it knows (they ran {', '.join(ops) or 'no operator of their own'}), "
            "so their matmuls are recomputed in backward as with 'full'. Name the operator in that format's "
            "QuantFormat.matmul_ops, or use ActivationCheckpointing('full').",
            category=UserWarning,
        )


def report_chunks(module: nn.Module, blocks: Sequence[str], chunks: int) -> list[str]:
    """The layers recomputed in token chunks after the first step; warns naming the blocks that got none, and why."""
    chunked: list[str] = []
    left: dict[str, list[str]] = {}
    for name in blocks:
        verdicts = {
            child: forward.verdict
            for child, layer in candidates(module.get_submodule(name)) + inner_candidates(module.get_submodule(name))
            for forward in [torch_compat.forward_override(layer)]
            if isinstance(forward, ChunkedForward) and forward.verdict is not None
        }
        chunked += [f"{name}.{n}" for n, v in verdicts.items() if v == ""]
        if "" not in verdicts.values():
            left[name] = [f"{n}: {v}" for n, v in verdicts.items()] or ["none of its layers ran with gradients"]
    if left:
        first = next(iter(left))
        rank_zero_warn(
            f"ActivationCheckpointing(mlp_chunks={chunks}) found no layer to recompute in token chunks in {len(left)} "
            f"block(s), e.g. {first} ({'; '.join(left[first][:4])}); their recompute is whole, as with mlp_chunks=1. "
            "A layer qualifies when it is called with one tensor of tokens, treats each token on its own, saves at "
            "least 2x its input and output per token for backward and draws no random numbers: set the MLP's dropout "
            "to 0, or pass mlp_chunks=1 to drop the request."
        )
    if chunked:
        rank_zero_info(f"lightning_hbm: {len(chunked)} layers recomputed in {chunks} token chunks ({chunked[0]}, ...)")
    return chunked


def _disable_hf_cache(module: nn.Module) -> None:
    """Turn off the key/value cache of the Hugging Face models inside ``module``, as their own
    ``gradient_checkpointing_enable`` does.

    With the cache on, a decoder (T5's) stores different tensors in the forward and in the
    recomputation, and non-reentrant checkpointing fails ("a different number of tensors was saved").
    Every ``config`` is changed (T5 gives its encoder and decoder stacks their own copies); generation
    after training can pass ``use_cache=True`` explicitly.
    """
    configs: dict[int, Any] = {id(c): c for m in module.modules() for c in [getattr(m, "config", None)] if getattr(c, "use_cache", False)}
    for config in configs.values():
        config.use_cache = False
    if configs:
        rank_zero_info(f"lightning_hbm: use_cache=False on {len(configs)} Hugging Face config(s) (activation checkpointing)")


__all__ = ["ActivationCheckpointing", "OffloadSavedTensors", "host_footprint", "pinned_footprint", "pinned_pieces"]
