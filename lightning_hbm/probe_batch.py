"""The probe batch: the first batches of the Trainer's train dataloader, drawn leaving no trace.

Drawing the batch is a job of its own, apart from running a model on it (:mod:`lightning_hbm.probe`): the precision
plugin draws it once per surgery, then its measures (GPTQ statistics, the calibrated correction, the smoothing, the
plans, the accuracy check) run the model on it. ``lightning_hbm.probe`` and ``lightning_hbm.quality`` re-export
:func:`first_batch` and :func:`first_batches`.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, Callable, NamedTuple, Optional

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils._pytree import tree_flatten, tree_unflatten

from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import torch as torch_compat


def first_batch(trainer: Optional[pl.Trainer], who: str) -> Any:
    """The first batch of ``trainer``'s train dataloader, whatever gives it (a datamodule, the loader passed to
    ``fit``, the LightningModule's own ``train_dataloader``), drawn leaving no trace (:func:`first_batches`).

    Raises:
        ValueError: the Trainer has no train dataloader, or it is empty.
    """
    return first_batches(trainer, who, 0, most=1)


def first_batches(trainer: Optional[pl.Trainer], who: str, min_tokens: int, most: int = 16) -> Any:
    """The first batches of ``trainer``'s train dataloader (a datamodule's, the loader passed to ``fit``, the
    LightningModule's own) joined along the batch dimension until they hold ``min_tokens`` tokens (at most ``most``
    batches; fewer when the loader ends first or the next batch cannot join the others: another shape past the batch
    dimension). The loader is requested as the fit loop requests it and handed to it (the user's hook runs once per fit,
    issue 55); its batches are drawn leaving no trace (``torch_compat.leading_batches``: a loader read once gives its
    first batch only, the one the loop trains first; a map-style one is read in a pass left as it was).

    Tokens: the first tensor's first two dimensions (batch x sequence), or its first for a 1-D tensor.

    Raises:
        ValueError: the Trainer has no train dataloader, or it is empty.
    """
    return first_and_joined(trainer, who, min_tokens, 0, most)[1]


class Drawn(NamedTuple):
    """What :func:`first_and_joined` drew: the first batch, the first batches joined, how their lists were read, and why
    the join stopped short of the samples asked."""

    first: Any
    joined: Any
    #: whether the lists of the batch that read as per-sample images by their shapes (:func:`per_sample_images`) were
    #: decided, by running, to be batched tensors (a Conv1d net's ``(x [4, 16, 32], y)``): joined and counted as such
    batched: bool = False
    #: why the join stopped before the samples asked while the loader had more (``None``: it did not; the loader ran out)
    short: Optional[str] = None


def first_and_joined(
    trainer: Optional[pl.Trainer], who: str, min_tokens: int, min_samples: int, most: int = 16,
    batched: Optional[Callable[[Any], bool]] = None,
) -> Drawn:  # fmt: skip
    """The first batch of ``trainer``'s train dataloader, and its first batches joined as :func:`first_batches` joins
    them until they hold ``min_tokens`` tokens and ``min_samples`` samples (the first tensor's first dimension), from
    one pass: the fit-start accuracy check of a conv net measures more images than the convolutions' modes are chosen
    on (:data:`~lightning_hbm.precision.accuracy.CHECK_SAMPLES`, session 35). The same object twice where one batch
    is enough (or the loader gives one).

    ``batched``: asked once, with the first batch, where a list of it reads as per-sample images by its shapes
    (:func:`per_sample_images`: ``[B, C, L]`` or ``[B, L, D]`` tensors of ``B`` at most 4 read as them): whether they are
    batched tensors instead (the caller runs the model to tell, session 38); then they are joined and counted along
    their first dimension. Without it (or where it says no) they are per-sample images, not joined, as before.

    Raises:
        ValueError: the Trainer has no train dataloader, or it is empty.
    """
    has_loader = lightning_compat.has_train_dataloader(trainer)
    loader = lightning_compat.train_dataloader(trainer) if has_loader else None
    if loader is None:
        raise ValueError(
            f"{who} found no probe batch: the Trainer has no train dataloader (no datamodule, no train_dataloaders "
            f"passed to fit, no train_dataloader() on the LightningModule). Pass {who}(probe_batch=...), or fit with "
            "train_dataloaders=... or datamodule=..."
        )
    joined: list[Any] = []  # the longest run of first batches that join
    decided: list[bool] = []  # whether the lists read as images are batched tensors (asked once, on the first batch)
    short: list[str] = []

    def enough(drawn: list[Any]) -> bool:
        if not decided:
            decided.append(batched is not None and reads_as_images(drawn[0]) and batched(drawn[0]))
        images = not decided[0]
        longer = _join(drawn, images)
        if longer is None:  # the last one does not join the others: stop before it
            short.append(_why_not_joined(drawn, images))
            return True
        joined[:] = [longer]
        return len(drawn) >= most or (_tokens(longer) >= min_tokens and samples(longer, images) >= min_samples)

    batches = torch_compat.leading_batches(loader, enough)  # a loader read once: its first batch, enough not asked
    if not batches:
        raise ValueError(f"{who} found no probe batch: the Trainer's train dataloader is empty. Pass {who}(probe_batch=...) or a loader with at least one batch.")
    if not decided:  # a loader read once: its first batch alone, the lists still read (they are counted)
        enough(batches[:1])
    return Drawn(batches[0], joined[0] if joined else batches[0], decided[0], short[0] if short else None)


def reads_as_images(batch: Any) -> bool:
    """Whether a list or tuple of ``batch`` reads as per-sample images by its shapes (:func:`per_sample_images`)."""
    return any(per_sample_images(leaf) for leaf in tree_flatten(batch, is_leaf=per_sample_images)[0])


def doubled(batch: Any) -> Any:
    """``batch`` joined with itself, every list in it read as batched tensors (``None``: it does not join): twice its
    samples where its lists are batched tensors, images of twice the channels where they are per-sample images. The
    candidate the caller of :func:`first_and_joined` runs the model on to tell the two apart."""
    return _join([batch, batch], images=False)


def _why_not_joined(drawn: list[Any], images: bool) -> str:
    if images and reads_as_images(drawn[0]):
        return "its samples are per-sample images (a list of C x H x W tensors, a detection collate), not joined into more"
    return f"batch {len(drawn)} does not join the first ones (another structure, or other shapes past the batch dimension)"


def say_streams_drawn_anew() -> None:
    """A warning for each loader over an ``IterableDataset`` the fit-start measures drew their batch from in a new pass
    (:func:`~lightning_hbm._compat.torch.streams_drawn_anew`: its ``__iter__`` does not take its pass from
    ``_get_iterator``, so the batch could not be handed back to the loop): a stream read once does not train it. Said
    at fit start, after the surgery that drew it, with the fixes (issue 55: "nothing consumed that the user did not
    ask to be consumed")."""
    for loader in torch_compat.streams_drawn_anew():
        name = type(loader).__name__
        warnings.warn(
            f"lightning_hbm drew 1 batch from the train dataloader ({name}, over an IterableDataset) at fit start, in a "
            f"pass of its own, for the probe step and the quantization's fit-start measures: {name}.__iter__ does not "
            "take its pass from self._get_iterator(), so that batch cannot be handed back to the training loop, and a "
            "stream read once does not train it (the loop starts at its second batch). Fix: give the measures their "
            "batch, QuantizedPrecision(probe_batch=<a batch>) with LIGHTNING_HBM_PROBE_STEP=0 (nothing is drawn then), "
            f"or make {name}.__iter__ return self._get_iterator() as DataLoader's does (the batch drawn is then the "
            "loop's first).",
            UserWarning, stacklevel=2,
        )  # fmt: skip


def samples(batch: Any, images: bool = True) -> int:
    """The samples of ``batch``: its first tensor's first dimension (0: no tensor, or a 0-d one), or where the first
    tensor is one of a list or tuple of per-sample tensors (:func:`per_sample_images`: torchvision's detection
    collate, a tuple of CHW images), how many they are (was: the first image's channels, 3, session 37).
    ``images=False``: such lists were found to be batched tensors (:class:`Drawn`), counted along their first dimension."""
    found = _first_samples(batch, images)
    return found if found is not None else 0


def per_sample_images(value: Any) -> bool:
    """Whether ``value`` is a list or tuple of per-sample images as a detection collate gives them: floating tensors
    ``C x H x W`` of one channel count ``C`` of at most 4 (gray, RGB, RGBA) and ``H``, ``W`` of at least 8. Batched
    tensors are not taken for them (``[B, C, H, W]`` images and masks, ``[B, 1, T]`` audio: another rank, or a second
    dimension under 8), but for a tuple of ``[B, L, D]`` floating tensors of ``B`` at most 4 and ``L``, ``D`` of at least 8."""
    if not isinstance(value, (list, tuple)) or not value or not all(isinstance(v, Tensor) and v.is_floating_point() for v in value):
        return False
    return all(v.dim() == 3 and v.shape[0] == value[0].shape[0] <= 4 and min(v.shape[1:]) >= 8 for v in value)


def _first_samples(batch: Any, images: bool = True) -> Optional[int]:
    for leaf in tree_flatten(batch, is_leaf=per_sample_images if images else None)[0]:
        if images and per_sample_images(leaf):
            return len(leaf)
        if isinstance(leaf, Tensor):
            return leaf.shape[0] if leaf.dim() else 0
        if isinstance(leaf, Mapping):  # one leaf to the pytree (a BatchEncoding): its tensors
            inner = _first_samples(dict(leaf), images)
            if inner is not None:
                return inner
    return None


def _tokens(batch: Any) -> int:
    leaves = torch_compat.tensor_leaves(batch)  # a BatchEncoding's too (it counted 0)
    if not leaves or leaves[0].dim() == 0:
        return 0
    first = leaves[0]
    return first.shape[0] * (first.shape[1] if first.dim() >= 2 else 1)


def _batch_first(batch: Any) -> bool:
    """Whether every tensor of ``batch`` has the same first dimension, its samples (none 0-d)."""
    leaves = torch_compat.tensor_leaves(batch)
    return all(leaf.dim() and leaf.shape[0] == leaves[0].shape[0] for leaf in leaves)


def _per_sample_values(value: Any) -> bool:
    """Whether ``value`` is a list of plain values (what a DataLoader collates strings into: a file name per sample):
    one leaf to the join, joined as a list where it holds one per sample (it stopped the join before, session 36).
    Plain: a string, a number, ``None`` (an optional caption), or a list or tuple of those (a sample's tags, an image's
    original size), which stopped the join at the first batch too (session 37: 4 images checked, not 32)."""
    return type(value) is list and bool(value) and all(_plain(v) for v in value)


def _plain(value: Any, depth: int = 0) -> bool:
    if value is None or isinstance(value, (str, bytes, int, float, bool)):
        return True
    return depth < 2 and type(value) in (list, tuple) and all(_plain(v, depth + 1) for v in value)


def _join(batches: list[Any], images: bool = True) -> Any:
    """``batches`` concatenated leaf by leaf along dimension 0; ``None`` where they do not join (structure, shapes past
    the batch dimension, other values than tensors that differ, or tensors of one batch that do not share their first
    dimension: a tuple of per-sample images, torchvision's detection collate, joined image by image along the channels
    and the check's forward failed, session 36); nor any list or tuple of per-sample images (:func:`per_sample_images`:
    one that was the whole batch, its images all of 3 channels, still joined along the channels and the check was
    lost, session 37): measured on the first batch. Refused rather than joined as more images, as a tuple of batched
    tensors of 4 samples or fewer may read as one; ``images=False``: such lists were found to be batched tensors by
    running the model (:class:`Drawn`), joined as any (a Conv1d net's ``(x [4, 16, 32], y)`` measured 4 samples, not 32,
    session 38)."""
    if len(batches) == 1:
        return batches[0]
    if images and any(reads_as_images(b) for b in batches):
        return None  # per-sample images (the whole batch, or beside tensors sharing their channel count): not joined
    flat = [tree_flatten(b, is_leaf=_per_sample_values) for b in batches]
    spec = flat[0][1]
    if any(other != spec for _, other in flat[1:]) or not all(_batch_first(b) for b in batches):
        return None
    joined = []
    for leaves in zip(*(leaves for leaves, _ in flat)):
        first = leaves[0]
        if isinstance(first, Tensor):
            if first.dim() == 0 or any(not isinstance(t, Tensor) or t.shape[1:] != first.shape[1:] for t in leaves):
                return None
            joined.append(torch.cat(leaves))
        elif isinstance(first, Mapping):  # one leaf to the pytree (a BatchEncoding): joined key by key, in its type
            # (compared with != instead, its tensors raised "Boolean value of Tensor ... is ambiguous" at fit start)
            inner = _join([dict(leaf) if isinstance(leaf, Mapping) else leaf for leaf in leaves], images)
            if inner is None or not isinstance(inner, dict):
                return None
            joined.append(torch_compat.rewrapped(first, inner))
        elif _per_sample_values(first) and all(_per_sample_values(leaf) and len(leaf) == samples(b, images) for leaf, b in zip(leaves, batches)):
            joined.append(type(first)(value for leaf in leaves for value in leaf))  # names, ids: one per sample, joined
        elif any(leaf != first for leaf in leaves[1:]):
            return None
        else:
            joined.append(first)
    return tree_unflatten(joined, spec)


__all__ = ["Drawn", "doubled", "first_and_joined", "first_batch", "first_batches", "per_sample_images", "reads_as_images", "samples", "say_streams_drawn_anew"]
