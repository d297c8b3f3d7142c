"""Probe a model on one batch and compare its outputs: shared by ``QuantizationQuality`` and the precision plugin.

It sits below ``precision`` and ``callbacks`` (see ``tests/test_layering.py``) so that the quantization
choices (sensitivity plan, smoothing, GPTQ) and the callback that reports their cost measure with the
same code; those of one quantization are handed a :class:`Probe` (the model and its batch, built once) and run their
forwards through it. ``lightning_hbm.quality`` re-exports every name. The probe batch is drawn by :mod:`lightning_hbm.probe_batch`
(:func:`first_batch`, :func:`first_batches`, re-exported here); what a forward did (its module calls and its
data-dependent selections, recorded and followed) by :mod:`lightning_hbm.probe_record` (re-exported here).
"""

from __future__ import annotations

import warnings
from collections.abc import Collection, Generator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten
from torchmetrics import CosineSimilarity, RelativeSquaredError

from lightning_hbm._compat import torch as torch_compat
from lightning_hbm.naming import under
from lightning_hbm.probe_batch import first_batch, first_batches, per_sample_images  # the first two public here too (drawn by probe_batch)
from lightning_hbm.probe_record import (  # public here too (recorded by probe_record)
    INDEXED,
    MASKING,
    POOLED,
    SELECTING,
    Call,
    Followed,
    Selection,
    agreeing_calls,
    call_values,
    diverging,
    following,
    recording_calls,
    recording_selections,
)
from lightning_hbm.probe_stand_ins import quiet_logging, source_tree  # public here too (what a probe step lends; read from source)

PREFIX = "quant/"


def has_forward(module: nn.Module) -> bool:
    """Whether ``module`` defines a ``forward`` (a LightningModule need not: ``training_step`` may compute without one)."""
    return "forward" in vars(module) or type(module).forward not in (nn.Module.forward, pl.LightningModule.forward)


def check_forward(module: nn.Module, who: str) -> None:
    """``TypeError`` naming the fix when ``module`` has no ``forward`` for the probe batch to go through.

    Without this, the probe fails inside torch: ``_forward_unimplemented() got an unexpected keyword argument
    'input_ids'``, which names neither the module nor what to add.
    """
    if has_forward(module):
        return
    name = type(module).__name__
    raise TypeError(
        f"{who} runs a probe batch through {name}.forward (module(x), module(inputs) of an (inputs, targets) pair, or "
        f"module(**batch) of a dict), but {name} defines no forward (Lightning trains through training_step, which "
        f"may compute without one). Define {name}.forward returning the output tensor or an object with .logits, e.g. "
        f"`def forward(self, **batch): return self.model(**batch)` for a dict batch or `def forward(self, x): return "
        f"self.model(x)`."
    )



