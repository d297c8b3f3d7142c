"""Which quantized layers lose the output, for the fit-start accuracy check (issue 53, session 32).

The check (:mod:`lightning_hbm.precision.accuracy`) runs on every model the plugin quantizes (was: only models with a
quantized convolution; a Pix2Struct in nf4-dq lost its output, cosine 0.965, and nothing was said). Under the threshold
its warning names the layers most responsible, measured on the same two forwards, no forward added: each quantized
layer's first input and its output are kept (an evenly strided subset) as built and as computed; the layer's share is
how far the centred cosine of its output falls below its input's (what the layer adds to the error it was given). The
fix then names them (``ignore_modules``) beside the plan that widens the most sensitive layers until the probe output
reaches the threshold (``min_cosine``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Generator, Mapping, Sequence
from contextlib import contextmanager
from typing import Callable

from torch import Tensor, nn

from lightning_hbm.probe import Call
from lightning_hbm.probe_record import call_values

#: how many layers the warning names
NAMED = 3


@contextmanager
def recording_inputs(module: nn.Module, names: Sequence[str], keep: int) -> Generator[dict[tuple[str, int], Tensor], None, None]:
    """The first positional input of each layer ``names`` of ``module`` at each call during the forwards inside, keyed as
    :class:`~lightning_hbm.probe.Call` keys them (name, calls before), at most ``keep`` values each (every k-th)."""
    inputs: dict[tuple[str, int], Tensor] = {}
    counts: Counter[str] = Counter()

    def hook(name: str) -> object:
        def take(layer: nn.Module, args: tuple) -> None:
            key = (name, counts[name])
            counts[name] += 1
            if args and isinstance(args[0], Tensor) and args[0].is_floating_point():
                inputs[key] = call_values(args[0], keep)

        return take

    handles = []
    for name in names:
        try:
            layer = module.get_submodule(name)
        except AttributeError:  # replaced by a wrapper of another name: not measured, the figure as ever
            continue
        handles.append(layer.register_forward_pre_hook(hook(name)))  # type: ignore[arg-type]
    try:
        yield inputs
    finally:
        for handle in handles:
            handle.remove()


def responsible(
    reference: Sequence[Call],
    calls: Sequence[Call],
    want_inputs: Mapping[tuple[str, int], Tensor],
    got_inputs: Mapping[tuple[str, int], Tensor],
    centred_cosine: Callable[[Tensor, Tensor], float],
) -> list[tuple[str, float, float]]:
    """The quantized layers (those whose inputs were kept) ordered by how much output cosine each loses: ``(name, input
    cosine, output cosine)`` of its call with the largest fall, the largest first; calls whose shapes differ are left out.
    ``centred_cosine``: the check's figure (:func:`~lightning_hbm.precision.accuracy.centred_cosine`)."""
    theirs = {call.key: call for call in calls}
    worst: dict[str, tuple[float, float, float]] = {}
    for want in reference:
        got = theirs.get(want.key)
        if want.key not in want_inputs or want.key not in got_inputs or got is None or got.shapes != want.shapes:
            continue
        if want.values is None or got.values is None or not want.values.numel():
            continue
        a, b = want_inputs[want.key], got_inputs[want.key]
        cos_in = centred_cosine(b, a) if a.shape == b.shape and a.numel() else 1.0
        cos_out = centred_cosine(got.values, want.values)
        fall = cos_in - cos_out
        if fall == fall and (want.key[0] not in worst or fall > worst[want.key[0]][0]):  # NaN: no figure
            worst[want.key[0]] = (fall, cos_in, cos_out)
    ranked = sorted(worst.items(), key=lambda item: (-item[1][0], item[0]))
    return [(name, cos_in, cos_out) for name, (_, cos_in, cos_out) in ranked]


def named(layers: Sequence[tuple[str, float, float]], most: int = NAMED) -> str:
    """The sentence of the warning naming the layers most responsible, or ``""`` where none was measured."""
    if not layers:
        return ""
    listed = ", ".join(f"{name!r} {cos_in:.4f} -> {cos_out:.4f}" for name, cos_in, cos_out in layers[:most])
    return f" The layers losing the most (centred output cosine of the layer's input -> its output, quantized against as built, on the probe): {listed}."


def layers_fix(threshold: float, layers: Sequence[tuple[str, float, float]], four_bit: bool, mode: str) -> str:
    """The fix of a model without quantized convolutions under ``threshold``: the plan that widens its most sensitive
    layers until the probe output reaches the threshold, or the layers named kept wide, or a wider mode. Measured on a
    4-layer Pix2Struct in nf4-dq (0.9746 on its probe): ``min_cosine=0.98`` 0.9900, the three layers named kept wide
    0.9827, ``rounding="gptq"`` 0.9934 (on the probe it was fitted on), ``mode="int8"`` 0.9997."""
    names = [name for name, _, _ in layers[:NAMED]]
    keep = f"ignore_modules={names}" if names else "ignore_modules=[<the layers losing the most>]"
    wider = "rounding='gptq' or mode='int8'" if four_bit else "dtype='float32'"
    return (
        f"Fix: QuantizedPrecision({mode!r}, min_cosine={threshold}) (the sensitivity plan measures each layer on the "
        f"probe and widens the most sensitive, to nf4-dq-b32 or int8, until the output reaches {threshold}), or "
        f"QuantizedPrecision(..., {keep}) (kept in the compute dtype), or QuantizedPrecision(..., {wider})."
    )


def layers_stored(modes: Mapping[str, str], base: str, dtype_name: str) -> str:
    split = ", ".join(f"{count} in {mode}" for mode, count in sorted(Counter(modes.values()).items()))
    return f"with its {len(modes)} layers stored quantized ({split}; mode {base!r}; no convolution) and computing in {dtype_name}"


__all__ = ["NAMED", "layers_fix", "layers_stored", "named", "recording_inputs", "responsible"]
