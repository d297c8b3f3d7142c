"""Which as-built key a changed key is a form of (peft's ``base_layer``, quantization constants, converted layers)."""

from __future__ import annotations

from typing import Callable, Iterable, Optional

from torch import nn

from lightning_hbm.layers import converted_keys
from lightning_hbm.naming import under


def _canonical(key: str) -> str:
    """The as-built name behind a changed key: peft wraps a layer and moves its weight to ``base_layer``."""
    return key.replace(".base_layer.", ".")


class KeyMap:
    """Which as-built key a changed key is a form of, for one changed model.

    Besides peft's ``base_layer`` and quantization constants (``x.weight.absmax``, ``x.weight_scale``), a
    layer converted by a kind's ``prepare`` renames its tensors (``in_proj_weight`` ->
    ``q_proj.weight``, 3-D ``gate_up_proj`` -> ``gate_up_proj.0.weight``): each kind declares that map
    (``LayerKind.as_built_keys``). Under a converted as-built key only the mapped tensors are its forms,
    not the adapters that now sit below its name (``gate_up_proj.0.lora_A.default.weight``).
    """

    def __init__(self, module: Optional[nn.Module] = None) -> None:
        self.converted = converted_keys(module) if module is not None else {}
        self.targets = set(self.converted.values())

    def as_built(self, changed_key: str) -> tuple[str, bool]:
        """``(key in as-built names, whether a conversion mapped it)``."""
        canonical = _canonical(changed_key)
        head, _, last = canonical.rpartition(".")
        if last in _BESIDE_WEIGHT and f"{head}.weight" in self.converted:
            return self.converted[f"{head}.weight"], True
        parts = canonical.split(".")
        for i in range(len(parts), 0, -1):
            prefix = ".".join(parts[:i])
            if prefix in self.converted:  # x.q_proj.weight(.absmax) -> x.in_proj_weight(.absmax)
                return self.converted[prefix] + canonical[len(prefix) :], True
        return canonical, False

    def covers(self, changed_key: str, as_built_key: str) -> bool:
        return self._form_of(self.as_built(changed_key), as_built_key)

    def covered(self, key: str, omitted: Iterable[str]) -> bool:
        """Whether ``key`` (as built or changed) is a form of one of the ``omitted`` as-built keys."""
        mapped = self.as_built(key)
        return any(self._form_of(mapped, o) for o in omitted)

    def any_form_of(self, changed_keys: Iterable[str]) -> Callable[[str], bool]:
        """``f(as_built_key)``: whether any of ``changed_keys`` is a form of it; the same answer as
        ``any(self.covers(k, as_built_key) for k in changed_keys)``, from sets built once (that loop was
        O(keys x keys) per checkpoint save: ~10^5 calls for a 135M Llama)."""
        covered: tuple[set[str], set[str]] = (set(), set())  # (from unconverted forms, from converted ones)
        for changed_key in changed_keys:
            key, converted = self.as_built(changed_key)
            names = covered[converted]
            canonical = _canonical(key)  # as _covers does
            names.add(canonical)
            end = canonical.find(".")
            while end > 0:  # canonical.startswith(k + "."): every dotted prefix
                names.add(canonical[:end])
                end = canonical.find(".", end + 1)
            head, dot, last = canonical.rpartition(".")
            if dot and last in _BESIDE_WEIGHT:  # x.weight_scale is a form of x.weight
                names.add(f"{head}.weight")
        unconverted, converted_ = covered
        return lambda as_built_key: as_built_key in converted_ or (as_built_key in unconverted and as_built_key not in self.targets)

    def _form_of(self, mapped: tuple[str, bool], as_built_key: str) -> bool:
        key, converted = mapped
        if not converted and as_built_key in self.targets:
            return False  # an adapter or other new tensor under a converted layer's name
        return _covers(key, as_built_key)


def covered(key: str, omitted: Iterable[str], module: Optional[nn.Module] = None) -> bool:
    """Whether ``key`` (as built or changed) is a form of one of the ``omitted`` as-built keys of ``module``."""
    return KeyMap(module).covered(key, omitted)


# int8-dynamic keeps its constants as buffers beside the weight (``x.weight_scale``, ``x.input_shift``), not under it;
# bitsandbytes' Linear8bitLt (int8) writes its row scales and layout byte beside it too (``x.SCB``, ``x.weight_format``):
# rebuilt from the omitted weight by the surgery, as a 4-bit layer's ``x.weight.absmax`` is (was: an adapter-only
# int8 checkpoint did not resume: "does not hold these tensors ... base_layer.SCB")
_BESIDE_WEIGHT = ("weight_scale", "input_shift", "SCB", "weight_format")


def _covers(changed_key: str, as_built_key: str) -> bool:
    """Whether ``changed_key`` (``x.weight.absmax``, ``x.base_layer.weight``, ``x.weight_scale``) is a form of
    ``as_built_key`` (``x.weight``), by name alone (see :class:`KeyMap` for converted layers)."""
    canonical = _canonical(changed_key)
    if as_built_key.endswith(".weight") and canonical in {as_built_key[: -len("weight")] + n for n in _BESIDE_WEIGHT}:
        return True
    return under(canonical, [as_built_key])