class Stepped:
    """A LightningModule without ``forward`` measured through the one direct submodule ``child`` holding every layer
    measured (issue 53), called on the probe batch as :func:`forward_on` takes a batch (a tensor, an (inputs, targets)
    pair, or a dict of keyword inputs).

    Whether ``child`` takes the raw probe batch is seen at its first call through :func:`forwarding` (the first
    measuring forward, the reference's in the default recipe): one that returns says yes. Only where that call raises
    is ``child`` run on the probe batch alone, as it was before every measurement until session 34 (one forward of the
    model more at every fit start of a LightningModule without ``forward``: 0.5 s of SmolLM2-135M's on a CPU), to tell
    a submodule that does not take the batch (then :attr:`takes_batch` is False: every measurement says "define
    forward") from a measurement that failed on its own (its error is raised as it was)."""

    def __init__(self, child: str, batch: Any = None, tried: bool = True) -> None:
        self.child = child
        #: whether ``child`` takes the raw probe batch (``None``: no call through it has returned or raised yet)
        self.takes_batch: Optional[bool] = True if tried else None
        self._batch = None if tried else batch

    def call(self, module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        """``child``'s output on the arguments of ``module``'s forward (``TypeError`` naming the fix: see :meth:`_untaken`)."""
        child = module.get_submodule(self.child)
        if self.takes_batch:
            return child(*args, **kwargs)
        if self.takes_batch is None:
            try:
                output = child(*args, **kwargs)
            except Exception:
                if self._tried(child):
                    raise  # it takes the batch: the measurement's own error, as before session 34
            else:
                self.takes_batch, self._batch = True, None
                return output
        raise self._untaken(module)

    def _tried(self, child: nn.Module) -> bool:
        """Whether ``child`` takes the probe batch, run on it alone (no user code), as :func:`stepped_inputs` ran it."""
        batch, self._batch = self._batch, None
        try:
            with eval_no_grad(child), torch_compat.preserved_rngs():
                forward_on(child, batch)
        except Exception:  # noqa: BLE001 - a step that prepares the batch first (CLIP, DiT, SD3 in the s29 families)
            self.takes_batch = False
            return False
        self.takes_batch = True
        return True

    @staticmethod
    def _untaken(module: nn.Module) -> TypeError:
        name = type(module).__name__
        return TypeError(
            f"{name} defines no forward for the probe batch, and no one of its submodules holds every layer "
            f"measured; define {name}.forward"
        )


def stepped_inputs(module: nn.Module, batch: Any, names: Collection[str]) -> Optional[Stepped]:
    """The :class:`Stepped` of ``module`` on ``batch``: the one direct submodule holding every layer of ``names`` (a
    backbone, the wrapped model: ``training_step`` calls ``self.model(...)``), given the probe batch as a forward is.
    ``None`` where no one submodule holds them all (the measurements then say to define ``forward``).

    The user's ``training_step`` is not run for this: a second run of the user's code before the fit is a call the
    user sees (a counter, a service called, a stream read; issue 55: the probe step is the one run, said once and
    switched off by ``LIGHTNING_HBM_PROBE_STEP=0``). A step that transforms the batch before that call (a head of its
    own first) gives the submodule other inputs than here: the figure is then the submodule's on the raw batch, or,
    where it does not run on it, "not measured" with the fix (define ``forward``). Whether it runs on it is seen at
    the first measuring forward (:class:`Stepped`: no forward is run here)."""
    holders = [n for n, _ in module.named_children() if names and all(under(x, [n]) for x in names)]
    if len(holders) != 1:
        return None
    return Stepped(holders[0], batch, tried=False)


@contextmanager
def forwarding(module: nn.Module, stepped: Callable[[], Optional[Stepped]]) -> Generator[None, None, None]:
    """While measuring a LightningModule without ``forward``: its ``forward`` is the call of the submodule
    ``stepped()`` names (:func:`stepped_inputs`, drawn with the probe batch; an instance attribute, removed after),
    so the probes, the reference and the quantized output measure that submodule on the inputs the step gave it, the
    layer names as in the LightningModule. Nothing where ``module`` has a ``forward``; where ``stepped()`` finds none,
    or one that does not take the probe batch, a call is the ``TypeError`` the measurements say (with the fix: define
    ``forward``)."""
    if has_forward(module):
        yield
        return

    def forward(*args: Any, **kwargs: Any) -> Any:
        found = stepped()
        if found is None:
            raise Stepped._untaken(module)
        return found.call(module, args, kwargs)

    module.__dict__["forward"] = forward
    try:
        yield
    finally:
        del module.__dict__["forward"]


def forward_on(module: nn.Module, batch: Any) -> Any:
    """``module``'s output on ``batch``, whatever it is: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets)
    pair (where that fails and the batch is per-sample images alone, :func:`~lightning_hbm.probe_batch.per_sample_images`:
    ``forward(images)``, session 37), or ``forward(**dict)``, on a copy of the batch: a forward that changes its input in place (``x /= 255``) ran
    on the user's batch once per probe forward, and the probe batch is the first batch training gets (a
    ``BatchEncoding``'s tensors too, :func:`~lightning_hbm._compat.torch.map_tensors`). Nothing cached by it is left
    in the model (:func:`caching_nothing`)."""
    with caching_nothing(module):
        if isinstance(batch, Tensor):
            return module(batch.clone())
        if isinstance(batch, (tuple, list)):
            images = per_sample_images(batch)
            try:
                return module(torch_compat.map_tensors(torch.clone, batch[0]))
            except Exception as error:
                if not images:
                    raise
                first_error = error
            # a batch that is per-sample images alone (collate_fn=tuple): forward(images), not forward(first image);
            # each a tensor (per_sample_images), so copied one by one. Where that fails too, the batch was no images
            # (a tuple of [B, L, D] tensors of B <= 4 reads as them): forward(inputs)'s own error is raised (h10)
            try:
                return module(type(batch)(image.clone() for image in batch))
            except Exception:
                raise first_error from None
        return module(**torch_compat.map_tensors(torch.clone, batch))


@contextmanager
def caching_nothing(module: nn.Module) -> Generator[None, None, None]:
    """Each module attribute a probe forward set to a tensor (or a list, tuple or dict of them) put back as it was, or
    removed: a model caching a tensor on its first forward (transformers' Mimi codebook: ``self._embed = ...``) kept the
    one computed by a probe on the model as built, in float32, and the cast to the compute dtype does not reach a plain
    attribute (the fit's first step: "expected scalar type Float but found BFloat16"; its resume not bit-exact; issue
    53, session 33). Parameters, buffers and submodules are not attributes here (their own dicts)."""
    before = [(vars(m), dict(vars(m))) for m in module.modules()]
    try:
        yield
    finally:
        put_back_attributes(before, _holds_tensor)


_MISSING = object()


def put_back_attributes(before: list[tuple[dict[str, Any], dict[str, Any]]], holds: Callable[[Any], bool]) -> None:
    """Each attribute dict of ``before`` (a module's ``vars`` and a copy of it taken earlier) with every key set since
    to a new value ``holds`` accepts put back as it was, or removed where it was not there. Shared with
    :func:`~lightning_hbm.layers.fake_leftovers.dropping_fake_leftovers` (a level above: it also restores the caches a
    step filled in place)."""
    for own, attributes in before:
        for key, value in list(own.items()):
            old = attributes.get(key, _MISSING)
            if old is not value and holds(value):
                if old is _MISSING:
                    del own[key]
                else:
                    own[key] = old


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, Tensor):
        return True
    items = value.values() if isinstance(value, Mapping) else value if isinstance(value, (list, tuple)) else ()
    return any(isinstance(item, Tensor) for item in items)


