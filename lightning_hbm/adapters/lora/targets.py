"""Which layers a ``LoRA`` adapts and which it trains in full: the selection, checked, before anything changes.

peft's ``tuners/lora/model.py`` keeps the model surgery apart from the config and the layer code; so does this
package: :class:`~lightning_hbm.adapters.lora.config.LoRAConfig` (the settings) -> :func:`select` (the layers, from
the model as it is) -> the callback's injection. :func:`select` reads the model and raises; it never changes it.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Optional, cast

from torch import nn

from lightning_hbm.adapters.lora.base import ALL_LINEAR, smaller_side
from lightning_hbm.adapters.lora.config import LoRAConfig
from lightning_hbm.adapters.lora.variants import is_quantized
from lightning_hbm.adapters.lora.weight_delta import own_forward_convs
from lightning_hbm.layers import (
    QuantizedConv1d,
    QuantizedConv2d,
    QuantizedConv3d,
    QuantizedConvTranspose1d,
    QuantizedConvTranspose2d,
    QuantizedConvTranspose3d,
    adaptable_names,
    kind_names,
    output_heads,
    weight_readers,
)
from lightning_hbm.naming import did_you_mean, name_list, name_matches, under


@dataclass
class Selection:
    """What :func:`select` found: the layers that get an adapter and those trained in full, and what 'all-linear'
    left out (named at fit start)."""

    targets: list[str]
    saved: list[str]
    #: all-linear layers narrower than r, left out
    narrow: list[str] = field(default_factory=list)
    #: output heads (layers.output_heads) left out of all-linear
    heads_left_out: list[str] = field(default_factory=list)


def select(
    module: nn.Module, config: LoRAConfig, modules_to_save: list[str], to_be_quantized: frozenset[str] = frozenset()
) -> Selection:
    """The layers ``config`` adapts in ``module`` and the ``modules_to_save`` it trains; changes nothing.

    Raises:
        ValueError: the model has no Linear, a target or ``modules_to_save`` entry matches nothing (the message lists
            what is available), a target is not a Linear, or a ``modules_to_save`` module is (or, per
            ``to_be_quantized``, is about to be) quantized.
    """
    named: dict[str, Optional[nn.Module]] = dict(module.named_modules())
    # Every layer kind LoRA reaches (lightning_hbm.layers): Linears (quantized or not), transformers
    # Conv1D, and the Linears an nn.MultiheadAttention or a 3-D experts layer gets when it is
    # prepared (names that exist only after prepare_model: None here).
    linears = adaptable_names(module)
    for n in linears:
        named.setdefault(n, None)
    if not linears:
        raise ValueError(
            f"LoRA found no torch.nn.Linear layer in {type(module).__name__}: there is nothing to put adapters on. "
            f"LoRA adapts these layer kinds: {kind_names(adapted=True)} (quantized ones included; "
            "docs/adapters.md); train this model without the LoRA callback."
        )
    saved = _saved(module, named, modules_to_save, linears, to_be_quantized)
    if config.target_modules == ALL_LINEAR:
        selection = _all_linear(module, config, named, linears, saved)
    else:
        selection = Selection(_listed(config, named, linears), saved)
    candidates = selection.targets
    if config.exclude_modules is not None:
        candidates = [n for n in candidates if not name_matches(n, config.exclude_modules)]
    selection.targets = [n for n in candidates if not under(n, saved)]
    if not selection.targets:
        wanted = [config.target_modules] if isinstance(config.target_modules, str) else list(config.target_modules or [])
        hint = "".join(did_you_mean(w, [n.rsplit(".", 1)[-1] for n in linears]) for w in wanted[:3])
        raise ValueError(
            f"target_modules={config.argument('target_modules')!r} (exclude_modules={config.argument('exclude_modules')!r}, "
            f"modules_to_save={modules_to_save!r}) selects no Linear layer of {type(module).__name__}.{hint} "
            f"Available Linear layers: {name_list(linears)}.{_readers_left_out(module, linears)}"
        )
    return selection


def _readers_left_out(module: nn.Module, linears: list[str]) -> str:
    """Why the layers whose weight their own forward or a parent reads are no target (BiT: every convolution is a
    ``WeightStandardizedConv2d``), for the error of a selection left empty."""
    readers = weight_readers(module, uses_only=True)
    left = [f"{n} ({readers[n]})" for n in linears if n in readers]
    if not left:
        return ""
    convs = own_forward_convs(module) & set(readers)
    fix = f" LoRA(dropout=0.0) adapts {len(convs)} of them, convolutions with their own forward, by a delta of their weight." if convs else ""
    return (
        f" Of them, {len(left)} are no target: their weight is read by code other than a plain call of the layer (their "
        f"own forward, or a parent's code), so an adapter around them would not add to what they compute, e.g. "
        f"{left[:3]}.{fix} With nothing else to adapt, LoRA cannot train this model: train it without the LoRA callback."
    )


def _saved(
    module: nn.Module, named: dict[str, Optional[nn.Module]], modules_to_save: list[str], linears: list[str],
    to_be_quantized: frozenset[str],
) -> list[str]:  # fmt: skip
    """The modules ``modules_to_save`` names, each found and none quantized (or about to be)."""
    saved: list[str] = []
    for name in modules_to_save:
        found = [n for n, m in named.items() if n and m is not None and name_matches(n, [name])]
        if not found:
            raise ValueError(
                f"modules_to_save entry {name!r} matches no submodule of {type(module).__name__}. "
                f"Top-level modules: {sorted(n for n in named if n and '.' not in n)}; Linears: {linears[:12]}."
            )
        for n in found:
            if is_quantized(cast(nn.Module, named[n])) or any(under(q, [n]) for q in to_be_quantized):
                raise ValueError(
                    f"modules_to_save entry {name!r} matches {n!r}, whose weights are quantized and cannot be "
                    f"trained. Keep it in full precision with QuantizedPrecision(ignore_modules=[{n!r}])."
                )
        saved.extend(n for n in found if not under(n, saved))
    return saved

#: layers whose ``weight`` property dequantizes a fresh tensor (see :func:`_weight_identity`)
_DEQUANTIZING = (QuantizedConv1d, QuantizedConv2d, QuantizedConv3d, QuantizedConvTranspose1d, QuantizedConvTranspose2d, QuantizedConvTranspose3d)


def _all_linear(
    module: nn.Module, config: LoRAConfig, named: dict[str, Optional[nn.Module]], linears: list[str], saved: list[str]
) -> Selection:
    """'all-linear': every adaptable layer but the output heads, tied weights, weights read directly and (unless all
    are) the layers narrower than r."""
    heads = output_heads(module)
    # Also skip Linears whose weight is tied to another module (a head tied to the embedding):
    # merging an adapter into a shared weight would silently untie or corrupt the other user.
    owners: dict[int, int] = {}
    for _, param in module.named_parameters(remove_duplicate=False):
        owners[id(param)] = owners.get(id(param), 0) + 1
    tied = {n for n in linears if named[n] is not None and owners.get(id(_weight_identity(cast(nn.Module, named[n]))), 0) > 1}
    # and layers whose weight a parent reads directly (Mamba's dt_proj): their adapter would never be called. A
    # convolution whose own forward computes with its weight (BiT's WeightStandardizedConv2d) is adapted by a weight
    # delta instead (weight_delta.py; no dropout there: it acts on the input)
    readers = weight_readers(module, uses_only=True)
    if config.dropout == 0.0:
        convs = own_forward_convs(module)
        readers = {n: why for n, why in readers.items() if n not in convs}
    # (a module trained in full is no LoRA candidate: neither adapted nor "narrower than r")
    candidates = [n for n in linears if n not in heads and n not in tied and n not in readers and not under(n, saved)]
    # (a head in modules_to_save is trained, not left out)
    heads_left_out = [n for n in linears if n in heads and n not in tied and n not in readers and not under(n, saved)]
    # and layers narrower than r (Qwen2-MoE's shared_expert_gate, 1 output; routers): a rank above a
    # layer's width adds parameters without capacity. An explicit target list keeps check_model's error.
    narrow = [n for n in candidates if named[n] is not None and smaller_side(named[n], config.r) < config.r]
    if len(narrow) < len(candidates):  # all narrower: r itself is wrong (check_model's error)
        return Selection([n for n in candidates if n not in narrow], saved, narrow, heads_left_out)
    return Selection(candidates, saved, [], heads_left_out)


def _weight_identity(layer: nn.Module) -> object:
    """What ``layer.weight`` is, for the tied-weight check: a quantized convolution's ``weight`` property dequantizes
    a new tensor at each read (never a registered parameter, so never tied; ~3-20 ms on fake tensors, dozens of
    convolutions in a MobileViT), so its registered ``weight`` parameter (None) is looked up instead."""
    if isinstance(layer, _DEQUANTIZING):
        return layer._parameters.get("weight")
    return layer.weight


def _listed(config: LoRAConfig, named: dict[str, Optional[nn.Module]], linears: list[str]) -> list[str]:
    """The layers a list of names or a regex selects, each name matching something and every match adaptable."""
    if not isinstance(config.target_modules, str):
        _check_each_matches(config.argument("target_modules"), [n for n in named if n], linears)
    candidates = [n for n in named if n and name_matches(n, config.target_modules)]
    adaptable = set(linears)
    wrong = [f"{n} ({type(named[n]).__name__})" for n in candidates if n not in adaptable]
    if wrong:
        raise ValueError(
            f"target_modules={config.argument('target_modules')!r} matches modules that are not Linear layers: {wrong[:8]}. "
            f"LoRA adapts Linear layers; available: {linears[:24]}."
        )
    return candidates


def _check_each_matches(patterns: list[str], names: list[str], linears: list[str]) -> None:
    """A target name that matches nothing is a typo (``v_projection``): an error, not a silently smaller LoRA."""
    for pattern in patterns:
        if any(name_matches(n, [pattern]) for n in names):
            continue
        # close matches among the short names and the full names of the adaptable layers
        choices = list(dict.fromkeys([n.rpartition(".")[2] for n in linears] + linears))
        close = difflib.get_close_matches(pattern, choices, n=3, cutoff=0.5)
        hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
        raise ValueError(
            f"target_modules={patterns!r}: the entry {pattern!r} matches no module of the model, so it would "
            f"silently adapt fewer layers.{hint} Available Linear layers: {name_list(linears)}."
        )


__all__ = ["Selection", "select"]
