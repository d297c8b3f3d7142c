"""Type checks for the public constructors, read from their annotations.

Every plugin, callback and strategy calls :func:`check_args` first thing in ``__init__``, so a
wrong type is refused before anything is stored, with the value and the fix. Python would accept
most of them silently and some turn features on: ``LoRA(allow_base_change="False")`` is truthy.
Reading the annotations (not one hand-written check per argument) means a new argument is checked
the day it is added. bool is not an int here: ``FusedLoss(chunk_size=True)`` is a mistake, not 1.
"""

from __future__ import annotations

import collections.abc
import inspect
import typing
from typing import Any, Callable, Iterator, Mapping, Optional, TypeVar

_NAMES = {bool: "True or False", int: "an int", float: "a number", str: "a str"}


def _ok(value: Any, hint: Any) -> bool:
    """Whether ``value`` matches the type ``hint`` (the subset of typing our constructors use)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if hint is type(None):
        return value is None
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        return any(_ok(value, a) for a in args)
    if origin is typing.Literal:  # the type only: a wrong choice gets the constructor's own message listing them
        return any(type(value) is type(a) for a in args)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:
        if not isinstance(value, (tuple, list)):
            return False
        if len(args) == 2 and args[1] is Ellipsis:
            return all(_ok(v, args[0]) for v in value)
        # the length is the constructor's own check (a ValueError showing the expected form)
        return all(_ok(v, a) for v, a in zip(value, args))
    if origin in (list, collections.abc.Sequence):
        # a bare str is a Sequence[str] to Python, but ignore_modules="lm_head" means ["lm_head"], not letters;
        # a Sequence hint takes any sequence (range(0, 100, 10)), a list hint a list or tuple
        kinds = collections.abc.Sequence if origin is collections.abc.Sequence else (list, tuple)
        if isinstance(value, (str, bytes)) or not isinstance(value, kinds):
            return False
        return all(_ok(v, args[0]) for v in value) if args else True
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, collections.abc.Mapping):
            return False
        return all(_ok(k, args[0]) and _ok(v, args[1]) for k, v in value.items()) if args else True
    if origin is not None:  # another generic (Callable[...], ...): its class is all we check
        return isinstance(value, origin)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _describe(hint: Any) -> str:
    """``hint`` in words, for the error message."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is type(None):
        return "None"
    if origin is typing.Union or origin is getattr(__import__("types"), "UnionType", None):
        return " or ".join(_describe(a) for a in args)
    if origin is typing.Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is tuple:
        return "a tuple (" + ", ".join(_describe(a) for a in args) + ")"
    if origin in (list, collections.abc.Sequence):
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if origin in (dict, collections.abc.Mapping):
        return f"a dict of {_describe(args[0])} -> {_describe(args[1])}" if args else "a dict"
    if hint in _NAMES:
        return _NAMES[hint]
    name = getattr(hint, "__name__", repr(hint))
    return f"a {name}"


def check_args(init: Callable[..., Any], values: dict[str, Any]) -> None:
    """Raise ``TypeError`` for the first argument of ``init`` whose value does not match its annotation.

    Call as ``check_args(MyCallback.__init__, locals())`` at the top of ``__init__``.
    """
    owner = init.__qualname__.split(".")[0]
    hints = typing.get_type_hints(init)
    for name in inspect.signature(init).parameters:
        if name == "self" or name not in hints or name not in values:
            continue
        value = values[name]
        if not _ok(value, hints[name]):
            raise TypeError(f"{owner}({name}={value!r}): {_what(value, hints[name])}; pass {_describe(hints[name])}.")


def _what(value: Any, hint: Any) -> str:
    """What is wrong with ``value``: its type, or the first element of a list that has the wrong type."""
    if isinstance(value, collections.abc.Sequence) and not isinstance(value, (str, bytes)):
        inner = [a for a in typing.get_args(hint) if typing.get_origin(a) in (list, collections.abc.Sequence)]
        if typing.get_origin(hint) in (list, collections.abc.Sequence):
            inner = [hint]
        for option in inner:
            element = typing.get_args(option)[0] if typing.get_args(option) else Any
            bad = [v for v in value if not _ok(v, element)]
            if bad:
                return f"element {bad[0]!r} is a {type(bad[0]).__name__}"
    if isinstance(value, str) and hint is bool:
        return "a str, and any non-empty str is true ('False' included)"
    if isinstance(value, bool):
        return "a bool, and True/False is not a number here"
    return f"wrong type {type(value).__name__}"


_K = TypeVar("_K")
_V = TypeVar("_V")


class FrozenDict(Mapping[_K, _V]):
    """A mapping that cannot change once built: the dict-valued settings of a frozen config (``LoRAConfig.rank_pattern``,
    ``QuantizationConfig.layer_modes``), so that a config checked once stays what was checked.

    Reads as a dict does (``[]``, ``get``, ``in``, ``items``, equal to a dict with the same items, printed as one;
    ``dict(it)``: a plain copy), and has no method that writes (``it[k] = v``: ``TypeError``). Unlike
    ``types.MappingProxyType`` it pickles and deep-copies (a plugin travels with the Trainer it is pickled with).
    """

    __slots__ = ("_items",)
    _items: dict[_K, _V]

    def __init__(self, items: Mapping[_K, _V]) -> None:
        self._items = dict(items)  # a copy: the caller's dict may change, this one does not

    def __getitem__(self, key: _K) -> _V:
        return self._items[key]

    def __iter__(self) -> Iterator[_K]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __repr__(self) -> str:
        return repr(self._items)  # printed as the dict it was given as (messages name the argument as written)

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self._items,))

    def __hash__(self) -> int:
        # a frozen config holding one is hashable, as a frozen dataclass promises (session 37: hash(LoRAConfig(
        # rank_pattern={...})) raised "unhashable type: 'FrozenDict'": a config in a set or as a cache key failed)
        return hash(frozenset(self._items.items()))


def frozen(items: Optional[Mapping[_K, _V]]) -> Optional[FrozenDict[_K, _V]]:
    """``items`` as a :class:`FrozenDict` (``None`` stays ``None``)."""
    return None if items is None else FrozenDict(items)