def probe_output(module: nn.Module, batch: Any) -> Tensor:
    """The module's output tensor for ``batch``: ``forward(x)``, ``forward(inputs)`` of an (inputs, targets) pair, or
    ``forward(**dict)``. Of an output that is not one tensor: its floating ``logits``, else its first floating tensor
    that is not one of the batch's own handed back.

    No logits (a UNet's ``.sample``, an encoder's ``last_hidden_state``, a dict of features; as
    ``ModelOutput.to_tuple()[0]``): floating, because an integer tensor first (a prediction's ``argmax`` beside the
    logits) was measured, and the 4-bit conv plan widened layers to keep class indices equal; not the batch's, because
    a forward returning ``(x, features)`` was measured on its input, the same whatever the quantization (cosine 1.0:
    every convolution kept in the base mode); not a 0-dim one while there is another, because ``(loss, logits)`` was
    measured on the loss, whose cosine is 1.0 (the cosine of one value is its sign).

    One way, in this function: the forward on a copy of the batch, then the batch's own tensors, then the pick (a helper
    of this module called after the copy sent the quantization's walk back and forth between here and ``_compat.torch``).
    """
    check_forward(module, "lightning_hbm")  # QuantizationQuality checks at setup; the plugin's probes land here
    out = forward_on(module, batch)
    if isinstance(out, Tensor):
        logits: Any = out
    else:
        logits = out.get("logits") if isinstance(out, Mapping) else getattr(out, "logits", None)
        if not (isinstance(logits, Tensor) and logits.is_floating_point()):
            values = out.to_tuple() if hasattr(out, "to_tuple") else list(out.values()) if isinstance(out, Mapping) else out
            given = torch_compat.tensor_leaves(batch)

            def echoed(t: Tensor) -> bool:
                return any(t.shape == b.shape and t.dtype == b.dtype and t.device == b.device and torch.equal(t, b) for b in given)

            found = [t for t in tree_flatten(values)[0] if isinstance(t, Tensor) and t.is_floating_point() and not echoed(t)]
            logits = next((t for t in found if t.dim() > 0), found[0] if found else None)
    if not (isinstance(logits, Tensor) and logits.is_floating_point()):
        got = f"a {logits.dtype} tensor" if isinstance(out, Tensor) else type(out).__name__
        raise TypeError(
            f"QuantizationQuality needs the model's forward to return a floating tensor (or an object with a `logits` "
            f"tensor, or any floating tensor other than its input), got {got}. Make forward return the output tensor "
            "for the probe batch."
        )
    return logits


