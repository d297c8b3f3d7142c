"""The fit-start accuracy check of a model with quantized convolutions, in any mode (issue 53, session 24).

The convolutions' plan (:func:`~lightning_hbm.precision.sensitivity.choose_layer_modes`, 4-bit modes only) measures each
convolution stored in its mode inside the model as built, the rest of the model in float32. What the user trains is
the model as ``QuantizedPrecision`` computes it: every layer in the compute dtype (bf16 by default), BatchNorm on
16-bit activations. On BatchNorm conv nets that costs on its own about what the plan saves: ``mode="int8"`` in bf16
gave the MobileNetV3-FPN backbone a held-out output cosine of 0.974-0.979 and a YOLO-style detector 0.978, under
:data:`~lightning_hbm.precision.sensitivity.CONV_MIN_COSINE`, and nothing said so (``benchmarks/conv_default.py``).

So for every model with a quantized convolution, whatever the mode: the model as built is run once on the probe batch
before any change (the reference; :class:`Reference` records it, from the plan's own first forward where the plan
runs: no forward added), then once more right after the quantization, as the plugin computes (the batch's floating
tensors and the default dtype in the compute dtype, eval, no grad). The figure: the cosine of every floating output
tensor of the forward, flattened and centred on the reference's mean (the figure of the tables in
``benchmarks/README.md``; the plan's own row cosine of the first output flagged ``mode="int8", dtype="float32"`` on the
MobileNetV3 backbone, 0.978, and an uncentred cosine per sample missed int8 in bf16 there, 0.985). Under the threshold
(``min_cosine``, default ``CONV_MIN_COSINE``): a warning naming the figure, the threshold and the fix measured to meet
it. A model without quantized convolutions is not measured here (today's behaviour); nor on fake tensors (the planner).

An output that changes shape as computed (a detector's post-processing in forward: boxes kept by score, NMS; masks
above a threshold) is measured at the outermost module calls returned before the first call whose outputs changed
shape (the heads; :func:`~lightning_hbm.probe_record.agreeing_calls`), the lowest figure, named; none: a warning that the
accuracy could not be measured, with the fix (session 26; was a NaN in the log). The same where the shapes agree but a
data-dependent selection (sort, top-k, a boolean mask, NMS: :func:`~lightning_hbm.probe_record.recording_selections`) picks
other elements or another order than the model as built's: measured at the last module calls returned before it
(session 27; was: the boxes compared in score order, a healthy int8/bf16 detector warned at 0.976, its heads 0.990).
Since session 28 the quantized forward follows the model as built's selections
(:func:`~lightning_hbm.probe_record.following`): where it picks otherwise it is given the model as built's picks (indices,
masks), so both take the same routes and every output is compared, the figure then the lowest of that and of the module
calls before the first selection followed (a detector's heads), said with how many selections differed (a DGCNN, kNN by
``topk`` in every layer, in bfloat16: NaN and "could not be measured" before, 0.9998 now; every convolution in nf4-dq,
measured after its first convolution only: 0.9945 and quiet before, 0.968 and warned now). Where a selection cannot be
followed (another op, other shapes given, no copy kept) or Python branches on values (an NMS written as a loop), the
comparison stops there as before. ``accuracy_at`` names the module measured instead. A forward that fails, as built or as computed: a warning with the
error and the fix (was: a log line).

Since session 32 every model the plugin quantizes is measured, not only those with quantized convolutions (a
Pix2Struct in nf4-dq lost its output, 0.965, unsaid): the same two forwards, the same threshold; the warning of a model
without convolutions names the layers losing the most (:mod:`~lightning_hbm.precision.accuracy_layers`) and the fix
that widens them (``min_cosine``, ``ignore_modules``). A LightningModule without ``forward`` is measured through the
submodule its ``training_step`` calls (:func:`~lightning_hbm.probe.forwarding`, on the inputs the step gave it); one
whose output cannot be recorded is logged (no convolution) or warned (convolutions), as before. Cost: the quantized
forward and the reference (one forward of the model as built where no plan ran one), the per-layer cosines only under
the threshold (where the warning names the layers): on SmolLM2-135M, 128 tokens, 2-core CPU, 1.25x the time to the
first step (session 33; 1.34x in session 32: ``benchmarks/accuracy_check_cost.py``, benchmarks/README.md).

Since session 35 a model with quantized convolutions whose probe the plugin draws (no ``probe_batch``) is checked on
the first training batches joined up to :data:`CHECK_SAMPLES` samples, its 4-bit modes still chosen on the first batch
(``Measures.probes_once``; the reference then one forward of the model as built on those samples): the figure of
a batch of 4 images is the figure of those 4 (batches of 4 read up to 0.04 apart under one quantized model), quiet at
0.983-0.986 where 64 held-out images read 0.915-0.975; on 32, no run of 20 on the wrong side of the threshold
(``benchmarks/conv_probe_samples.py``). :attr:`ConvAccuracy.samples` says how many were measured. Quiet on 32 or
more, it is the word said (session 36): the plan's caution that held-out data may read less
(:func:`~lightning_hbm.precision.sensitivity.widened_convs_warning`) is then left out (:attr:`ConvAccuracy.quiet_on_enough`).
"""

from __future__ import annotations

import difflib
import logging
import math
import time
from collections import Counter
from collections.abc import Generator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any, Optional, cast

import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten, tree_map_only

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.precision.accuracy_layers import layers_fix, layers_stored, named, recording_inputs, responsible
from lightning_hbm.probe import MASK_AS_COMPUTED, MASK_VALUE, Stepped, recorded_forward
from lightning_hbm.probe_batch import samples
from lightning_hbm.probe_record import Call, Followed, Selection, agreeing_calls, diverging, recording_calls, recording_selections

