"""Building the user's model without allocating it: fake tensors, built once per plan, copied per trace.

A factory (the LightningModule class, a ``partial``, a lambda) is called under torch's ``FakeTensorMode``
with :class:`~lightning_hbm.planner.realvalues.RealValues` on top (construction code that reads values,
such as ``trunc_normal_``, runs); a LightningModule instance is copied with fake parameters and buffers
(nothing of its weights is read or changed). ``from_pretrained`` inside a factory builds the model from its
saved config and reads no weight. The result is a :class:`Template`, built once for every candidate of a
plan and copied (with its repeated blocks already cut) for each trace.
"""

from __future__ import annotations

import copy
import itertools
import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union, cast

import lightning.pytorch as pl
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from lightning_hbm import record
from lightning_hbm._compat import lightning as lightning_compat
from lightning_hbm._compat import transformers as transformers_compat
from lightning_hbm.planner.realvalues import RealValues

ModelLike = Union[pl.LightningModule, Callable[[], pl.LightningModule]]


def _fake_mode() -> FakeTensorMode:
    """A FakeTensorMode in which ``nn.Module.to`` works on fake parameters.

    FakeTensorMode memoizes every op output in a ``WeakValueDictionary`` (meta tensor -> fake tensor),
    and ``Module._apply`` moves fake parameters with ``torch.utils.swap_tensors``, which refuses tensors
    that have a weak reference. The memo only maps a meta tensor to its fake twin, which fresh op outputs
    never need again, so it is skipped.
    """
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    fake_mode.fake_tensor_converter.set_tensor_memo = lambda tensor, fake: None  # type: ignore[method-assign,assignment]  # the memo is skipped on purpose
    return fake_mode


@contextmanager
def _quiet_logs() -> Iterator[None]:
    loggers = [logging.getLogger(name) for name in ("lightning_hbm", "lightning.pytorch.utilities.rank_zero")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextmanager
def _config_only_from_pretrained() -> Iterator[None]:
    """``from_pretrained`` inside a factory builds the model from its saved config and reads no weight.

    The planner needs shapes and dtypes only; reading an 8B checkpoint would take minutes and the
    memory the planner exists to save. The dtype is the one ``from_pretrained`` would use (the
    ``dtype``/``torch_dtype`` argument, else the config's), and ``attn_implementation`` is kept.
    """
    transformers = sys.modules.get("transformers")
    if transformers is None:  # the factory cannot call from_pretrained without importing transformers first
        yield
        return
    def from_pretrained(cls: type, path: Any, *args: Any, **kwargs: Any) -> Any:
        config = kwargs.pop("config", None)
        if not isinstance(config, transformers.PretrainedConfig):
            hub = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "trust_remote_code")
            config = transformers.AutoConfig.from_pretrained(path, **{k: kwargs[k] for k in hub if k in kwargs})
        options = {k: kwargs[k] for k in ("attn_implementation",) if k in kwargs}
        dtype = kwargs.get("dtype", kwargs.get("torch_dtype"))
        if dtype is not None and dtype != "auto":
            options["dtype"] = dtype
        return transformers_compat.from_config(cls, config, **options)

    with transformers_compat.replaced_from_pretrained(transformers, from_pretrained):
        yield


def _fake_like(tensor: torch.Tensor, fake_mode: FakeTensorMode, values: Optional[RealValues] = None) -> torch.Tensor:
    """A fake CPU tensor of the same shape, strides and dtype (the trace runs CPU kernels, see :mod:`lightning_hbm.planner.api`).

    Not ``fake_mode.from_tensor``: that keeps the device (a model already on CUDA would trace CUDA kernel
    choices that need a GPU) and reads nothing we need. With ``values``, a small real CPU tensor is its twin.
    """
    with fake_mode:
        fake = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device="cpu")
    if values is not None and not isinstance(tensor, FakeTensor) and tensor.device.type == "cpu":
        values.add(fake, tensor)
    return fake


def _fake_batch_like(tensor: torch.Tensor, fake_mode: FakeTensorMode, values: Optional[RealValues] = None) -> torch.Tensor:
    """A fake of a batch tensor laid out as the step holds it: as ``Tensor.to(device)`` (Lightning's transfer of the
    batch) copies it, and a DataLoader collates it: its own storage of its own elements, its strides kept where they
    are dense, else contiguous (``empty_like``'s ``preserve_format``). Not the strides of a view into a larger storage
    (``synthetic_batch``'s inputs and targets, views of one ``[b, t + 1]`` tensor): that traced a storage larger than
    the tensor, and a copy the model makes reshaping a view that is not contiguous (``targets.reshape(-1)``), that the
    step on the moved batch does not hold (+272 B on a 2 x 16 token batch, ``tests/planner/test_batch_layout_s35.py``).
    The real twin, if any, is copied to the same layout (a ``view`` that works on the fake works on it)."""
    strides = torch.empty_like(tensor, device="meta").stride()
    if strides == tensor.stride() and tensor.numel() * tensor.element_size() == tensor.untyped_storage().nbytes():
        return _fake_like(tensor, fake_mode, values)
    with fake_mode:
        fake = torch.empty_strided(tensor.size(), strides, dtype=tensor.dtype, device="cpu")
    if values is not None and not isinstance(tensor, FakeTensor) and tensor.device.type == "cpu":
        values.add(fake, torch.empty_strided(tensor.size(), strides, dtype=tensor.dtype).copy_(tensor))
    return fake