def input_absmax(module: nn.Module, layers: Mapping[str, nn.Module], batch: Any) -> tuple[dict[str, Tensor], Tensor]:
    """Per-channel ``max|x|`` (float32) of the input of each of ``layers`` over one forward of ``batch`` (all its
    calls), and the module's output (:func:`probe_output`, as float32). A layer the forward never calls is absent."""
    absmax: dict[str, Tensor] = {}

    def record(name: str) -> Any:
        def hook(layer: nn.Module, args: tuple[Any, ...]) -> None:
            x = args[0].detach()
            seen = x.abs().reshape(-1, x.shape[-1]).amax(dim=0).float()
            absmax[name] = seen if name not in absmax else torch.maximum(absmax[name], seen)

        return hook

    handles = [layer.register_forward_pre_hook(record(name)) for name, layer in layers.items()]
    try:
        output = probe_output(module, batch).float()
    finally:
        for handle in handles:
            handle.remove()
    return absmax, output


#: a value as built at most this (``-1e9``, ``-1e30``, ``torch.finfo(torch.float32).min``) is a mask (no probability
#: after a softmax), and so is a value computed at most :data:`MASK_AS_COMPUTED` (or the computing dtype's lowest, -inf)
#: where the model as built has one
MASK_VALUE = -1e9
#: :data:`MASK_VALUE` as a computing dtype may round it: bfloat16 (8 significant bits) gives ``-1e9`` as
#: ``-998,244,352``, above ``-1e9`` (was read as no mask, and the mask then dominated the figures: ~1.0 for a model
#: whose every other output was wrong, session 30); the 1 in 128 allowed is twice bfloat16's rounding
MASK_AS_COMPUTED = MASK_VALUE * (1 - 2**-7)


#: the fewest values a row of :func:`compare_outputs`' cosine holds outside a language model: an output whose last axis is
#: narrower (a feature map of 2x2, 4x4) is measured per sample, its every value one row
MIN_ROW = 8

#: the fewest values a sample's row holds for :func:`compare_outputs` to take a cosine per sample outside a language
#: model: a classifier's few logits (``[N, C]``, ``C`` under this) are measured over the whole batch, flattened and
#: centred on the reference's mean (issue 53, session 34: a 2-class head's rows of 2 logits read 0.993 on the probe,
#: dominated by the logits' common offset, while held out the quantized model measured 0.76 centred, 84 % top-1
#: agreement; planned on the batch's figure, 0.954 and 97 %; ``benchmarks/conv_few_classes.py``)
FEW_VALUES = 16


def compare_outputs(output: Tensor, reference: Tensor, lm: bool) -> dict[str, float]:
    """The metrics logged by :class:`QuantizationQuality` (and optimized by the sensitivity-aware plan).

    Cosine similarity per output row (per token for a language model, per sample otherwise: the last axis, or the
    sample's every value where the last axis holds fewer than :data:`MIN_ROW`; a sample of fewer than
    :data:`FEW_VALUES` values, a classifier's few logits: the whole batch as one row, centred on the reference's mean),
    root relative squared error over all outputs, and for a language model ``KL(p_fp || p_q)``.
    """
    limit = torch.finfo(output.dtype).max if output.is_floating_point() else float("inf")  # its dtype's range
    output, reference = output.float(), reference.float()
    width = reference.shape[-1] if reference.dim() >= 2 else reference.numel()
    # [N, C, 1, 1] (a pooled feature map): rows of one value were NaN where 0 (MobileNetV2); a feature map's last axis
    # narrower than MIN_ROW outside a language model: per sample (issue 53, session 33: MobileNetV2's [N, 1280, 2, 2]
    # at 64 px gave rows of 2 ReLU6 values, NaN where both are 0; the conv plan measured NaN and widened nothing)
    if reference.dim() >= 2 and (width == 1 or (not lm and width < MIN_ROW)):
        width = reference[0].numel()
    few = not lm and width < FEW_VALUES  # a few logits a sample: rows of 2-10 values, uncentred, read their offset
    if few:
        width = reference.numel()
    # an inf both give (a head that masks classes with -inf) agrees: left in, every row holding one measured NaN, and
    # the conv plan was chosen on NaN (planned 'to a probe output cosine of nan')
    same = ~reference.isfinite() & (output == reference)
    # a mask of torch.finfo(dtype).min both give (bfloat16 rounds float32's to -inf): its square overflows float32, every
    # row holding one measured NaN (identical outputs read cosine NaN); agrees like an inf both give
    huge = 2.0**63
    same |= (reference.abs() > huge) & (output.abs() > huge) & (reference.sign() == output.sign())
    # a mask (at most -1e9 as built) that the output gives as a mask in its own dtype (-1e9 as that dtype rounds it, or
    # that dtype's lowest: -inf, float16's -65504 from torch.finfo(dtype).min): the same mask; was cosine NaN, relative error inf
    # (session 29). Not an overflowing value of the output's own (-1e5 or +1e5 as built): those stay NaN and inf
    same |= (reference <= MASK_VALUE) & (output <= max(MASK_AS_COMPUTED, -limit))
    measured, wanted = (output.masked_fill(same, 0.0), reference.masked_fill(same, 0.0)) if bool(same.any()) else (output, reference)
    rows = ~same.reshape(-1, width).all(-1)  # a row both mask whole (-inf everywhere) has no direction: left out
    cosine = _centred if few else lambda got, want: float(CosineSimilarity(reduction="mean")(got, want))
    metrics = {
        PREFIX + "cosine_similarity": cosine(measured.reshape(-1, width)[rows], wanted.reshape(-1, width)[rows]),
        PREFIX + "relative_error": float(RelativeSquaredError(squared=False)(measured.flatten(), wanted.flatten())),
    }
    if lm:
        metrics[PREFIX + "kl_divergence"] = _kl_divergence(output.reshape(-1, width), reference.reshape(-1, width))
    return metrics


