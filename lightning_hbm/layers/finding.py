"""Finding a model's layers of the registered kinds (adapted or not), preparing the kinds that must be rewritten
first, and the names generic over kinds (what LoRA can adapt, the as-built keys of converted layers)."""

from __future__ import annotations

from typing import Any, Callable, Iterator, cast

from torch import nn

from lightning_hbm import record
from lightning_hbm.layers.kinds import LayerKind, kind_named, kind_of


def lora_layer_classes() -> tuple[type, ...]:
    """peft's LoRA layer class (``()`` when peft cannot be imported): what an adapted layer is."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return (LoraLayer,)


def is_adapted(module: nn.Module) -> bool:
    """Whether ``module`` is a peft LoRA layer (an adapted layer)."""
    lora = lora_layer_classes()
    return bool(lora) and isinstance(module, lora)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer itself: a peft LoRA layer's base layer, else ``module``."""
    lora = lora_layer_classes()
    return module.get_base_layer() if lora and isinstance(module, lora) else module  # type: ignore[operator]


def find_layers(module: nn.Module) -> Iterator[tuple[str, nn.Module, LayerKind]]:
    """``(name, layer, kind)`` for every layer of a registered kind, quantized, adapted or not.

    An adapted layer is reported once, under the peft LoRA layer's name (the module a parent calls);
    the adapters' own Linears (``lora_A``, ``lora_B``) are not layers of the model.
    """
    lora: tuple[type[Any], ...] = lora_layer_classes()
    # named_modules is pre-order: a module inside a skipped one has it as an ancestor prefix. A set looked up per
    # ancestor is O(depth); scanning a list of every skipped name was O(layers) per module (seconds at 200+ LoRA layers)
    skip: set[str] = set()
    for name, sub in module.named_modules():
        if skip and _inside_any(name, skip):
            continue
        if lora and isinstance(sub, lora):
            skip.add(name)
            kind = kind_of(base_layer(sub))
            if kind is not None:
                yield name, sub, kind
            continue
        kind = kind_of(sub)
        if kind is not None:
            if kind.stored_in is not None and kind.stored_in(sub) is not None:
                skip.add(name)  # its quantized storage is part of it, not a layer of the model
            yield name, sub, kind


def _inside_any(name: str, ancestors: set[str]) -> bool:
    """Whether a strict ancestor of the module ``name`` (dotted) is in ``ancestors``: ``naming.under`` for a set,
    looked up once per ancestor (O(depth), where ``under`` scans every prefix)."""
    end = name.rfind(".")
    while end > 0:
        if name[:end] in ancestors:
            return True
        end = name.rfind(".", 0, end)
    return False


def prepare_model(module: nn.Module, skip: Callable[[str], bool] = lambda name: False) -> list[str]:
    """Replace the layers whose kind has a ``prepare`` step (``nn.MultiheadAttention``, experts), in place.

    Checks every layer first (an unsupported one raises before anything changes); idempotent.
    Modules for which ``skip(name)`` is true stay as they are. Returns the names of the replaced modules.
    """
    to_prepare = [(n, m, k) for n, m in module.named_modules() for k in [kind_of(m)] if k is not None and k.prepare and k.matches(m) and not skip(n)]
    replacements = [(name, kind, kind.prepare(sub)) for name, sub, kind in to_prepare]  # type: ignore[misc]
    replacements = [(name, kind, new) for name, kind, new in replacements if new is not None]
    for name, kind, new in replacements:
        # the replacement's Linears count as layers of the kind they replace (coverage, quantize_model's tags)
        record.set_converted(cast(nn.Module, new), kind.name)  # not None: filtered above
        for sub in cast(nn.Module, new).modules():
            if isinstance(sub, nn.Linear):
                record.set_kind(sub, kind.name)
        parent_name, _, child = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        setattr(parent, child, new)
    for kind in {kind.name: kind for _, kind, _ in replacements}.values():
        if kind.after_prepare is not None:
            kind.after_prepare(module)
    return [name for name, _, _ in replacements]


def converted_keys(module: nn.Module) -> dict[str, str]:
    """``{prefix of a converted tensor: as-built key}`` for every layer :func:`prepare_model` replaced in ``module``.

    E.g. ``{"enc.attn.q_proj.weight": "enc.attn.in_proj_weight", "moe.experts.down_proj.3.weight":
    "moe.experts.down_proj"}``, from each kind's ``as_built_keys``. Peft's ``base_layer`` is left out of
    the names (see :func:`lightning_hbm.resume.as_built_key`).
    """
    keys: dict[str, str] = {}
    for name, sub in module.named_modules():
        kind = kind_named(record.converted_from(sub))
        if kind is None or kind.as_built_keys is None:
            continue
        prefix = name.replace(".base_layer", "") + "." if name else ""
        keys.update({prefix + new: prefix + old for new, old in kind.as_built_keys(sub).items()})
    return keys


def adaptable_names(module: nn.Module) -> list[str]:
    """Names of the layers LoRA can adapt, as they will be named after :func:`prepare_model` (each kind's
    ``adaptable_names``: e.g. the q/k/v projections of an ``nn.MultiheadAttention`` not yet prepared)."""
    names: list[str] = []
    for name, sub, kind in find_layers(module):
        names.extend(f"{name}.{local}" if local else name for local in kind.adaptable_names(base_layer(sub)))
    return names


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "num_routed_experts", "total_experts", "n_routed_experts", "moe_num_experts")


def expert_counts(module: nn.Module) -> set[int]:
    """The expert counts ``module`` declares (its own attributes, then its ``config``'s); empty for any other module."""
    counts: set[int] = set()
    for source in (module, getattr(module, "config", None)):
        for attr in _EXPERT_COUNTS:
            value = getattr(source, attr, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 1:
                counts.add(value)
    return counts


__all__ = [
    "adaptable_names",
    "base_layer",
    "converted_keys",
    "expert_counts",
    "find_layers",
    "is_adapted",
    "lora_layer_classes",
    "prepare_model",
]
