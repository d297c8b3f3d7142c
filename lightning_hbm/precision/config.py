"""``QuantizationConfig``: the settings of one ``QuantizedPrecision``, checked once, then fixed.

Written as torchao's ``AOBaseConfig`` configs are: a frozen dataclass whose fields are the settings. Each field is
documented on :class:`~lightning_hbm.QuantizedPrecision` (same name, same meaning); the plugin's constructor is the
friendly face that builds one. Built here, at construction: an unknown mode, a dtype the mode cannot compute in, an
invalid regex or a target out of range is refused before any model is seen, with the plugin's own messages. What a
surgery decides (targets, the per-layer modes, GPTQ rounding, smoothing exponents) is not a setting: it lives on
:class:`~lightning_hbm.precision.quantization.Quantization`.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch

from lightning_hbm._validate import frozen
from lightning_hbm.precision.bnb import import_bnb
from lightning_hbm.precision.correction import CalibratedCorrection
from lightning_hbm.precision.gptq import ROUNDINGS
from lightning_hbm.precision.registry import QuantFormat, get_format, to_dtype
from lightning_hbm.precision.sensitivity import check_layer_mode_args
from lightning_hbm.precision.smoothing import SMOOTH_MODE, check_smoothing
from lightning_hbm.precision.targets import DEFAULT_EMBEDDINGS_MODE, EMBEDDINGS_AUTO, checked_embeddings


def _checked_ignore(ignore_modules: Union[str, Sequence[str]]) -> Union[str, tuple[str, ...]]:
    """``ignore_modules`` as the config keeps it (a regex string, or a tuple of names and globs).

    Raises:
        ValueError: a string that is not a valid regex.
    """
    if not isinstance(ignore_modules, str):
        return tuple(ignore_modules)
    try:
        re.compile(ignore_modules)
    except re.error as err:
        raise ValueError(
            f"ignore_modules={ignore_modules!r} is a string, read as a regex (full match, as LoRA's target_modules), "
            f"but it is not a valid one: {err}. Pass a list of module names or glob patterns instead."
        ) from err
    return ignore_modules


@dataclass(frozen=True, eq=False)  # eq=False: a probe batch is a tensor, whose == is elementwise
class QuantizationConfig:
    """The settings of one ``QuantizedPrecision`` (its arguments, same names; ``mode`` and ``dtype`` given by name or
    as objects, held as a :class:`~lightning_hbm.precision.registry.QuantFormat` and a ``torch.dtype``).

    ``dtype="auto"`` is the plugin's (it times the machine): a config takes the dtype it chose.

    Raises:
        ValueError: an unknown mode, a dtype the mode cannot compute in, an invalid ``ignore_modules`` regex, a target
            out of range, an unknown ``rounding``, ``smoothing`` for modes that do not smooth, a negative
            ``correction_rank``, a ``quantize_embeddings`` that is neither a bool nor a mode name (the messages of
            ``QuantizedPrecision``).
        TypeError: a ``probe_batch`` or ``layer_modes`` of the wrong type.
    """

    mode: Union[str, QuantFormat] = "nf4-dq"
    dtype: Union[str, torch.dtype] = "bfloat16"
    ignore_modules: Union[str, Sequence[str]] = ()
    quantize_head: bool = False
    max_bytes_per_param: Optional[float] = None
    min_cosine: Optional[float] = None
    #: ``"auto"``, a mode, or modes (a list or tuple given; kept as a tuple: frozen, saved as a list)
    sensitive_mode: Union[str, Sequence[str]] = "auto"
    probe_batch: Any = field(default=None, repr=False)  # a batch of tensors: not printed
    #: the per-layer modes the user pins ``{layer name: mode name}`` (``None``: measured, or every layer in ``mode``;
    #: a dict given, kept as a read-only :class:`~lightning_hbm._validate.FrozenDict`)
    layer_modes: Optional[Mapping[str, str]] = None
    rounding: str = "nearest"
    #: the smoothing setting: ``"auto"`` or an alpha where a layer may be stored in ``int8-dynamic-smooth``, else None
    smoothing: Optional[Union[float, str]] = None
    #: ``True``/``False``, or the mode name the input embeddings are stored in (``"int8"``; the run's ``mode``: ``True``);
    #: ``"auto"`` (the default) is held as what it chose: ``"int8"`` (``True`` when ``mode`` is ``"int8"``)
    quantize_embeddings: Union[bool, str] = "auto"
    #: the rank of the calibrated correction (0: none)
    correction_rank: Optional[int] = None
    #: the module whose output the fit-start accuracy check and the convolutions' plan measure (``None``: the output)
    accuracy_at: Optional[str] = None
    #: whether ``quantize_embeddings`` is the default's choice (``"auto"``), not the user's (set by the config itself)
    embeddings_by_default: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        def _set(**values: Any) -> None:
            for name, value in values.items():
                object.__setattr__(self, name, value)  # the one way a frozen dataclass normalises its own fields

        # frozen: each setting is normalised once here, in the order the plugin always checked them (same first error)
        mode = self.mode if isinstance(self.mode, QuantFormat) else get_format(self.mode)
        dtype = to_dtype(self.dtype)
        mode.check_dtype(dtype)
        _set(mode=mode, dtype=dtype, ignore_modules=_checked_ignore(self.ignore_modules))
        embeddings = self.quantize_embeddings if isinstance(self.quantize_embeddings, str) else bool(self.quantize_embeddings)
        if embeddings == EMBEDDINGS_AUTO:  # the default: int8, where it costs < 0.3 % (benchmarks/README.md, issue 51)
            embeddings = DEFAULT_EMBEDDINGS_MODE
            _set(embeddings_by_default=True)
        _set(quantize_head=bool(self.quantize_head), quantize_embeddings=checked_embeddings(embeddings, mode.name, dtype))
        check_layer_mode_args(mode.name, self.max_bytes_per_param, self.min_cosine, self.sensitive_mode, self.probe_batch, self.layer_modes)
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"QuantizedPrecision(rounding={self.rounding!r}): use one of {list(ROUNDINGS)}.")
        _set(correction_rank=CalibratedCorrection.check_rank(self.correction_rank))
        if self.accuracy_at is not None and (not isinstance(self.accuracy_at, str) or not self.accuracy_at):
            raise ValueError(
                f"QuantizedPrecision(accuracy_at={self.accuracy_at!r}): pass the name of a submodule as named_modules() "
                "names it (e.g. 'model.head'), or None to measure the model's output."
            )
        # frozen as the other fields (the resume settings hold them as a list and a dict: sensitive_argument, settings)
        _set(sensitive_mode=self.sensitive_mode if isinstance(self.sensitive_mode, str) else tuple(self.sensitive_mode))
        _set(layer_modes=frozen(self.layer_modes) if self.layer_modes else None)
        sensitive = [self.sensitive_mode] if isinstance(self.sensitive_mode, str) else list(self.sensitive_mode)
        modes = [mode.name, *sensitive, *(self.layer_modes or {}).values(), *([self.quantize_embeddings] if isinstance(self.quantize_embeddings, str) else [])]
        _set(smoothing=check_smoothing(self.smoothing, SMOOTH_MODE in modes, mode.name))
        if mode.peft_kind is not None:  # bitsandbytes modes: fail now, not at fit time
            import_bnb()

    # mypy reads the fields as declared (str or object); after __post_init__ these two are always the objects
    @property
    def format(self) -> QuantFormat:
        """``mode`` as the :class:`~lightning_hbm.precision.registry.QuantFormat` it always is once built."""
        assert isinstance(self.mode, QuantFormat)
        return self.mode

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as the ``torch.dtype`` it always is once built."""
        assert isinstance(self.dtype, torch.dtype)
        return self.dtype

    @property
    def pinned_layer_modes(self) -> Optional[dict[str, str]]:
        """The per-layer modes the user gave (``layer_modes``, a dict copy), ``None`` when they are measured or every
        layer takes ``mode``."""
        return dict(self.layer_modes) if self.layer_modes is not None else None

    @property
    def measures_layer_modes(self) -> bool:
        """Whether the per-layer modes are measured on the probe batch at the surgery (a byte or cosine target)."""
        return self.layer_modes is None and (self.max_bytes_per_param is not None or self.min_cosine is not None)

    @property
    def pinned_plan(self) -> Optional[dict[str, str]]:
        """Deprecated: the old name of :attr:`pinned_layer_modes` ("plan" names the planner's, issue 54)."""
        warnings.warn("QuantizationConfig.pinned_plan is deprecated: read pinned_layer_modes (the same dict).", DeprecationWarning, stacklevel=2)
        return self.pinned_layer_modes

    @property
    def measures_plan(self) -> bool:
        """Deprecated: the old name of :attr:`measures_layer_modes` ("plan" names the planner's, issue 54)."""
        warnings.warn("QuantizationConfig.measures_plan is deprecated: read measures_layer_modes (the same value).", DeprecationWarning, stacklevel=2)
        return self.measures_layer_modes

    def sensitive_argument(self) -> Union[str, list[str]]:
        """``sensitive_mode`` as saved and shown (a list, or the one name): the checkpoint stores lists (a tuple would
        compare unequal after a load)."""
        return self.sensitive_mode if isinstance(self.sensitive_mode, str) else list(self.sensitive_mode)

    def ignore_list(self) -> Union[str, list[str]]:
        """``ignore_modules`` as saved and shown (a list, or the regex string)."""
        return self.ignore_modules if isinstance(self.ignore_modules, str) else list(self.ignore_modules)


__all__ = ["DEFAULT_EMBEDDINGS_MODE", "EMBEDDINGS_AUTO", "QuantizationConfig"]