def _centred(got: Tensor, want: Tensor) -> float:
    """The cosine of a batch's few values a sample (:data:`FEW_VALUES`; one row), centred on ``want``'s mean: a constant
    offset of the logits does not count (uncentred, a 2-class head's rows read 0.99 whatever its outputs did). A constant
    ``want`` has no centred direction: uncentred then (NaN against all zeros: no figure)."""
    got, want = got.double().flatten(), want.double().flatten()
    if want.numel() and not bool((want == want[0]).all()):
        mean = want.mean()
        got, want = got - mean, want - mean
    return float(torch.nn.functional.cosine_similarity(got, want, dim=0)) if want.numel() else float("nan")


def _kl_divergence(output: Tensor, reference: Tensor) -> float:
    """Mean over rows of ``KL(p || q)``, ``p`` the softmax of ``reference`` (the full-precision model's logits), ``q``
    of ``output``: torchmetrics ``KLDivergence``'s figure, with masked entries handled.

    A token the reference gives no mass (``-inf`` logit: a masked vocabulary entry; or a probability that underflows to
    0 in float32: a mask of ``-1e9`` or ``torch.finfo(torch.float32).min``, which float16 or bfloat16 round to
    ``-inf``) adds 0, whatever ``output`` gives it (torchmetrics: ``0 * (-inf - x)`` = NaN, the whole figure NaN when both models mask the same entries). A token
    the reference gives mass to and ``output`` -inf adds inf: the quantized model rules out what the model as built
    predicts, and the figure says so (with a warning naming how many), not NaN; a row ``output`` masks whole (every
    entry -inf) rules out every token, inf. A row the reference masks whole (every entry -inf: a padded position
    masked entirely) has no distribution to compare with: it is left out of the mean, whatever ``output`` gives it,
    and a warning counts such rows (counting it 0 would lower the mean by the share of such rows; its softmax is NaN,
    which made the whole figure NaN). If every row is left out there is no figure: NaN, with that warning.
    """
    p_log, q_log = reference.float().log_softmax(-1), output.float().log_softmax(-1)
    empty, none_left = reference.eq(float("-inf")).all(-1), output.eq(float("-inf")).all(-1)
    q_log = q_log.masked_fill(none_left.unsqueeze(-1), float("-inf"))  # its softmax is NaN: no mass anywhere
    p_log, q_log = p_log[~empty], q_log[~empty]
    if bool(empty.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence leaves out {int(empty.sum())} of {empty.shape[0]} rows the full-precision "
            f"model masks whole (-inf for every entry: no next-token distribution to compare with; "
            f"{int((empty & none_left).sum())} of them the quantized model masks whole too): the figure is the mean "
            f"over the other {int((~empty).sum())} rows{' (none: NaN)' if bool(empty.all()) else ''}. Probe on rows "
            "the model predicts (no fully masked positions) for a figure over every row.",
            stacklevel=2,
        )
    masked = p_log.exp() == 0  # no mass in float32 (the figure's own p * (log p - log q) is 0 there)
    ruled_out = (q_log == float("-inf")) & ~masked
    terms = (p_log.exp() * (p_log - q_log)).masked_fill(masked, 0.0).masked_fill(ruled_out, float("inf"))
    if bool(ruled_out.any()):
        warnings.warn(
            f"lightning_hbm: KL divergence is inf: the quantized model gives -inf (no probability) to "
            f"{int(ruled_out.sum())} token(s) the full-precision model gives probability to, in "
            f"{int(ruled_out.any(-1).sum())} of {ruled_out.shape[0]} rows (the quantized logits overflowed, or mask "
            f"differently): compare the two models' masks, or quantize fewer layers (skip=...).",
            stacklevel=2,
        )
    return float(terms.sum(-1).mean()) if terms.shape[0] else float("nan")


