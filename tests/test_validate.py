"""Every public constructor refuses a wrong argument type, with the value and the fix (issue #27 item 5)."""

from __future__ import annotations

import inspect
import typing
from datetime import timedelta
from typing import Any

import pytest
import torch

import lightning_hbm as L
from lightning_hbm._validate import _ok

CONSTRUCTORS = [
    L.ActivationCheckpointing, L.AttentionKernel, L.AutoFit, L.CPUOffloadStrategy, L.FusedLoss, L.HBMProfiler, L.LoRA,
    L.MemoryEfficientOptimizer, L.QuantizationQuality, L.QuantizedPrecision, L.QuantizedFSDPStrategy,
]  # fmt: skip

# the ten the outside tester found accepted (some turned a feature on)
REPORTED = [
    (L.LoRA, "allow_base_change", "False", r"LoRA\(allow_base_change='False'\): a str, and any non-empty str is true"),
    (L.CPUOffloadStrategy, "offload_gradients", "no", r"offload_gradients='no'\).*pass True or False"),
    (L.QuantizedFSDPStrategy, "cpu_offload", "no", r"cpu_offload='no'\).*pass True or False"),
    (L.QuantizedPrecision, "quantize_head", "no", r"quantize_head='no'\).*pass True or False"),
    (L.LoRA, "full_checkpoint", "no", r"full_checkpoint='no'\).*pass True or False"),
    (L.FusedLoss, "chunk_size", True, r"chunk_size=True\): a bool, and True/False is not a number here; pass an int or None"),
    (L.HBMProfiler, "dirpath", 123, r"HBMProfiler\(dirpath=123\): wrong type int; pass a str or None"),
    (L.QuantizedPrecision, "ignore_modules", [1], r"ignore_modules=\[1\]\): element 1 is a int; pass a str or a list of strs"),
    (L.ActivationCheckpointing, "offload", "yes", r"offload='yes'\).*pass True or False"),
]


@pytest.mark.parametrize(("cls", "name", "value", "message"), REPORTED, ids=lambda v: getattr(v, "__name__", None))
def test_reported_arguments_are_refused(cls: type, name: str, value: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        cls(**{name: value})


def test_empty_heads_is_refused() -> None:
    with pytest.raises(ValueError, match=r"FusedLoss\(heads=\[\]\): an empty list fuses nothing.*heads=\['lm_head'\]"):
        L.FusedLoss(heads=[])


_WRONG = ["no", True, 1.5, 123, [1], ("a", "b", "c"), {"a": 1}, object()]


def _every_argument() -> list[tuple[type, str, Any]]:
    """(constructor, argument, a value of the wrong type) for every annotated argument (``Any`` accepts all)."""
    cases = []
    for cls in CONSTRUCTORS:
        hints = typing.get_type_hints(cls.__init__)
        for name in list(inspect.signature(cls.__init__).parameters)[1:]:
            wrong = [v for v in _WRONG if not _ok(v, hints[name])]
            if wrong:
                cases.append((cls, name, wrong[0]))
    return cases


def test_every_argument_has_a_case() -> None:
    cases = {(cls.__name__, name) for cls, name, _ in _every_argument()}
    # the only arguments without a wrong type are those typed Any (a probe batch, Lightning's own plugins)
    assert len(cases) >= 55
    assert ("LoRA", "allow_base_change") in cases and ("QuantizedPrecision", "smoothing") in cases


@pytest.mark.parametrize(("cls", "name", "value"), _every_argument(), ids=lambda v: getattr(v, "__name__", None))
def test_every_argument_is_type_checked(cls: type, name: str, value: Any) -> None:
    with pytest.raises(TypeError, match=rf"{cls.__name__}\({name}=.*; pass "):
        cls(**{name: value})


@pytest.mark.parametrize(
    ("cls", "kwargs"),
    [
        (L.QuantizedPrecision, dict(dtype=torch.bfloat16, ignore_modules=("lm_head",), layer_modes={"h.0": "int8"}, mode="int8-dynamic-smooth", smoothing=0.5)),
        (L.QuantizedPrecision, dict(max_bytes_per_param=1, sensitive_mode=["int8"])),
        (L.HBMProfiler, dict(snapshot_steps=(1, 3), detailed_steps=[1, 2], dirpath="x")),
        (L.FusedLoss, dict(heads="lm_head", chunk_size=4)),
        (L.LoRA, dict(alpha=16, dropout=0, target_modules=["q"], exclude_modules="k")),
        (L.QuantizedFSDPStrategy, dict(timeout=timedelta(seconds=5), shard_modules=["Block"])),
        (L.CPUOffloadStrategy, dict(device=torch.device("cpu"), offload_device="cpu")),
        (L.AutoFit, dict(budget=2**30, checkpointing=["none"], fused_loss=[True])),
    ],
)
def test_right_types_are_accepted(cls: type, kwargs: dict[str, Any]) -> None:
    cls(**kwargs)


def test_a_sequence_hint_takes_any_sequence_but_not_a_str() -> None:
    from collections.abc import Sequence

    assert _ok(range(0, 100, 10), Sequence[int]) and _ok((1, 2), Sequence[int]) and _ok([1], Sequence[int])
    assert not _ok("13", Sequence[int]) and not _ok(b"13", Sequence[int]) and not _ok(iter([1]), Sequence[int])
    assert not _ok(range(3), list[int])  # a list hint still asks for a list (or tuple)
    assert L.HBMProfiler(detailed_steps=range(0, 30, 10)).detailed_steps == {0, 10, 20}
    with pytest.raises(TypeError, match=r"HBMProfiler\(detailed_steps='13'\): wrong type str; pass a list of ints"):
        L.HBMProfiler(detailed_steps="13")