log = logging.getLogger(__name__)


@dataclass
class ConvAccuracy:
    """What the check measured: the centred output cosine of the quantized model against the model as built."""

    cosine: float
    threshold: float
    #: seconds of the quantized model's forward (the reference's is the plan's own, or one forward more)
    seconds: float
    #: whether the fit-start warning was said (under the threshold)
    warned: bool = False
    #: output values finite in the model as built and inf or NaN as the plugin computes it (float16 past 65504)
    nonfinite: int = 0
    #: the output changed shape (a detector's boxes after score thresholding and NMS): how (``None``: it did not)
    changed: Optional[str] = None
    #: then, the module whose output gave the figure (the lowest of the last ones that kept their shapes: the heads
    #: before post-processing), and how many were compared; ``None`` with a NaN cosine: nothing comparable was found
    measured_at: Optional[str] = None
    compared: int = 0
    #: the output is selected by the values (post-processing: sort, top-k, a threshold, NMS) and the quantized model
    #: first selects otherwise there (:func:`~lightning_hbm.probe_record.diverging`): how (``None``: every selection agreed);
    #: then measured as for a changed shape, at the last module calls returned before that selection
    selected: Optional[str] = None
    #: measured at the module the user named (``QuantizedPrecision(accuracy_at=...)``)
    chosen: bool = False
    #: the selections of the model as built, how many of them the quantized model picked otherwise and was given the
    #: model as built's picks instead (:func:`~lightning_hbm.probe_record.following`: the same routes, the figure the loss
    #: of the quantization alone), and why following stopped where it did (``None``: it did not)
    selections: int = 0
    followed: int = 0
    unfollowed: Optional[str] = None
    #: then, the cosine of every output so computed (the figure unless the calls before the first selection followed,
    #: compared as ever, gave a lower one: :func:`measure`)
    routed: Optional[float] = None
    #: the quantized layers by how much output cosine each loses, ``(name, input cosine, output cosine)``, the most
    #: first (:func:`~lightning_hbm.precision.accuracy_layers.responsible`; session 32); measured only under the
    #: threshold, where the warning names them (empty at or above it: session 33, the check's cost)
    layers: list[tuple[str, float, float]] = field(default_factory=list)
    #: the samples measured (:func:`~lightning_hbm.probe_batch.samples` of the batch the forward was given: the first
    #: tensor's first dimension, or how many per-sample images a tuple of them holds; 0: none)
    samples: int = 0

    @property
    def quiet_on_enough(self) -> bool:
        """Whether the fit-start check measured at least :data:`CHECK_SAMPLES` samples and found the output at or above its
        threshold: then a BatchNorm conv net's plan, chosen on the first batch by widening some convolutions within
        ``sensitive_mode``, is not cautioned again (:func:`~lightning_hbm.precision.sensitivity.widened_convs_warning`,
        session 36). Measured over 40 runs (10 conv nets x 4 seeds, ``benchmarks/conv_probe_samples.py --widened``): where
        the check on 32 was quiet that caution fired on 14, 12 of them accurate on 64 held-out images (0.9802-0.9851) and
        2 under 0.98 by 0.0002-0.0003 (0.9797, 0.9798; the check read 0.9807, 0.9801): noise, not a signal. A check on
        fewer samples (a ``probe_batch`` the user gives, a batch size chosen for memory) keeps it."""
        return (
            not self.warned and self.samples >= CHECK_SAMPLES and math.isfinite(self.cosine) and self.cosine >= self.threshold
        )


#: the fewest samples the fit-start check of a model with quantized convolutions measures where the plugin draws its
#: probe (no ``probe_batch``): the first training batches joined up to this many, the convolutions' modes still chosen on
#: the first (session 35, ``benchmarks/conv_probe_samples.py``: on 4 images the check was quiet at 0.986 where 64 held-out
#: images read 0.975; on 32, no run of 20 quiet under 0.98 held out; the time to the first step 0.93-1.57x, noise to two
#: forwards on 32 images)
CHECK_SAMPLES = 32


#: the most output values kept for the figure (16 MiB in fp32): a language model with a convolution (Mamba's conv1d)
#: gives logits of hundreds of millions of values on the probe; above this, every k-th value, the same on both sides
KEPT_VALUES = 1 << 22

#: the most bytes of the model as built's selections (indices, masks) kept on the host for the quantized model to
#: follow (:func:`~lightning_hbm.probe_record.following`): a DGCNN's kNN graphs, an MoE's experts, a detector's boxes; past it,
#: the quantized model picks its own from there
ROUTE_BYTES = 1 << 27

#: the first input of each quantized layer at each call, keyed as a :class:`~lightning_hbm.probe.Call` (strided values)
Inputs = dict[tuple[str, int], Tensor]

#: the fewest values kept of each module call's outputs (for a model whose output changes shape): the budget is
#: :data:`KEPT_VALUES` shared by the model's modules, at least this many each
CALL_VALUES = 1 << 12


def _floating(output: Any) -> list[Tensor]:
    return [t for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point()]


def echoes(output: Any, given: Any) -> list[int]:
    """Positions among the floating tensors of ``output`` (as :func:`outputs` walks them) of the inputs ``given``
    handed back unchanged (a forward returning ``(x, features)``): the same whatever the quantization, they raised the
    figure (a two-convolution BatchNorm net in nf4-dq: 0.9919, its features alone 0.9899)."""
    inputs = torch_compat.tensor_leaves(given)
    return [i for i, t in enumerate(_floating(output))
            if any(t.shape == g.shape and t.dtype == g.dtype and t.device == g.device and torch.equal(t, g) for g in inputs)]