@contextmanager
def eval_no_grad(module: nn.Module) -> Generator[None, None, None]:
    # Dropout would make the probe outputs random; the same eval forward is used on both sides.
    # Each module's own flag is put back (not module.train(flag) on the root, which would also switch on the
    # submodules the user froze in eval mode, e.g. a frozen encoder whose BatchNorm statistics must not move).
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in flags:
            m.training = training


@dataclass
class Probe:
    """A model and its probe batch, as the measurements of one quantization run them: built once by their owner
    (``Measures.measure_model``, ``choose_layer_modes``) and handed down, so that each measurement (the smoothing, its
    candidates' errors, the swapped-in outputs of the plans) asks it for a forward instead of taking the model and
    the batch apart again. Each method is the function of this module of the same name on :attr:`module` and
    :attr:`batch`."""

    module: nn.Module
    batch: Any

    def eval_no_grad(self) -> AbstractContextManager[None]:
        """:func:`eval_no_grad` of the model."""
        return eval_no_grad(self.module)

    def output(self) -> Tensor:
        """:func:`probe_output`: the model's output tensor on the batch."""
        return probe_output(self.module, self.batch)

    def forward(self) -> Any:
        """:func:`forward_on`: the model's output on (a copy of) the batch, as it returns it."""
        return forward_on(self.module, self.batch)

    def input_absmax(self, layers: Mapping[str, nn.Module]) -> tuple[dict[str, Tensor], Tensor]:
        """:func:`input_absmax` of ``layers`` over one forward, and the output."""
        return input_absmax(self.module, layers, self.batch)

    def recording_calls(self, names: Optional[Collection[str]] = None, keep: int = 0) -> AbstractContextManager[list["Call"]]:
        """:func:`recording_calls` of the model's submodules ``names``."""
        return recording_calls(self.module, names, keep)


def recorded_forward(
    module: nn.Module, args: tuple, kwargs: Mapping[str, Any], names: Optional[Collection[str]], keep: int, follow: Sequence[Selection] = (),
    stepped: Optional[Stepped] = None,
) -> tuple[Any, list[Call], Followed]:
    """``module(*args, **kwargs)`` in eval mode without grad (:func:`eval_no_grad`), with the calls of its submodules
    ``names`` (:func:`recording_calls`, ``keep`` values each) and its data-dependent selections
    (:func:`recording_selections`), following those of ``follow`` (:func:`following`; none: its own): the output, the
    calls, the selections, in one pass. A LightningModule without ``forward`` runs through the submodule ``stepped``
    names (:func:`forwarding`: as the model as built was recorded)."""
    with forwarding(module, lambda: stepped), eval_no_grad(module), recording_calls(module, names, keep) as calls, following(calls, follow) as followed:
        return module(*args, **kwargs), calls, followed


__all__ = ["FEW_VALUES", "INDEXED", "MASKING", "MASK_AS_COMPUTED", "MASK_VALUE", "MIN_ROW", "POOLED", "PREFIX", "SELECTING", "Call", "Stepped", "Followed", "Probe", "Selection", "agreeing_calls", "call_values", "check_forward", "compare_outputs", "diverging", "eval_no_grad", "first_batch", "first_batches", "following", "forward_on", "put_back_attributes",
           "has_forward", "input_absmax", "probe_output", "recorded_forward", "quiet_logging", "source_tree", "recording_calls", "recording_selections", "stepped_inputs", "forwarding"]
