"""The coverage table: per layer kind, the parameters quantized, adapted, checkpointed and left alone (with why),
printed at fit start, logged, kept in the model's record (:func:`lightning_hbm.record.coverage_of`; public:
:func:`lightning_hbm.coverage_of`), and its warnings (a kind left alone, not by choice, above :data:`WARN_SHARE` of
the parameters)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, cast

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_hbm import record
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm.layers.correction import correction_of
from lightning_hbm.layers.finding import base_layer, find_layers, lora_layer_classes
from lightning_hbm.layers.kinds import LayerKind, kind_named
from lightning_hbm.layers.outside import OUTSIDE, OUTSIDE_ROWS, outside_kinds, outside_reason
from lightning_hbm.layers.readers import observation as probe_observation
from lightning_hbm.layers.source_scan import weight_readers
from lightning_hbm.memory import parameter_bytes, parameter_count
from lightning_hbm.memory.storage import quantized_format
from lightning_hbm.naming import under

WARN_SHARE = 0.05  # a kind left alone (not by choice) above this share of all parameters is a warning


@dataclass
class CoverageRow:
    """Parameters of one kind (logical element counts) and what was done with them."""

    kind: str
    layers: int = 0
    params: int = 0
    quantized: int = 0
    adapted: int = 0
    checkpointed: int = 0
    left_alone: int = 0
    bytes: int = 0  # storage bytes of the layers' parameters (quantization constants included)
    unhandled: int = 0  # left alone not by choice (nothing supports them): warned above 5 %
    reasons: dict[str, int] = field(default_factory=dict)  # why left alone -> parameters
    undeliberate: list[str] = field(default_factory=list)  # names of layers left alone not by choice


def _left_alone_reason(layer: nn.Module, kind: LayerKind, quantizing: bool, adapting: bool, reader: Optional[str] = None) -> tuple[str, bool]:
    tagged = record.left_alone(layer)
    if tagged is not None:
        return tagged
    if reader is not None:
        return f"weight read directly by {reader}, not by calling the layer: kept in the compute dtype", False
    if kind.prepare is not None and kind.matches(layer):
        return f"{kind.name}: this variant is not supported yet", False
    # a layer LoRA cannot adapt (a grouped convolution) is said so, with the fix, not just "not quantized"
    skipped = f"; {kind.not_adapted}" if adapting and kind.not_adapted and not kind.adaptable_names(layer) else ""
    if kind.to_linear is None and quantizing:
        return kind.quantized_as + skipped, False
    if quantizing:  # the plugin tags what it skips; an untagged float layer came after it
        return "added after quantization", True
    if skipped:
        return "frozen in full precision (no QuantizedPrecision)" + skipped, True
    return "frozen in full precision (no QuantizedPrecision" + (", not a LoRA target)" if adapting else ")"), True


def _not_adapted_reason(layer: nn.Module, kind: LayerKind) -> str:
    """Why a quantized layer has no adapter while LoRA adapts others: its kind's (LoRA cannot adapt it), else LoRA's
    tag (an output head left out of 'all-linear'), else it was not a LoRA target."""
    if not kind.adaptable_names(layer):
        return kind.not_adapted or kind.adapted_as
    tagged = record.left_alone(layer)
    if tagged is not None:
        return tagged[0]
    return "not adapted: not a LoRA target (LoRA(target_modules=[...]) names the layers it adapts)"


def coverage(module: nn.Module, quantizing: bool, adapting: bool) -> list[CoverageRow]:
    """One row per registered kind present in ``module``, the LoRA adapters, and ``other`` (embeddings, norms, ...).

    ``quantizing``/``adapting``: whether a QuantizedPrecision / LoRA took part (for the reasons).
    """
    lora = lora_layer_classes()
    unchecked = _unchecked_blocks(module)
    blocks = [b for b in record.checkpointed_blocks(module) if b not in unchecked]
    rows: dict[str, CoverageRow] = {}
    in_kinds: set[int] = set()
    readers, users = weight_readers(module), weight_readers(module, uses_only=True)
    for name, sub, kind in find_layers(module):
        layer = base_layer(sub)
        row = rows.setdefault(kind.name, CoverageRow(kind.name))
        # a layer's own parameters: the children of an unconverted MultiheadAttention or experts module
        # (out_proj, a router) are layers or "other" parameters of their own
        own = list(layer.parameters(recurse=False))
        storage = kind.stored_in(layer) if kind.stored_in is not None else None
        if storage is not None:  # a wrapped quantized layer: its storage's tensors are its own
            own += list(storage.parameters())
        # a quantized layer's calibrated correction: part of its stored weight (its bytes), not more weights
        correction = correction_of(layer)
        factors = list(correction.parameters()) if correction is not None else []
        has_children = storage is None and any(child is not correction for child in layer.children())
        count = sum(p.numel() for p in own) if has_children else parameter_count(layer) - sum(p.numel() for p in factors)
        in_kinds.update(id(p) for p in [*own, *factors])
        row.layers += 1
        row.params += count
        if has_children:
            row.bytes += sum(p.numel() * p.element_size() for p in [*own, *factors])
        else:
            row.bytes += parameter_bytes(layer)
        quantized = storage is not None or any(not p.is_floating_point() for p in own) or quantized_format(layer) is not None
        adapted = bool(lora) and isinstance(sub, lora)
        row.quantized += count if quantized else 0
        row.adapted += count if adapted else 0
        note = getattr(layer, "coverage_note", None)  # stored small but not computed as the others (T5's fp32 `wo`)
        if storage is not None and kind.name == "Embedding" and quantized_format(storage) is not None:
            # the input embeddings' mode is a setting of its own (quantize_embeddings, int8 by default): said here
            note = f"stored in {quantized_format(storage).name} (QuantizedPrecision(quantize_embeddings=...))"
        if quantized and note:
            row.reasons[note] = row.reasons.get(note, 0) + count
        if under(name, blocks):
            row.checkpointed += count
        inside = next((b for b in unchecked if name == b or name.startswith(b + ".")), None)
        if inside is not None:  # a block ActivationCheckpointing chose and runs without checkpoint: its layers say why
            row.reasons[unchecked[inside]] = row.reasons.get(unchecked[inside], 0) + count
        if not quantized and not adapted:
            reader = (readers if kind.to_linear is not None else users).get(name)  # a convolution is never quantized
            reason, deliberate = _left_alone_reason(layer, kind, quantizing, adapting, reader)
            row.left_alone += count
            row.reasons[reason] = row.reasons.get(reason, 0) + count
            if not deliberate:
                row.undeliberate.append(name)
                row.unhandled += count
        elif adapted and quantizing and not quantized and kind.to_linear is None:
            # adapted, but its frozen base stays at full size (a convolution): said, and warned above 5 %
            reason = f"{kind.quantized_as}; adapted by LoRA"
            row.reasons[reason] = row.reasons.get(reason, 0) + count
            row.undeliberate.append(name)
            row.unhandled += count
        elif adapted and quantizing and not quantized:
            # adapted but kept wide (ignore_modules, the head, the sensitivity plan): its reason too (issue 53: every
            # layer kept wide has its reason in the table)
            # (in the table only: an adapted layer trains, so it is not counted among those warned as left alone)
            reason, _ = _left_alone_reason(layer, kind, quantizing, adapting, readers.get(name))
            reason = f"{reason}; adapted by LoRA"
            row.reasons[reason] = row.reasons.get(reason, 0) + count
        elif quantized and not adapted and adapting:
            # quantized, but no adapter while LoRA trains others (a transposed or grouped convolution, an embedding, a
            # layer not named in target_modules): its reason too, as every layer left unadapted has one
            reason = _not_adapted_reason(layer, kind)
            row.reasons[reason] = row.reasons.get(reason, 0) + count
    other = CoverageRow("other (embeddings, norms, ...)")
    adapters = CoverageRow("LoRA adapters (trained)")
    # its "layers": the adapted layers (peft LoRA layers), each holding one lora_A/lora_B pair
    adapters.layers = sum(1 for m in module.modules() if isinstance(m, lora)) if lora else 0
    seen = probe_observation(module)
    unrun = seen.unrun if seen is not None else frozenset()  # layers the probe step never ran (surgery/probe_step.py)
    outside = {kind: CoverageRow(kind) for kind in OUTSIDE_ROWS}
    owners = {id(p): n for n, m in module.named_modules() if not isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    tables = {id(m.weight): m for m in module.modules() if type(m) is nn.Embedding}
    kinds = outside_kinds(module, {id(p) for p in module.parameters() if id(p) not in in_kinds})
    holders: dict[str, list[str]] = {kind: [] for kind in OUTSIDE_ROWS}
    for name, param in module.named_parameters():
        if id(param) in in_kinds:
            continue
        if ".lora_" in name:
            adapters.params += param.numel()
            if name.partition(".lora_")[0] in unrun:  # counted as trained, it was not (session 39: the row said so)
                adapters.reasons[UNRUN_ADAPTERS] = adapters.reasons.get(UNRUN_ADAPTERS, 0) + param.numel()
        elif id(param) in owners and id(param) in kinds:
            # a weight matrix no layer kind holds (DBRX's experts: 2-D w1/v1/w2 Parameters, routers, RG-LRU gates,
            # weight_norm's factors): never quantized or adapted; its own row says what it is, warned above 5 %
            owner, row = owners[id(param)], outside[kinds[id(param)]]
            reason, deliberate = outside_reason(row.kind, param), OUTSIDE[row.kind][1]
            row.params += param.numel()
            row.left_alone += param.numel()
            row.reasons[reason] = row.reasons.get(reason, 0) + param.numel()
            row.checkpointed += param.numel() if under(owner, blocks) else 0
            row.unhandled += 0 if deliberate else param.numel()
            if owner not in holders[row.kind]:
                holders[row.kind].append(owner)
        else:
            other.params += param.numel()
            tagged = record.left_alone(tables[id(param)]) if id(param) in tables else None
            if tagged is not None:  # an input embedding the precision plugin kept wide (too small to gain, ...): why
                other.reasons[tagged[0]] = other.reasons.get(tagged[0], 0) + param.numel()
    other.left_alone = other.params
    for row in outside.values():
        row.layers = len(holders[row.kind])
        row.undeliberate = [] if OUTSIDE[row.kind][1] else holders[row.kind]
    present = [row for row in outside.values() if row.params]
    return [*rows.values(), *present, *([adapters] if adapters.params else []), other]


#: the adapters row's reason for adapters on layers the training step never ran (warned at fit start as well)
UNRUN_ADAPTERS = "on layers the training step never runs: never trained (warned at fit start)"


def _unchecked_blocks(module: nn.Module) -> dict[str, str]:
    """Checkpointed blocks whose first training forward changed a list or dict it was given (they run without
    checkpoint, :mod:`lightning_hbm.activations.checkpointing`): block name -> the reason their layers are given."""
    found = {}
    for name, block in module.named_modules():
        changes = getattr(record.checkpoint_setup(block), "mutates", None)
        if changes:
            found[name] = (f"not checkpointed: {name!r} ({type(block).__name__}) changes {changes.split(' (')[0]} in its "
                           "forward (activations kept)")
    return found


def format_coverage(rows: list[CoverageRow]) -> str:
    """The coverage table as text (one line per kind)."""
    total = max(sum(r.params for r in rows), 1)
    header = f"{'layer kind':<30} {'layers':>6} {'params':>12} {'share':>6} {'quantized':>12} {'adapted':>12} {'checkpointed':>12} {'left alone':>12}  why left alone"
    lines = [header]
    for r in rows:
        why = "; ".join(f"{reason} ({n:,})" for reason, n in r.reasons.items())
        lines.append(
            f"{r.kind:<30} {r.layers:>6} {r.params:>12,} {100 * r.params / total:>5.1f}% {r.quantized:>12,} "
            f"{r.adapted:>12,} {r.checkpointed:>12,} {r.left_alone:>12,}  {why}"
        )
    return "\n".join(lines)


def coverage_warnings(rows: list[CoverageRow]) -> list[str]:
    """One message per kind left alone, not by choice, holding more than 5 % of all parameters."""
    total = max(sum(r.params for r in rows), 1)
    messages = []
    for r in rows:
        if r.unhandled / total > WARN_SHARE and r.kind in OUTSIDE:
            names = f"{r.undeliberate[:4]}{' ...' if len(r.undeliberate) > 4 else ''}"
            messages.append(
                f"lightning_hbm: {100 * r.unhandled / total:.1f}% of the parameters are {r.kind}, left as they were (not "
                f"quantized, no adapter): {OUTSIDE[r.kind][2].format(names=names)}."
            )
        elif r.unhandled / total > WARN_SHARE:
            kind = kind_named(r.kind)
            assert kind is not None  # the rows of other parameters (embeddings, adapters) are never unhandled
            read = [why for why in r.reasons if why.startswith("weight read directly")]
            option = (
                f"{'; '.join(read)}. Replace the reading code by a call of the layer to quantize/adapt them"
                if read else f"Option: {kind.option}"
            )
            # convolutions LoRA adapted are unhandled too (not quantized), but not left as they were
            state = "left as they were (not quantized, no adapter)" if r.left_alone >= r.unhandled else "not quantized"
            if kind.to_linear is None and kind.prepare is None:
                option = f"{kind.quantized_as}. {option}"
            if kind.not_adapted and any(kind.not_adapted in why for why in r.reasons):
                option = f"{option}. {kind.not_adapted}"
            messages.append(
                f"lightning_hbm: {100 * r.unhandled / total:.1f}% of the parameters are {r.kind} layers {state}: "
                f"{r.undeliberate[:4]}{' ...' if len(r.undeliberate) > 4 else ''}. {option}."
            )
    return messages


def report_coverage(module: nn.Module, quantizing: bool) -> list[CoverageRow]:
    """Compute, print (rank 0), log and store the coverage table; warn.

    Stored in the model's record, nothing set on the model: read it with :func:`lightning_hbm.coverage_of` (as
    documented in docs/adapters.md).

    Logged through the Trainer's loggers (when ``module`` is attached to one), per kind ``K``:
    ``layers/K/params``, ``layers/K/quantized``, ``layers/K/adapted``, ``layers/K/checkpointed``,
    ``layers/K/left_alone`` (parameter counts).
    """
    while not isinstance(module, pl.LightningModule) and isinstance(getattr(module, "module", None), nn.Module):
        module = cast(nn.Module, module.module)  # DDP / wrappers: the LightningModule inside
    lora = lora_layer_classes()
    adapting = bool(lora) and any(isinstance(m, lora) for m in module.modules())
    rows = coverage(module, quantizing, adapting)
    record.set_coverage(module, rows)
    rank_zero_info("lightning_hbm: layer kinds (parameters)\n" + format_coverage(rows))
    for message in coverage_warnings(rows):
        rank_zero_warn(message)
    trainer = lightning_compat.attached_trainer(module)
    if trainer is not None:
        metrics = {
            f"layers/{r.kind.split(' ')[0]}/{field}": float(getattr(r, field))
            for r in rows
            for field in ("params", "quantized", "adapted", "checkpointed", "left_alone")
        }
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
    return rows


__all__ = ["WARN_SHARE", "CoverageRow", "coverage", "coverage_warnings", "format_coverage", "report_coverage"]