@dataclass
class Template:
    """A model built once (fake, with the real twins of its small tensors), copied for every trace of a plan.

    Building an 8B transformers model under the fake mode runs its whole weight init (~10 s on the CPU
    dev machine); copying the built fakes takes a fraction of that.
    """

    module: pl.LightningModule
    values: RealValues


def build_template(model: Union[ModelLike, Template]) -> Template:
    """Build ``model`` (a LightningModule or a factory) once, fake; raises ``TypeError`` for anything else."""
    if isinstance(model, Template):
        return model
    fake_mode = _fake_mode()
    values = RealValues(fake_mode)
    with warnings.catch_warnings(), _quiet_logs(), torch.random.fork_rng(devices=[]):
        warnings.simplefilter("ignore")
        return Template(_build(model, fake_mode, values), values)


def _fake_copy(
    module: pl.LightningModule, fake_mode: FakeTensorMode, values: RealValues, source: Optional[RealValues] = None
) -> pl.LightningModule:
    """A copy of ``module`` whose parameters and buffers are fake (nothing of the real weights is copied).

    Small tensors get a real twin: a copy of the real tensor, or of the twin in ``source`` (the template's),
    so that a trace changing its twins (an optimizer step) changes neither the user's model nor the template.
    """
    memo: dict[int, Any] = {}
    for tensor in itertools.chain(module.parameters(), module.buffers(), _tensor_attributes(module)):
        if id(tensor) in memo:
            continue
        fake = _fake_like(tensor, fake_mode)
        real = source.twin(tensor) if isinstance(tensor, FakeTensor) and source is not None else tensor
        if real is not None and not isinstance(real, FakeTensor) and real.numel() <= values.max_elements:
            values.add(fake, real.detach().clone().cpu())
        memo[id(tensor)] = nn.Parameter(fake, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else fake
    # The copy must not drag the Trainer along (nor log into it): detach it for the duration of the copy.
    with lightning_compat.detached(module):
        copied = copy.deepcopy(module, memo)
    record.copy_record(module, copied)  # what lightning_hbm knows of the model (kept outside it) holds for the copy
    return copied


def _tensor_attributes(module: nn.Module) -> Iterator[torch.Tensor]:
    """Tensors a module holds as plain attributes, neither parameters nor buffers (transformers' Mimi: each
    ``MimiConv1d``'s ``padding_left``/``padding_right``, its codebooks' cached ``_embed``). Left to ``copy.deepcopy``,
    such a fake became a FakeTensor of a *copy* of the template's fake mode (the mode object deep-copied with it, torch
    2.13), and the process died a few plans later with a corrupted heap (segmentation fault; glibc "corrupted
    double-linked list"). Each is made a fresh fake of the copy's mode, as parameters and buffers are."""
    for sub in module.modules():
        for value in vars(sub).values():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                yield value


def _build(model: Union[ModelLike, Template], fake_mode: FakeTensorMode, values: RealValues) -> pl.LightningModule:
    if isinstance(model, Template):
        built = _fake_copy(model.module, fake_mode, values, model.values)
    elif isinstance(model, pl.LightningModule):
        built = _fake_copy(model, fake_mode, values)
    elif isinstance(model, nn.Module) or not callable(model):
        raise TypeError(
            f"plan() needs a LightningModule or a factory returning one, got {type(model).__name__}. "
            "Wrap a plain nn.Module in a LightningModule (training_step + configure_optimizers)."
        )
    else:
        with fake_mode, values, _config_only_from_pretrained():
            built = model()
            _adopt_foreign_fakes(built, fake_mode)
        if not isinstance(built, pl.LightningModule):
            raise TypeError(f"The model factory returned {type(built).__name__}, not a LightningModule.")
    _forget_conversions(fake_mode)
    return built


def _adopt_foreign_fakes(module: nn.Module, fake_mode: FakeTensorMode) -> None:
    """Replace parameters and buffers that belong to another fake mode by fresh ones of ``fake_mode`` (in place).

    ``copy.deepcopy`` of a FakeTensor (``nn.TransformerEncoder`` clones its layer so) makes a tensor of a
    new FakeTensorMode; every op then converts it again, and each view of the weight is new memory, once
    per forward. A clone made by an op of ``fake_mode`` is its own; small tensors keep their real twins.
    """
    replaced: dict[int, torch.Tensor] = {}  # tied parameters stay tied
    for sub in module.modules():
        for store in (cast(dict[str, Optional[torch.Tensor]], sub._parameters), sub._buffers):  # a Parameter goes back to _parameters
            for name, tensor in store.items():
                if tensor is None or getattr(tensor, "fake_mode", fake_mode) is fake_mode:
                    continue
                if id(tensor) not in replaced:
                    clone = tensor.detach().clone()
                    is_param = isinstance(tensor, nn.Parameter)
                    replaced[id(tensor)] = nn.Parameter(clone, requires_grad=tensor.requires_grad) if is_param else clone
                store[name] = replaced[id(tensor)]


def _forget_conversions(fake_mode: FakeTensorMode) -> None:
    """Drop the fake mode's memos of real -> fake conversions (``deepcopy`` and real inputs make some).

    They hold weak references to the fakes they made, and ``Module.to`` (``HalfPrecision``, peft moving
    adapters) swaps parameter tensors with ``torch.utils.swap_tensors``, which refuses a tensor that has one.
    """
    converter = fake_mode.fake_tensor_converter.meta_converter
    converter.tensor_memo.clear()
    converter.describer.lookup_tensor.clear()


__all__ = ["ModelLike", "Template", "build_template"]
