"""What a step run on fake tensors leaves in a real model: cached results, dropped when the step ends.

The probe step (:mod:`lightning_hbm.layers.readers`) runs the user's real model under ``FakeTensorMode``. Its values
are restored (buffers, RNGs), but a model may also remember what it computed: transformers' BEiT, Data2Vec-Vision,
DINOv3, DETR, RT-DETR, Mask2Former, SAM 2 and others cache their relative-position index or position embeddings with
``compile_compatible_method_lru_cache`` (a ``functools.lru_cache`` on the method, keyed by the module, or on a function
of their Python module, keyed by sizes, dtype and device), and some
modules keep a tensor in a plain attribute (``self._cached_mask = ...``). A fake tensor cached by the probe was handed
back to every real forward after it: BEiT's gradients came out as fake tensors, and the first read of one stopped
the fit (``DataDependentOutputException: aten._local_scalar_dense.default``).

:func:`dropping_fake_leftovers` empties, when the step ends, each ``lru_cache`` on the model's classes that gained an
entry during it (a miss; a cache of the model's classes or of their Python modules; a cache is pure by contract: it fills again on the next real call), puts back each module
attribute the step set to something holding a fake tensor, and gives a dict, list or set attribute the step filled in
place with one (``self._cache[n] = ...``) its items of before.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor  # as readers.py: no public home

from lightning_hbm.probe import put_back_attributes

_LRU = type(functools.lru_cache(maxsize=None)(lambda: None))
_MISSING = object()


def _caches_in(value: Any, depth: int = 3) -> Iterator[Any]:
    """The ``functools.lru_cache`` wrappers ``value`` is or wraps (``__wrapped__``, a closure cell: transformers'
    ``compile_compatible_method_lru_cache`` keeps its cache in its wrapper's closure)."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        value = value.fget
    if isinstance(value, _LRU):
        yield value
    if depth == 0 or not callable(value):
        return
    inner = [getattr(value, "__wrapped__", None), *(c.cell_contents for c in getattr(value, "__closure__", None) or () if _filled(c))]
    for item in inner:
        if callable(item) and item is not value:
            yield from _caches_in(item, depth - 1)


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def model_caches(module: nn.Module) -> list[Any]:
    """Every ``lru_cache`` on the classes of ``module``'s submodules (their methods and properties) and among the
    functions of the Python modules defining them (DINOv3's ``get_patches_center_coordinates``, cached by its sizes,
    dtype and device: a fake result there reached every model of that shape), each once."""
    found: dict[int, Any] = {}
    namespaces: dict[int, dict[str, Any]] = {}
    for cls in {type(m) for m in module.modules()}:
        for klass in cls.__mro__:
            if klass.__module__.startswith(("torch.", "builtins")):
                continue
            namespaces.setdefault(id(klass), dict(vars(klass)))
            home = sys.modules.get(klass.__module__)
            if home is not None:
                namespaces.setdefault(id(home), dict(vars(home)))
    for namespace in namespaces.values():
        for value in namespace.values():
            for cache in _caches_in(value):
                found.setdefault(id(cache), cache)
    return list(found.values())


def holds_fake(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` is a fake tensor or a list, tuple, set or mapping holding one (``depth`` levels down)."""
    return _holds(value, FakeTensor, depth)


def holds_tensor(value: Any, depth: int = 3) -> bool:
    """Whether ``value`` is a tensor (real or fake) or a list, tuple, set or mapping holding one (``depth`` levels down)."""
    return _holds(value, torch.Tensor, depth)


def _holds(value: Any, kind: type, depth: int) -> bool:
    if isinstance(value, kind):
        return True
    if depth == 0:
        return False
    if isinstance(value, Mapping):
        return any(_holds(v, kind, depth - 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_holds(v, kind, depth - 1) for v in value)
    return False


#: the attribute types whose items are kept (shallow copies) across the step: a plain dict, list or set (a module's
#: own cache); a container nested in one is not looked into
_CONTAINERS = (dict, list, set)


def _put_back(container: Any, items: Any) -> None:
    """``container`` (a dict, list or set) holding ``items`` again, the same object (a reference to it stays valid)."""
    if isinstance(container, list):
        container[:] = items
    else:
        container.clear()
        container.update(items)


@contextmanager
def dropping_fake_leftovers(module: nn.Module, holds: Callable[[Any], bool] = holds_fake) -> Iterator[None]:
    """Inside, ``module`` may run on fake tensors; at the end nothing fake is left cached in it (module docstring):
    an attribute the step set to something holding a fake tensor is put back (or removed), and a dict, list or set
    attribute the step filled in place with one (``self._cache[n] = ...``) gets its items of before back (was: left
    holding the fake tensor, handed to every real forward after; session 31).

    ``holds=holds_tensor``: the same for any tensor, for a step run on the real model (the probe's real attempts):
    transformers' Mimi codebook caches ``_embed`` on its first decode; computed by the probe in float32, before the
    cast to bf16, it stayed float32 and stopped the first step ("expected scalar type Float but found BFloat16",
    issue 53, session 33)."""
    caches = [(cache, cache.cache_info().misses) for cache in model_caches(module)]
    before = {id(m): (m, dict(vars(m))) for m in module.modules()}
    items = {id(value): value.copy() for _, attributes in before.values() for value in attributes.values() if type(value) in _CONTAINERS}
    helpers = {id(v): (own, dict(own)) for _, attributes in before.values() for v in attributes.values() if (own := _own_attributes(v)) is not None}
    try:
        yield
    finally:
        for cache, misses in caches:
            if cache.cache_info().misses != misses:  # computed (and stored) an entry during the step
                cache.cache_clear()
        for sub, attributes in before.values():
            for key, value in vars(sub).items():
                if attributes.get(key, _MISSING) is value and id(value) in items and holds(value):  # filled in place
                    _put_back(value, items[id(value)])
        put_back_attributes([(vars(sub), attributes) for sub, attributes in before.values()] + list(helpers.values()), holds)


def _own_attributes(value: Any) -> dict[str, Any] | None:
    """The attribute dict of a plain object a module holds (not a module, tensor, class or function), whose own
    attributes a step may set: transformers' Chameleon keeps its image-token vocabulary in a
    ``ChameleonImageVocabularyMapping`` whose lookup tensors are ``functools.cached_property``s; computed by the probe
    on fake tensors, the fake table was kept and every real step after mapped its image tokens through it (session
    40: the fit's gradients came out fake, ``DataDependentOutputException`` at the first read)."""
    if isinstance(value, (nn.Module, torch.Tensor, type)) or callable(value):
        return None
    own = getattr(value, "__dict__", None)
    return own if type(own) is dict else None


__all__ = ["dropping_fake_leftovers", "holds_fake", "holds_tensor", "model_caches"]
