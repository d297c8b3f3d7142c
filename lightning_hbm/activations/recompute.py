"""The recompute set up on a model: the mechanism behind
:class:`~lightning_hbm.activations.checkpointing.ActivationCheckpointing`, without Lightning's callback.

Its settings checked (:func:`check_settings`), the blocks chosen (:func:`resolve_blocks`: the repeated blocks, or those
named), each one's ``forward`` wrapped with one setting (:func:`checkpoint_blocks`, over
:mod:`~lightning_hbm.activations.block_forward`), and what the first training step tells: the layers recomputed in
token chunks (:func:`report_chunks`), the blocks left without checkpoint in the coverage table
(:func:`recount_coverage`), the inputs ``regenerate`` could not remake (:func:`warn_unremade`; those FSDP2's units
keep, at fit start: :func:`warn_fsdp_units`) and the keyword tensors the offload never sees
(:func:`warn_keywords_kept`). The callback holds the settings and the run's state and calls
these at its hooks, as Lightning's ``ThroughputMonitor`` over ``Throughput``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional, Union

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.activations.block_forward import _BlockSetup, unwrap, wrap
from lightning_hbm.activations.offload import OffloadSavedTensors
from lightning_hbm.activations.regenerate import Remade, kept_inputs, size, unit_crossings
from lightning_hbm.activations.selective import SelectivePolicy, format_matmuls, unkept_formats
from lightning_hbm.activations.token_chunks import ChunkedForward, candidates, inner_candidates
from lightning_hbm.layers.blocks import find_blocks, unordered_stacks
from lightning_hbm.layers.coverage_table import coverage
from lightning_hbm.layers.finding import lora_layer_classes
from lightning_hbm.naming import did_you_mean
from lightning_hbm.record import checkpoint_setup, coverage_of, set_coverage


def check_settings(
    policy: str, blocks: Optional[Sequence[str]], every: int, offload: Union[bool, int], offload_device: str,
    mlp_chunks: int, regenerate: int,
) -> torch.device:
    """Raise (``ValueError``, ``TypeError``) on settings of ``ActivationCheckpointing`` that cannot run, naming the
    value and the fix; returns the ``offload_device`` as a torch device."""
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
        return torch.device(offload_device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"ActivationCheckpointing(offload_device={offload_device!r}) is not a torch device: use 'cpu'."
        ) from err


def resolve_blocks(module: nn.Module, blocks: Optional[Sequence[str]], every: int) -> list[str]:
    """Names of the blocks to checkpoint (``blocks``: class names or module paths; ``None``: the repeated blocks),
    every ``every``-th one; raises (changing nothing) if there are none."""
    found = _blocks_by_spec(module, blocks) if blocks is not None else find_blocks(module)
    if not found:
        raise _no_blocks(module)
    hf_checkpointing = [n for n, m in found if getattr(m, "gradient_checkpointing", False)]
    if hf_checkpointing:
        raise ValueError(
            f"Blocks {hf_checkpointing[:3]} already use transformers' own gradient checkpointing; doing it twice "
            "recomputes every block twice. Call model.gradient_checkpointing_disable() or drop ActivationCheckpointing."
        )
    return [n for i, (n, _) in enumerate(found) if i % every == 0]


def _no_blocks(module: nn.Module) -> ValueError:
    """The error of a model in which :func:`find_blocks` found no stack: what a stack is, the modules that came near
    (plain modules whose children of one class their forward does not run in order), and the fix."""
    lists = [n for n, m in module.named_modules() if isinstance(m, nn.ModuleList)]
    near = unordered_stacks(module)
    seen = (
        "Plain modules holding children of one class that their forward does not run one after another (a skip "
        "connection, another order, a child called twice or inside another call), so not taken: "
        f"{', '.join(f'{n or type(module).__name__} ({len(items)} {k.__name__})' for n, k, items in near[:6])}. "
        if near else ""
    )  # fmt: skip
    example = ""
    if near:  # a class of the user's: its name; a torch container (Sequential) would name every one: the paths
        name, kind, items = near[0]
        example = f", e.g. blocks=[{kind.__name__!r}]" if not kind.__module__.startswith("torch.") else f", e.g. blocks={items[:4]!r}"
    return ValueError(
        f"ActivationCheckpointing found no repeated blocks in {type(module).__name__}: it checkpoints one by one the "
        "children of a stack, and none of its modules is one. A stack is an nn.ModuleList or nn.Sequential whose "
        "children are composite modules of one class, or a plain module whose children are all composite modules of "
        "one class that its forward runs one after another (a loop `for block in self.children()`, or one statement "
        f"`x = self.<child>(x)` per child, in the order they were registered). {seen}ModuleLists seen: {lists[:8]}. "
        f"Pass blocks=[...] with the class names or module paths of the layers to checkpoint{example}."
    )


def check_offload_device(offload: Optional[OffloadSavedTensors]) -> None:
    """Raise ``ValueError`` when the offload goes to a device this machine has not (the first step would fail)."""
    target = offload.device if offload is not None else None
    if target is not None and target.type != "cpu" and not _device_available(target):
        raise ValueError(
            f"ActivationCheckpointing(offload_device={str(target)!r}): no {target.type} device here, so the first "
            "training step would fail. Offload to host memory: offload_device='cpu' (the default)."
        )


def checkpoint_blocks(
    module: nn.Module, names: Sequence[str], policy: str, offload: Optional[OffloadSavedTensors], moved: int,
    mlp_chunks: int, counts: Optional[Remade],
) -> None:
    """Wrap the ``forward`` of each block of ``module`` named in ``names`` in checkpoint with one setting: ``policy``,
    the inputs of the first ``moved`` blocks through ``offload``, their token-wise layers in ``mlp_chunks`` chunks,
    ``counts``: linked for ``regenerate`` (None: every input kept). A block wrapped before (an earlier Trainer's
    callback) gets this setting instead."""
    chosen = [(n, module.get_submodule(n)) for n in names]
    context_fn = None
    if policy == "selective":  # the quantized layers' matmul operators are kept too (QuantFormat.matmul_ops)
        matmuls = {op for _, block in chosen for op in format_matmuls(block)}
        selective = SelectivePolicy(matmuls)
        _warn_unkept(unkept_formats([b for _, b in chosen], selective))
        context_fn = functools.partial(create_selective_checkpoint_contexts, selective)
    for block in module.modules():
        if checkpoint_setup(block) is not None:
            unwrap(block)
        chunked = torch_compat.forward_override(block)
        if isinstance(chunked, ChunkedForward):
            torch_compat.override_forward(block, chunked.own_forward)
    # Partial offload moves the FIRST blocks' inputs: an input lives from its block's forward to its block's
    # backward, and backward runs the blocks in reverse, so block 0's input is alive for the whole step and the
    # last block's is freed as soon as backward starts. At the peak (the start of backward) the first k inputs
    # off the device free k inputs; the last k would free k - 2 there (the last block's input is back on the
    # device to be used, and the one before it prefetched), and k - 1 at the end of the forward (one in flight).
    setups = [_BlockSetup(block, context_fn, offload, moves=index < moved) for index, (_, block) in enumerate(chosen)]
    for setup, (name, _) in zip(setups, chosen):
        setup.name = name
        setup.counts = counts  # regenerate=n: linked to the block called before by what it is fed (Remade.link)
    for index, (setup, (_, block)) in enumerate(zip(setups, chosen)):
        wrap(block, setup)
        for _, layer in candidates(block) if mlp_chunks > 1 else ():
            torch_compat.override_forward(layer, ChunkedForward(layer, mlp_chunks, block=index))
        for _, layer in inner_candidates(block) if mlp_chunks > 1 else ():
            torch_compat.override_forward(layer, ChunkedForward(layer, mlp_chunks, block=index, fed_only=True))
    for layer in _beside_blocks(module, list(names)) if mlp_chunks > 1 else ():
        torch_compat.override_forward(layer, ChunkedForward(layer, mlp_chunks))
    _disable_hf_cache(module)


def warn_keywords_kept(offload: Optional[OffloadSavedTensors], warned: set[str]) -> None:
    """Warn (once per block: ``warned`` holds those named) about offloaded blocks called with a large tensor as a
    keyword: it stays on the device."""
    kept = offload.keywords_kept if offload is not None else {}
    new = [n for n in kept if n not in warned]
    if not new:
        return
    warned.update(new)
    named = "; ".join(f"{n}: {', '.join(f'{k} ({size(b)})' for k, b in kept[n])}" for n in new[:12])
    rank_zero_warn(
        f"lightning_hbm: ActivationCheckpointing(offload=...) keeps on the device the keyword tensor inputs of "
        f"{len(new)} block(s): {named}{'; ...' if len(new) > 12 else ''}. torch's checkpoint saves only positional "
        "tensors through the saved-tensor hooks that offload; a tensor passed as a keyword stays in its closure, on "
        "the device, until the block's backward (what regenerate remakes, the output of the block called just "
        "before, is moved and offloaded). Call the blocks with it positionally (block(h), not block(hidden_states=h))."
    )


def warn_unremade(counts: Remade, regenerate: int, warned: set[str]) -> None:
    """Warn (once per block: ``warned`` holds those named) about blocks that keep their input under ``regenerate``
    because it is not the output of the checkpointed block called just before them: each by name with the bytes it
    keeps and that block, then what is remade and what is kept as every n-th link (the whole picture of the step, in
    call order)."""
    new = [n for n in counts.unmatched if n not in warned]
    if not new:
        return
    warned.update(new)
    unmatched = list(counts.unmatched.items())
    kept = "; ".join(f"{n} ({size(b)}, the block called before it: {before})" for n, (b, before) in unmatched[:12])
    kept += f"; and {len(unmatched) - 12} more" if len(unmatched) > 12 else ""
    rank_zero_warn(
        f"lightning_hbm: ActivationCheckpointing(regenerate={regenerate}) could not remake the input of "
        f"{len(unmatched)} block(s), which keep it as without regenerate ({size(sum(b for _, (b, _) in unmatched))}"
        f" in all): {kept}. A block's input is remade only when it is exactly the output of the checkpointed "
        "block called just before it (as that block returned it); these are fed something else (layers between "
        "the blocks: a downsampler, a skip connection concatenated, the hidden states scaled or changed in place). "
        f"Remade: {_named_sizes(counts.made)}; kept as one block in {regenerate} of a chain: "
        f"{_named_sizes(counts.kept)}. Use regenerate=1 (the same memory for these blocks, no block forward run "
        "again), or checkpoint blocks that feed each other directly."
    )



def warn_fsdp_units(module: nn.Module, names: Sequence[str], regenerate: int, warned: set[str]) -> None:
    """Say at fit start (the FSDP2 units exist: the strategy's setup ran) which checkpointed blocks of ``names`` keep
    their input under ``regenerate`` because FSDP2 hands it over across a unit boundary from a block that is no unit of
    its own (:func:`~lightning_hbm.activations.regenerate.unit_crossings`), with how many inputs are kept against every
    block linked, and the fix; those blocks go into ``warned`` (the warning after the first step does not name them
    again). A warning where more inputs are kept; where the units' boundaries fall on blocks that keep theirs anyway
    (units of ``k`` blocks, ``regenerate`` dividing ``k``), an info line. Before session 38 this was said after the
    first step only, as blocks "fed something else", FSDP2 unnamed."""
    crossings = unit_crossings(module, names) if regenerate > 1 else []
    if not crossings:
        return
    warned.update(c.name for c in crossings)
    starts = [list(names).index(c.name) for c in crossings]
    kept, linked = kept_inputs(len(names), regenerate, starts), kept_inputs(len(names), regenerate)
    listed = "; ".join(
        f"{c.name} (in unit {c.entered[-1]}, fed by {c.before}, "
        f"{'in unit ' + c.source_unit if c.source_unit is not None else 'in no unit'})" for c in crossings[:8])
    listed += f"; and {len(crossings) - 8} more" if len(crossings) > 8 else ""
    said = (f"lightning_hbm: ActivationCheckpointing(regenerate={regenerate}) under FSDP2: {len(crossings)} checkpointed "
            f"block(s) get their input from a block in another FSDP2 unit that is not a unit of its own: {listed}. "
            "FSDP2 hands a unit its input through the unit's pre-forward function, and the block before could be run "
            "again in the backward only with its whole unit gathered, so each of these keeps its input (one block "
            f"input: batch x tokens x hidden) and starts a new chain: {kept} of {len(names)} block inputs kept")
    if kept == linked:
        rank_zero_info(f"{said}, as many as with every block linked (each unit's first block keeps its input anyway).")
        return
    rank_zero_warn(
        f"{said}, where {linked} would be with every block linked: {kept - linked} block input(s) more on the device "
        "(in host memory where offloaded). Make each checkpointed block an FSDP2 unit of its own (QuantizedFSDPStrategy's "
        f"default units, or shard_modules=[{torch_compat.own_class_name(module.get_submodule(crossings[0].name))!r}]), or one unit around "
        f"them all{_aligned(len(names), regenerate, starts)}."
    )


def _aligned(count: int, regenerate: int, starts: Sequence[int]) -> str:
    """``, or regenerate=k``: the largest ``k`` below ``regenerate`` whose chains the units' boundaries do not cut
    (as many inputs kept as with every block linked), if one above 1 is."""
    fits = [k for k in range(2, regenerate) if kept_inputs(count, k, starts) == kept_inputs(count, k)]
    return f", or regenerate={fits[-1]} (each unit's first block then keeps its input anyway)" if fits else ""


def recount_coverage(module: nn.Module) -> None:
    """The coverage table printed at fit start counted every chosen block as checkpointed; a block its first training
    forward found changing a list or dict (:func:`~lightning_hbm.activations.block_forward._looked_at`) runs without: the table kept in the model's record
    (``coverage_of``) is counted again, naming it, as the warning did."""
    rows = coverage_of(module)
    if rows is None or not any(getattr(checkpoint_setup(m), "mutates", None) for m in module.modules()):
        return
    quantizing = any(r.quantized for r in rows)
    lora = lora_layer_classes()
    set_coverage(module, coverage(module, quantizing, bool(lora) and any(isinstance(m, lora) for m in module.modules())))


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