def outputs(output: Any, left_out: Sequence[int] = ()) -> Tensor:
    """Every floating tensor of a forward's output (a tensor, a list of a detector's heads, a dict, a ModelOutput) but
    those at ``left_out`` (:func:`echoes`), flattened, in fp32, on the host; above :data:`KEPT_VALUES` values, an evenly
    strided subset of them."""
    leaves = [t.detach().flatten() for i, t in enumerate(_floating(output)) if i not in left_out]
    step = -(-sum(t.numel() for t in leaves) // KEPT_VALUES)  # ceil: 1 for a conv net's outputs
    return torch.cat([t[::step].float().cpu() for t in leaves]) if leaves else torch.zeros(0)


def overflowed(got: Tensor, want: Tensor, limit: float) -> Tensor:
    """Where ``want`` is a mask (at most :data:`~lightning_hbm.probe.MASK_VALUE`) and ``got`` is one too in the dtype it
    was computed in (at most :data:`~lightning_hbm.probe.MASK_AS_COMPUTED`: ``-1e9`` as bfloat16 rounds it, or at most
    ``-limit``: that dtype's lowest, or ``-inf``): a mask of ``-1e9`` as built that float16 (lowest -65504) rounds to
    ``-inf`` and bfloat16 to ``-998,244,352`` (read as no mask, the figure was ~1.0 whatever the other outputs were,
    session 30); ``torch.finfo(dtype).min`` as transformers masks, float32's as built and
    float16's (-65504) as computed (the centred cosine read 0.0000 there, and the check warned a healthy float16 model).
    Not a value of the output's own that overflows (``-1e5`` or ``+1e5`` as built, inf in float16: its loss is inf):
    that is said as not finite."""
    return (want <= MASK_VALUE) & (got <= max(MASK_AS_COMPUTED, -limit))


def centred_cosine(got: Tensor, want: Tensor, limit: float = math.inf) -> float:
    """Cosine of ``got`` and ``want`` centred on ``want``'s mean (a constant output offset does not count), in float64:
    in float32 the squares of outputs past about 1e19 overflowed and the figure read 0.0.

    ``limit``: the largest value of the dtype ``got`` was computed in; a value of ``want`` beyond it that ``got`` gives
    as the inf of its sign (a mask of ``-1e9`` as built, ``-inf`` in float16: :func:`overflowed`) agrees, as an inf
    both give (was: NaN, and the check warned of values not finite on a healthy float16 model).

    A constant ``want`` has no centred direction (diffusers' ControlNet at init: its zero convolutions give exact zeros;
    the figure read 0.0 and the check warned on a healthy model): 1.0 when ``got`` equals it, else the uncentred cosine
    (NaN against all zeros: no figure). No values: NaN.
    """
    got, want = got.double(), want.double()
    agree = ~want.isfinite() & (got == want)  # an inf both give (a head masking classes with -inf): no figure of its own
    agree |= overflowed(got, want, limit)
    if bool(agree.any()):  # left in, the mean was inf and the figure NaN: the model went unmeasured, nothing said
        got, want = got[~agree], want[~agree]
    if not want.numel():
        return float("nan")
    if bool((want == want[0]).all()):
        if torch.equal(got, want):
            return 1.0
        return float(F.cosine_similarity(got, want, dim=0)) if bool(want.any()) else float("nan")
    mean = want.mean()
    return float(F.cosine_similarity(got - mean, want - mean, dim=0))


class Reference:
    """The model as built on the probe batch: the arguments its forward was called with and its outputs.

    Recorded by :meth:`recording` from the first forward of the root module while every layer in ``names`` (the
    convolutions to quantize) is the model's own (the plan swaps quantized copies in for its other forwards): the
    plan's reference forward when the plan runs, else a forward of the probe made for it.
    """

    def __init__(self, names: Sequence[str], convs: Optional[Sequence[str]] = None) -> None:
        self.names = list(names)
        #: the convolutions among them (the warning's wording and fix); default all (before session 32 the check measured
        #: only models with quantized convolutions, and only those)
        self.convs = list(names if convs is None else convs)
        #: the first input of each layer ``names`` at each call of the recorded forward (strided: the layers' share)
        self.inputs: dict[tuple[str, int], Tensor] = {}
        self.args: Optional[tuple] = None
        self.kwargs: dict[str, Any] = {}
        self.output: Optional[Tensor] = None
        #: every module call of the recorded forward (:class:`~lightning_hbm.probe_record.Call`, a strided subset of its
        #: outputs): where the quantized model's output changes shape, the figure is taken from the last that agree
        self.calls: list[Call] = []
        #: the data-dependent selections of the recorded forward (:func:`~lightning_hbm.probe_record.recording_selections`)
        self.selections: list[Selection] = []
        self.keep = CALL_VALUES
        #: the global RNG states the recorded forward began with: a forward that draws (a diffusion step's noise) draws
        #: the same again when measured; else the figure compared two noises (0.01 on a healthy model)
        self.rngs: Optional[dict[str, Any]] = None
        #: the output tensors that are inputs handed back (:func:`echoes`), left out on both sides
        self.echoed: list[int] = []
        #: a LightningModule without ``forward``: the submodule the recorded forward ran through
        #: (:func:`~lightning_hbm.probe.stepped_inputs`), the quantized model's forward runs through it too
        self.stepped: Optional[Stepped] = None
        #: the samples the check asked of the train dataloader where the plugin drew its batch (:data:`CHECK_SAMPLES`;
        #: 0: none asked, a ``probe_batch`` given), whether the lists the shapes read as per-sample images were found to
        #: be batched tensors (:func:`~lightning_hbm.probe_batch.first_and_joined`), and why fewer were measured while the
        #: loader had more (``None``: they were not); set by :class:`~lightning_hbm.precision.measures.Measures`
        self.asked = 0
        self.batched = False
        self.short: Optional[str] = None

    @contextmanager
    def recording(self, module: nn.Module) -> Generator[None, None, None]:
        own = {name: module.get_submodule(name) for name in self.names}
        pending: list[tuple[tuple, dict[str, Any], dict[str, Any]]] = []

        def as_built() -> bool:
            return self.output is None and all(module.get_submodule(n) is layer for n, layer in own.items())

        def before(root: nn.Module, args: tuple, kwargs: dict) -> None:
            if as_built():  # copies: a forward that changes its input in place (x.mul_) left the batch changed
                copy = lambda t: t.detach().clone()  # noqa: E731
                pending[:] = [(torch_compat.map_tensors(copy, args), torch_compat.map_tensors(copy, dict(kwargs)), torch_compat.rng_states())]
                calls.close()  # every module call of this forward, hooked for it only (not the plan's other forwards)
                self.calls = calls.enter_context(recording_calls(module, names, self.keep))
                self.inputs = calls.enter_context(recording_inputs(module, self.names, self.keep))
                self.selections = calls.enter_context(recording_selections(self.calls, ROUTE_BYTES))

        def record(root: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            if as_built() and pending:
                self.args, self.kwargs, self.rngs = pending.pop()
                self.echoed = echoes(output, (self.args, self.kwargs))
                self.output = outputs(output, self.echoed)
                calls.close()
                shapes = tuple(tuple(t.shape) for t in tree_flatten(output)[0] if isinstance(t, Tensor) and t.is_floating_point())
                self.calls.append(Call(("", 0), None, shapes))  # the root's call, for the shapes

        names = {name for name, _ in module.named_modules() if name}
        self.keep = max(CALL_VALUES, KEPT_VALUES // max(1, len(names)))
        handles = [module.register_forward_pre_hook(before, with_kwargs=True), module.register_forward_hook(record, with_kwargs=True)]
        with ExitStack() as calls:
            try:
                yield
            finally:
                self.calls = self.calls if self.output is not None else []
                self.selections = self.selections if self.output is not None else []
                self.inputs = self.inputs if self.output is not None else {}
                for handle in handles:
                    handle.remove()

    def quantized_output(self, module: nn.Module, dtype: torch.dtype, quantized: Sequence[str]) -> tuple[Tensor, list[Call], Followed, Inputs]:
        """The outputs (:func:`outputs`) of ``module`` (quantized since) on the recorded arguments, computed as
        ``QuantizedPrecision`` computes: floating inputs and the default dtype in ``dtype``, eval, no grad, with the
        random draws of the recorded forward, and the calls of the modules the recorded forward called (those of the
        model as built: a quantized layer's own submodules are not) and its data-dependent selections, following those
        of the model as built (:func:`~lightning_hbm.probe_record.following`). Layers quantized on another device than the rest
        (a GPU, before the strategy moves the model) get their inputs there and give their outputs back.

        A forward that fails given the picks followed (post-processing that counts its boxes by its own mask,
        ``int(keep.sum())``, and fills them from the mask followed: a size mismatch) runs again with its own picks,
        following stopped there and said why (session 29: the check warned a healthy detector that its forward fails
        as the plugin computes it, naming the compute dtype, and measured nothing)."""
        assert self.args is not None and self.output is not None
        try:
            return self._computed(module, dtype, quantized, self.selections)
        except Exception as error:
            if not self.selections:
                raise
            failed = f"{type(error).__name__}: {str(error)[:200]}"
        got, calls, followed, inputs = self._computed(module, dtype, quantized, ())
        followed.stopped = f"none: the forward failed when given the model as built's picks ({failed}), measured with its own"
        return got, calls, followed, inputs

    def _computed(self, module: nn.Module, dtype: torch.dtype, quantized: Sequence[str], follow: Sequence[Selection]) -> tuple[Tensor, list[Call], Followed, Inputs]:
        assert self.args is not None
        cast = lambda t: t.to(dtype) if t.is_floating_point() else t  # noqa: E731 - as the plugin's convert_input
        args, kwargs = torch_compat.map_tensors(cast, self.args), torch_compat.map_tensors(cast, self.kwargs)
        previous = torch.get_default_dtype()
        names = {call.key[0] for call in self.calls}  # the root's own call included ("")
        try:
            with _on_their_devices(module, quantized), torch_compat.drawing_as(self.rngs), recording_inputs(module, self.names, self.keep) as inputs:
                torch.set_default_dtype(dtype if dtype != torch.float32 else previous)  # the plugin's forward context
                output, calls, followed = recorded_forward(module, args, kwargs, names, self.keep, follow, self.stepped)  # eval, no grad
        finally:
            torch.set_default_dtype(previous)
        return outputs(output, self.echoed), calls, followed, inputs


def _changed(reference: Sequence[Call], calls: Sequence[Call], got: Tensor, want: Tensor) -> Optional[str]:
    """How the quantized model's output differs in shape from the model as built's, or ``None`` (the same shapes)."""
    ours = next((c for c in reversed(reference) if c.key == ("", 0)), None)
    theirs = next((c for c in reversed(calls) if c.key == ("", 0)), None)
    if ours is not None and theirs is not None:
        if ours.shapes == theirs.shapes:
            return None
        first = next((i for i, (a, b) in enumerate(zip(ours.shapes, theirs.shapes)) if a != b), min(len(ours.shapes), len(theirs.shapes)))
        return f"from its floating output {first + 1}: shapes {_shapes(ours.shapes, first)} as built, {_shapes(theirs.shapes, first)} as computed"
    return None if got.shape == want.shape else f"{want.numel()} output values as built, {got.numel()} as computed"


def _shapes(shapes: Sequence[tuple[int, ...]], first: int, most: int = 4) -> str:
    listed = ", ".join(str(list(shape)) for shape in shapes[first : first + most])
    return f"[{listed}{', ...' if len(shapes) > first + most else ''}] (of {len(shapes)})"


def _at_agreeing_calls(reference: Sequence[Call], calls: Sequence[Call], threshold: float, changed: Optional[str], limit: float = math.inf) -> ConvAccuracy:
    """The figure of a model whose output changed shape or selects otherwise: the centred cosine of each outermost
    module call before the first call whose outputs changed shape (:func:`~lightning_hbm.probe_record.agreeing_calls`; the
    callers cut both sequences before the first selection that differs), the lowest; NaN when none."""
    figures = []
    for want, got in agreeing_calls(reference, calls):
        if want.values is not None and got.values is not None and want.values.numel():
            figures.append((centred_cosine(got.values, want.values, limit), _call_name(want)))
    figures = [(cosine, name) for cosine, name in figures if cosine == cosine]  # NaN: no figure
    if not figures:
        return ConvAccuracy(float("nan"), threshold, 0.0, changed=changed)
    cosine, name = min(figures)
    return ConvAccuracy(cosine, threshold, 0.0, changed=changed, measured_at=name, compared=len(figures))


def _call_name(call: Call) -> str:
    return call.key[0] + (f" (call {call.key[1] + 1})" if call.key[1] else "")


def _at_module(reference: Sequence[Call], calls: Sequence[Call], threshold: float, name: str, limit: float = math.inf) -> ConvAccuracy:
    """The figure at the module the user named (``accuracy_at``): the centred cosine of each of its calls, the lowest;
    a call whose outputs changed shape (after a selection) or that did not run: NaN, with how in ``changed``."""
    theirs = {call.key: call for call in calls}
    figures, differ = [], []
    for want in (call for call in reference if call.key[0] == name):
        got = theirs.get(want.key)
        if got is None or got.shapes != want.shapes:
            differ.append(f"{_call_name(want)}: shapes {[list(s) for s in want.shapes]} as built, {[list(s) for s in got.shapes] if got else 'no call'} as computed")
        elif want.values is not None and got.values is not None and want.values.numel():
            figures.append((centred_cosine(got.values, want.values, limit), _call_name(want)))
    if differ or not figures:
        how = "; ".join(differ) or "no floating output"
        return ConvAccuracy(float("nan"), threshold, 0.0, changed=f"accuracy_at={name!r}: {how}", chosen=True)
    cosine, at = min(figures)
    return ConvAccuracy(cosine, threshold, 0.0, measured_at=at, compared=len(figures), chosen=True)


def measure(
    reference: Reference, got: Tensor, calls: Sequence[Call], followed: Followed, threshold: float, at: Optional[str] = None, dtype: torch.dtype = torch.float32
) -> ConvAccuracy:
    """The figure of the quantized model (its outputs ``got``, its module ``calls`` and data-dependent selections,
    ``followed``: :func:`~lightning_hbm.probe_record.following`) against ``reference``: at the module named ``at``
    (``accuracy_at``) when given; else every output where the shapes agree and every selection picked the same or was
    given the model as built's picks (a healthy bf16 DGCNN's kNN graph, an MoE's near-tied experts: were NaN or one
    layer), the lowest of that and of the last module calls before the first selection followed (a detector's heads,
    more sensitive than its kept boxes: int8/bf16 0.990 at the heads, 0.9995 on the boxes); else (another number of
    boxes, or the same boxes picked or ordered otherwise, not followed) at the last module calls before the first
    change (:func:`_at_agreeing_calls`). ``dtype``: the one the quantized model computes in (a value as built beyond its
    range that it gives as the inf of its sign agrees: :func:`overflowed`)."""
    limit = torch.finfo(dtype).max
    if at is not None:
        return _at_module(reference.calls, calls, threshold, at, limit)
    want = cast(Tensor, reference.output)
    changed, diverged = _changed(reference.calls, calls, got, want), diverging(reference.selections, followed.selections)
    if changed is None and diverged is None:
        nonfinite = int((want.isfinite() & ~got.isfinite() & ~overflowed(got, want, limit)).sum())
        whole = ConvAccuracy(centred_cosine(got, want, limit), threshold, 0.0, nonfinite=nonfinite)
        if followed.first is None:
            return whole
        cut, how = followed.first
        before = _at_agreeing_calls(reference.calls[:cut], calls[:cut], threshold, None, limit)
        measured = before if before.measured_at is not None and not before.cosine >= whole.cosine and not whole.nonfinite else whole
        measured.selected, measured.routed = (how if measured is before else None), whole.cosine
        return measured
    cut = diverged[0] if diverged is not None else len(reference.calls)
    measured = _at_agreeing_calls(reference.calls[:cut], calls[:cut], threshold, changed, limit)
    measured.selected = diverged[1] if diverged is not None else None
    return measured


@contextmanager
def _on_their_devices(module: nn.Module, names: Sequence[str]) -> Generator[None, None, None]:
    devices = {t.device for t in (*module.parameters(), *module.buffers())}
    handles, homes = [], []  # homes: the device each running layer's caller computes on
    if len(devices) > 1:  # quantized on the strategy's device, the rest where it was built

        def there(layer: nn.Module, args: tuple) -> tuple:
            where = next(t.device for t in (*layer.parameters(), *layer.buffers()))
            homes.append(next((t.device for t in tree_flatten(args)[0] if isinstance(t, Tensor)), where))
            return tree_map_only(Tensor, lambda t: t.to(where), args)

        def back(layer: nn.Module, args: tuple, out: Any) -> Any:
            home = homes.pop()
            return tree_map_only(Tensor, lambda t: t.to(home), out)

        for name in names:
            layer = module.get_submodule(name)
            if [*layer.parameters(), *layer.buffers()]:
                handles += [layer.register_forward_pre_hook(there), layer.register_forward_hook(back)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def accuracy_warning(
    measured: ConvAccuracy, modes: Mapping[str, str], dtype: torch.dtype, base: str, four_bit: bool, convs: Optional[Sequence[str]] = None
) -> Optional[str]:
    """The fit-start warning for a model whose quantized output on the probe measured under its threshold, or ``None``.

    ``modes``: ``{quantized layer: mode}``; ``convs``: the convolutions among them (default: all). A model without
    quantized convolutions (session 32) is said by its layers, the layers losing the most named
    (:attr:`ConvAccuracy.layers`), the fix :func:`~lightning_hbm.precision.accuracy_layers.layers_fix`. The fix named is the one measured to meet the threshold on the nets of issue 53
    (``benchmarks/README.md``, session 23/24): computing in float32 (int8 in float32: 0.989-0.9996 held out on all
    eight runs); already in float32, a 4-bit mode: ``mode="int8"``; int8 in float32: the convolutions kept unquantized.
    Outputs finite as built and inf or NaN as computed (no cosine: NaN) are said with their count; the fix: a dtype
    with float32's range. An output that changed shape (post-processing: boxes kept by score, NMS, masks above a
    threshold) is measured at the last modules that kept theirs and said so; none found: said as not measured.
    """
    unmeasured = (measured.changed is not None or measured.selected is not None) and measured.measured_at is None
    if not measured.cosine < measured.threshold and not measured.nonfinite and not unmeasured:  # NaN: no figure
        return None
    name = str(dtype).removeprefix("torch.")
    convs = list(modes) if convs is None else [c for c in convs if c in modes]
    split = ", ".join(f"{count} in {mode}" for mode, count in sorted(Counter(modes[c] for c in convs).items()))
    stored = f"with its {len(convs)} convolutions stored quantized ({split}; mode {base!r}; its other quantized layers as planned) and computing in {name}"
    stored = stored if convs else layers_stored(modes, base, name)
    if unmeasured and measured.chosen:
        return (
            f"lightning_hbm: {stored}, the accuracy of this model as it computes could not be measured at fit start at the "
            f"module named ({measured.changed}): its output is not comparable with the model as built's. Fix: "
            "QuantizedPrecision(..., accuracy_at=<a module before the post-processing: the heads>), or accuracy_at=None."
        )
    if unmeasured:
        return _unmeasured_warning(stored, cast(str, measured.changed or measured.selected))
    if measured.nonfinite:
        wider = "dtype='bfloat16' (float16 overflows past 65504; bfloat16 has float32's range)" if dtype == torch.float16 else "dtype='float32'"
        fix = f"QuantizedPrecision(..., {wider})" if dtype != torch.float32 else f"QuantizedPrecision(..., ignore_modules=[<the {'convolutions' if convs else 'layers'}>])"
        return (
            f"lightning_hbm: {stored}, this model's output on the probe batch has {measured.nonfinite} values that are inf "
            f"or NaN where the model as built gives finite ones: its loss and gradients would be too. Fix: {fix}."
        )
    what, where = _where(measured)
    return (
        f"lightning_hbm: {stored}, {what} a cosine of {measured.cosine:.4f} against the model as "
        f"built (centred, {where}), under {measured.threshold} (min_cosine; default CONV_MIN_COSINE).{named(measured.layers)} "
        + (_convs_fix(dtype, four_bit) if convs else layers_fix(measured.threshold, measured.layers, four_bit, base))
    )


def _convs_fix(dtype: torch.dtype, four_bit: bool) -> str:
    """The fix of a model with quantized convolutions under the threshold: measured on the nets of issue 53."""
    name = str(dtype).removeprefix("torch.")
    if dtype != torch.float32:
        fix = f"QuantizedPrecision(..., dtype='float32'{', mode=' + repr('int8') if four_bit else ''})"
        why = f"computing in {name} loses about 0.01 on its own on BatchNorm conv nets; int8 computed in float32 measured 0.989-0.9996 held out"
    elif four_bit:
        fix, why = "QuantizedPrecision(..., mode='int8', dtype='float32')", "measured 0.989-0.9996 held out on the nets of issue 53"
    else:
        fix, why = "QuantizedPrecision(..., ignore_modules=[<the most sensitive convolutions>])", "keeps them as built"
    return f"Fix: {fix} ({why}; benchmarks/README.md).{AMPLIFYING if four_bit else ''}"


#: the further fix for a net that amplifies small errors, where int8 in float32 is still under (session 33, measured:
#: ``benchmarks/conv_mobilenet_v2.py``, two seeds, held out)
AMPLIFYING = (
    " Where that is still under (a net that amplifies small errors: transformers' MobileNetV2 with calibrated BatchNorm "
    "statistics, 0.885-0.891 in int8 and float32, 0.923-0.942 in bfloat16 with no convolution quantized): "
    "QuantizedPrecision(..., dtype='float32', sensitive_mode=['nf4-dq-b32', 'int8', 'none'], min_cosine=0.99) keeps its "
    "most sensitive convolutions in float32 (0.980-0.989 held out at 1.11-1.12 bytes per conv weight)."
)


def _routes(measured: ConvAccuracy) -> str:
    """What the log and the warning say of the selections followed: ``""`` where none picked otherwise."""
    if not measured.followed:
        return f"; the model as built's selections not followed: {measured.unfollowed}" if measured.unfollowed else ""
    stopped = f"; followed up to {measured.unfollowed}" if measured.unfollowed else ""
    routed = f" (every output so: {measured.routed:.4f})" if measured.routed is not None and measured.measured_at is not None else ""
    return f"; {measured.followed} of {measured.selections} selections differed; measured with the full-precision model's selections{routed}{stopped}"


def _where(measured: ConvAccuracy) -> tuple[str, str]:
    """What the warning says was measured, and where: every output, or (post-processed; ``accuracy_at``) a module's."""
    if measured.measured_at is None and measured.followed:  # the same routes (kNN graph, experts, boxes) as built
        return (
            f"this model's output on the probe batch ({_routes(measured)[2:]}: sort, top-k, argmax, a mask or NMS "
            "picked otherwise as computed and was given the picks of the model as built, so the figure is the "
            "quantization's loss on the same routes) has"
        ), "every output"
    if measured.measured_at is None:
        return "this model's output on the probe batch has", "every output"
    where = f"the output of {measured.measured_at!r}"
    if measured.changed is not None:  # measured where both still compute the same things
        return (
            f"this model's output on the probe batch changes shape against the model as built ({measured.changed}: "
            "post-processing that keeps a number of boxes, masks or tokens that depends on the scores), so it is measured "
            f"at the outputs of the last modules that keep their shapes, before the first that changes: the lowest of "
            f"{measured.compared}, {where}, has"
        ), where
    if measured.selected is not None:  # the same shapes, other boxes or another order: measured before the selection
        return (
            "this model's output on the probe batch is selected by its values (post-processing: sort, top-k, a "
            f"threshold, NMS) and the quantized model selects otherwise ({measured.selected}{_routes(measured)}), so its boxes are not "
            "compared in order: it is measured at the outputs of the last modules returned before that selection: the "
            f"lowest of {measured.compared}, {where}, has"
        ), where
    return f"{where} (accuracy_at) has", where


def _unmeasured_warning(stored: str, changed: str) -> str:
    return (
        f"lightning_hbm: {stored}, the accuracy of this model as it computes could not be measured at fit start: its "
        f"output on the probe batch changes shape or selects otherwise against the model as built ({changed}: "
        "post-processing that keeps a number of boxes, masks or tokens, or an order, that depends on the scores) and no "
        "module's output before that change could "
        "be compared (the first module call already differs, or none has floating outputs). The loss of 4-bit or 16-bit "
        "convolutions is unknown here (issue 53: a YOLO-style detector's heads 0.10 in uniform nf4-dq). Fix: have the "
        "forward the probe batch goes through return the outputs before the post-processing (the heads' maps; the "
        "thresholding and NMS in predict_step), QuantizedPrecision(..., accuracy_at=<the heads' module name>), or "
        "QuantizedPrecision(..., mode='int8', dtype='float32') (0.989-0.9996 "
        "held out on the nets of issue 53; benchmarks/README.md)."
    )


def check_accuracy_at(module: nn.Module, name: Optional[str]) -> None:
    """``accuracy_at`` checked against the model, before anything changes.

    Raises:
        ValueError: ``name`` is no submodule of ``module`` (the closest names listed).
    """
    if name is None:
        return
    names = [n for n, _ in module.named_modules() if n]
    if name not in names:
        close = difflib.get_close_matches(name, names, n=3, cutoff=0.5) or names[:3]
        raise ValueError(
            f"QuantizedPrecision(accuracy_at={name!r}): {type(module).__name__} has no submodule of that name (names as "
            f"named_modules() gives them, from the module the plugin quantizes: the LightningModule). Fix: one of "
            f"{close}{' ...' if len(names) > 3 else ''}, or accuracy_at=None to measure the model's output."
        )


def accuracy_at_unused(module: nn.Module, name: Optional[str], reference: Optional[Reference], convs: Sequence[str]) -> Optional[str]:
    """After the model as built was recorded, before any change: the warning that ``accuracy_at`` measures nothing (no
    quantized layer: the check does not run), or ``None``. ``convs``: the layers to quantize (every kind since session
    32; the name kept).

    Raises:
        ValueError: the probe forward never called the module named.
    """
    if name is None:
        return None
    if not convs:
        return (
            f"lightning_hbm: QuantizedPrecision(accuracy_at={name!r}) changes nothing for {type(module).__name__}: the "
            "fit-start accuracy check measures models with quantized layers, and it has none to quantize. Fix: "
            "accuracy_at=None."
        )
    if reference is not None and reference.output is not None and not any(call.key[0] == name for call in reference.calls):
        called = sorted({call.key[0] for call in reference.calls if call.key[0]})
        called = difflib.get_close_matches(name, called, n=3, cutoff=0.5) or called[:3]
        raise ValueError(
            f"QuantizedPrecision(accuracy_at={name!r}): the forward of {type(module).__name__} on the probe batch never "
            f"calls that module, so its output cannot be measured (nothing was changed). Fix: a module the forward calls, "
            f"e.g. {called[:3]}, or accuracy_at=None."
        )
    return None


def unmeasured_reference_warning(module: nn.Module, names: Sequence[str], error: BaseException) -> str:
    """The fit-start warning for a model with convolutions to quantize whose output as built could not be recorded on
    the probe batch (no probe batch, no forward, a forward that fails): its accuracy as quantized goes unmeasured."""
    listed = ", ".join(repr(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (
        f"lightning_hbm: the accuracy of {type(module).__name__} with its {len(names)} convolutions stored quantized "
        f"({listed}) is not measured at fit start: the model as built could not run on the probe batch "
        f"({type(error).__name__}: {error}). The loss of the quantized convolutions is unknown (issue 53: a YOLO-style "
        "detector 0.10 in uniform nf4-dq, int8 in bfloat16 0.97-0.98 on BatchNorm conv nets). Fix: "
        "QuantizedPrecision(probe_batch=<a batch the model's forward takes>) or a train dataloader, and a forward that "
        "runs on it; or QuantizedPrecision(..., mode='int8', dtype='float32') (0.989-0.9996 held out)."
    )


def check_accuracy(
    module: nn.Module, reference: Optional[Reference], quantized: Sequence[str], modes: Mapping[str, str], config: Any, threshold: float
) -> Optional[ConvAccuracy]:
    """The quantized ``module``'s output on the probe against ``reference`` (the model as built), said under
    ``threshold`` as a warning with the figure, the threshold and the fix; ``None`` when not measured (no reference, no
    convolution quantized, or a forward that fails: warned with the error and the fix, never raised).

    ``modes``: the layer modes of the plan (a layer not in it is in ``config.format``); ``config``: the
    :class:`~lightning_hbm.precision.config.QuantizationConfig`.
    """
    if reference is None or reference.output is None:
        return None
    base = config.format.name
    layers = {name: modes.get(name, base) for name in reference.names if name in quantized}
    convs = [name for name in reference.convs if name in layers]
    if not layers:
        return None
    start = time.perf_counter()
    try:
        with torch_compat.preserved_rngs():
            got, calls, followed, inputs = reference.quantized_output(module, config.torch_dtype, quantized)
    except Exception as error:  # noqa: BLE001 - the model ran as built: a measurement that fails is said, never raised
        what = f"{len(convs)} convolutions" if convs else f"{len(layers)} layers"
        rank_zero_warn(
            f"lightning_hbm: the accuracy of {type(module).__name__} with its {what} stored quantized (mode {base!r}, "
            f"computing in {str(config.torch_dtype).removeprefix('torch.')}) could not be measured at fit start: its forward "
            f"on the probe batch failed as the plugin computes it ({type(error).__name__}: {error}); the loss of the "
            "quantization is unknown, the fit goes on. Fix: make the forward run with its floating inputs and the default "
            "dtype in the compute dtype (a tensor built inside forward takes the default dtype), or QuantizedPrecision(..., "
            "dtype='float32')."
        )
        return None
    measured = measure(reference, got, calls, followed, threshold, getattr(config, "accuracy_at", None), config.torch_dtype)
    measured.seconds = time.perf_counter() - start
    measured.selections, measured.followed, measured.unfollowed = len(reference.selections), followed.differed, followed.stopped
    # the forward's arguments side by side (their tuple is no list of per-sample images: (x [4, 16, 32],) read as 1)
    measured.samples = samples([*(reference.args or ()), reference.kwargs], images=not reference.batched)
    if measured.cosine < threshold:  # the layers are named only in the warning under it (NaN: no figure, none named)
        measured.layers = responsible(reference.calls, calls, reference.inputs, inputs, centred_cosine)
    log.info("lightning_hbm: output cosine of the quantized model on the probe batch (%d samples): %.4f (threshold %s; %d values not finite; %s%s)",
             measured.samples, measured.cosine, threshold, measured.nonfinite, measured.measured_at or "every output", _routes(measured))  # fmt: skip
    warning = accuracy_warning(measured, layers, config.torch_dtype, base, config.format.peft_kind == "4bit", convs)
    if warning is not None:
        rank_zero_warn(warning)
        measured.warned = True
    elif reference.short is not None and measured.samples < reference.asked:
        rank_zero_warn(fewer_samples_warning(module, measured, reference.asked, reference.short))
    return measured


def fewer_samples_warning(module: nn.Module, measured: ConvAccuracy, asked: int, why: str) -> str:
    """The fit-start warning for a quiet accuracy check that measured fewer samples than it asked of a train dataloader
    that had more (``why``): its figure is that of those samples (session 35: quiet at 0.986 on 4 images where 64
    held-out images read 0.975), said with the figure and the fix (session 38: it was only in ``samples``)."""
    return (
        f"lightning_hbm: the fit-start accuracy check of {type(module).__name__} stored quantized measured output "
        f"cosine {measured.cosine:.4f} on {measured.samples} samples, not the {asked} it asks of the train dataloader: "
        f"{why}. On so few the figure reads higher than new data may (on 4 images 0.986 where 64 held-out images read "
        "0.975, benchmarks/conv_probe_samples.py). Fix: QuantizedPrecision(probe_batch=<a batch of at least "
        f"{asked} samples as the forward takes it>), or "
        "QuantizedPrecision(..., mode='int8', dtype='float32') (0.989-0.9996 held out on the conv nets of issue 53)."
    )


__all__ = ["CHECK_SAMPLES", "KEPT_VALUES", "ConvAccuracy", "Reference", "accuracy_at_unused", "accuracy_warning", "centred_cosine", "check_accuracy", "check_accuracy_at", "echoes", "fewer_samples_warning", "measure", "MASK_VALUE", "outputs", "overflowed", "unmeasured_reference_warning"]
