"""``LoRAConfig``: the settings of one ``LoRA`` callback, checked once, then fixed.

Written as :class:`~lightning_hbm.precision.config.QuantizationConfig` is (torchao's ``AOBaseConfig`` style): a frozen
dataclass whose fields are the callback's arguments, same names, same meaning (documented on
:class:`~lightning_hbm.LoRA`); the callback's constructor is the friendly face that builds one. It plays the part of
peft's ``LoraConfig`` and builds it (:meth:`LoRAConfig.peft_config`) once the surgery has resolved the target layers.
Bad values are refused here, before any model is seen. What a surgery decides (the adapted layers, the task heads,
the layers left out) is not a setting: it lives on the callback.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional, Sequence, Union

from lightning_hbm._validate import frozen
from lightning_hbm.adapters.lora import variants
from lightning_hbm.adapters.lora.base import ALL_LINEAR

#: peft's ``init_lora_weights`` values the callback knows (some refused by ``variants.check_init``, with the reason)
_INITS = ("gaussian", *variants.REWRITES_BASE, "loftq", "eva")


def checked_patterns(arg: str, value: Any, allow_all_linear: bool = False) -> Union[str, tuple[str, ...]]:
    """``target_modules`` / ``exclude_modules`` as kept: ``"all-linear"``, a regex string, or a tuple of names (a list
    or tuple given, copied: the settings cannot change after the check).

    Raises:
        ValueError: ``"all-linear"`` where it is not allowed, or a string that is not a valid regex.
        TypeError: anything else than a string or a non-empty list of non-empty strings.
    """
    if isinstance(value, str):
        if value.lower() == ALL_LINEAR:
            if allow_all_linear:
                return ALL_LINEAR
            raise ValueError(f"{arg}={value!r} is not allowed; pass module names or a regex.")
        try:
            re.compile(value)
        except re.error as err:
            raise ValueError(f"{arg}={value!r} is not a valid regex ({err}). Pass a regex or a list of names.") from err
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
        return tuple(value)
    raise TypeError(f"{arg} must be 'all-linear', a regex string or a non-empty list of module names, got {value!r}.")


@dataclass(frozen=True)
class LoRAConfig:
    """The settings of one ``LoRA`` callback (its arguments, same names).

    Raises:
        TypeError: ``r`` not an int; ``target_modules``, ``exclude_modules`` or ``modules_to_save`` of the wrong type.
        ValueError: a rank or alpha that is not positive, a dropout outside ``[0, 1)``, an invalid regex, an unknown
            ``adapter_dtype``, ``bias`` or ``init_lora_weights``, a bad ``rank_pattern`` / ``alpha_pattern`` (the
            messages of ``LoRA``).
    """

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    #: ``"all-linear"``, a regex, or names (a list or tuple given; kept as a tuple: frozen, as the other fields)
    target_modules: Union[str, Sequence[str]] = ALL_LINEAR
    exclude_modules: Optional[Union[str, Sequence[str]]] = None
    #: the argument: ``None`` (the task heads found on the model) or exactly these modules (kept as a tuple)
    modules_to_save: Optional[Sequence[str]] = None
    adapter_dtype: Literal["float32", "bfloat16"] = "float32"
    full_checkpoint: bool = False
    allow_base_change: bool = False
    use_dora: bool = False
    use_rslora: bool = False
    init_lora_weights: Union[bool, str] = True
    bias: Literal["none", "all", "lora_only"] = "none"
    #: ``{regex: rank}`` (a dict given; kept as a read-only :class:`~lightning_hbm._validate.FrozenDict`: frozen, as the other fields)
    rank_pattern: Optional[Mapping[str, int]] = None
    #: ``{regex: alpha}``, kept as ``rank_pattern``
    alpha_pattern: Optional[Mapping[str, float]] = None

    def __post_init__(self) -> None:
        def _normalise(**values: Any) -> None:
            for name, value in values.items():
                object.__setattr__(self, name, value)  # the one way a frozen dataclass normalises its own fields

        # in the order LoRA always checked them (the same first error)
        _normalise(**_checked_numbers(self.r, self.alpha, self.dropout))
        _normalise(target_modules=checked_patterns("target_modules", self.target_modules, allow_all_linear=True))
        if self.exclude_modules is not None:
            _normalise(exclude_modules=checked_patterns("exclude_modules", self.exclude_modules))
        saved = self.modules_to_save
        if saved is not None and (isinstance(saved, str) or not all(isinstance(m, str) for m in saved)):
            raise TypeError(f"modules_to_save must be a list of module names, got {saved!r}; e.g. modules_to_save=['lm_head'].")
        _normalise(modules_to_save=None if saved is None else tuple(saved))
        _check_choices(self.adapter_dtype, self.bias, self.init_lora_weights)
        _normalise(rank_pattern=frozen(variants.check_pattern("rank_pattern", self.rank_pattern, integer=True)))
        _normalise(alpha_pattern=frozen(variants.check_pattern("alpha_pattern", self.alpha_pattern, integer=False)))

    def argument(self, name: str) -> Any:
        """The setting ``name`` as the callback's argument is written (names as a list, patterns as a dict, as YAML and
        checkpoints hold them): what a checkpoint records and a message shows."""
        value = getattr(self, name)
        return list(value) if isinstance(value, tuple) else dict(value) if isinstance(value, Mapping) else value

    def resume_config(self) -> dict[str, Any]:
        """The settings a checkpoint records and a resume must find again (``dropout`` and the checkpoint flags may change)."""
        return {
            "r": self.r,
            "alpha": self.alpha,
            "target_modules": self.argument("target_modules"),
            "exclude_modules": self.argument("exclude_modules"),
            # the argument (None: the task heads): known before the heads are found on the model (a resume check)
            "modules_to_save": self.argument("modules_to_save"),
            "adapter_dtype": self.adapter_dtype,
            # peft's variants: each changes the adapters' shapes or arithmetic (dropout does not)
            "use_dora": self.use_dora,
            "use_rslora": self.use_rslora,
            "init_lora_weights": self.init_lora_weights,
            "bias": self.bias,
            "rank_pattern": self.argument("rank_pattern"),
            "alpha_pattern": self.argument("alpha_pattern"),
        }

    def peft_config(self, peft: Any, targets: list[str]) -> Any:
        """peft's ``LoraConfig`` for the resolved ``targets`` (exact names, as one anchored regex: peft applies our
        selection verbatim). ``peft`` is the imported module (imported by the caller, where peft's absence is explained)."""
        return peft.LoraConfig(
            r=self.r,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules="(?:" + "|".join(re.escape(t) for t in targets) + ")",
            bias=self.bias,
            use_dora=self.use_dora,
            use_rslora=self.use_rslora,
            init_lora_weights=self.init_lora_weights,
            rank_pattern=dict(self.rank_pattern or {}),
            alpha_pattern=dict(self.alpha_pattern or {}),
        )



def _checked_numbers(r: Any, alpha: Any, dropout: Any) -> dict[str, Any]:
    """``r``, ``alpha`` and ``dropout`` checked (``alpha`` and ``dropout`` as floats)."""
    if isinstance(r, bool) or not isinstance(r, int):
        raise TypeError(f"LoRA r must be an int (the adapter rank), got {r!r} of type {type(r).__name__}.")
    if r <= 0:
        raise ValueError(f"LoRA r must be a positive rank, got r={r}. Typical values: 4, 8, 16, 64.")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha) or alpha <= 0:
        raise ValueError(f"LoRA alpha must be a positive number, got alpha={alpha!r}. A common choice is 2 * r.")
    if not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ValueError(f"LoRA dropout must be in [0, 1), got dropout={dropout!r}.")
    return {"alpha": float(alpha), "dropout": float(dropout)}


def _check_choices(adapter_dtype: Any, bias: Any, init_lora_weights: Any) -> None:
    """``adapter_dtype``, ``bias`` and ``init_lora_weights`` among the values known (and an init not refused)."""
    if adapter_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"adapter_dtype must be 'float32' or 'bfloat16', got {adapter_dtype!r}.")
    if bias not in ("none", "all", "lora_only"):
        raise ValueError(f"LoRA bias must be 'none', 'all' or 'lora_only' (peft's values), got {bias!r}.")
    if not isinstance(init_lora_weights, bool) and init_lora_weights not in _INITS:
        raise ValueError(
            f"LoRA init_lora_weights must be True, False, 'gaussian', 'pissa' or 'olora', got {init_lora_weights!r}."
        )
    variants.check_init(init_lora_weights)


__all__ = ["LoRAConfig", "checked_patterns"]
